//! A description of the machine the numbers come from.

use super::results::Machine;

/// Reads CPU model, CPU count, memory, kernel and TCP congestion control from /proc.
pub fn describe() -> Machine {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, v)| v.trim().to_string())
        .unwrap_or_else(|| "unknown CPU".into());
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let memory_kib: f64 = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0);
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown".into());
    let tcp_congestion_control =
        std::fs::read_to_string("/proc/sys/net/ipv4/tcp_congestion_control")
            .map(|s| s.trim().to_string())
            .unwrap_or_else(|_| "unknown".into());
    Machine {
        tcp_congestion_control,
        cpu,
        cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
        memory_gib: memory_kib / (1024.0 * 1024.0),
        kernel,
    }
}

/// CPU seconds (user + system) a process has used, from `/proc/<pid>/stat` (`self` for
/// this one, all threads included).
pub fn cpu_seconds(pid: &str) -> Option<f64> {
    stat_seconds(pid, 11)
}

/// CPU seconds (user + system) this process's waited-for children have used (fio, with
/// `--client fio`).
pub fn children_cpu_seconds() -> Option<f64> {
    stat_seconds("self", 13)
}

/// The sum of `/proc/<pid>/stat`'s two tick fields from `first` (counting after the state
/// field), in seconds.
fn stat_seconds(pid: &str, first: usize) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may hold spaces) start after the last ')'.
    let rest = stat.get(stat.rfind(')')? + 2..)?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let user: f64 = fields.get(first)?.parse().ok()?;
    let system: f64 = fields.get(first + 1)?.parse().ok()?;
    let ticks = rustix::param::clock_ticks_per_second() as f64;
    Some((user + system) / ticks)
}
