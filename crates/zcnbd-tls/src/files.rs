//! Reading credential files: bounded in size, and secrets checked for loose permissions.

use std::fs::File;
use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use zeroize::Zeroizing;

use crate::error::{LoadWarning, TlsLoadError};

/// No certificate, key or PSK file is larger than this (a PEM chain of a dozen certificates
/// is ~20 KiB; a PSK file of a thousand users ~100 KiB).
pub const CREDENTIAL_FILE_BYTES_MAX: u64 = 1 << 20;

/// Reads a public file (certificates).
pub fn read_public(path: &Path) -> Result<Vec<u8>, TlsLoadError> {
    let (file, len) = open_bounded(path)?;
    let mut bytes = Vec::with_capacity(len);
    read_all(file, path, &mut bytes)?;
    Ok(bytes)
}

/// Reads a file that holds secrets (a private key, PSKs): the bytes are wiped when dropped,
/// and a file that group or others may read adds a warning.
pub fn read_secret(
    path: &Path,
    warnings: &mut Vec<LoadWarning>,
) -> Result<Zeroizing<Vec<u8>>, TlsLoadError> {
    let (file, len) = open_bounded(path)?;
    let mode = file.metadata().map_err(|e| read_error(path, e))?.mode();
    if let Some(w) = permission_warning(path, mode) {
        warnings.push(w);
    }
    // Sized up front so that the buffer never reallocates and leaves a copy behind.
    let mut bytes = Zeroizing::new(Vec::with_capacity(len + 1));
    read_all(file, path, &mut bytes)?;
    Ok(bytes)
}

/// A warning when `mode` lets group or others read (or write) a secret file.
pub fn permission_warning(path: &Path, mode: u32) -> Option<LoadWarning> {
    (mode & 0o077 != 0).then(|| LoadWarning::SecretReadableByOthers {
        path: path.to_path_buf(),
        mode,
    })
}

fn open_bounded(path: &Path) -> Result<(File, usize), TlsLoadError> {
    let file = File::open(path).map_err(|e| read_error(path, e))?;
    let len = file.metadata().map_err(|e| read_error(path, e))?.len();
    if len > CREDENTIAL_FILE_BYTES_MAX {
        return Err(TlsLoadError::TooLarge {
            path: path.to_path_buf(),
            max_bytes: CREDENTIAL_FILE_BYTES_MAX,
        });
    }
    Ok((file, len as usize))
}

fn read_all(file: File, path: &Path, into: &mut Vec<u8>) -> Result<(), TlsLoadError> {
    // The take() bounds a file that grows between the size check and the read.
    let n = file
        .take(CREDENTIAL_FILE_BYTES_MAX + 1)
        .read_to_end(into)
        .map_err(|e| read_error(path, e))?;
    if n as u64 > CREDENTIAL_FILE_BYTES_MAX {
        return Err(TlsLoadError::TooLarge {
            path: path.to_path_buf(),
            max_bytes: CREDENTIAL_FILE_BYTES_MAX,
        });
    }
    Ok(())
}

fn read_error(path: &Path, source: std::io::Error) -> TlsLoadError {
    TlsLoadError::Read {
        path: path.to_path_buf(),
        source,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_owner_bits_pass() {
        let p = Path::new("k");
        assert_eq!(permission_warning(p, 0o100600), None);
        assert_eq!(permission_warning(p, 0o100400), None);
        assert!(permission_warning(p, 0o100640).is_some());
        assert!(permission_warning(p, 0o100604).is_some());
        assert!(permission_warning(p, 0o100602).is_some());
    }
}
