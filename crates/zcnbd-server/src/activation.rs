//! Socket activation (systemd's protocol, `sd_listen_fds(3)`): a service manager — systemd,
//! `systemd-socket-activate`, libnbd's `nbd_connect_systemd_socket_activation` — opens the
//! listening sockets, sets `LISTEN_PID` to the server's pid and `LISTEN_FDS` to how many it
//! passed as descriptors 3, 4, ..., and the server serves those instead of binding its own.
//! `LISTEN_FDNAMES` is not used.

use std::os::fd::OwnedFd;

use crate::listener::Listeners;
use crate::server::ServerError;
use crate::sys::inherited;

/// Most sockets taken from a service manager.
pub const LISTEN_FDS_MAX: usize = 64;

/// The sockets the service manager passed to this process, or `None` when it passed none
/// (no `LISTEN_PID`, or another process's). The variables are removed from the environment
/// either way they were meant for this process, so the commands it starts do not see them.
///
/// Call it at most once, before starting threads (it changes the environment).
pub fn passed_listeners() -> Result<Option<Listeners>, ServerError> {
    let Some(count) = passed_count()? else {
        return Ok(None);
    };
    let fds: Vec<OwnedFd> =
        inherited::take_sockets(count).map_err(|source| ServerError::Passed {
            fd: inherited::LISTEN_FDS_START,
            source,
        })?;
    Listeners::from_fds(fds).map(Some)
}

/// How many sockets were passed to this process (`None`: none, or not to this process).
fn passed_count() -> Result<Option<usize>, ServerError> {
    let pid = std::env::var("LISTEN_PID").ok();
    let fds = std::env::var("LISTEN_FDS").ok();
    let (Some(pid), Some(fds)) = (pid, fds) else {
        return Ok(None);
    };
    if pid.trim().parse::<u32>().ok() != Some(std::process::id()) {
        return Ok(None);
    }
    for name in ["LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"] {
        std::env::remove_var(name);
    }
    let count = parse_count(&fds).map_err(|message| ServerError::Passed {
        fd: inherited::LISTEN_FDS_START,
        source: std::io::Error::new(std::io::ErrorKind::InvalidInput, message),
    })?;
    Ok((count > 0).then_some(count))
}

/// `LISTEN_FDS`, bounded by [`LISTEN_FDS_MAX`].
fn parse_count(text: &str) -> Result<usize, String> {
    let count: usize = text
        .trim()
        .parse()
        .map_err(|_| format!("LISTEN_FDS={text:?} is not a number"))?;
    if count > LISTEN_FDS_MAX {
        return Err(format!(
            "LISTEN_FDS={count}: at most {LISTEN_FDS_MAX} passed sockets are served"
        ));
    }
    Ok(count)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_are_parsed_and_bounded() {
        assert_eq!(parse_count("2"), Ok(2));
        assert_eq!(parse_count("0"), Ok(0));
        assert!(parse_count("two").is_err());
        assert!(parse_count("65").is_err());
    }
}
