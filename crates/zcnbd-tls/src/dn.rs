//! A certificate's distinguished name as the string GnuTLS prints and qemu's `--tls-authz`
//! compares: RFC 4514, last RDN first (`CN=client,O=Example,C=GB`), the attributes of a
//! multi-valued RDN in encoded order joined by `+`, GnuTLS's attribute names (`EMAIL`,
//! `street`, `surName`, ...), an unknown attribute as `dotted.oid=#hex-of-DER`, and `,+"\<>;`,
//! a leading `#` or space and a trailing space escaped with `\`. Checked against certtool
//! 3.7.9 (`certtool -i`) for the cases in the tests.
//!
//! The name is walked from its DER with a bounds-checked cursor; it comes from a certificate
//! OpenSSL has already parsed and verified.

use std::fmt::Write as _;

use openssl::x509::X509NameRef;

/// The subject or issuer name in GnuTLS's RFC 4514 form; `None` if the DER is malformed.
pub fn gnutls_dn(name: &X509NameRef) -> Option<String> {
    let der = name.to_der().ok()?;
    let mut outer = Der(&der);
    let (tag, rdns) = outer.take_tlv()?;
    if tag != 0x30 || !outer.0.is_empty() {
        return None;
    }
    let mut parsed = Vec::new();
    let mut rdns = Der(rdns);
    while !rdns.0.is_empty() {
        let (tag, set) = rdns.take_tlv()?;
        if tag != 0x31 {
            return None;
        }
        parsed.push(rdn(set)?);
    }
    parsed.reverse();
    Some(parsed.join(","))
}

/// One RDN (a SET of attribute type and value pairs) as `type=value+type=value`.
fn rdn(set: &[u8]) -> Option<String> {
    let mut items = Vec::new();
    let mut set = Der(set);
    while !set.0.is_empty() {
        let (tag, ava) = set.take_tlv()?;
        if tag != 0x30 {
            return None;
        }
        let mut ava = Der(ava);
        let (oid_tag, oid) = ava.take_tlv()?;
        let value_tlv = ava.0;
        let (value_tag, value) = ava.take_tlv()?;
        if oid_tag != 0x06 || !ava.0.is_empty() {
            return None;
        }
        let oid = dotted_oid(oid)?;
        let text = match (attribute_name(&oid), decode_string(value_tag, value)) {
            (Some(name), Some(text)) => format!("{name}={}", escape(&text)),
            _ => format!("{oid}=#{}", hex(value_tlv)),
        };
        items.push(text);
    }
    Some(items.join("+"))
}

/// GnuTLS's name for an attribute type (lib/x509/common.c), for the types it prints by name.
fn attribute_name(oid: &str) -> Option<&'static str> {
    Some(match oid {
        "2.5.4.3" => "CN",
        "2.5.4.4" => "surName",
        "2.5.4.5" => "serialNumber",
        "2.5.4.6" => "C",
        "2.5.4.7" => "L",
        "2.5.4.8" => "ST",
        "2.5.4.9" => "street",
        "2.5.4.10" => "O",
        "2.5.4.11" => "OU",
        "2.5.4.12" => "title",
        "2.5.4.13" => "description",
        "2.5.4.15" => "businessCategory",
        "2.5.4.17" => "postalCode",
        "2.5.4.41" => "name",
        "2.5.4.42" => "givenName",
        "2.5.4.43" => "initials",
        "2.5.4.44" => "generationQualifier",
        "2.5.4.46" => "dnQualifier",
        "2.5.4.65" => "pseudonym",
        "0.9.2342.19200300.100.1.1" => "UID",
        "0.9.2342.19200300.100.1.25" => "DC",
        "1.2.840.113549.1.9.1" => "EMAIL",
        "1.3.6.1.4.1.311.60.2.1.1" => "jurisdictionOfIncorporationLocalityName",
        "1.3.6.1.4.1.311.60.2.1.2" => "jurisdictionOfIncorporationStateOrProvinceName",
        "1.3.6.1.4.1.311.60.2.1.3" => "jurisdictionOfIncorporationCountryName",
        _ => return None,
    })
}

/// The text of a directory string; `None` for types GnuTLS prints as hex.
fn decode_string(tag: u8, value: &[u8]) -> Option<String> {
    match tag {
        // UTF8String, PrintableString, T61String, IA5String, VisibleString
        0x0c | 0x13 | 0x14 | 0x16 | 0x1a => String::from_utf8(value.to_vec()).ok(),
        // BMPString: UCS-2, big-endian
        0x1e => {
            let units = value
                .chunks_exact(2)
                .map(|p| u16::from_be_bytes([p[0], p[1]]));
            value.len().is_multiple_of(2).then(|| {
                char::decode_utf16(units)
                    .collect::<Result<String, _>>()
                    .ok()
            })?
        }
        // UniversalString: UCS-4, big-endian
        0x1c => {
            let chars = value
                .chunks_exact(4)
                .map(|q| char::from_u32(u32::from_be_bytes([q[0], q[1], q[2], q[3]])));
            value
                .len()
                .is_multiple_of(4)
                .then(|| chars.collect::<Option<String>>())?
        }
        _ => None,
    }
}

/// RFC 4514 section 2.4 escaping, as GnuTLS applies it.
fn escape(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    let last = value.chars().count().saturating_sub(1);
    for (i, c) in value.chars().enumerate() {
        let special = matches!(c, ',' | '+' | '"' | '\\' | '<' | '>' | ';');
        let edge = (i == 0 && (c == '#' || c == ' ')) || (i == last && c == ' ');
        if special || edge {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

fn dotted_oid(der: &[u8]) -> Option<String> {
    let (&first, rest) = der.split_first()?;
    let mut out = format!(
        "{}.{}",
        (first / 40).min(2),
        first - (first / 40).min(2) * 40
    );
    let mut arc: u64 = 0;
    for &b in rest {
        arc = arc.checked_mul(128)? | u64::from(b & 0x7f);
        if b & 0x80 == 0 {
            write!(out, ".{arc}").ok()?;
            arc = 0;
        }
    }
    Some(out)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().fold(String::new(), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

/// A DER cursor: takes one tag-length-value at a time, never reading past its slice.
struct Der<'a>(&'a [u8]);

impl<'a> Der<'a> {
    /// The next element's tag and contents.
    fn take_tlv(&mut self) -> Option<(u8, &'a [u8])> {
        let (&tag, rest) = self.0.split_first()?;
        let (&first, mut rest) = rest.split_first()?;
        let len = if first < 0x80 {
            usize::from(first)
        } else {
            let count = usize::from(first & 0x7f);
            if count == 0 || count > 4 || rest.len() < count {
                return None;
            }
            let (bytes, after) = rest.split_at(count);
            rest = after;
            bytes.iter().try_fold(0usize, |n, &b| {
                n.checked_mul(256).map(|n| n | usize::from(b))
            })?
        };
        if rest.len() < len {
            return None;
        }
        let (contents, after) = rest.split_at(len);
        self.0 = after;
        Some((tag, contents))
    }
}

#[cfg(test)]
#[path = "dn_tests.rs"]
mod tests;
