//! `zcnbd serve`: where to listen (sockets passed by a service manager, a private socket for
//! `--run`, or `-p`/`-b`/`-s`), then the server until it is stopped, with the start-up steps
//! scripts wait for (the captive command).

mod args;
mod captive;

pub use args::ServeArgs;

use std::process::ExitCode;

use captive::PrivateDir;
use tracing::info;
use zcnbd_server::activation::passed_listeners;
use zcnbd_server::{ListenAddr, Listeners, ServerConfig};

/// Runs the server until SIGINT/SIGTERM (or, with `--run`, until the command exits).
pub fn run(args: ServeArgs) -> Result<ExitCode, Box<dyn std::error::Error>> {
    if args.exit_with_parent {
        captive::exit_with_parent()?;
    }
    // Before anything opens a descriptor or starts a thread: the sockets a service manager
    // passed (socket activation) are descriptors 3, 4, ... of this process.
    let passed = passed_listeners()?;
    let config = args.server_config()?;
    // nbdkit's --run without -p/-U listens on the regular port; a private socket is what
    // its manual recommends, so that is the default here.
    let private = match (&passed, &args.run) {
        (None, Some(_)) if !args.listen_given() => Some(PrivateDir::new()?),
        _ => None,
    };
    let listeners = listeners(passed, &config, private.as_ref())?;
    let Some(command) = &args.run else {
        zcnbd_server::serve_on(config, listeners, |_| Ok(()))?;
        return Ok(ExitCode::SUCCESS);
    };
    let export = config.exports.first().map(|e| e.name.clone());
    let mut outcome = None;
    zcnbd_server::serve_on(config, listeners, |ready| {
        outcome = Some(captive::start(command, ready, &export.unwrap_or_default())?);
        Ok(())
    })?;
    // The socket is gone (the server removed it); now its directory.
    drop(private);
    Ok(outcome.map_or(ExitCode::FAILURE, |o| captive::exit_code(&o)))
}

/// The passed sockets, or those bound here: in `private` if given, else `config.listen`.
fn listeners(
    passed: Option<Listeners>,
    config: &ServerConfig,
    private: Option<&PrivateDir>,
) -> Result<Listeners, zcnbd_server::ServerError> {
    if let Some(listeners) = passed {
        info!(
            sockets = ?listeners.addrs(),
            "socket activation: serving the passed sockets (-p, -b, -s not used)"
        );
        return Ok(listeners);
    }
    match private {
        Some(dir) => Listeners::bind(&[ListenAddr::Unix(dir.path().join("nbd.sock"))]),
        None => Listeners::bind(&config.listen),
    }
}
