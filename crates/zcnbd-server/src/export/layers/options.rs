//! A filter as the command line and TOML name it: `NAME`, or `NAME:KEY=VALUE,KEY=VALUE` with
//! its options (nbdkit's filter parameters; `--filter-opt NAME.KEY=VALUE` adds to every
//! `--filter NAME`). Each layer takes the options it knows; one it does not is refused, with
//! the list of those it has.

use std::time::Duration;

use crate::config::parse_size;

/// The longest delay or wait an option may ask for.
pub const OPTION_DURATION_MAX: Duration = Duration::from_secs(3600);

/// One filter's options, taken one by one by the layer that reads them.
#[derive(Debug)]
pub struct Options<'a> {
    filter: &'a str,
    pairs: Vec<(&'a str, &'a str)>,
    known: Vec<&'static str>,
}

/// `NAME` and its options from `NAME[:KEY=VALUE,...]`.
pub fn split(entry: &str) -> Result<(&str, Options<'_>), String> {
    let (name, rest) = entry.split_once(':').unwrap_or((entry, ""));
    let mut pairs = Vec::new();
    for pair in rest.split(',').filter(|p| !p.is_empty()) {
        let (key, value) = pair
            .split_once('=')
            .ok_or_else(|| format!("filter {name}: {pair:?} is not KEY=VALUE"))?;
        pairs.push((key.trim(), value.trim()));
    }
    Ok((
        name,
        Options {
            filter: name,
            pairs,
            known: Vec::new(),
        },
    ))
}

impl<'a> Options<'a> {
    /// The value of `key` (the last one given), if any.
    pub fn get(&mut self, key: &'static str) -> Option<&'a str> {
        self.known.push(key);
        self.pairs
            .iter()
            .rev()
            .find(|(k, _)| *k == key)
            .map(|(_, v)| *v)
    }

    /// A duration: `1.5` (seconds), `250ms`, `100us`, `2s`; at most
    /// [`OPTION_DURATION_MAX`].
    pub fn duration(&mut self, key: &'static str) -> Result<Option<Duration>, String> {
        let Some(text) = self.get(key) else {
            return Ok(None);
        };
        parse_duration(text)
            .filter(|d| *d <= OPTION_DURATION_MAX)
            .map(Some)
            .ok_or_else(|| {
                format!(
                    "filter {}: {key}={text:?} is not a duration from 0 to {}s (1.5, 250ms, 100us)",
                    self.filter,
                    OPTION_DURATION_MAX.as_secs()
                )
            })
    }

    /// A probability: `0.1` or `10%`, from 0 to 1.
    pub fn rate(&mut self, key: &'static str) -> Result<Option<f64>, String> {
        let Some(text) = self.get(key) else {
            return Ok(None);
        };
        let value = match text.strip_suffix('%') {
            Some(percent) => percent.parse::<f64>().ok().map(|p| p / 100.0),
            None => text.parse::<f64>().ok(),
        };
        value
            .filter(|r| (0.0..=1.0).contains(r))
            .map(Some)
            .ok_or_else(|| {
                format!(
                    "filter {}: {key}={text:?} is not a rate from 0 to 1 (0.1 or 10%)",
                    self.filter
                )
            })
    }

    /// A size (`64K`, `1M`, `4096`) from `min` to `max`.
    pub fn size(&mut self, key: &'static str, min: u64, max: u64) -> Result<Option<u64>, String> {
        let Some(text) = self.get(key) else {
            return Ok(None);
        };
        parse_size(text)
            .ok()
            .filter(|n| (min..=max).contains(n))
            .map(Some)
            .ok_or_else(|| {
                format!(
                    "filter {}: {key}={text:?} is not a size from {min} to {max} (4096, 64K, 1M)",
                    self.filter
                )
            })
    }

    /// A whole number from `min` to `max`.
    pub fn count(&mut self, key: &'static str, min: u64, max: u64) -> Result<Option<u64>, String> {
        let Some(text) = self.get(key) else {
            return Ok(None);
        };
        text.parse::<u64>()
            .ok()
            .filter(|n| (min..=max).contains(n))
            .map(Some)
            .ok_or_else(|| {
                format!(
                    "filter {}: {key}={text:?} is not a number from {min} to {max}",
                    self.filter
                )
            })
    }

    /// A yes/no option: `true`, `yes`, `on`, `1` or `false`, `no`, `off`, `0`.
    pub fn boolean(&mut self, key: &'static str) -> Result<Option<bool>, String> {
        let Some(text) = self.get(key) else {
            return Ok(None);
        };
        match text.to_ascii_lowercase().as_str() {
            "true" | "yes" | "on" | "1" => Ok(Some(true)),
            "false" | "no" | "off" | "0" => Ok(Some(false)),
            _ => Err(format!(
                "filter {}: {key}={text:?} is not yes or no (true, false, on, off, 1, 0)",
                self.filter
            )),
        }
    }

    /// Refuses any option no `get` asked for.
    pub fn finish(self) -> Result<(), String> {
        match self.pairs.iter().find(|(k, _)| !self.known.contains(k)) {
            None => Ok(()),
            Some((key, _)) => {
                let mut known = self.known.clone();
                known.sort_unstable();
                known.dedup();
                Err(format!(
                    "filter {} has no option {key:?} (it has: {})",
                    self.filter,
                    known.join(", ")
                ))
            }
        }
    }
}

/// Seconds (`1.5`), or a number with `s`, `ms` or `us`.
fn parse_duration(text: &str) -> Option<Duration> {
    let (number, scale) = if let Some(n) = text.strip_suffix("ms") {
        (n, 1e-3)
    } else if let Some(n) = text.strip_suffix("us") {
        (n, 1e-6)
    } else if let Some(n) = text.strip_suffix('s') {
        (n, 1.0)
    } else {
        (text, 1.0)
    };
    let seconds = number.trim().parse::<f64>().ok()? * scale;
    (seconds.is_finite() && seconds >= 0.0).then(|| Duration::from_secs_f64(seconds.min(1e9)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_split_into_a_name_and_options() {
        let (name, mut o) = split("delay:rdelay=10ms, wdelay=1.5").unwrap();
        assert_eq!(name, "delay");
        assert_eq!(
            o.duration("rdelay").unwrap(),
            Some(Duration::from_millis(10))
        );
        assert_eq!(
            o.duration("wdelay").unwrap(),
            Some(Duration::from_millis(1500))
        );
        assert_eq!(o.duration("zdelay").unwrap(), None);
        o.finish().unwrap();
        let (name, o) = split("passthrough").unwrap();
        assert_eq!(name, "passthrough");
        o.finish().unwrap();
        assert!(split("delay:rdelay").is_err());
    }

    #[test]
    fn bad_values_and_unknown_keys_are_refused_with_what_is_allowed() {
        let (_, mut o) = split("delay:rdelay=-1").unwrap();
        assert!(o.duration("rdelay").unwrap_err().contains("not a duration"));
        let (_, mut o) = split("delay:rdelay=2h").unwrap();
        assert!(o.duration("rdelay").is_err());
        let (_, mut o) = split("delay:rdelay=3601").unwrap();
        assert!(o.duration("rdelay").is_err());
        let (_, mut o) = split("error:error-rate=10%").unwrap();
        assert_eq!(o.rate("error-rate").unwrap(), Some(0.1));
        let (_, mut o) = split("error:error-rate=1.5").unwrap();
        assert!(o.rate("error-rate").is_err());
        let (_, mut o) = split("delay:rdelay=1,bogus=2").unwrap();
        o.duration("rdelay").unwrap();
        o.duration("wdelay").unwrap();
        let e = o.finish().unwrap_err();
        assert!(
            e.contains("\"bogus\"") && e.contains("rdelay, wdelay"),
            "{e}"
        );
    }

    #[test]
    fn sizes_counts_and_yes_or_no() {
        let (_, mut o) = split("x:a=64K,b=7,c=yes,d=off,e=maybe,f=0").unwrap();
        assert_eq!(o.size("a", 1, 1 << 20).unwrap(), Some(65536));
        assert_eq!(o.count("b", 0, 10).unwrap(), Some(7));
        assert_eq!(o.boolean("c").unwrap(), Some(true));
        assert_eq!(o.boolean("d").unwrap(), Some(false));
        assert!(o.boolean("e").unwrap_err().contains("yes or no"));
        assert!(o.size("f", 1, 10).unwrap_err().contains("from 1 to 10"));
        assert!(o.count("a", 0, 10).is_err());
        assert_eq!(o.size("g", 1, 10).unwrap(), None);
    }

    #[test]
    fn the_last_value_of_a_key_counts() {
        let (_, mut o) = split("delay:rdelay=1,rdelay=2").unwrap();
        assert_eq!(o.duration("rdelay").unwrap(), Some(Duration::from_secs(2)));
    }
}
