#!/usr/bin/env bash
# Run every test: Rust unit/integration tests (the client library's run against zcnbd,
# nbdkit, qemu-nbd and nbd-server), the C ABI test, the Debian package (built with
# cargo-deb, installed on this machine, used and removed), the interop suite that
# drives real NBD clients (qemu-img/qemu-io/qemu-nbd, nbdinfo, nbdsh/libnbd,
# nbdcopy, fio) against `zcnbd serve` (with test_rbd.py: RBD exports against a throwaway
# single-node Ceph cluster, tests/ceph/cluster.sh), then the VM lab (tests/vm/lab.sh): the Linux
# kernel's NBD client against zcnbd, nbdkit and qemu-nbd inside a QEMU guest, and a
# guest whose disks are zcnbd exports on this host; then the lab's attach checks again on
# trixie-backports' 6.17 kernel (tests/vm/lab.sh --kernel zero-copy), the one with ublk zero
# copy.
#
#   scripts/test.sh [PYTEST ARGS...]     e.g. scripts/test.sh -k qemu -x
#
# Environment:
#   ZCNBD_BIN            server binary for the interop suite
#                        (default: $CARGO_TARGET_DIR or target, /release/zcnbd)
#   ZCNBD_TEST_SERVER    zcnbd (default) | nbdkit  (validate the suite itself)
#   ZCNBD_SKIP_CARGO=1   skip the cargo build/test steps (interop suite only)
#   ZCNBD_TEST_VERBOSE=1 run the server with -v (its log is shown on failure)
#   ZCNBD_SKIP_VM=1      skip the VM lab (about 7 minutes under TCG, and 4 more for the
#                        zero-copy kernel's attach checks; its first run downloads 170 MB)
#   ZCNBD_MODEL_ROUNDS   rounds of tests/interop/test_model.py's concurrency model per export
#                        (default 4; hundreds for a long, fuzzing run; ZCNBD_MODEL_SEED picks
#                        the seed)
#   CI=true              missing tools make the interop suite and the VM lab fail, not skip
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

step() { printf '\n==> [%s, %ss in] %s\n' "$(date -u +%H:%M:%S)" "$SECONDS" "$*" >&2; }

step "scripts/install-deps.sh"
scripts/install-deps.sh

if [ "${ZCNBD_SKIP_CARGO:-0}" != 1 ]; then
    step "cargo build --release --workspace --all-targets"
    cargo build --release --workspace --all-targets
    step "cargo test --release --workspace"
    cargo test --release --workspace
    step "tests/c/run.sh (the C ABI, built against the installed header and library)"
    tests/c/run.sh
    step "tests/package/test.sh (the .deb: cargo-deb, dpkg -i, used, dpkg -r and -P)"
    tests/package/test.sh
fi

export ZCNBD_BIN="${ZCNBD_BIN:-${CARGO_TARGET_DIR:-$PWD/target}/release/zcnbd}"
# Debian's interpreter: python3-libnbd and python3-pytest are installed for
# it (a pyenv/venv python3 earlier on PATH would not have them).
PYTHON=${ZCNBD_PYTHON:-/usr/bin/python3}
export PYTHONDONTWRITEBYTECODE=1
# The whole suite runs once per engine and data path (each run takes well under a minute),
# unless ZCNBD_SERVE_ARGS picks one or the suite is pointed at nbdkit.
if [ -n "${ZCNBD_SERVE_ARGS+set}" ] || [ "${ZCNBD_TEST_SERVER:-zcnbd}" != zcnbd ]; then
    configs=("${ZCNBD_SERVE_ARGS:-}")
else
    # The last run stacks a pass-through layer over every export: each mechanism of the
    # default engine must still work with a layer between it and the data.
    configs=(
        "--engine portable"
        "--engine uring --data-path auto"
        "--engine uring --data-path zerocopy"
        "--engine uring --data-path copy"
        "--engine uring --data-path auto --filter passthrough"
    )
fi
for config in "${configs[@]}"; do
    export ZCNBD_SERVE_ARGS="$config"
    # An RBD export's requests all go through the dispatcher whatever the data path, so its
    # tests (and their Ceph cluster, about a minute in all) run once per engine only; the disk
    # image tests (QEMU's tools as the oracle, about a minute) run on both engines, on the
    # default data path, and under a layer; the dirty bitmap tests on every data path (each
    # lands writes in place its own way, and every way must set the bits).
    # The other data paths and the layer change how bytes move, not how a session starts,
    # stops, reloads or negotiates: those passes skip the files that only test that, and
    # the files whose requests all go through the dispatcher anyway (filters, upstreams).
    ignore=()
    not_data=(--ignore=tests/interop/test_lifecycle.py --ignore=tests/interop/test_lifecycle_service.py
        --ignore=tests/interop/test_lifecycle_start.py --ignore=tests/interop/test_lifecycle_units.py
        --ignore=tests/interop/test_config.py --ignore=tests/interop/test_reload.py
        --ignore=tests/interop/test_nbdsh_handshake.py --ignore=tests/interop/test_filters.py
        --ignore=tests/interop/test_upstream.py --ignore=tests/interop/test_attach.py)
    case "$config" in
    *--data-path\ zerocopy* | *--data-path\ copy*)
        ignore=(--ignore=tests/interop/test_rbd.py --ignore=tests/interop/test_images.py
            --deselect=tests/interop/test_bitmaps.py::test_rbd_snapshots_are_offered_as_bitmaps_and_back_up_incrementally
            "${not_data[@]}")
        ;;
    *--filter\ passthrough*)
        ignore=(--ignore=tests/interop/test_rbd.py "${not_data[@]}"
            --deselect=tests/interop/test_bitmaps.py::test_rbd_snapshots_are_offered_as_bitmaps_and_back_up_incrementally)
        ;;
    esac
    step "$PYTHON -m pytest tests/interop ${ignore[*]} $* (server: ${ZCNBD_TEST_SERVER:-zcnbd} $config)"
    "$PYTHON" -m pytest tests/interop "${ignore[@]}" "$@"
done

if [ "${ZCNBD_SKIP_VM:-0}" = 1 ]; then
    step "tests/vm/lab.sh (default and zero-copy kernels): SKIPPED (ZCNBD_SKIP_VM=1)"
else
    step "tests/vm/lab.sh (the kernel client and QEMU guests)"
    tests/vm/lab.sh
    # The default guest's 6.12 has no ublk zero copy (UBLK_F_AUTO_BUF_REG is 6.16+): zcnbd
    # attach runs in copy mode there, so its zero-copy path is only tested on a newer kernel.
    step "tests/vm/lab.sh --kernel zero-copy --only '17*' (ublk zero copy needs 6.16+: the attach checks again on trixie-backports' 6.17 kernel)"
    tests/vm/lab.sh --kernel zero-copy --only '17*'
fi
step "every test passed"
