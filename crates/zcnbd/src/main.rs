//! `zcnbd`: the command-line front end.
#![forbid(unsafe_code)]

mod attach;
mod bench;
mod bitmap;
mod daemon;
mod devices;
#[cfg(test)]
mod doc_links;
mod docs;
mod filter_control;
mod filters;
mod http_args;
mod logging;
mod man_sections;
mod serve;
mod units;

use std::process::ExitCode;

use clap::{CommandFactory, Parser, Subcommand};

/// Zero-copy network block device server.
#[derive(Debug, Parser)]
#[command(name = "zcnbd", version, about)]
struct Cli {
    /// More logging (-v: debug, -vv: trace). RUST_LOG overrides.
    #[arg(short, long, action = clap::ArgAction::Count, global = true, help_heading = "Logging")]
    verbose: u8,
    /// Where the log goes.
    ///
    /// stderr (coloured on a terminal unless NO_COLOR), journald (stderr with priorities,
    /// for a systemd unit), syslog (/dev/log); auto: journald when JOURNAL_STREAM names
    /// stderr, syslog for serve --fork, else stderr.
    #[arg(long, value_name = "TARGET", value_enum, default_value_t = logging::LogTarget::Auto, global = true, help_heading = "Logging")]
    log: logging::LogTarget,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serve exports over NBD (default: a 1 GiB memory export on 127.0.0.1:10809).
    Serve(Box<serve::ServeArgs>),
    /// Measure NBD targets side by side (IOPS, MiB/s, latency, CPU per GiB) and print the
    /// seeds' before/after table; optionally JSON, Markdown and a PNG plot.
    Bench(Box<bench::BenchArgs>),
    /// Add, clear, remove or list the dirty bitmaps of a running server's exports (through
    /// its --control socket), for incremental backup.
    Bitmap(bitmap::BitmapArgs),
    /// Change a filter's option on a running server's export (through its --control
    /// socket): the rate filter's rates.
    Filter(filter_control::FilterArgs),
    /// Attach an export as a local block device, /dev/ublkbN (the kernel's ublk driver);
    /// print it once it takes I/O, serve it until SIGINT/SIGTERM or zcnbd detach.
    Attach(Box<attach::AttachArgs>),
    /// Detach devices zcnbd attach made (their attach processes remove them and exit).
    Detach(devices::DetachArgs),
    /// List the devices zcnbd attach made: device, size, read-only, queues, state, pid.
    List(devices::ListArgs),
    /// Write man pages (DIR/man) and bash, zsh and fish completions (DIR/completions).
    #[command(hide = true)]
    GenerateDocs(docs::DocsArgs),
}

fn init_logging(verbose: u8, target: logging::LogTarget, forking: bool) {
    let level = match verbose {
        0 => "info",
        1 => "debug",
        _ => "trace",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(level));
    logging::init(filter, logging::resolve(target, forking));
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let Some(command) = cli.command else {
        // Bare `zcnbd`: what it can do (`zcnbd serve` serves a memory export).
        let _ = Cli::command().print_help();
        return ExitCode::from(2);
    };
    let forking = match &command {
        Command::Serve(args) => args.forks(),
        Command::Attach(args) => args.forks(),
        _ => false,
    };
    init_logging(cli.verbose, cli.log, forking);
    let result = match command {
        Command::Serve(args) => serve::run(*args),
        Command::Bench(args) => bench::run(*args)
            .map(|()| ExitCode::SUCCESS)
            .map_err(Into::into),
        Command::Bitmap(args) => bitmap::run(&args),
        Command::Filter(args) => filter_control::run(&args),
        Command::Attach(args) => attach::run(&args),
        Command::Detach(args) => devices::detach(&args),
        Command::List(args) => devices::list(&args),
        Command::GenerateDocs(args) => docs::run(&args, Cli::command())
            .map(|()| ExitCode::SUCCESS)
            .map_err(Into::into),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("zcnbd: {}", for_people(&e.to_string()));
            ExitCode::FAILURE
        }
    }
}

/// An error as a person reads it: without the OS's error numbers ("(os error 2)") and
/// without the name of the one unnamed export (`export "": `).
fn for_people(message: &str) -> String {
    let mut out = message.replace("export \"\": ", "");
    while let Some(at) = out.find(" (os error ") {
        let Some(len) = out[at..].find(')') else {
            break;
        };
        out.replace_range(at..=at + len, "");
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn errors_lose_the_noise() {
        assert_eq!(
            super::for_people(
                "export \"\": cannot open /x: No such file or directory (os error 2)"
            ),
            "cannot open /x: No such file or directory"
        );
        assert_eq!(super::for_people("export \"a\": bad"), "export \"a\": bad");
    }
}
