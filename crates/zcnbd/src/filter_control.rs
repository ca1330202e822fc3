//! `zcnbd filter`: changes a filter's option on a running server's export through its
//! control socket (`zcnbd serve --control PATH`), without disconnecting its clients - the
//! rate filter's `rate` and `connection-rate`.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;
use zcnbd_server::control::{self, ControlOp, ControlRequest};

/// Options of `zcnbd filter`.
#[derive(Debug, Args)]
pub struct FilterArgs {
    /// The server's control socket (its --control PATH).
    #[arg(short = 'c', long, value_name = "PATH")]
    control: PathBuf,
    /// The export [default: "", the default export].
    #[arg(short = 'x', long, value_name = "NAME")]
    export: Option<String>,
    /// What to change: FILTER.KEY=VALUE (rate.rate=40M, rate.connection-rate=8M); several
    /// are changed in order.
    #[arg(value_name = "FILTER.KEY=VALUE", required = true)]
    settings: Vec<String>,
}

/// `FILTER.KEY=VALUE` as its three parts.
fn parse_setting(text: &str) -> Result<(String, String, String), String> {
    let bad = || format!("{text:?} is not FILTER.KEY=VALUE (for example rate.rate=40M)");
    let (name, value) = text.split_once('=').ok_or_else(bad)?;
    let (filter, key) = name.split_once('.').ok_or_else(bad)?;
    if filter.is_empty() || key.is_empty() {
        return Err(bad());
    }
    Ok((filter.to_owned(), key.to_owned(), value.to_owned()))
}

/// Sends each change; fails at the first the server refuses.
pub fn run(args: &FilterArgs) -> Result<ExitCode, Box<dyn std::error::Error>> {
    let settings: Vec<_> = args
        .settings
        .iter()
        .map(|s| parse_setting(s))
        .collect::<Result<_, _>>()?;
    for (filter, key, value) in settings {
        let request = ControlRequest {
            op: ControlOp::Set,
            export: args.export.clone(),
            bitmap: None,
            granularity: None,
            filter: Some(filter),
            key: Some(key),
            value: Some(value),
        };
        let reply = control::request(&args.control, &request)
            .map_err(|e| format!("{}: {e}", args.control.display()))?;
        if let Some(why) = reply.error {
            return Err(why.into());
        }
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_name_a_filter_a_key_and_a_value() {
        assert_eq!(
            parse_setting("rate.connection-rate=8M").unwrap(),
            ("rate".into(), "connection-rate".into(), "8M".into())
        );
        assert!(parse_setting("rate=8M").is_err());
        assert!(parse_setting("rate.rate").is_err());
        assert!(parse_setting(".rate=1").is_err());
    }
}
