//! `zcnbd serve`: where to listen (sockets passed by a service manager, a private socket for
//! `--run`, or `-p`/`-b`/`-s`), then the server until it is stopped, with the start-up steps
//! scripts wait for (`--fork`, `--pid-file`, the captive command).

mod args;
mod captive;

pub use args::ServeArgs;

use std::io;
use std::path::PathBuf;
use std::process::ExitCode;

use crate::daemon::{self, PidFile, Readiness};
use captive::{Outcome, PrivateDir};
use tracing::info;
use zcnbd_server::activation::passed_listeners;
use zcnbd_server::{ListenAddr, Listeners, Ready, ServerConfig};

/// Runs the server until SIGINT/SIGTERM (or, with `--run`, until the command exits).
pub fn run(args: ServeArgs) -> Result<ExitCode, Box<dyn std::error::Error>> {
    if let Some(dir) = args.cache_dir() {
        zcnbd_server::export::layers::set_cache_dir(dir.to_owned());
    }
    if args.check {
        println!("{}", args.check_report()?);
        return Ok(ExitCode::SUCCESS);
    }
    if args.exit_with_parent {
        captive::exit_with_parent()?;
    }
    // Before anything opens a descriptor or starts a thread: the sockets a service manager
    // passed (socket activation) are descriptors 3, 4, ... of this process.
    let passed = passed_listeners()?;
    // From here a SIGTERM stops the server in order, even one that arrives between the
    // listeners accepting connections and the accept loop starting.
    zcnbd_server::catch_stop_signals()?;
    let config = args.server_config()?;
    // nbdkit's --run without -p/-U listens on the regular port; a private socket is what
    // its manual recommends, so that is the default here.
    let private = match (&passed, &args.run) {
        (None, Some(_)) if !args.listen_given() => Some(PrivateDir::new()?),
        _ => None,
    };
    let listeners = listeners(passed, &config, private.as_ref(), args.vsock_addr())?;
    // Listening and the exports open, no thread started yet (serve_on starts them): the
    // one moment to fork.
    let readiness = if args.fork {
        Some(daemon::fork()?)
    } else {
        None
    };
    let mut startup = Startup {
        pid_file_path: args.pid_file.clone(),
        pid_file: None,
        readiness,
        command: args.run.clone(),
        export: config.exports.first().map(|e| e.name.clone()),
        exports: config.exports.iter().map(|e| e.name.clone()).collect(),
        tls: config.tls.mode != zcnbd_server::tls::TlsMode::Off,
        print_uri: args.print_uri,
        outcome: None,
    };
    let served = zcnbd_server::serve_on(config, listeners, |ready| startup.on_ready(ready));
    // A clean exit removes the pid file, and the private socket's directory.
    drop(startup.pid_file.take());
    drop(private);
    served?;
    Ok(match &startup.outcome {
        Some(outcome) => captive::exit_code(outcome),
        None if startup.command.is_some() => ExitCode::FAILURE,
        None => ExitCode::SUCCESS,
    })
}

/// What happens once the listeners accept clients, in this order: the pid file, the
/// forked parent told, the captive command started.
struct Startup {
    pid_file_path: Option<PathBuf>,
    pid_file: Option<PidFile>,
    readiness: Option<Readiness>,
    command: Option<String>,
    export: Option<String>,
    /// Every export's name, for the URIs logged (and printed with `--print-uri`).
    exports: Vec<String>,
    tls: bool,
    print_uri: bool,
    outcome: Option<Outcome>,
}

impl Startup {
    fn on_ready(&mut self, ready: Ready) -> io::Result<()> {
        if let Some(addr) = ready.addrs.first() {
            for (i, name) in self.exports.iter().enumerate() {
                let uri = captive::uri(addr, name, self.tls);
                info!(export = %name, "connect with {uri}");
                if self.print_uri && i == 0 {
                    let mut out = io::stdout().lock();
                    io::Write::write_all(&mut out, format!("{uri}\n").as_bytes())?;
                    io::Write::flush(&mut out)?;
                }
            }
        }
        if let Some(path) = &self.pid_file_path {
            self.pid_file = Some(PidFile::write(path)?);
        }
        if let Some(readiness) = self.readiness.take() {
            readiness.notify()?;
        }
        if let Some(command) = &self.command {
            let export = self.export.as_deref().unwrap_or_default();
            self.outcome = Some(captive::start(command, ready, export)?);
        }
        Ok(())
    }
}

/// The passed sockets, or those bound here: in `private` if given (and `vsock`'s, if
/// given), else `config.listen`.
fn listeners(
    passed: Option<Listeners>,
    config: &ServerConfig,
    private: Option<&PrivateDir>,
    vsock: Option<ListenAddr>,
) -> Result<Listeners, zcnbd_server::ServerError> {
    if let Some(listeners) = passed {
        info!(
            sockets = ?listeners.addrs(),
            "socket activation: serving the passed sockets (-p, -b, -s, --vsock not used)"
        );
        return Ok(listeners);
    }
    match private {
        Some(dir) => {
            let private = ListenAddr::Unix(dir.path().join("nbd.sock"));
            Listeners::bind(
                &[Some(private), vsock]
                    .into_iter()
                    .flatten()
                    .collect::<Vec<_>>(),
            )
        }
        None => Listeners::bind(&config.listen),
    }
}
