//! Runs the fuzz targets' bodies under `cargo test`: every saved input in
//! `fuzz/regressions/<target>/`, then a few thousand deterministic inputs, random but shaped
//! like the protocol (valid magics, real option codes, a finished handshake before random
//! requests), so each target reaches deep states without a fuzzer.
//!
//! A failing generated input is written to `CARGO_TARGET_TMPDIR`; copy it into
//! `fuzz/regressions/<target>/` to keep it.

mod fuzz_harness;
mod fuzz_inputs;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Once};
use std::time::Duration;

use fuzz_harness::session::{self, Preamble};
use fuzz_harness::{client, handshake, image, reply, request, transcript, Target, TARGETS};
use fuzz_inputs::{gen_option, gen_reply, gen_request, mutate, Rng};
use zcnbd_proto::consts::{client_flags, cmd_flags, opt, IHAVEOPT, REQUEST_MAGIC};
use zcnbd_proto::cursor::PutBe;

/// How long one session may take before it counts as a hang.
const SESSION_DEADLINE: Duration = Duration::from_secs(5);
/// How long a batch of sans-IO inputs may take.
const BATCH_DEADLINE: Duration = Duration::from_secs(60);

#[test]
fn saved_regressions_still_pass() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/regressions");
    for (name, body) in TARGETS {
        for path in files_in(&root.join(name)) {
            let data = std::fs::read(&path).expect("read regression input");
            let deadline = if name == "session" {
                SESSION_DEADLINE
            } else {
                BATCH_DEADLINE
            };
            within(deadline, &path.display().to_string(), move || {
                body(&data);
            });
        }
    }
}

#[test]
fn generated_damaged_images() {
    run_generated(("image", image::run), 1500, 23, |rng| {
        // Patches over the template image: mostly in the header and the first clusters
        // (L1, refcount table and block, L2 tables), values either random or the edges of
        // their fields; now and then the file cut short; then the operations' parameters.
        let mut input = vec![rng.below(24) as u8];
        for _ in 0..input[0] {
            let at = if rng.chance(1, 2) {
                rng.below(512)
            } else {
                rng.below(64 << 10)
            };
            input.put_u32(at as u32);
            let len = rng.below(16) as u8;
            input.push(len);
            let value = match rng.below(4) {
                0 => vec![0; usize::from(len) + 1],
                1 => vec![0xff; usize::from(len) + 1],
                2 => {
                    let mut v = vec![0; usize::from(len) + 1];
                    *v.last_mut().unwrap() = rng.pick(&[1, 2, 3, 4, 9, 12, 16, 22, 63, 64, 0x80]);
                    v
                }
                _ => rng.bytes(usize::from(len) + 1),
            };
            input.extend(value);
        }
        let cut = rng.chance(1, 10);
        input.push(u8::from(cut));
        if cut {
            input.put_u32(rng.below(80 << 10) as u32);
        }
        let ops = rng.below(200) as usize;
        input.extend(rng.bytes(ops));
        input
    });
}

#[test]
fn generated_tls_handshakes() {
    run_generated(("handshake_tls", handshake::run_tls), 5000, 11, |rng| {
        // The policy (on or require), then client flags (mostly fixed newstyle), options
        // with STARTTLS among them, and the odd byte changed.
        let mut input = vec![rng.next() as u8];
        if rng.chance(9, 10) {
            input.put_u32(client_flags::FIXED_NEWSTYLE | client_flags::NO_ZEROES);
        } else {
            input.put_u32(rng.pick(&[0, 2, client_flags::FIXED_NEWSTYLE]));
        }
        for _ in 0..rng.below(8) {
            if rng.chance(1, 4) {
                input.put_u64(IHAVEOPT);
                input.put_u32(opt::STARTTLS);
                input.put_u32(0);
            } else {
                gen_option(rng, &mut input);
            }
        }
        mutate(rng, &mut input);
        input
    });
}

#[test]
fn generated_handshakes() {
    run_generated(("handshake", handshake::run), 5000, 1, |rng| {
        let mut input = Vec::new();
        if rng.chance(9, 10) {
            input.put_u32(client_flags::FIXED_NEWSTYLE | client_flags::NO_ZEROES);
        } else {
            let any = rng.next() as u32;
            input.put_u32(rng.pick(&[0, 1, 2, 4, any]));
        }
        for _ in 0..rng.below(8) {
            gen_option(rng, &mut input);
        }
        mutate(rng, &mut input);
        input
    });
}

#[test]
fn generated_requests() {
    run_generated(("request", request::run), 5000, 2, |rng| {
        let mode = rng.pick(&request::MODES);
        let mut input = Vec::new();
        for _ in 0..1 + rng.below(4) {
            gen_request(rng, mode, false, &mut input);
        }
        mutate(rng, &mut input);
        input
    });
}

#[test]
fn generated_replies() {
    run_generated(("reply", reply::run), 5000, 3, |rng| {
        if rng.chance(1, 2) {
            // Round-trip parameters: mode, cookie, offset, encoder, then encoder arguments.
            let len = rng.below(96) as usize;
            return rng.bytes(len);
        }
        let mode = rng.pick(&request::MODES);
        let mut input = Vec::new();
        for _ in 0..1 + rng.below(4) {
            gen_reply(rng, mode, &mut input);
        }
        mutate(rng, &mut input);
        input
    });
}

#[test]
fn generated_client_sessions() {
    run_generated(("client_session", client::run_session), 5000, 7, |rng| {
        // Mode, base:allocation, request count, requests, step, then replies.
        let mode_index = rng.below(3) as usize;
        let mode = request::MODES[mode_index];
        let count = 1 + rng.below(8) as u8;
        let mut input = vec![mode_index as u8, rng.below(2) as u8, count - 1];
        let mut starts = Vec::new();
        for _ in 0..count {
            let command = rng.below(7) as u8;
            let offset = rng.below(1 << 20) as u32;
            let length = rng.below(16384) as u32;
            input.push(command);
            input.push(rng.below(16) as u8);
            input.put_u32(offset);
            input.put_u32(length);
            starts.push((offset, length));
        }
        input.push(rng.below(64) as u8);
        for _ in 0..rng.below(6) {
            // Replies to the requests just started: cookies are (generation 1, slot i).
            let i = rng.below(u64::from(count)) as usize;
            let (offset, length) = starts[i];
            let to = zcnbd_proto::ReplyTo {
                mode,
                cookie: 1 << 32 | i as u64,
                offset: u64::from(offset),
            };
            let half = u64::from(length / 2);
            match rng.below(5) {
                0 => to.encode_ok(&mut input),
                1 => to.encode_error(zcnbd_proto::Errno::Io, "no", &mut input),
                2 => {
                    to.encode_data_header(u64::from(offset), half, rng.chance(1, 2), &mut input);
                    input.extend(std::iter::repeat_n(7u8, half as usize));
                }
                3 => to.encode_hole(
                    u64::from(offset) + half,
                    length.max(1) / 2,
                    true,
                    &mut input,
                ),
                _ => {
                    let e = [zcnbd_proto::Extent {
                        length: u64::from(length.max(1)),
                        flags: 1,
                    }];
                    to.encode_block_status(1, &e, &mut input);
                }
            }
        }
        mutate(rng, &mut input);
        input
    });
}

#[test]
fn generated_client_handshakes() {
    run_generated(
        ("client_handshake", client::run_handshake),
        3000,
        8,
        |rng| {
            // A real server's side of a handshake, then mutated.
            let exports = &fuzz_harness::fixture::fixture().infos;
            let mut server = zcnbd_proto::ServerHandshake::new(Default::default());
            let mut client = zcnbd_proto::ClientHandshake::new(Default::default());
            let mut wire = Vec::new();
            for _ in 0..64 {
                wire.extend_from_slice(server.pending_output());
                let n = server.pending_output().len();
                server.consume_output(n);
                let mut fed = Vec::new();
                std::mem::swap(&mut fed, &mut wire);
                let mut at = 0;
                while let Ok(used) = client.handle_input(&fed[at..]) {
                    if used == 0 {
                        break;
                    }
                    at += used;
                }
                wire = fed;
                let out = client.pending_output().to_vec();
                client.consume_output(out.len());
                let mut at = 0;
                while let Ok(used) = server.handle_input(&out[at..], exports) {
                    if used == 0 {
                        break;
                    }
                    at += used;
                }
                if out.is_empty() {
                    break;
                }
            }
            let mut input = vec![rng.below(8) as u8, 0, rng.below(32) as u8];
            input.extend_from_slice(&wire);
            mutate(rng, &mut input);
            input
        },
    );
}

#[test]
fn generated_sessions() {
    run_generated(("session", session::run), 500, 4, gen_session);
}

#[test]
fn generated_sessions_uring() {
    run_generated(("session", session::run_uring), 300, 5, gen_session);
}

#[test]
fn generated_sessions_uring_zerocopy() {
    run_generated(
        ("session", session::run_uring_zerocopy),
        300,
        6,
        gen_session,
    );
}

/// A session input: a preamble selector, then options or requests shaped by the protocol.
fn gen_session(rng: &mut Rng) -> Vec<u8> {
    {
        let preamble = rng.pick(&Preamble::ALL);
        let mut input = vec![preamble.selector()];
        match preamble.mode() {
            None => {
                if preamble == Preamble::Raw {
                    input.put_u32(client_flags::FIXED_NEWSTYLE | client_flags::NO_ZEROES);
                }
                for _ in 0..rng.below(5) {
                    gen_option(rng, &mut input);
                }
            }
            Some(mode) => {
                for _ in 0..rng.below(12) {
                    gen_request(rng, mode, true, &mut input);
                }
            }
        }
        if rng.chance(1, 4) {
            let mut tail = input.split_off(1);
            mutate(rng, &mut tail);
            input.extend(tail);
        }
        input
    }
}

/// The session checker must itself fail on a wrong transcript, or the fuzzer could not.
#[test]
fn transcript_check_rejects_missing_and_extra_replies() {
    let mut input = vec![Preamble::Structured.selector()];
    // (flags, cookie, offset, length): a read in one data chunk, and a flag nothing takes.
    let read = (cmd_flags::DF, 1, 0, 512);
    let bad_flag = (1 << 15, 2, 0, 512);
    for (flags, cookie, offset, length) in [read, bad_flag] {
        input.put_u32(REQUEST_MAGIC);
        input.put_u16(flags);
        input.put_u16(0);
        input.put_u64(cookie);
        input.put_u64(offset);
        input.put_u32(length);
    }
    let sent = session::client_input(&input);
    let copy = sent.clone();
    let (output, may_time_out) = within_result(move || session::serve_timed(&copy));
    if may_time_out {
        return; // The output may be cut short; nothing to learn from it.
    }
    transcript::check(&sent, &output, false);
    let hs = handshake::drive(&sent, &fuzz_harness::fixture::fixture().infos, sent.len());
    let replies = output[hs.output.len()..].to_vec();
    assert!(replies.len() > 512 + 20, "a read reply and an error reply");
    let fails = |out: Vec<u8>| {
        let sent = sent.clone();
        std::panic::catch_unwind(move || transcript::check(&sent, &out, false)).is_err()
    };
    assert!(fails(output[..output.len() - 1].to_vec()), "cut short");
    assert!(fails(output[..hs.output.len()].to_vec()), "no replies");
    assert!(
        fails([&output[..], &replies[..]].concat()),
        "every reply twice"
    );
}

/// Runs `f` on its own thread within the session deadline and returns its result.
fn within_result<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    let (done, finished) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = done.send(f());
    });
    finished
        .recv_timeout(SESSION_DEADLINE)
        .expect("session finished")
}

/// Runs `count` inputs from `generate` through `target` under one deadline (sessions: one
/// deadline each), with the PRNG seeded by `seed` so every run sees the same inputs.
fn run_generated(target: Target, count: usize, seed: u64, generate: fn(&mut Rng) -> Vec<u8>) {
    let (name, body) = target;
    let mut rng = Rng::new(seed);
    let inputs: Vec<Vec<u8>> = (0..count).map(|_| generate(&mut rng)).collect();
    if name == "session" {
        for (i, input) in inputs.into_iter().enumerate() {
            let what = format!("{name} input {i}");
            within(SESSION_DEADLINE, &what, move || guarded(name, body, &input));
        }
        return;
    }
    within(BATCH_DEADLINE, name, move || {
        for input in &inputs {
            guarded(name, body, input);
        }
    });
}

/// Runs `body` on `input`; if it panics, saves the input and fails naming the file.
fn guarded(name: &str, body: fn(&[u8]), input: &[u8]) {
    if std::panic::catch_unwind(|| body(input)).is_err() {
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("fuzz-failures");
        let _ = std::fs::create_dir_all(&dir);
        let path = dir.join(format!("{name}-{:016x}", fnv1a(input)));
        let _ = std::fs::write(&path, input);
        panic!("{name} failed on {} (saved {})", hex(input), path.display());
    }
}

/// Runs `f` on its own thread and fails if it panics, takes longer than `deadline`, or a
/// server worker panicked meanwhile.
fn within(deadline: Duration, what: &str, f: impl FnOnce() + Send + 'static) {
    install_panic_counter();
    let before = PANICS.load(Ordering::SeqCst);
    let (done, finished) = mpsc::channel();
    let thread = std::thread::spawn(move || {
        f();
        let _ = done.send(());
    });
    match finished.recv_timeout(deadline) {
        Ok(()) => thread.join().expect("harness thread"),
        Err(mpsc::RecvTimeoutError::Disconnected) => panic!("{what}: failed (see above)"),
        Err(mpsc::RecvTimeoutError::Timeout) => panic!("{what}: hung for {deadline:?}"),
    }
    let after = PANICS.load(Ordering::SeqCst);
    assert_eq!(
        before, after,
        "{what}: a server worker panicked (see above)"
    );
}

/// Panics on the server's worker threads, which no `join` reports: the worker just dies.
static PANICS: AtomicUsize = AtomicUsize::new(0);

fn install_panic_counter() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let name = std::thread::current().name().map(str::to_owned);
            if name.is_some_and(|n| n.starts_with("worker-")) {
                PANICS.fetch_add(1, Ordering::SeqCst);
            }
            previous(info);
        }));
    });
}

fn files_in(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut files: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    files
}

fn hex(bytes: &[u8]) -> String {
    let shown: String = bytes.iter().take(256).map(|b| format!("{b:02x}")).collect();
    if bytes.len() > 256 {
        format!("{shown}... ({} bytes)", bytes.len())
    } else {
        shown
    }
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3)
    })
}
