//! `zcnbd bench --netns`: the servers this run starts live in a network namespace of their own,
//! reached over a veth pair, instead of on the loopback. On the loopback a sender's packet is
//! received in the sender's own softirq (the receiver's TCP work is charged to whoever sent);
//! over veth the namespace's side has a device of its own, so the client's and the server's
//! TCP work split more as they would between two machines. Made with iproute2's `ip` (both
//! veth and network namespaces are in the host kernel, no module needed), removed at the end.

use std::net::Ipv4Addr;
use std::process::{Command, Stdio};

/// The client's end of the veth pair.
pub const HOST_ADDR: Ipv4Addr = Ipv4Addr::new(10, 231, 0, 1);
/// The servers' end, inside the namespace (the run's certificates name it too).
pub const NS_ADDR: Ipv4Addr = Ipv4Addr::new(10, 231, 0, 2);
/// The prefix both ends are in.
const PREFIX_LEN: u8 = 30;

/// Why the namespace could not be made.
#[derive(Debug, thiserror::Error)]
#[error("--netns: `ip {command}` failed (root and iproute2 needed): {why}")]
pub struct NetnsError {
    command: String,
    why: String,
}

/// A network namespace with a veth pair to it; deleted (with its end of the pair, which takes
/// the other) when this drops.
#[derive(Debug)]
pub struct Netns {
    name: String,
}

impl Netns {
    /// Makes the namespace `zcnbd-bench-PID`, the pair, the addresses, and brings them up.
    pub fn create() -> Result<Netns, NetnsError> {
        let pid = std::process::id();
        let netns = Netns {
            name: format!("zcnbd-bench-{pid}"),
        };
        // Interface names are at most 15 bytes.
        let (host_if, ns_if) = (format!("zcb{pid}"), format!("zcbn{pid}"));
        let host_addr = format!("{HOST_ADDR}/{PREFIX_LEN}");
        let ns_addr = format!("{NS_ADDR}/{PREFIX_LEN}");
        let name = netns.name.as_str();
        ip(&["netns", "add", name])?;
        let steps: [&[&str]; 8] = [
            &[
                "link", "add", &host_if, "type", "veth", "peer", "name", &ns_if,
            ],
            &["link", "set", &ns_if, "netns", name],
            &["addr", "add", &host_addr, "dev", &host_if],
            &["link", "set", &host_if, "up"],
            &["-n", name, "addr", "add", &ns_addr, "dev", &ns_if],
            &["-n", name, "link", "set", &ns_if, "up"],
            &["-n", name, "link", "set", "lo", "up"],
            // The pair answers at once (no neighbour discovery at the first connection).
            &["-n", name, "neigh", "flush", "all"],
        ];
        for step in steps {
            ip(step)?;
        }
        Ok(netns)
    }

    /// `program args` run inside the namespace (`ip netns exec` execs it: the process
    /// started is the program, so its CPU is the program's).
    pub fn wrap(&self, program: &str, args: Vec<String>) -> (String, Vec<String>) {
        let mut all = vec![
            "netns".to_string(),
            "exec".to_string(),
            self.name.clone(),
            program.to_string(),
        ];
        all.extend(args);
        ("ip".to_string(), all)
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = ip(&["netns", "del", &self.name]);
    }
}

/// Runs `ip ARGS`, quietly; an error says which and why.
fn ip(args: &[&str]) -> Result<(), NetnsError> {
    let command = args.join(" ");
    let out = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| NetnsError {
            command: command.clone(),
            why: e.to_string(),
        })?;
    if out.status.success() {
        return Ok(());
    }
    Err(NetnsError {
        command,
        why: String::from_utf8_lossy(&out.stderr).trim().to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wrap_runs_the_program_inside_the_namespace() {
        let ns = Netns {
            name: "zcnbd-bench-test".into(),
        };
        let (program, args) = ns.wrap("nbdkit", vec!["-f".into()]);
        assert_eq!(program, "ip");
        assert_eq!(args, ["netns", "exec", "zcnbd-bench-test", "nbdkit", "-f"]);
        // Nothing was made: the drop's delete fails quietly.
        drop(ns);
    }
}
