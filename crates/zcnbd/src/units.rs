//! The one syntax for sizes and durations on the command line: sizes as `parse_size` reads
//! them (`512`, `64K`, `1.5G`), durations as a number with a unit - `us` (or `µs`), `ms`,
//! `s`, `m`, `h` - or a bare number of seconds: `500us`, `10s`, `2m`.

use std::time::Duration;

/// Parses a duration (see the module's documentation); `None` if it does not parse.
pub fn parse_duration(text: &str) -> Option<Duration> {
    let text = text.trim();
    let (number, scale) = [
        ("us", 1e-6),
        ("µs", 1e-6),
        ("ms", 1e-3),
        ("s", 1.0),
        ("m", 60.0),
        ("h", 3600.0),
    ]
    .iter()
    .find_map(|(unit, scale)| text.strip_suffix(unit).map(|n| (n, *scale)))
    .unwrap_or((text, 1.0));
    let value: f64 = number.trim().parse().ok()?;
    (value.is_finite() && value >= 0.0).then(|| Duration::from_secs_f64(value * scale))
}

/// A clap value parser for a duration option.
pub fn duration(text: &str) -> Result<Duration, String> {
    parse_duration(text).ok_or_else(|| {
        "write a number with a unit: 500us, 250ms, 10s, 2m (a bare number is seconds)".to_owned()
    })
}

/// How a duration is shown as a default: `10s`, `500ms`, `50us` (the options' defaults are
/// written so; a test compares them with the server's).
#[cfg(test)]
pub fn show(d: Duration) -> String {
    if d.as_micros().is_multiple_of(1_000_000) {
        format!("{}s", d.as_secs())
    } else if d.as_micros().is_multiple_of(1000) {
        format!("{}ms", d.as_millis())
    } else {
        format!("{}us", d.as_micros())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_take_units_or_seconds() {
        assert_eq!(parse_duration("10s"), Some(Duration::from_secs(10)));
        assert_eq!(parse_duration("500ms"), Some(Duration::from_millis(500)));
        assert_eq!(parse_duration("50us"), Some(Duration::from_micros(50)));
        assert_eq!(parse_duration("50µs"), Some(Duration::from_micros(50)));
        assert_eq!(parse_duration("2m"), Some(Duration::from_secs(120)));
        assert_eq!(parse_duration("1h"), Some(Duration::from_secs(3600)));
        assert_eq!(parse_duration("3"), Some(Duration::from_secs(3)));
        assert_eq!(parse_duration("0"), Some(Duration::ZERO));
        assert_eq!(parse_duration("x"), None);
        assert_eq!(parse_duration("-1s"), None);
        assert_eq!(show(Duration::from_secs(10)), "10s");
        assert_eq!(show(Duration::from_millis(1500)), "1500ms");
        assert_eq!(show(Duration::from_micros(50)), "50us");
    }
}
