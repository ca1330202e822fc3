//! Numbers for people: block sizes as `4k`, rates as `177k`, latencies as `180µs` or `1.2ms`.
//! Every report (table, markdown, plot) formats through here so they agree.

const KIB: u64 = 1024;
const MIB: u64 = 1024 * KIB;
const GIB: u64 = 1024 * MIB;

/// A block size the way fio spells it: `4k`, `64k`, `1m`; bytes when not a whole KiB.
pub fn block_size(bytes: u64) -> String {
    match bytes {
        0 => "0".to_string(),
        b if b % GIB == 0 => format!("{}g", b / GIB),
        b if b % MIB == 0 => format!("{}m", b / MIB),
        b if b % KIB == 0 => format!("{}k", b / KIB),
        b => b.to_string(),
    }
}

/// A byte count with a binary unit: `512 MiB`, `1 GiB`, `1.5 GiB`.
pub fn bytes(bytes: u64) -> String {
    let units = [(GIB, "GiB"), (MIB, "MiB"), (KIB, "KiB")];
    for (size, unit) in units {
        if bytes >= size {
            return format!("{} {unit}", trim(bytes as f64 / size as f64, 2));
        }
    }
    format!("{bytes} B")
}

/// A byte count as MiB with one decimal, for the data-path counters; a bare `0` for none, so
/// the paths that were taken stand out.
pub fn mib(bytes: u64) -> String {
    if bytes == 0 {
        return "0".to_string();
    }
    format!("{:.1}", bytes as f64 / MIB as f64)
}

/// A rate with an SI suffix, three significant digits: `950`, `9.3k`, `177k`, `1.23M`.
pub fn count(value: f64) -> String {
    if !value.is_finite() {
        return "-".to_string();
    }
    let (scaled, suffix) = if value >= 1e6 {
        (value / 1e6, "M")
    } else if value >= 1e3 {
        (value / 1e3, "k")
    } else {
        (value, "")
    };
    format!("{}{suffix}", three_digits(scaled))
}

/// An axis tick: as [`count`] but without padding zeros: `0`, `500`, `50k`, `2.5k`, `1M`.
pub fn axis(value: f64) -> String {
    if value >= 1e6 {
        format!("{}M", trim(value / 1e6, 2))
    } else if value >= 1e3 {
        format!("{}k", trim(value / 1e3, 2))
    } else {
        trim(value, 2)
    }
}

/// A latency given in microseconds: `4.2µs`, `180µs`, `1.23ms`, `2.5s`.
pub fn latency_us(us: f64) -> String {
    if !us.is_finite() {
        return "-".to_string();
    }
    if us >= 1e6 {
        format!("{}s", three_digits(us / 1e6))
    } else if us >= 1e3 {
        format!("{}ms", three_digits(us / 1e3))
    } else {
        format!("{}µs", three_digits(us))
    }
}

/// Throughput in MiB/s: one decimal below 100, whole numbers above.
pub fn mib_s(value: f64) -> String {
    if value >= 100.0 {
        format!("{value:.0}")
    } else {
        format!("{value:.1}")
    }
}

/// A ratio such as `1.40×`.
pub fn ratio(value: f64) -> String {
    format!("{value:.2}×")
}

/// A fraction as a spread: `±1.2%`.
pub fn spread(fraction: f64) -> String {
    format!("±{:.1}%", fraction * 100.0)
}

/// A fraction as a whole percentage: `87%`.
pub fn percent(fraction: f64) -> String {
    format!("{:.0}%", fraction * 100.0)
}

/// CPU seconds per GiB moved.
pub fn cpu_s_per_gib(value: f64) -> String {
    format!("{value:.3}")
}

/// Seconds, without a trailing `.0` for whole values: `10 s`, `2.5 s`.
pub fn seconds(value: f64) -> String {
    format!("{} s", trim(value, 2))
}

/// `value` with three significant digits (for values below 1000).
fn three_digits(value: f64) -> String {
    if value >= 100.0 {
        format!("{value:.0}")
    } else if value >= 10.0 {
        format!("{value:.1}")
    } else {
        format!("{value:.2}")
    }
}

/// `value` with at most `decimals` decimals and no trailing zeros.
fn trim(value: f64, decimals: usize) -> String {
    let s = format!("{value:.decimals$}");
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_sizes_read_like_fio() {
        assert_eq!(block_size(4096), "4k");
        assert_eq!(block_size(65536), "64k");
        assert_eq!(block_size(1 << 20), "1m");
        assert_eq!(block_size(1 << 30), "1g");
        assert_eq!(block_size(1000), "1000");
    }

    #[test]
    fn rates_and_latencies_have_three_digits() {
        assert_eq!(count(177_312.0), "177k");
        assert_eq!(count(9_312.0), "9.31k");
        assert_eq!(count(950.0), "950");
        assert_eq!(count(1_234_000.0), "1.23M");
        assert_eq!(axis(0.0), "0");
        assert_eq!(axis(50_000.0), "50k");
        assert_eq!(axis(2_500.0), "2.5k");
        assert_eq!(axis(1e6), "1M");
        assert_eq!(latency_us(4.2), "4.20µs");
        assert_eq!(latency_us(180.4), "180µs");
        assert_eq!(latency_us(1_234.0), "1.23ms");
        assert_eq!(latency_us(2_500_000.0), "2.50s");
    }

    #[test]
    fn byte_counts_trim_zeros() {
        assert_eq!(bytes(1 << 30), "1 GiB");
        assert_eq!(bytes(3 << 29), "1.5 GiB");
        assert_eq!(bytes(512), "512 B");
        assert_eq!(seconds(10.0), "10 s");
    }
}
