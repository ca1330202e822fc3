# The attach comparison (only with lab.sh --bench): fio in the guest on a local disk made from
# one source by each tool that makes one, all in the same boot, interleaved per cell:
#   raw    a raw file: zcnbd attach (and with --no-zero-copy: the same on a kernel without ublk
#          zero copy), qemu-nbd -c (nbd.ko), a loop device (losetup --direct-io=on)
#   ext4   the same raw file on ext4 (over a loop device on a file in tmpfs: the guest has no
#          spare disk), every tool with O_DIRECT: zcnbd attach --direct (and with
#          --no-zero-copy), qemu-nbd -c --cache=none --aio=native, a loop device
#          (losetup --direct-io=on) - each one's reads and writes go to the same block device
#          beneath, where in tmpfs "direct" I/O is a copy from the page cache
#   qcow2  the same data as a qcow2 image (64 KiB clusters, every one allocated): zcnbd attach
#          (and with --no-zero-copy), qemu-nbd -c
#   nbd    an NBD export served by zcnbd on the guest's loopback: zcnbd attach nbd:// (and with
#          --no-zero-copy), nbd-client (nbd.ko), both with $attach_conns connections (zero-copy
#          mode: each queue's ring has its own connection besides them)
# fio: direct=1, libaio, one job; 4k randread/randwrite and 1M read/write, iodepth 32, each
# cell run vmlab.repeats times (lab.sh --repeats), every tool once per round. Each row gives the process's CPU (the attach, qemu-nbd or nothing: nbd.ko and loop work in the
# kernel) and the whole guest's per GiB. Under TCG only the ratios mean something; the host's
# lab.sh turns the metric lines into target/vmlab/attach-table.{md,json}.
if [ "${VMLAB_BENCH:-0}" != 1 ]; then
    log "bench (attach): not asked for (lab.sh --bench)"
    return 0
fi
if ! { [ -e /dev/ublk-control ] || modprobe ublk_drv 2>/dev/null; }; then
    skip bench/attach "no ublk driver in this kernel ($(uname -r))"
    return 0
fi
modprobe loop 2>/dev/null
# qemu-nbd -c keeps a socket there.
mkdir -p /var/lock
attach_seconds=${VMLAB_BENCH_SECONDS:-8}
# Which sources (lab.sh --attach-sources: vmlab.attach=LIST on the kernel command line).
attach_sources=ext4,raw,qcow2,nbd
attach_repeats=1
for word in $(cat /proc/cmdline); do
    case $word in
    vmlab.attach=*) attach_sources=${word#vmlab.attach=} ;;
    vmlab.repeats=*) attach_repeats=${word#vmlab.repeats=} ;;
    esac
done
attach_wanted() { case ",$attach_sources," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }
attach_conns=2
attach_raw=$WORK/attach-bench.raw
attach_qcow2=$WORK/attach-bench.qcow2
attach_dev=
attach_pid=

proc_ticks() {
    [ -n "$attach_pid" ] || { echo 0; return; }
    awk '{ print $14 + $15 }' "/proc/$attach_pid/stat"
}
guest_ticks() { awk '$1 == "cpu" { print $2 + $3 + $4 + $7 + $8 }' /proc/stat; }

# attach_up TOOL SOURCE: makes $attach_dev from SOURCE with TOOL, and $attach_pid the process
# serving it (none for the kernel's own).
attach_up() {
    local tool=$1 source=$2 i=0
    attach_pid=
    case $tool in
    zcnbd-attach*)
        # shellcheck disable=SC2086
        attach_dev=$(zcnbd attach --fork --pid-file "$WORK/attach-bench.pid" $3 "$source") || return 1
        attach_pid=$(cat "$WORK/attach-bench.pid")
        ;;
    qemu-nbd-c)
        rm -f "$WORK/attach-bench.pid"
        # shellcheck disable=SC2086
        qemu-nbd -c /dev/nbd1 -f $3 --pid-file "$WORK/attach-bench.pid" "$source" || return 1
        attach_dev=/dev/nbd1
        while [ ! -s "$WORK/attach-bench.pid" ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i + 1)); done
        attach_pid=$(cat "$WORK/attach-bench.pid")
        ;;
    nbd-client)
        nbd-client 127.0.0.1 "$VMLAB_PORT" /dev/nbd1 -N vmlab -C "$attach_conns" -b 4096 -t 120 \
            >/dev/null || return 1
        attach_dev=/dev/nbd1
        ;;
    loop)
        attach_dev=$(/usr/sbin/losetup --direct-io=on -f --show "$source") || return 1
        ;;
    esac
    while [ "$(blockdev --getsize64 "$attach_dev" 2>/dev/null || echo 0)" = 0 ] && [ $i -lt 100 ]; do
        sleep 0.1
        i=$((i + 1))
    done
}

attach_down() {
    case $1 in
    zcnbd-attach*) zcnbd detach "$attach_dev" ;;
    qemu-nbd-c) qemu-nbd -d "$attach_dev" >/dev/null ;;
    nbd-client) nbd-client -d "$attach_dev" >/dev/null 2>&1 ;;
    loop) /usr/sbin/losetup -d "$attach_dev" ;;
    esac
    local i=0
    while [ -n "$attach_pid" ] && kill -0 "$attach_pid" 2>/dev/null && [ $i -lt 100 ]; do
        sleep 0.1
        i=$((i + 1))
    done
}

# attach_cell TARGET TOOL SOURCE ARG BS RW RUN: one fio run on a fresh device, one metric line.
attach_cell() {
    local target=$1 tool=$2 source=$3 arg=$4 bs=$5 rw=$6 run=$7 out=$WORK/attach-bench.out
    local p0 g0 p1 g1 rc=0
    attach_up "$tool" "$source" "$arg" || { fail "$tool could not make a device of $source"; return 1; }
    p0=$(proc_ticks) g0=$(guest_ticks)
    fio --name=bench --filename="$attach_dev" --direct=1 --ioengine=libaio --iodepth=32 \
        --bs="$bs" --rw="$rw" --size=128M --time_based --runtime="$attach_seconds" \
        --minimal >"$out" 2>&1 || rc=1
    p1=$(proc_ticks) g1=$(guest_ticks)
    attach_down "$tool"
    [ $rc = 0 ] || { cat "$out"; return 1; }
    awk -F';' -v target="$target" -v tool="$tool" -v bs="$bs" -v rw="$rw" -v pt=$((p1 - p0)) \
        -v gt=$((g1 - g0)) -v has_proc="${attach_pid:+1}" -v run="$run" '{
        if (rw ~ /read/) { kib = $6; bw = $7; iops = $8 } else { kib = $47; bw = $48; iops = $49 }
        gib = kib / 1048576
        proc = has_proc ? sprintf("%.2f", pt / 100 / gib) : "kernel"
        printf "@@VMLAB metric attach-bench target=%s tool=%s bs=%s rw=%s run=%d mibs=%.1f iops=%d process_cpu_s_per_gib=%s guest_cpu_s_per_gib=%.2f\n",
            target, tool, bs, rw, run, bw / 1024, iops, proc, gt / 100 / gib
    }' "$out"
}

# attach_target TARGET SOURCE "TOOL:ARG"...: every cell, each tool in turn per round.
attach_target() {
    local target=$1 source=$2 cell bs rw spec tool arg run
    shift 2
    for cell in 4k:randread 4k:randwrite 1M:read 1M:write; do
        bs=${cell%%:*} rw=${cell#*:}
        for run in $(seq 1 "$attach_repeats"); do
            for spec in "$@"; do
                tool=${spec%%:*} arg=${spec#*:}
                check "bench/attach-$target-$tool-$bs-$rw-$run" 180 \
                    attach_cell "$target" "$tool" "$source" "$arg" "$bs" "$rw" "$run"
            done
        done
    done
}

dd if=/dev/urandom of="$attach_raw" bs=1M count=128 status=none
# ext4 on a loop device over a file in tmpfs, holding a copy of the raw file.
attach_ext4_dir() {
    attach_ext4_loop=
    truncate -s 256M "$WORK/attach-ext4.img"
    mkfs.ext4 -q -F "$WORK/attach-ext4.img" || return 1
    attach_ext4_loop=$(/usr/sbin/losetup -f --show "$WORK/attach-ext4.img") || return 1
    mkdir -p "$WORK/attach-ext4"
    mount -t ext4 "$attach_ext4_loop" "$WORK/attach-ext4" || return 1
    dd if="$attach_raw" of="$WORK/attach-ext4/attach-bench.raw" bs=1M conv=fsync status=none
}
if attach_wanted ext4; then
    if check bench/attach-ext4-dir 120 attach_ext4_dir; then
        attach_target ext4 "$WORK/attach-ext4/attach-bench.raw" "zcnbd-attach:--direct" \
            "zcnbd-attach-copy:--direct --no-zero-copy" "qemu-nbd-c:raw --cache=none --aio=native" \
            "loop:"
    fi
    umount "$WORK/attach-ext4" 2>/dev/null
    [ -z "$attach_ext4_loop" ] || /usr/sbin/losetup -d "$attach_ext4_loop"
    rm -f "$WORK/attach-ext4.img"
fi
qemu-img convert -f raw -O qcow2 -o cluster_size=65536 "$attach_raw" "$attach_qcow2"
# zcnbd attach reads and writes a file on each queue's own ring, in the request's pages where
# the kernel has ublk zero copy (6.16+), else in the queue's buffer (--no-zero-copy: that mode
# on any kernel, for the comparison in one boot).
attach_wanted raw && attach_target raw "$attach_raw" "zcnbd-attach:" \
    "zcnbd-attach-copy:--no-zero-copy" "qemu-nbd-c:raw" "loop:"
attach_wanted qcow2 && attach_target qcow2 "$attach_qcow2" "zcnbd-attach:" \
    "zcnbd-attach-copy:--no-zero-copy" "qemu-nbd-c:qcow2"
rm -f "$attach_qcow2"
if ! attach_wanted nbd; then
    :
elif server_start zcnbd serve --memory 128M -x vmlab -p "$VMLAB_PORT"; then
    attach_target nbd "nbd://127.0.0.1:$VMLAB_PORT/vmlab" \
        "zcnbd-attach:--connections=$attach_conns" \
        "zcnbd-attach-copy:--connections=$attach_conns --no-zero-copy" "nbd-client:"
    server_stop
else
    result bench/attach-nbd fail "the zcnbd server did not start"
fi
rm -f "$attach_raw"
