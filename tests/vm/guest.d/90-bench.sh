# The fio comparison (only with lab.sh --bench): fio on /dev/nbd0 inside the guest against
# zcnbd (both engines), nbdkit and qemu-nbd in the same guest, with each server's CPU time and
# the guest's. Under an emulated CPU the absolute figures mean little; the CPU columns compare
# what each server costs per GiB moved. Then the same over TLS (the kernel client's nbd-client
# decrypts in user space with GnuTLS, the same for every server): zcnbd with kTLS (the kernel
# encrypts what is sent), zcnbd with user-space TLS, nbdkit and qemu-nbd (GnuTLS).
if [ "${VMLAB_BENCH:-0}" != 1 ]; then
    log "bench: not asked for (lab.sh --bench)"
    return 0
fi
bench_seconds=${VMLAB_BENCH_SECONDS:-8}
bench_file=$WORK/bench.img

# CPU ticks (1/100 s) the server and the whole guest (not idle) have used so far.
server_ticks() { awk '{ print $14 + $15 }' "/proc/$SERVER_PID/stat"; }
guest_ticks() { awk '$1 == "cpu" { print $2 + $3 + $4 + $7 + $8 }' /proc/stat; }

# bench_cell SERVER BS RW: one fio run, one metric line.
bench_cell() {
    local server=$1 bs=$2 rw=$3 out=$WORK/bench.out
    local s0 g0 s1 g1
    s0=$(server_ticks) g0=$(guest_ticks)
    fio --name=bench --filename="$NBD" --direct=1 --ioengine=libaio --iodepth=16 --bs="$bs" \
        --rw="$rw" --size=64M --time_based --runtime="$bench_seconds" --minimal >"$out" 2>&1 ||
        { cat "$out"; return 1; }
    s1=$(server_ticks) g1=$(guest_ticks)
    awk -F';' -v server="$server" -v bs="$bs" -v rw="$rw" -v st=$((s1 - s0)) -v gt=$((g1 - g0)) '{
        if (rw == "randread") { kib = $6; bw = $7; iops = $8 } else { kib = $47; bw = $48; iops = $49 }
        gib = kib / 1048576
        printf "@@VMLAB metric bench server=%s bs=%s rw=%s mibs=%.1f iops=%d server_cpu_s_per_gib=%.1f guest_cpu_s_per_gib=%.1f\n",
            server, bs, rw, bw / 1024, iops, st / 100 / gib, gt / 100 / gib
    }' "$out"
}

# bench_server NAME START-COMMAND...: every cell against one server.
bench_server() {
    local name=$1
    shift
    server_start "$@" || { result "bench/$name" fail "the server did not start"; return; }
    # shellcheck disable=SC2086
    if NBD_TIMEOUT=120 nbd_connect 1 vmlab $bench_connect_args; then
        dd if=/dev/urandom of="$NBD" bs=1M count=64 oflag=direct conv=notrunc status=none
        local bs rw
        for bs in 4k 1M; do
            for rw in randread randwrite; do
                check "bench/$name-$bs-$rw" 120 bench_cell "$name" "$bs" "$rw"
            done
        done
        nbd_disconnect
    else
        # A server the table would silently leave out is a failure, not a missing row.
        result "bench/$name" fail "nbd-client could not connect"
    fi
    server_stop
}

bench_connect_args=
bench_server zcnbd-uring zcnbd serve --memory 128M -x vmlab --engine uring -p "$VMLAB_PORT"
bench_server zcnbd-portable zcnbd serve --memory 128M -x vmlab --engine portable -p "$VMLAB_PORT"
bench_server nbdkit nbdkit -f -i 127.0.0.1 -p "$VMLAB_PORT" -e vmlab memory 128M
rm -f "$bench_file" && truncate -s 128M "$bench_file"
bench_server qemu-nbd qemu-nbd -f raw -x vmlab -b 127.0.0.1 -p "$VMLAB_PORT" -t "$bench_file"
rm -f "$bench_file"

tls=/vmlab/tls
if [ ! -f "$tls/ca-cert.pem" ]; then
    skip bench/tls "no certificates in the initramfs"
    return 0
fi
bench_connect_args="-cacertfile $tls/ca-cert.pem -tlshostname localhost"
tls_args="--tls=require --tls-certificates=$tls/server"
# shellcheck disable=SC2086
bench_server zcnbd-uring-ktls zcnbd serve --memory 128M -x vmlab --engine uring $tls_args \
    -p "$VMLAB_PORT"
# shellcheck disable=SC2086
bench_server zcnbd-usertls zcnbd serve --memory 128M -x vmlab --tls-ktls=off $tls_args \
    -p "$VMLAB_PORT"
# shellcheck disable=SC2086
bench_server nbdkit-tls nbdkit -f -i 127.0.0.1 -p "$VMLAB_PORT" -e vmlab $tls_args memory 128M
rm -f "$bench_file" && truncate -s 128M "$bench_file"
bench_server qemu-nbd-tls qemu-nbd -f raw -x vmlab -b 127.0.0.1 -p "$VMLAB_PORT" -t \
    --object "tls-creds-x509,id=tls0,dir=$tls/server,endpoint=server,verify-peer=off" \
    --tls-creds tls0 \
    "$bench_file"
rm -f "$bench_file"
