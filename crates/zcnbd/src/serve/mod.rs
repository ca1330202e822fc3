//! `zcnbd serve`: where to listen (sockets passed by a service manager, or bound here), then
//! the server until it is stopped.

mod args;

pub use args::ServeArgs;

use std::process::ExitCode;

use tracing::info;
use zcnbd_server::activation::passed_listeners;
use zcnbd_server::Listeners;

/// Runs the server until SIGINT/SIGTERM.
pub fn run(args: ServeArgs) -> Result<ExitCode, Box<dyn std::error::Error>> {
    // First, before anything opens a descriptor or starts a thread: the sockets a service
    // manager passed (socket activation) are descriptors 3, 4, ... of this process.
    let passed = passed_listeners()?;
    let config = args.server_config()?;
    let listeners = match passed {
        Some(listeners) => {
            info!(
                sockets = ?listeners.addrs(),
                "socket activation: serving the passed sockets (-p, -b, -s not used)"
            );
            listeners
        }
        None => Listeners::bind(&config.listen)?,
    };
    zcnbd_server::serve_on(config, listeners, |_| Ok(()))?;
    Ok(ExitCode::SUCCESS)
}
