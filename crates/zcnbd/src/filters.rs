//! `--filter NAME` with `--filter-opt NAME.KEY=VALUE`: each option joins every `--filter` of
//! that name, as `NAME:KEY=VALUE,...` (the form TOML's `filters` takes too).

/// The `--filter` entries with the `--filter-opt` options added to those they name.
pub fn with_options(filters: &[String], options: &[String]) -> Result<Vec<String>, String> {
    let mut out = filters.to_vec();
    for option in options {
        let (name, pair) = option
            .split_once('.')
            .filter(|(_, pair)| pair.contains('='))
            .ok_or_else(|| format!("--filter-opt {option:?}: give NAME.KEY=VALUE"))?;
        let mut found = false;
        for entry in out.iter_mut().filter(|e| e.split(':').next() == Some(name)) {
            entry.push(if entry.contains(':') { ',' } else { ':' });
            entry.push_str(pair);
            found = true;
        }
        if !found {
            return Err(format!(
                "--filter-opt {option:?}: no --filter {name} to give it to"
            ));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_join_the_filters_they_name() {
        let filters = vec!["delay".to_owned(), "error:error=EIO".to_owned()];
        let opts = vec![
            "delay.rdelay=10ms".to_owned(),
            "error.error-rate=1".to_owned(),
            "delay.wdelay=1".to_owned(),
        ];
        assert_eq!(
            with_options(&filters, &opts).unwrap(),
            ["delay:rdelay=10ms,wdelay=1", "error:error=EIO,error-rate=1"]
        );
        assert!(with_options(&filters, &["cache.size=1".to_owned()])
            .unwrap_err()
            .contains("no --filter cache"));
        assert!(with_options(&filters, &["delay".to_owned()]).is_err());
    }
}
