//! Expected strings are what `certtool -i` (GnuTLS 3.7.9) printed for the same names.

use super::*;
use openssl::x509::X509Name;

fn name(entries: &[(&str, &str)]) -> X509Name {
    let mut b = X509Name::builder().unwrap();
    for (field, value) in entries {
        b.append_entry_by_text(field, value).unwrap();
    }
    b.build()
}

#[test]
fn last_rdn_first_with_gnutls_names() {
    let n = name(&[
        ("C", "GB"),
        ("ST", "London"),
        ("L", "London"),
        ("O", "Example, Inc."),
        ("CN", "client #1"),
        ("emailAddress", "a@b.c"),
        ("DC", "example"),
        ("UID", "u1"),
        ("serialNumber", "42"),
        ("street", "Main St"),
        ("title", "Dr"),
    ]);
    assert_eq!(
        gnutls_dn(&n).unwrap(),
        "title=Dr,street=Main St,serialNumber=42,UID=u1,DC=example,EMAIL=a@b.c,\
         CN=client #1,O=Example\\, Inc.,L=London,ST=London,C=GB"
    );
}

#[test]
fn special_characters_are_escaped() {
    let cases = [
        (" lead", "CN=\\ lead,O=Ex"),
        ("#hash", "CN=\\#hash,O=Ex"),
        ("q\"x\\y", "CN=q\\\"x\\\\y,O=Ex"),
        ("lt<gt>", "CN=lt\\<gt\\>,O=Ex"),
        ("a+b;c", "CN=a\\+b\\;c,O=Ex"),
        ("trail ", "CN=trail\\ ,O=Ex"),
        ("héllo", "CN=héllo,O=Ex"),
        ("eq=x", "CN=eq=x,O=Ex"),
    ];
    for (cn, expected) in cases {
        assert_eq!(
            gnutls_dn(&name(&[("O", "Ex"), ("CN", cn)])).unwrap(),
            expected
        );
    }
}

#[test]
fn other_names_and_unknown_types() {
    let n = name(&[
        ("GN", "g"),
        ("SN", "s"),
        ("initials", "i"),
        ("pseudonym", "p"),
        ("postalCode", "pc"),
        ("description", "d"),
        ("postalAddress", "pa"),
    ]);
    assert_eq!(
        gnutls_dn(&n).unwrap(),
        "2.5.4.16=#0c027061,description=d,postalCode=pc,pseudonym=p,initials=i,surName=s,\
         givenName=g"
    );
}

#[test]
fn multi_valued_rdns_join_with_plus_in_encoded_order() {
    // SEQUENCE { SET { O=Ex }, SET { OU=Dev, OU=Ops } }
    let der = [
        0x30, 0x27, //
        0x31, 0x0b, 0x30, 0x09, 0x06, 0x03, 0x55, 0x04, 0x0a, 0x0c, 0x02, b'E', b'x', //
        0x31, 0x18, //
        0x30, 0x0a, 0x06, 0x03, 0x55, 0x04, 0x0b, 0x0c, 0x03, b'D', b'e', b'v', //
        0x30, 0x0a, 0x06, 0x03, 0x55, 0x04, 0x0b, 0x0c, 0x03, b'O', b'p', b's',
    ];
    let n = X509Name::from_der(&der).unwrap();
    assert_eq!(gnutls_dn(&n).unwrap(), "OU=Dev+OU=Ops,O=Ex");
}

#[test]
fn truncated_der_is_refused() {
    let mut c = Der(&[0x30, 0x05, 0x01]);
    assert!(c.take_tlv().is_none());
    let mut c = Der(&[0x30, 0x84, 0xff, 0xff, 0xff, 0xff]);
    assert!(c.take_tlv().is_none());
}
