//! Naming an RBD image: `POOL[/NAMESPACE]/IMAGE[@SNAP]` and how to reach its cluster (parsed whether or
//! not this build can serve RBD, so a config file reads the same either way).

use std::path::PathBuf;

use crate::sys::rbd::ImageName;

/// Which image, and how to reach its cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RbdSpec {
    pub pool: String,
    /// The pool's namespace (`None`: the default one).
    pub namespace: Option<String>,
    pub image: String,
    /// A snapshot: served read-only.
    pub snap: Option<String>,
    /// The Ceph configuration file (`None`: librados' search: `$CEPH_CONF`,
    /// `/etc/ceph/ceph.conf`, ...).
    pub conf: Option<PathBuf>,
    /// The client id, without `client.` (`None`: `admin`, or `CEPH_ARGS`' `--id`).
    pub id: Option<String>,
}

/// Why an `rbd` spec did not parse.
#[derive(Debug, thiserror::Error)]
#[error("bad RBD image {0:?}: want POOL[/NAMESPACE]/IMAGE or POOL[/NAMESPACE]/IMAGE@SNAPSHOT")]
pub struct RbdSpecError(pub String);

impl RbdSpec {
    /// Parses `POOL[/NAMESPACE]/IMAGE[@SNAP]` (Ceph's own notation, as `rbd` takes it).
    pub fn parse(text: &str) -> Result<RbdSpec, RbdSpecError> {
        let bad = || RbdSpecError(text.to_owned());
        let (pool, rest) = text.split_once('/').ok_or_else(bad)?;
        let (namespace, rest) = match rest.split_once('/') {
            Some((namespace, rest)) => (Some(namespace), rest),
            None => (None, rest),
        };
        let (image, snap) = match rest.split_once('@') {
            Some((image, snap)) => (image, Some(snap)),
            None => (rest, None),
        };
        let empty = |s: &str| s.is_empty() || s.contains('/') || s.contains('@');
        if empty(pool) || empty(image) || snap.is_some_and(empty) || namespace.is_some_and(empty) {
            return Err(bad());
        }
        Ok(RbdSpec {
            pool: pool.to_owned(),
            namespace: namespace.map(str::to_owned),
            image: image.to_owned(),
            snap: snap.map(str::to_owned),
            conf: None,
            id: None,
        })
    }

    /// `POOL[/NAMESPACE]/IMAGE[@SNAP]`.
    pub fn name(&self) -> String {
        self.image_name().to_string()
    }

    /// The image to open, as librbd's calls take it.
    pub fn image_name(&self) -> ImageName<'_> {
        ImageName {
            pool: &self.pool,
            namespace: self.namespace.as_deref(),
            image: &self.image,
            snap: self.snap.as_deref(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse() {
        let s = RbdSpec::parse("rbd/disk").expect("plain");
        assert_eq!(
            (s.pool.as_str(), s.image.as_str(), s.snap),
            ("rbd", "disk", None)
        );
        let s = RbdSpec::parse("p/i@snap1").expect("snapshot");
        assert_eq!(s.snap.as_deref(), Some("snap1"));
        assert_eq!(s.name(), "p/i@snap1");
        let s = RbdSpec::parse("p/ns/i@s").expect("namespace");
        assert_eq!(
            (s.namespace.as_deref(), s.image.as_str(), s.snap.as_deref()),
            (Some("ns"), "i", Some("s"))
        );
        assert_eq!(s.name(), "p/ns/i@s");
        assert_eq!(RbdSpec::parse("p/ns/i").unwrap().name(), "p/ns/i");
        for bad in [
            "", "rbd", "/img", "rbd/", "rbd/img@", "a/b/c/d", "a/b@c@d", "a//c", "a/b/", "a/@x/c",
        ] {
            assert!(RbdSpec::parse(bad).is_err(), "{bad:?} parsed");
        }
    }
}
