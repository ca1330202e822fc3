# Crash consistency of a raw export at every FLUSH (issue 34): zcnbd serves a RAM disk behind
# the kernel's log-writes target, which records every write, flush and FUA the disk receives,
# in order, on the lab's third virtio disk (/dev/vdc, a file on the host). For round r the
# kernel client writes 256 KiB of byte r at r x 256 KiB with O_DIRECT and fsync (a FLUSH), and
# once fsync returns the guest sets the mark "round-r" in the log; rounds 1-4 on the io_uring
# engine, 5-8 on the portable one. After the guest stops, the host replays the log to every
# mark (tests/vm/replay_log_writes.py): each acknowledged FLUSH's writes must be on the disk
# there - what a power cut at that moment would have left.
#
# Then a qcow2 image over a raw backing file (64 KiB clusters) on the same logged disk: for
# round r the kernel client trims round r-1's allocating write, writes 128 KiB of 0x40+r at
# r MiB (new clusters), 4 KiB of 0x60+r at r MiB + 516 KiB (copy-on-write from the backing
# file's 0xee) and FLUSHes (mark "q-round-r"), then 64 KiB of 0x80+r at r MiB + 768 KiB with
# O_DSYNC (mark "q-fua-r"); rounds 1-3 on the io_uring engine, 4-6 on the portable one. The
# host replays the log to every entry: `qemu-img check` finds the image consistent
# everywhere, every 4 KiB block reads a value that block had at some time (never another
# block's data or stale bytes), and at each mark exactly what was acknowledged.
#
# Last, an ext4 file system on the same disk holding a raw export with a tracked bitmap (-B b0,
# kept in disk.raw.b0.zcnbd-bitmap beside it): three rounds of 64 KiB of 0xc0+r at r MiB with a
# FLUSH (marks "b-round-r"), a clean stop (mark "b-stopped"), then a start and a round 4 cut by
# kill -9 (mark "b-killed"). The host replays to every entry, repairs the file system's journal
# as a mount would, and reads the bitmap file: absent, new, or marked in use (reported all
# dirty at the next start) anywhere; where it says closed cleanly, its bits cover every
# round written; at "b-stopped" it must say closed cleanly.
LW=zcnbd-lw
LOG_DEV=/dev/vdc
LW_BYTES=$((32 * 1024 * 1024))
export DM_DISABLE_UDEV=1

lw_make() {
    [ -b "$LOG_DEV" ] || fail "no log disk $LOG_DEV"
    modprobe brd rd_nr=1 rd_size=$((LW_BYTES / 1024)) || return 1
    modprobe dm_log_writes || return 1
    # A stale super block must not pass for this run's.
    dd if=/dev/zero of="$LOG_DEV" bs=1M count=1 oflag=direct 2>/dev/null || return 1
    dmsetup create "$LW" --table "0 $((LW_BYTES / 512)) log-writes /dev/ram0 $LOG_DEV" ||
        return 1
    [ -b "/dev/mapper/$LW" ] || dmsetup mknodes "$LW"
    [ -b "/dev/mapper/$LW" ] || fail "no /dev/mapper/$LW"
}

# pattern BYTE KIB: KIB KiB of BYTE (0-255) on standard output.
pattern() {
    local size=1
    # shellcheck disable=SC2059 # the format is the byte, as an octal escape
    printf "\\$(printf %03o "$1")" >"$WORK/block" || return 1
    while [ "$size" -lt $(($2 * 1024)) ]; do
        cat "$WORK/block" "$WORK/block" >"$WORK/block2" && mv "$WORK/block2" "$WORK/block" || return 1
        size=$((size * 2))
    done
    head -c $(($2 * 1024)) "$WORK/block"
}

# rounds FIRST LAST: each round's write, its FLUSH (fsync), then its mark.
rounds() {
    local r
    for r in $(seq "$1" "$2"); do
        pattern "$r" 256 >"$WORK/round-$r" || return 1
        dd if="$WORK/round-$r" of="$NBD" bs=65536 seek=$((r * 4)) count=4 oflag=direct \
            conv=fsync 2>/dev/null || fail "round $r: the write or its FLUSH failed" || return 1
        dmsetup message "$LW" 0 mark "round-$r" || return 1
    done
}

# served_rounds NAME FORMAT EXPORT ROUNDS ENGINE FIRST LAST: zcnbd serves the logged disk as
# FORMAT on ENGINE, the kernel client runs ROUNDS FIRST LAST, then all is stopped.
served_rounds() {
    local p=zcnbd-log-writes$1-$5
    if ! server_start zcnbd serve "/dev/mapper/$LW" -f "$2" -x "$3" --engine "$5" -p "$VMLAB_PORT"; then
        result "$p/start" fail "zcnbd serve did not start"
        return 1
    fi
    if check "$p/connect" 60 nbd_connect 1 "$3"; then
        check "$p/rounds-$6-$7" 180 "$4" "$6" "$7"
        nbd_disconnect
    fi
    server_stop
}


Q_BASE=$WORK/lw-base.raw

q_make() {
    pattern 238 8192 >"$Q_BASE" || return 1
    qemu-img create -q -f qcow2 -o cluster_size=65536 -u -b "$Q_BASE" -F raw "$WORK/lw.qcow2" 24M ||
        return 1
    dd if="$WORK/lw.qcow2" of="/dev/mapper/$LW" bs=64k oflag=direct conv=fsync 2>/dev/null ||
        return 1
    dmsetup message "$LW" 0 mark qcow2-made
}

# q_write BYTE KIB AT_KIB [DD_FLAGS...]
q_write() {
    local byte=$1 kib=$2 at=$3
    shift 3
    pattern "$byte" "$kib" >"$WORK/q-data" &&
        dd if="$WORK/q-data" of="$NBD" bs=4096 seek=$((at / 4)) oflag=direct "$@" 2>/dev/null
}

q_rounds() {
    local r at
    for r in $(seq "$1" "$2"); do
        at=$((r * 1024))
        if [ "$r" -gt 1 ]; then
            blkdiscard -o $(((at - 1024) * 1024)) -l $((128 * 1024)) "$NBD" ||
                fail "round $r: the trim failed" || return 1
        fi
        q_write $((0x40 + r)) 128 "$at" || fail "round $r: the write failed" || return 1
        q_write $((0x60 + r)) 4 $((at + 516)) conv=fsync ||
            fail "round $r: the copy-on-write or the FLUSH failed" || return 1
        dmsetup message "$LW" 0 mark "q-round-$r" || return 1
        q_write $((0x80 + r)) 64 $((at + 768)) oflag=direct,dsync ||
            fail "round $r: the O_DSYNC write failed" || return 1
        dmsetup message "$LW" 0 mark "q-fua-$r" || return 1
    done
}

B_MNT=$WORK/lw-fs

b_make() {
    # The qcow2 phase ends here (the replay stops checking its image).
    dmsetup message "$LW" 0 mark qcow2-done || return 1
    mkdir -p "$B_MNT" &&
        mkfs.ext4 -q -F -E lazy_itable_init=0,lazy_journal_init=0 "/dev/mapper/$LW" &&
        mount -t ext4 "/dev/mapper/$LW" "$B_MNT" || return 1
    dd if=/dev/zero of="$B_MNT/disk.raw" bs=1M count=8 conv=fsync 2>/dev/null && sync &&
        dmsetup message "$LW" 0 mark bitmap-fs
}

b_round() { # R
    q_write $((0xc0 + $1)) 64 $(($1 * 1024)) conv=fsync || fail "round $1: the write or FLUSH failed"
}

b_run() {
    local r
    server_start zcnbd serve "$B_MNT/disk.raw" -f raw -x lwb -B b0 -p "$VMLAB_PORT" || return 1
    nbd_connect 1 lwb || return 1
    for r in 1 2 3; do
        b_round "$r" && dmsetup message "$LW" 0 mark "b-round-$r" || return 1
    done
    nbd_disconnect
    server_stop
    sync && dmsetup message "$LW" 0 mark b-stopped || return 1
    server_start zcnbd serve "$B_MNT/disk.raw" -f raw -x lwb -B b0 -p "$VMLAB_PORT" || return 1
    nbd_connect 1 lwb || return 1
    b_round 4 && dmsetup message "$LW" 0 mark b-round-4 || return 1
    kill -KILL "$SERVER_PID"
    nbd_disconnect
    server_stop
    sync && dmsetup message "$LW" 0 mark b-killed
}

if check zcnbd-log-writes/setup 60 lw_make; then
    served_rounds "" raw lw rounds uring 1 4
    served_rounds "" raw lw rounds portable 5 8
    if check zcnbd-log-writes/qcow2-make 60 q_make; then
        served_rounds -qcow2 qcow2 lwq q_rounds uring 1 3
        served_rounds -qcow2 qcow2 lwq q_rounds portable 4 6
        echo "@@VMLAB metric log-writes-qcow2 base=$Q_BASE"
    fi
    if check zcnbd-log-writes/bitmap-fs 60 b_make; then
        check zcnbd-log-writes/bitmap-file 180 b_run
        umount "$B_MNT" 2>/dev/null
    fi
    # The target writes its last entries and the super block as it is removed.
    dmsetup remove "$LW" && sync && echo "@@VMLAB metric log-writes-done bytes=$LW_BYTES"
fi
rmmod brd 2>/dev/null
true
