# zcnbd's own client (`zcnbd bench`: the client library, OpenSSL in user space, no kernel
# client) against zcnbd on the io_uring engine in the same guest, once in plain text and once
# with kTLS (the kernel encrypts what the server sends), both servers up and measured
# interleaved in one run: the TLS issue's kTLS goal is the ratio of the two at 1 MiB. Only
# with lab.sh --bench; the table and its raw JSON end up in target/vmlab/own-bench.{md,json}.
if [ "${VMLAB_BENCH:-0}" != 1 ]; then
    log "bench (own client): not asked for (lab.sh --bench)"
    return 0
fi
tls=/vmlab/tls
if [ ! -f "$tls/ca-cert.pem" ]; then
    skip bench/own-client "no certificates in the initramfs"
    return 0
fi
own_port=$((VMLAB_PORT + 1))

own_client() {
    local plain_pid rc=0 i=0
    zcnbd serve --memory 128M -x vmlab --engine uring -p "$own_port" >"$WORK/own-plain.log" 2>&1 &
    plain_pid=$!
    if ! server_start zcnbd serve --memory 128M -x vmlab --engine uring --tls=require \
        --tls-certificates="$tls/server" -p "$VMLAB_PORT"; then
        kill "$plain_pid"
        return 1
    fi
    while ! listening "$own_port" && [ $i -lt 150 ]; do
        sleep 0.2
        i=$((i + 1))
    done
    zcnbd bench "nbd://127.0.0.1:$own_port/vmlab" \
        "nbds://127.0.0.1:$VMLAB_PORT/vmlab?tls-certificates=$tls&tls-hostname=localhost" \
        --rw randread,randwrite --bs 4k,1m --size 64M --runtime "${VMLAB_BENCH_SECONDS:-8}s" \
        --repeat 2 --no-ceiling --prefill --json "$WORK/own-bench.json" \
        --markdown "$WORK/own-bench.md" 2>"$WORK/own-bench.err" ||
        { cat "$WORK/own-bench.err"; rc=1; }
    # lab.sh writes these to target/vmlab/ (the table and the raw measurements).
    [ -f "$WORK/own-bench.json" ] && emit_file own-bench.json "$WORK/own-bench.json"
    [ -f "$WORK/own-bench.md" ] && emit_file own-bench.md "$WORK/own-bench.md"
    kill "$plain_pid"
    wait "$plain_pid" 2>/dev/null
    server_stop
    grep -q 'records sent by the kernel (kTLS)' "$SERVER_LOG" ||
        { fail "the TLS server did not send through kTLS"; rc=1; }
    return $rc
}
check bench/own-client 900 own_client
