//! Whether a block device zcnbd attached is in use - a filesystem mounted from it or one of its
//! partitions, or another block device built on it (device-mapper, md: `holders/`) - so
//! `zcnbd detach` refuses to pull it away from under them unless told to.

use std::fs;
use std::path::Path;

/// What uses `/dev/NAME` (`ublkb0`, `nbd0`) or its partitions: one line each ("mounted at
/// /mnt", "held by dm-0"); empty when nothing does (or the kernel does not know the device).
pub fn users(name: &str) -> Vec<String> {
    let sys = Path::new("/sys/class/block").join(name);
    let mut names = vec![name.to_string()];
    if let Ok(dir) = fs::read_dir(&sys) {
        for e in dir.flatten() {
            let n = e.file_name().to_string_lossy().into_owned();
            if n.starts_with(name) && n.len() > name.len() {
                names.push(n);
            }
        }
    }
    let mut devs = Vec::new();
    let mut out = Vec::new();
    for n in &names {
        let dir = Path::new("/sys/class/block").join(n);
        if let Some(dev) = fs::read_to_string(dir.join("dev"))
            .ok()
            .and_then(|s| parse_dev(s.trim()))
        {
            devs.push(dev);
        }
        if let Ok(holders) = fs::read_dir(dir.join("holders")) {
            for h in holders.flatten() {
                out.push(format!(
                    "/dev/{n} held by {}",
                    h.file_name().to_string_lossy()
                ));
            }
        }
    }
    if let Ok(info) = fs::read_to_string("/proc/self/mountinfo") {
        out.extend(mounted(&info, &devs));
    }
    out
}

/// `MAJOR:MINOR`.
fn parse_dev(s: &str) -> Option<(u32, u32)> {
    let (major, minor) = s.split_once(':')?;
    Some((major.parse().ok()?, minor.parse().ok()?))
}

/// The mounts in `mountinfo` (proc(5)'s format: the third field is the device's
/// MAJOR:MINOR, the fifth the mount point) of any of `devs`: "mounted at POINT" each.
fn mounted(mountinfo: &str, devs: &[(u32, u32)]) -> Vec<String> {
    mountinfo
        .lines()
        .filter_map(|line| {
            let mut fields = line.split(' ');
            let dev = parse_dev(fields.nth(2)?)?;
            let point = fields.nth(1)?;
            devs.contains(&dev)
                .then(|| format!("mounted at {}", unescape(point)))
        })
        .collect()
}

/// A mount point as mountinfo escapes it (`\040` for a space, octal).
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let octal = b
            .get(i + 1..i + 4)
            .filter(|d| d.iter().all(|c| (b'0'..=b'7').contains(c)));
        match (b[i], octal) {
            (b'\\', Some(d)) => {
                out.push((d[0] - b'0') * 64 + (d[1] - b'0') * 8 + (d[2] - b'0'));
                i += 4;
            }
            (c, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    const INFO: &str = "\
22 1 0:21 / / rw,relatime - tmpfs tmpfs rw
35 22 259:0 / /mnt rw,relatime shared:1 - ext4 /dev/ublkb0 rw
36 22 259:2 / /mnt/my\\040disk rw,relatime - ext4 /dev/ublkb0p1 rw
37 22 43:0 / /srv rw - ext4 /dev/nbd0 rw";

    #[test]
    fn mounts_of_the_device_and_its_partitions_are_found() {
        assert_eq!(mounted(INFO, &[(259, 0)]), ["mounted at /mnt"]);
        assert_eq!(
            mounted(INFO, &[(259, 1), (259, 2)]),
            ["mounted at /mnt/my disk"]
        );
        assert_eq!(mounted(INFO, &[(43, 0)]), ["mounted at /srv"]);
        assert!(mounted(INFO, &[(259, 9)]).is_empty());
        assert!(mounted("garbage\n\n1 2", &[(259, 0)]).is_empty());
    }

    #[test]
    fn devices_parse() {
        assert_eq!(parse_dev("259:3"), Some((259, 3)));
        assert_eq!(parse_dev("259"), None);
        assert_eq!(parse_dev("a:b"), None);
    }
}
