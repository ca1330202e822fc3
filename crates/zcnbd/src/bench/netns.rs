//! `zcnbd bench --netns`: the servers this run starts live in a network namespace of their own,
//! reached over a veth pair, instead of on the loopback. On the loopback a sender's packet is
//! received in the sender's own softirq: the receiver's TCP work is charged to whoever sent.
//! A plain veth pair does the same (its `netif_rx` queues to the sending CPU's backlog, run as
//! the send returns). So each end gets GRO, which gives a veth end a NAPI instance, and the
//! NAPI instance a kernel thread of its own (`threaded`): a packet is then received by the
//! receiving end's thread, as a NIC's interrupt would on another machine, and neither process
//! is charged for its peer's receive work. The threads' CPU is reported beside the processes'
//! (`receive_cpu_seconds`). Made with iproute2's `ip` and `ethtool` (veth, network namespaces
//! and threaded NAPI are in the host kernel, no module needed), removed at the end.

use std::net::Ipv4Addr;
use std::process::{Command, Stdio};

/// The client's end of the veth pair.
pub const HOST_ADDR: Ipv4Addr = Ipv4Addr::new(10, 231, 0, 1);
/// The servers' end, inside the namespace (the run's certificates name it too).
pub const NS_ADDR: Ipv4Addr = Ipv4Addr::new(10, 231, 0, 2);
/// The prefix both ends are in.
const PREFIX_LEN: u8 = 30;
/// Both ends' MTU: a veth's largest, as the loopback's, so that packets are as large with TSO
/// off as a TSO packet would be.
const MTU: &str = "65535";

/// Why the namespace could not be made.
#[derive(Debug, thiserror::Error)]
#[error("--netns: `{command}` failed (root, iproute2 and ethtool needed): {why}")]
pub struct NetnsError {
    command: String,
    why: String,
}

/// A network namespace with a veth pair to it; deleted (with its end of the pair, which takes
/// the other) when this drops.
#[derive(Debug)]
pub struct Netns {
    name: String,
    /// The client's end of the pair.
    host_if: String,
    /// The servers' end, inside the namespace.
    ns_if: String,
}

impl Netns {
    /// Makes the namespace `zcnbd-bench-PID`, the pair, the addresses, and brings them up.
    pub fn create() -> Result<Netns, NetnsError> {
        let pid = std::process::id();
        // Interface names are at most 15 bytes, and short enough that a NAPI thread's name
        // (`napi/DEV-`, cut at 15 bytes) still tells the two ends apart.
        let netns = Netns {
            name: format!("zcnbd-bench-{pid}"),
            host_if: format!("zh{pid}"),
            ns_if: format!("zn{pid}"),
        };
        let (host_if, ns_if) = (netns.host_if.as_str(), netns.ns_if.as_str());
        let host_addr = format!("{HOST_ADDR}/{PREFIX_LEN}");
        let ns_addr = format!("{NS_ADDR}/{PREFIX_LEN}");
        let name = netns.name.as_str();
        ip(&["netns", "add", name])?;
        let steps: [&[&str]; 8] = [
            &[
                "link", "add", host_if, "type", "veth", "peer", "name", ns_if,
            ],
            &["link", "set", ns_if, "netns", name],
            &["addr", "add", &host_addr, "dev", host_if],
            &["link", "set", host_if, "up"],
            &["-n", name, "addr", "add", &ns_addr, "dev", ns_if],
            &["-n", name, "link", "set", ns_if, "up"],
            &["-n", name, "link", "set", "lo", "up"],
            // The pair answers at once (no neighbour discovery at the first connection).
            &["-n", name, "neigh", "flush", "all"],
        ];
        for step in steps {
            ip(step)?;
        }
        // GRO first (it makes the NAPI instance), then a thread for it; in the namespace,
        // `ip netns exec` mounts the namespace's own /sys. A veth end hands its peer's NAPI
        // no TCP packet it segments by TSO (`veth_skb_is_eligible_for_gro`), so TSO is off
        // and the MTU the loopback's size: the stack sends packets of up to 64 KiB itself.
        let offloads = ["gro", "on", "tso", "off"];
        run("ethtool", &[&["-K", host_if][..], &offloads].concat())?;
        netns.exec("ethtool", &[&["-K", ns_if][..], &offloads].concat())?;
        ip(&["link", "set", host_if, "mtu", MTU])?;
        ip(&["-n", name, "link", "set", ns_if, "mtu", MTU])?;
        let threaded = |dev: &str| format!("echo 1 > /sys/class/net/{dev}/threaded");
        run("sh", &["-c", &threaded(host_if)])?;
        netns.exec("sh", &["-c", &threaded(ns_if)])?;
        Ok(netns)
    }

    /// CPU seconds the receive threads of each end have used so far: the servers' end (what
    /// the servers were sent) and the client's end (what the client was sent). `None` when a
    /// thread cannot be found.
    pub fn receive_cpu_seconds(&self) -> Option<ReceiveCpu> {
        Some(ReceiveCpu {
            servers: napi_thread_seconds(&self.ns_if)?,
            client: napi_thread_seconds(&self.host_if)?,
        })
    }

    /// Runs `program args` inside the namespace (as [`Netns::wrap`] has it).
    fn exec(&self, program: &str, args: &[&str]) -> Result<(), NetnsError> {
        let (ip, args) = self.wrap(program, args.iter().map(|a| a.to_string()).collect());
        run(&ip, &args.iter().map(String::as_str).collect::<Vec<_>>())
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

/// CPU seconds of one end's receive work so far, each end's NAPI threads' sum.
#[derive(Debug, Clone, Copy)]
pub struct ReceiveCpu {
    /// The servers' end.
    pub servers: f64,
    /// The client's end.
    pub client: f64,
}

impl ReceiveCpu {
    /// What was used between `before` and this.
    pub fn since(self, before: ReceiveCpu) -> ReceiveCpu {
        ReceiveCpu {
            servers: self.servers - before.servers,
            client: self.client - before.client,
        }
    }
}

/// The summed CPU seconds of the kernel threads `napi/DEV-ID` (kernel threads are in the
/// root namespace's /proc whatever namespace their device is in); `None` if there are none.
fn napi_thread_seconds(dev: &str) -> Option<f64> {
    let prefix = napi_thread_prefix(dev);
    let mut found = None;
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let pid = entry.file_name();
        let Some(pid) = pid
            .to_str()
            .filter(|p| p.bytes().all(|b| b.is_ascii_digit()))
        else {
            continue;
        };
        let Ok(comm) = std::fs::read_to_string(format!("/proc/{pid}/comm")) else {
            continue;
        };
        if comm.trim_end().starts_with(&prefix) {
            let seconds = super::machine::cpu_seconds(pid)?;
            found = Some(found.unwrap_or(0.0) + seconds);
        }
    }
    found
}

/// What the names of `dev`'s NAPI threads start with: `napi/DEV-`, cut as the kernel cuts a
/// thread's name (15 bytes).
fn napi_thread_prefix(dev: &str) -> String {
    let mut prefix = format!("napi/{dev}-");
    prefix.truncate(15);
    prefix
}

/// Runs `ip ARGS`, quietly; an error says which and why.
fn ip(args: &[&str]) -> Result<(), NetnsError> {
    run("ip", args)
}

/// Runs `program ARGS`, quietly; an error says which and why.
fn run(program: &str, args: &[&str]) -> Result<(), NetnsError> {
    let command = format!("{program} {}", args.join(" "));
    let out = Command::new(program)
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
            host_if: "zhtest".into(),
            ns_if: "zntest".into(),
        };
        let (program, args) = ns.wrap("nbdkit", vec!["-f".into()]);
        assert_eq!(program, "ip");
        assert_eq!(args, ["netns", "exec", "zcnbd-bench-test", "nbdkit", "-f"]);
        // Nothing was made: the drop's delete fails quietly.
        drop(ns);
    }

    #[test]
    fn each_ends_threads_are_told_apart_whatever_the_pid() {
        for pid in [1, 4_194_304] {
            let (host, ns) = (
                napi_thread_prefix(&format!("zh{pid}")),
                napi_thread_prefix(&format!("zn{pid}")),
            );
            assert!(host.len() <= 15 && ns.len() <= 15);
            // A longer pid's threads never match a shorter one's prefix: the dash stays.
            assert!(host.ends_with('-') && ns.ends_with('-'), "{host} {ns}");
            assert!(!host.starts_with(&ns) && !ns.starts_with(&host));
        }
    }
}
