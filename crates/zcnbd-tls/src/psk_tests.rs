use super::*;

const SECRET: &str = "c67270e9691a1d975b69bfd7e5bbb1a0";

fn parse(text: &str) -> Result<PskFile, TlsLoadError> {
    PskFile::parse(text.as_bytes(), Path::new("keys.psk"))
}

fn line_problem(text: &str) -> (usize, PskLineProblem) {
    match parse(text) {
        Err(TlsLoadError::PskLine { line, problem, .. }) => (line, problem),
        other => panic!("expected a line error, got {other:?}"),
    }
}

#[test]
fn psktool_lines_parse() {
    // As psktool 3.7 writes them: a plain username, a hex one (it held a ':'), a short key.
    let text = "alice:7682841d058dc2bf74f0ba3589703d86c13e819fa6f50dd3407e4634bb8744f9\n\
                #626f623a78:C67270E9691A1D975B69BFD7E5BBB1A022B63C0B6AD50F213A153B512FA8CBE2\r\n\
                \n\
                carol:f2119de35b7110839ff89292c2550d90  \n";
    let file = parse(text).unwrap();
    assert_eq!(file.len(), 3);
    assert_eq!(file.key(b"alice").unwrap().as_bytes().len(), 32);
    assert_eq!(file.key(b"bob:x").unwrap().as_bytes()[..2], [0xc6, 0x72]);
    assert_eq!(file.key(b"carol").unwrap().as_bytes().len(), 16);
    assert!(file.key(b"dave").is_none());
    assert!(file.key_for_user("dave").is_err());
}

#[test]
fn each_bad_line_is_reported_by_number() {
    let cases = [
        ("alice:00\nbob\n", 2, PskLineProblem::NoColon),
        (":00\n", 1, PskLineProblem::EmptyUsername),
        ("#zz:00\n", 1, PskLineProblem::BadHexUsername),
        ("alice:\n", 1, PskLineProblem::EmptyKey),
        ("alice:abc\n", 1, PskLineProblem::BadHexKey),
        ("alice:xy\n", 1, PskLineProblem::BadHexKey),
        (
            "a:00\n\na:01\n",
            3,
            PskLineProblem::DuplicateUsername { first_line: 1 },
        ),
    ];
    for (text, line, problem) in cases {
        assert_eq!(line_problem(text), (line, problem), "{text:?}");
    }
    let long_user = format!("{}:00", "u".repeat(PSK_IDENTITY_BYTES_MAX + 1));
    assert!(matches!(
        line_problem(&long_user).1,
        PskLineProblem::UsernameTooLong { .. }
    ));
    let long_key = format!("u:{}", "00".repeat(PSK_KEY_BYTES_MAX + 1));
    assert!(matches!(
        line_problem(&long_key).1,
        PskLineProblem::KeyTooLong { .. }
    ));
}

#[test]
fn an_empty_file_is_an_error() {
    assert!(matches!(parse("\n\n"), Err(TlsLoadError::PskEmpty { .. })));
}

#[test]
fn errors_and_debug_never_show_the_key() {
    let text = format!("alice:{SECRET}\nbob:{SECRET}z\n");
    let err = parse(&text).unwrap_err().to_string();
    assert!(err.contains("line 2"), "{err}");
    assert!(!err.contains(&SECRET[..8]), "{err}");
    let file = parse(&format!("alice:{SECRET}\n")).unwrap();
    let debug = format!("{file:?}");
    assert!(
        !debug.contains(&SECRET[..8]) && !debug.contains("198,"),
        "{debug}"
    );
}
