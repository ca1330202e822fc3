//! Pre-shared keys in the format GnuTLS's `psktool` writes (and nbdkit `--tls-psk`, qemu's
//! `tls-creds-psk` and libnbd's `tls-psk-file` read): one `username:hexkey` per line.
//!
//! Accepted, as GnuTLS accepts it (lib/auth/psk_passwd.c): the username is everything before
//! the first `:`; a username starting with `#` is hex (psktool writes usernames that hold a
//! `:` or unprintable bytes that way); the key is hex, either case. Trailing spaces, tabs and
//! `\r` are ignored and blank lines skipped. Stricter than GnuTLS, so that a typo is found at
//! start and not at a client's first handshake: a malformed line, a duplicate username or a
//! file without keys is an error that names the line, never its text.

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};

use zeroize::Zeroizing;

use crate::error::{LoadWarning, PskLineProblem, TlsLoadError};
use crate::files;

/// Longest PSK identity OpenSSL carries (`PSK_MAX_IDENTITY_LEN`).
pub const PSK_IDENTITY_BYTES_MAX: usize = 256;
/// Longest key OpenSSL accepts from a PSK callback (`PSK_MAX_PSK_LEN`).
pub const PSK_KEY_BYTES_MAX: usize = 512;

/// One pre-shared key. Its bytes appear in no `Debug` output and are wiped when dropped.
#[derive(Clone)]
pub struct PskKey(Zeroizing<Vec<u8>>);

impl PskKey {
    /// The key's bytes, to hand to OpenSSL.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }
}

impl fmt::Debug for PskKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PskKey(<{} bytes, redacted>)", self.0.len())
    }
}

/// The keys of a PSK file, by username (the TLS PSK identity).
#[derive(Debug)]
pub struct PskFile {
    path: PathBuf,
    keys: HashMap<Vec<u8>, PskKey>,
}

impl PskFile {
    /// Reads and parses `path`; a file group or others can read adds a warning.
    pub fn load(path: &Path, warnings: &mut Vec<LoadWarning>) -> Result<PskFile, TlsLoadError> {
        let text = files::read_secret(path, warnings)?;
        PskFile::parse(&text, path)
    }

    /// Parses the contents of a PSK file; `path` only names it in errors.
    pub fn parse(text: &[u8], path: &Path) -> Result<PskFile, TlsLoadError> {
        let mut keys = HashMap::new();
        let mut first_line = HashMap::new();
        for (index, raw) in text.split(|&b| b == b'\n').enumerate() {
            let line = index + 1;
            let fault = |problem| TlsLoadError::PskLine {
                path: path.to_path_buf(),
                line,
                problem,
            };
            let Some((user, key)) = parse_line(raw).map_err(fault)? else {
                continue;
            };
            if let Some(&first) = first_line.get(&user) {
                return Err(fault(PskLineProblem::DuplicateUsername {
                    first_line: first,
                }));
            }
            first_line.insert(user.clone(), line);
            keys.insert(user, key);
        }
        if keys.is_empty() {
            return Err(TlsLoadError::PskEmpty {
                path: path.to_path_buf(),
            });
        }
        Ok(PskFile {
            path: path.to_path_buf(),
            keys,
        })
    }

    /// The key of `identity`, if the file has one.
    pub fn key(&self, identity: &[u8]) -> Option<&PskKey> {
        self.keys.get(identity)
    }

    /// The key of `username` for a client, or an error naming the file.
    pub fn key_for_user(&self, username: &str) -> Result<&PskKey, TlsLoadError> {
        self.key(username.as_bytes())
            .ok_or_else(|| TlsLoadError::PskNoUser {
                path: self.path.clone(),
                username: username.to_string(),
            })
    }

    /// How many usernames have a key.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Whether the file has no key (never true for a parsed file).
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }
}

/// One line: `Ok(None)` for a blank line.
fn parse_line(raw: &[u8]) -> Result<Option<(Vec<u8>, PskKey)>, PskLineProblem> {
    let line = trim_end(raw);
    if line.is_empty() {
        return Ok(None);
    }
    let colon = line
        .iter()
        .position(|&b| b == b':')
        .ok_or(PskLineProblem::NoColon)?;
    let (user, key) = (&line[..colon], &line[colon + 1..]);
    let user = match user.strip_prefix(b"#") {
        Some(hex) => decode_hex(hex)
            .ok_or(PskLineProblem::BadHexUsername)?
            .to_vec(),
        None => user.to_vec(),
    };
    if user.is_empty() {
        return Err(PskLineProblem::EmptyUsername);
    }
    if user.len() > PSK_IDENTITY_BYTES_MAX {
        return Err(PskLineProblem::UsernameTooLong {
            max_bytes: PSK_IDENTITY_BYTES_MAX,
        });
    }
    Ok(Some((user, parse_key(key)?)))
}

fn parse_key(hex: &[u8]) -> Result<PskKey, PskLineProblem> {
    if hex.is_empty() {
        return Err(PskLineProblem::EmptyKey);
    }
    if hex.len() / 2 > PSK_KEY_BYTES_MAX {
        return Err(PskLineProblem::KeyTooLong {
            max_bytes: PSK_KEY_BYTES_MAX,
        });
    }
    decode_hex(hex).map(PskKey).ok_or(PskLineProblem::BadHexKey)
}

fn trim_end(line: &[u8]) -> &[u8] {
    let end = line
        .iter()
        .rposition(|b| !matches!(b, b' ' | b'\t' | b'\r'))
        .map_or(0, |i| i + 1);
    &line[..end]
}

/// Hex digits to bytes (either case); `None` for an odd count or a non-hex byte.
fn decode_hex(hex: &[u8]) -> Option<Zeroizing<Vec<u8>>> {
    if !hex.len().is_multiple_of(2) {
        return None;
    }
    let mut out = Zeroizing::new(Vec::with_capacity(hex.len() / 2));
    for pair in hex.chunks_exact(2) {
        let high = (pair[0] as char).to_digit(16)?;
        let low = (pair[1] as char).to_digit(16)?;
        out.push((high * 16 + low) as u8);
    }
    Some(out)
}

#[cfg(test)]
#[path = "psk_tests.rs"]
mod tests;
