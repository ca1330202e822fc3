//! What the man pages say besides the options clap documents: EXAMPLES, ENVIRONMENT,
//! SIGNALS, FILES, EXIT STATUS and SEE ALSO for each page, and the whole of zcnbd.toml(5).
//! Written here as plain text (`roff` turns it into man(7) requests); the tests check that
//! every `--option` a `zcnbd` command line here names exists in the binary, and that
//! zcnbd.toml(5) names every key the configuration file takes.

/// One section: its title and paragraphs. A paragraph whose lines start with two spaces is
/// shown as typed (a command, a file); any other is filled text.
pub struct Section {
    pub title: &'static str,
    pub paragraphs: &'static [&'static str],
}

const ENV_LOG: &str = "RUST_LOG: what is logged, in tracing's filter syntax (e.g. \
zcnbd_server=debug); -v and -vv are shortcuts. NO_COLOR: never colour the log (it is coloured only \
when standard error is a terminal). JOURNAL_STREAM: set by systemd when standard error is the \
journal; zcnbd then writes to the journal with priorities (--log journald).";

const SEE_ALSO: &str =
    "zcnbd(1), zcnbd-serve(1), zcnbd-attach(1), zcnbd-bench(1), zcnbd-bitmap(1), zcnbd-filter(1), zcnbd.toml(5), \
qemu-nbd(8), nbdkit(1), nbd-client(8), nbdinfo(1), nbdcopy(1), qemu-img(1). The guides are \
docs/guides/ in the source tree.";

/// Sections of zcnbd(1).
pub const ZCNBD: &[Section] = &[
    Section {
        title: "EXAMPLES",
        paragraphs: &[
            "Serve a 1 GiB memory export on 127.0.0.1:10809 and look at it:",
            "  zcnbd serve\n  nbdinfo nbd://127.0.0.1",
            "Serve a qcow2 image read-only, and measure it beside qemu-nbd:",
            "  zcnbd serve -r vm.qcow2 -x vm\n  zcnbd bench zcnbd:vm.qcow2 qemu-nbd:vm.qcow2",
            "Clear a tracked dirty bitmap after a backup:",
            "  zcnbd bitmap -c /run/zcnbd.ctl clear backup",
        ],
    },
    Section {
        title: "ENVIRONMENT",
        paragraphs: &[ENV_LOG],
    },
    Section {
        title: "EXIT STATUS",
        paragraphs: &[
            "0 on success (serve: after SIGINT or SIGTERM; with --run, the command's \
status); 1 when zcnbd cannot start or a subcommand fails, with the reason on standard error; \
2 for a command line it does not understand.",
        ],
    },
    Section {
        title: "SEE ALSO",
        paragraphs: &[SEE_ALSO],
    },
];

/// Sections of zcnbd-serve(1).
pub const SERVE: &[Section] = &[
    Section {
        title: "EXAMPLES",
        paragraphs: &[
            "A raw file or block device (its format probed from its first bytes and logged), a \
qcow2 image with its backing chain, read-only, named vm, and a throwaway overlay that takes the \
writes:",
            "  zcnbd serve disk.img\n  zcnbd serve -r vm.qcow2 -x vm\n  zcnbd serve --snapshot vm.qcow2",
            "A Ceph RBD image, and one of its snapshots (read-only):",
            "  zcnbd serve rbd:rbd/vm1 --ceph-conf /etc/ceph/ceph.conf\n  zcnbd serve rbd:rbd/vm1@monday",
            "On a Unix socket, with a dirty bitmap tracked for incremental backup and a control \
socket to clear it:",
            "  zcnbd serve -s /run/zcnbd.sock -B backup --control /run/zcnbd.ctl disk.img",
            "A disk image on a web server, read-only, with a token (nbdkit's curl plugin); \
the same with a throwaway overlay that takes writes:",
            "  zcnbd serve --http-header \"Authorization: Bearer $TOKEN\" https://example.com/vm.img\n  zcnbd serve --snapshot https://example.com/vm.img",
            "What another NBD server serves, with TLS added in front (nbdkit's nbd plugin):",
            "  zcnbd serve --tls require --tls-certificates /etc/pki/zcnbd nbd://old-appliance/disk",
            "qemu-nbd's dirty bitmap and allocation depth through zcnbd (the upstream's metadata \
contexts pass through), read by a backup tool:",
            "  qemu-nbd -k /run/q.sock -A -B backup vm.qcow2 &\n  zcnbd serve -s /run/p.sock 'nbd+unix:///?socket=/run/q.sock'\n  nbdinfo --map=qemu:dirty-bitmap:backup 'nbd+unix:///?socket=/run/p.sock'",
            "TLS with certificates in QEMU's and nbdkit's layout, required:",
            "  zcnbd serve --tls require --tls-certificates /etc/pki/zcnbd disk.img",
            "Several exports from a file, in the background (logging to syslog), with the URI \
printed; an edited file checked, then a reload:",
            "  zcnbd serve --config /etc/zcnbd/disks.toml --fork --pid-file /run/zcnbd.pid --print-uri\n  zcnbd serve --config /etc/zcnbd/disks.toml --check\n  kill -HUP \"$(cat /run/zcnbd.pid)\"",
            "Logs for a systemd unit, and a shorter wait for slow clients:",
            "  zcnbd serve --log journald --handshake-timeout 5s --write-timeout 30s disk.img",
            "Filters (nbdkit's): the second partition of a GPT disk, every read 10 ms late, one \
request in ten failing while /tmp/fail exists:",
            "  zcnbd serve disk.img --filter partition:partition=2\n  zcnbd serve --memory 1G --filter delay --filter-opt delay.rdelay=10ms\n  zcnbd serve disk.img --filter error:error-rate=10%,error-file=/tmp/fail",
            "Captive: run a command against the export, then stop:",
            "  zcnbd serve --memory 64M --run 'nbdcopy \"$uri\" copy.img'",
        ],
    },
    Section {
        title: "ENVIRONMENT",
        paragraphs: &[
            ENV_LOG,
            "LISTEN_PID, LISTEN_FDS, LISTEN_FDNAMES: sockets passed by systemd's socket \
activation; zcnbd serves on them instead of binding its own. TMPDIR: where --snapshot's \
overlay is made (default /var/tmp). CEPH_CONF, CEPH_ARGS: read by librados for rbd: exports.",
        ],
    },
    Section {
        title: "SIGNALS",
        paragraphs: &[
            "SIGINT, SIGTERM: stop accepting, answer the requests in flight, flush every export, \
save tracked bitmaps, exit 0.",
            "SIGHUP: read --config again (new exports appear, removed ones take no new clients, \
unchanged ones keep their open file) and the TLS credentials; a file that does not parse or \
open is logged and the running configuration kept.",
        ],
    },
    Section {
        title: "FILES",
        paragraphs: &[
            "/etc/zcnbd/NAME.toml: the exports of the zcnbd@NAME service (zcnbd.toml(5)). \
FILE.NAME.zcnbd-bitmap beside an export's file (or in --bitmap-dir): a tracked bitmap kept \
between runs. DIR/ca-cert.pem, DIR/server-cert.pem, DIR/server-key.pem: --tls-certificates \
DIR (a key readable by others is warned about).",
        ],
    },
    Section {
        title: "EXIT STATUS",
        paragraphs: &["0 after SIGINT or SIGTERM (with --run: the command's status); 1 when the \
server cannot start (a file that cannot be opened, an address in use, another server on the \
socket), with the reason on standard error; 2 for a command line it does not understand."],
    },
    Section {
        title: "SEE ALSO",
        paragraphs: &[SEE_ALSO],
    },
];

/// Sections of zcnbd-bench(1).
pub const BENCH: &[Section] = &[
    Section {
        title: "EXAMPLES",
        paragraphs: &[
            "zcnbd beside nbdkit and qemu-nbd, each serving memory or a file it starts itself, \
4 KiB and 1 MiB random reads and writes, 3 repeats, with JSON and Markdown kept:",
            "  zcnbd bench zcnbd:memory nbdkit:memory qemu-nbd:/var/tmp/q.img \\\n      --rw randread,randwrite --bs 4k,1m --repeat 3 --json out.json --markdown out.md",
            "A server already running:",
            "  zcnbd bench nbd://127.0.0.1:10809/vm --bs 4k --iodepth 1",
            "A cache's second pass: every target read once before it is measured (zcnbd's cache \
filter over the file of a web server the bench starts, beside a file export):",
            "  zcnbd bench --warm zcnbd:web:--filter=cache:--filter-opt=cache.cache-on-read=true \\\n      zcnbd:/var/tmp/disk.img --rw read,randread --bs 1m",
            "The same cells driven by fio's nbd engine (libnbd), TLS included:",
            "  zcnbd bench --client fio zcnbd:memory:tls nbdkit:memory:tls --iodepth 1,16",
            "An RBD image through zcnbd and qemu-nbd beside fio's rbd engine on the cluster \
directly (each target on its own image, made with rbd create --size 1G):",
            "  zcnbd bench --client fio zcnbd:rbd:rbd/a qemu-nbd:rbd:rbd/b \\\n      fio-rbd:rbd/c:rbd_cache=false",
        ],
    },
    Section {
        title: "ENVIRONMENT",
        paragraphs: &[
            ENV_LOG,
            "CEPH_CONF, CEPH_ARGS: the cluster RBD targets use (librados' own lookup, for \
zcnbd, qemu-nbd and fio alike). With --client fio, fio runs with HOME set to the run's TLS \
credentials for :tls targets, where libnbd finds them.",
        ],
    },
    Section {
        title: "EXIT STATUS",
        paragraphs: &["0 once every cell ran; 1 when a target cannot be started or a cell \
fails (a verification error, a server that died), with the reason on standard error."],
    },
    Section {
        title: "SEE ALSO",
        paragraphs: &["fio(1), nbdkit(1), qemu-nbd(8), zcnbd-serve(1)."],
    },
];

/// Sections of zcnbd-bitmap(1).
pub const BITMAP: &[Section] = &[
    Section {
        title: "EXAMPLES",
        paragraphs: &[
            "A full backup, then a checkpoint: the bitmap records every write from now on.",
            "  nbdcopy nbd://127.0.0.1/vm full.img\n  zcnbd bitmap -c /run/zcnbd.ctl -x vm clear backup",
            "What the bitmaps of every export say:",
            "  zcnbd bitmap -c /run/zcnbd.ctl list",
        ],
    },
    Section {
        title: "EXIT STATUS",
        paragraphs: &["0 when the server did what was asked; 1 when it refused (the reason is \
printed) or the control socket cannot be reached."],
    },
    Section {
        title: "SEE ALSO",
        paragraphs: &["zcnbd-serve(1) (--control, -B), nbdinfo(1) (--map=qemu:dirty-bitmap:NAME)."],
    },
];

/// Sections of zcnbd-filter(1).
pub const FILTER: &[Section] = &[
    Section {
        title: "EXAMPLES",
        paragraphs: &[
            "Serve an export at 80 Mbit/s in all and 16 Mbit/s per client, then raise both \
without disconnecting anyone:",
            "  zcnbd serve --control /run/zcnbd.ctl --filter rate:rate=80M,connection-rate=16M disk.img\n  \
zcnbd filter -c /run/zcnbd.ctl rate.rate=400M rate.connection-rate=100M",
            "Remove the limit of export vm:",
            "  zcnbd filter -c /run/zcnbd.ctl -x vm rate.rate=0",
        ],
    },
    Section {
        title: "EXIT STATUS",
        paragraphs: &["0 when the server changed every option asked; 1 when it refused one (the \
reason is printed; those before it were changed) or the control socket cannot be reached."],
    },
    Section {
        title: "SEE ALSO",
        paragraphs: &["zcnbd-serve(1) (--control, --filter), nbdkit-rate-filter(1)."],
    },
];

/// Sections of zcnbd-attach(1) (and of zcnbd-detach(1) and zcnbd-list(1)).
pub const ATTACH: &[Section] = &[
    Section {
        title: "EXAMPLES",
        paragraphs: &[
            "A qcow2 image's files, as qemu-nbd -c /dev/nbd0 vm.qcow2 would give them (the \
partitions are there when the device is printed):",
            "  zcnbd attach vm.qcow2 &      # prints /dev/ublkb0 once it takes I/O\n  \
mount /dev/ublkb0p1 /mnt\n  umount /mnt ; zcnbd detach /dev/ublkb0",
            "Look at an image without writing to it:",
            "  zcnbd attach --snapshot vm.qcow2",
            "In a script: return once the device takes I/O, its name in a variable:",
            "  dev=$(zcnbd attach --fork --pid-file /run/vm.pid vm.qcow2)",
            "The attach process was killed; its device waits, with its I/O. Take it over:",
            "  zcnbd list\n  zcnbd attach --recover /dev/ublkb0 vm.qcow2",
            "A 4 GiB RAM disk with two queues of 64 requests:",
            "  zcnbd attach --memory 4G --queues 2 --queue-depth 64",
            "A remote export as a local disk, over TLS and two connections (nbd-client's job):",
            "  zcnbd attach --connections 2 'nbds://server/vm?tls-certificates=/etc/pki/zcnbd'",
            "An RBD image with 32 threads per queue answering its requests (round trips overlap):",
            "  zcnbd attach --io-threads 32 rbd:rbd/vm1",
            "On a host where every CPU submits I/O, each queue's thread on the CPUs it serves \
(ublksrv's choice; the default, elsewhere, keeps it off them so a program and its server \
work side by side):",
            "  zcnbd attach --queue-placement own vm.raw",
            "Where the kernel has no ublk: the kernel's NBD client (nbd.ko), as qemu-nbd -c would \
make it, on two connections:",
            "  zcnbd attach --driver nbd --queues 2 vm.raw      # prints /dev/nbd0\n  \
zcnbd detach /dev/nbd0",
            "What is attached:",
            "  zcnbd list --json",
        ],
    },
    Section {
        title: "NOTES",
        paragraphs: &[
            "The device is the kernel's ublk driver's (Linux 6.0 or later, module \
ublk_drv; root): requests go to zcnbd over io_uring, a thread per queue. On Linux 6.16 or later \
a file or image source runs in zero-copy mode: the queue's thread reads the file into the \
request's own pages and writes it from them (ublk's automatic buffer registration); so does a \
plain nbd:// server that offers multi-conn, each queue with a connection of its own on which \
replies are received into the request's pages and writes sent from them; otherwise \
(and with --no-zero-copy) each request is copied once between the kernel's pages and the \
queue's buffers. zcnbd list shows the mode, the log says why. Stop the device \
with SIGINT or SIGTERM to its attach process, or zcnbd detach. If the attach process dies, the \
device stays and its I/O waits for zcnbd attach --recover (unless --no-recovery). Writes the \
device acknowledged are in the export (flushes and FUA writes durable, as the export makes \
them).",
            "With --driver nbd (or auto where ublk is missing) the device is /dev/nbdN, the \
kernel's NBD client (module nbd; root), connected over generic netlink to zcnbd's own server \
through Unix socket pairs (qemu-nbd -c's and nbd-client's job); --queues is its number of \
connections. If the attach process dies, its I/O waits --dead-connection-timeout for zcnbd \
attach --recover /dev/nbdN SOURCE (NBD_CMD_RECONFIGURE), then fails.",
        ],
    },
    Section {
        title: "EXIT STATUS",
        paragraphs: &[
            "0 once the device is removed again; 1 when it cannot be made (no ublk or nbd \
driver, not root, a source that does not open), with the reason on standard error, leaving no \
device behind.",
        ],
    },
    Section {
        title: "SEE ALSO",
        paragraphs: &[
            "zcnbd-serve(1) (the same sources), qemu-nbd(8) (-c), nbd-client(8), \
losetup(8).",
        ],
    },
];

/// The keys of an `[[export]]` table: (key, what it holds).
pub const EXPORT_KEYS: &[(&str, &str)] = &[
    ("name", "the export name clients ask for (default \"\")"),
    ("description", "shown by nbdinfo --list"),
    ("memory", "a sparse memory export of this size (\"64M\")"),
    ("null", "writes discarded, reads return zeroes, this size"),
    (
        "file",
        "a regular file or block device, or the disk image in it",
    ),
    (
        "rbd",
        "a Ceph RBD image, \"POOL/IMAGE\", \"POOL/NS/IMAGE\", \"...@SNAP\"",
    ),
    (
        "url",
        "a file on a web server, \"http://...\" or \"https://...\" (read-only)",
    ),
    (
        "http_connections",
        "with url, keep-alive connections (default 4)",
    ),
    (
        "http_headers",
        "with url, request fields, never logged ([\"Authorization: ...\"])",
    ),
    (
        "http_cafile",
        "with url, CA certificates (PEM) instead of the system's",
    ),
    (
        "http_insecure",
        "with url, no verification of the server at all",
    ),
    (
        "http_timeout",
        "with url, connect, head and stall timeout (\"30s\")",
    ),
    ("ceph_conf", "with rbd, the Ceph configuration file"),
    ("ceph_id", "with rbd, the client id without \"client.\""),
    (
        "direct",
        "O_DIRECT for a raw file, or an image's data clusters (true/false)",
    ),
    ("read_only", "refuse writes"),
    (
        "block_size_min",
        "advertised minimum block size (default 1)",
    ),
    (
        "payload_max",
        "largest read or write (default --payload-max, \"64M\")",
    ),
    ("connections_max", "clients attached to this export at once"),
    ("min_block_size", "old name of block_size_min, still read"),
    ("max_payload", "old name of payload_max, still read"),
    ("max_connections", "old name of connections_max, still read"),
    ("tls_only", "offered only to clients that started TLS"),
    ("rotational", "advertise NBD_FLAG_ROTATIONAL"),
    (
        "filters",
        "layers over the data, bottom first, with options: [\"delay:rdelay=10ms\"] or \
[{ name = \"delay\", rdelay = \"10ms\" }]",
    ),
    ("format", "raw, qcow2 or vmdk (default: probed)"),
    ("snapshot", "writes go to a throwaway qcow2 overlay"),
    (
        "force_share",
        "with read_only, open an image QEMU has open for writing",
    ),
    ("bitmaps", "dirty bitmaps to serve or track ([\"backup\"])"),
    (
        "bitmap_granularity",
        "bytes per bit of tracked bitmaps (default \"64K\")",
    ),
    ("bitmap_dir", "where tracked bitmaps' files are kept"),
    (
        "invalidate_bitmaps",
        "mark a writable image's persistent bitmaps in use first",
    ),
];

/// The keys of the `[tls]` table.
pub const TLS_KEYS: &[(&str, &str)] = &[
    ("mode", "\"off\", \"on\" or \"require\""),
    (
        "certificates",
        "directory of ca-cert.pem, server-cert.pem, server-key.pem",
    ),
    (
        "verify_peer",
        "require a client certificate signed by ca-cert.pem",
    ),
    (
        "authz",
        "client subjects or PSK usernames allowed ([\"CN=client\"])",
    ),
    ("psk", "psktool's username:hexkey file"),
    (
        "ktls",
        "\"auto\", \"on\" or \"off\": the kernel's TLS for sending",
    ),
];

/// The sections of zcnbd.toml(5) after NAME.
pub fn toml_page() -> Vec<(String, Vec<String>)> {
    let table = |keys: &[(&str, &str)]| {
        keys.iter()
            .map(|(k, v)| format!("  {k:<20} {v}"))
            .collect::<Vec<_>>()
            .join("\n")
    };
    vec![
        (
            "DESCRIPTION".into(),
            vec![
                "The exports of zcnbd serve --config FILE.toml (and of the zcnbd@NAME service, \
/etc/zcnbd/NAME.toml): one [[export]] table per export, exactly one of memory, null, file, \
rbd or url in each, and an optional [tls] table; any --tls* option on the command line replaces the \
table. Sizes are written 64M, 1G, 512K. SIGHUP reads the file again. Unknown keys are refused."
                    .into(),
            ],
        ),
        (
            "EXPORT KEYS".into(),
            vec![table(EXPORT_KEYS)],
        ),
        ("TLS KEYS".into(), vec![table(TLS_KEYS)]),
        (
            "EXAMPLES".into(),
            vec![
                "  [[export]]\n  name = \"vm\"\n  file = \"/var/lib/vm.qcow2\"\n  bitmaps = [\"backup\"]\n\n  [[export]]\n  name = \"scratch\"\n  memory = \"1G\"\n\n  [tls]\n  mode = \"require\"\n  certificates = \"/etc/pki/zcnbd\"".into(),
            ],
        ),
        ("SEE ALSO".into(), vec![SEE_ALSO.into()]),
    ]
}

/// `text` as man(7) source: a typed paragraph (lines starting with two spaces) in `.nf`,
/// any other filled; hyphens as minus signs, a leading dot or quote escaped.
pub fn roff(paragraphs: &[&str]) -> String {
    let mut out = String::new();
    for p in paragraphs {
        let typed = p.starts_with("  ");
        out.push_str(if typed { ".PP\n.nf\n.RS 4\n" } else { ".PP\n" });
        for line in p.lines() {
            let line = if typed {
                line.strip_prefix("  ").unwrap_or(line)
            } else {
                line
            };
            let escaped = line.replace('\\', "\\e").replace('-', "\\-");
            if escaped.starts_with('.') || escaped.starts_with('\'') {
                out.push_str("\\&");
            }
            out.push_str(&escaped);
            out.push('\n');
        }
        if typed {
            out.push_str(".RE\n.fi\n");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    /// The long options (and aliases) of `zcnbd SUB`, and the global ones.
    fn options(sub: &str) -> Vec<String> {
        let cli = crate::Cli::command();
        let mut names: Vec<String> = cli
            .get_arguments()
            .filter_map(|a| a.get_long().map(str::to_owned))
            .collect();
        let sub = cli.find_subcommand(sub).unwrap();
        for arg in sub.get_arguments() {
            names.extend(arg.get_long().map(str::to_owned));
            names.extend(
                arg.get_all_aliases()
                    .unwrap_or_default()
                    .into_iter()
                    .map(str::to_owned),
            );
        }
        names.push("help".into());
        names
    }

    /// Every `--option` after `zcnbd SUB` on a line of `text` must be one of SUB's.
    pub(crate) fn unknown_options(text: &str) -> Vec<String> {
        let mut unknown = Vec::new();
        for line in text.lines() {
            for sub in ["serve", "bench", "bitmap"] {
                let Some(at) = line.find(&format!("zcnbd {sub}")) else {
                    continue;
                };
                // Up to the next command of the line (a pipe, `&&`, `;`).
                let rest = &line[at..];
                let end = rest.find(['|', ';', '`']).unwrap_or(rest.len());
                let known = options(sub);
                for word in rest[..end].split_whitespace() {
                    let Some(name) = word.strip_prefix("--") else {
                        continue;
                    };
                    let name: String = name
                        .chars()
                        .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
                        .collect();
                    if !name.is_empty() && !known.contains(&name) {
                        unknown.push(format!("zcnbd {sub} --{name}: {line}"));
                    }
                }
            }
        }
        unknown
    }

    #[test]
    fn an_option_the_binary_lacks_is_caught() {
        let text = "run `zcnbd serve --no-such-thing disk.img | nbdinfo --json`";
        assert_eq!(
            unknown_options(text).len(),
            1,
            "{:?}",
            unknown_options(text)
        );
        assert!(unknown_options("zcnbd serve -k s --shared 4 --tls-ktls auto").is_empty());
    }

    #[test]
    fn the_pages_name_only_options_the_binary_has() {
        for sections in [ZCNBD, SERVE, BENCH, BITMAP, ATTACH] {
            for s in sections {
                let text = s.paragraphs.join("\n");
                assert_eq!(unknown_options(&text), Vec::<String>::new(), "{}", s.title);
            }
        }
    }

    #[test]
    fn the_guides_name_only_options_the_binary_has() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let mut files = vec![root.join("README.md"), root.join("CONTRIBUTING.md")];
        for entry in std::fs::read_dir(root.join("docs/guides")).unwrap() {
            files.push(entry.unwrap().path());
        }
        for file in files {
            let text = std::fs::read_to_string(&file).unwrap();
            assert_eq!(
                unknown_options(&text),
                Vec::<String>::new(),
                "{}",
                file.display()
            );
        }
    }

    #[test]
    fn the_toml_page_names_every_key_the_file_takes() {
        // The configuration refuses unknown keys, naming the ones it expects.
        for (table, keys) in [("[[export]]", EXPORT_KEYS), ("[tls]", TLS_KEYS)] {
            let text = format!("{table}\nno_such_key = 1\n");
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("c.toml");
            std::fs::write(&path, text).unwrap();
            let err = zcnbd_server::config::load_config(&path)
                .unwrap_err()
                .to_string();
            let expected: Vec<&str> = err.split('`').skip(3).step_by(2).collect();
            assert!(!expected.is_empty(), "{err}");
            let documented: Vec<&str> = keys.iter().map(|(k, _)| *k).collect();
            let mut missing: Vec<&str> = expected
                .iter()
                .filter(|k| !documented.contains(k))
                .copied()
                .collect();
            missing.sort();
            assert_eq!(
                missing,
                Vec::<&str>::new(),
                "{table} keys missing from zcnbd.toml(5)"
            );
            let extra: Vec<&str> = documented
                .iter()
                .filter(|k| !expected.contains(k))
                .copied()
                .collect();
            assert_eq!(
                extra,
                Vec::<&str>::new(),
                "{table} keys the file does not take"
            );
        }
    }
}
