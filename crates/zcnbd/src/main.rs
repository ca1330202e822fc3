//! `zcnbd`: the command-line front end.
#![forbid(unsafe_code)]

mod bench;
mod bitmap;
mod docs;
mod man_sections;
mod serve;

use std::process::ExitCode;

use clap::{CommandFactory, Parser, Subcommand};

/// Zero-copy network block device server.
#[derive(Debug, Parser)]
#[command(name = "zcnbd", version, about)]
struct Cli {
    /// More logging (-v: debug, -vv: trace). RUST_LOG overrides.
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    verbose: u8,
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
    /// Write man pages (DIR/man) and bash, zsh and fish completions (DIR/completions).
    #[command(hide = true)]
    GenerateDocs(docs::DocsArgs),
}

fn init_logging(verbose: u8) {
    let level = match verbose {
        0 => "info",
        1 => "debug",
        _ => "trace",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(level));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging(cli.verbose);
    let command = cli
        .command
        .unwrap_or_else(|| Command::Serve(Box::new(serve::ServeArgs::parse_from(["zcnbd serve"]))));
    let result = match command {
        Command::Serve(args) => serve::run(*args),
        Command::Bench(args) => bench::run(*args)
            .map(|()| ExitCode::SUCCESS)
            .map_err(Into::into),
        Command::Bitmap(args) => bitmap::run(&args),
        Command::GenerateDocs(args) => docs::run(&args, Cli::command())
            .map(|()| ExitCode::SUCCESS)
            .map_err(Into::into),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("zcnbd: {e}");
            ExitCode::FAILURE
        }
    }
}
