//! `zcnbd bitmap`: asks a running server's control socket (`zcnbd serve --control PATH`) to
//! add, clear, remove or list dirty bitmaps, without disconnecting its clients.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Subcommand};
use zcnbd_server::control::{self, ControlOp, ControlRequest};
use zcnbd_server::parse_size;

/// Options of `zcnbd bitmap`.
#[derive(Debug, Args)]
pub struct BitmapArgs {
    /// The server's control socket (its --control PATH).
    #[arg(short = 'c', long, value_name = "PATH")]
    control: PathBuf,
    /// The export [default: "", the default export].
    #[arg(short = 'x', long, value_name = "NAME")]
    export: Option<String>,
    /// Print the reply as JSON.
    #[arg(long)]
    json: bool,
    #[command(subcommand)]
    action: Action,
}

#[derive(Debug, Subcommand)]
enum Action {
    /// Start tracking a bitmap: empty, or as its file was left (offered to clients that
    /// connect from now on as qemu:dirty-bitmap:NAME).
    Add {
        name: String,
        /// Bytes per bit, a power of two from 512 to 2G [default: the export's, 64K].
        #[arg(long, value_name = "SIZE")]
        granularity: Option<String>,
    },
    /// Mark a bitmap clean: writes acknowledged from now on are recorded (a checkpoint).
    Clear { name: String },
    /// Stop tracking a bitmap and delete its file.
    Remove { name: String },
    /// List the bitmaps (of --export, or of every export).
    List,
}

/// Sends the request and prints the answer; fails if the server refused it.
pub fn run(args: &BitmapArgs) -> Result<ExitCode, Box<dyn std::error::Error>> {
    let (op, bitmap, granularity) = match &args.action {
        Action::Add { name, granularity } => {
            let granularity = granularity.as_deref().map(parse_size).transpose()?;
            (ControlOp::Add, Some(name.clone()), granularity)
        }
        Action::Clear { name } => (ControlOp::Clear, Some(name.clone()), None),
        Action::Remove { name } => (ControlOp::Remove, Some(name.clone()), None),
        Action::List => (ControlOp::List, None, None),
    };
    let request = ControlRequest {
        op,
        export: args.export.clone(),
        bitmap,
        granularity,
        filter: None,
        key: None,
        value: None,
    };
    let reply = control::request(&args.control, &request)
        .map_err(|e| format!("{}: {e}", args.control.display()))?;
    if args.json {
        println!("{}", serde_json::to_string(&reply)?);
    } else {
        for b in &reply.bitmaps {
            let file = b.file.as_ref().map(|f| f.display().to_string());
            println!(
                "{:?}\t{}\tgranularity {}\tdirty {} bytes\t{}",
                b.export,
                b.name,
                b.granularity,
                b.dirty_bytes,
                file.as_deref().unwrap_or("(in memory)")
            );
        }
    }
    match reply.error {
        Some(why) => Err(why.into()),
        None => Ok(ExitCode::SUCCESS),
    }
}
