# Crash consistency of a raw export at every FLUSH (issue 34): zcnbd serves a RAM disk behind
# the kernel's log-writes target, which records every write, flush and FUA the disk receives,
# in order, on the lab's third virtio disk (/dev/vdc, a file on the host). For round r the
# kernel client writes 256 KiB of byte r at r x 256 KiB with O_DIRECT and fsync (a FLUSH), and
# once fsync returns the guest sets the mark "round-r" in the log; rounds 1-4 on the io_uring
# engine, 5-8 on the portable one. After the guest stops, the host replays the log to every
# mark (tests/vm/replay_log_writes.py): each acknowledged FLUSH's writes must be on the disk
# there - what a power cut at that moment would have left.
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

# round_pattern R: 256 KiB of byte R in $WORK/round-R.
round_pattern() {
    awk -v r="$1" 'BEGIN { for (i = 0; i < 4096; i++) printf "%c", r }' >"$WORK/chunk" &&
        for _ in $(seq 64); do cat "$WORK/chunk"; done >"$WORK/round-$1"
}

# rounds FIRST LAST: each round's write, its FLUSH (fsync), then its mark.
rounds() {
    local r
    for r in $(seq "$1" "$2"); do
        round_pattern "$r" || return 1
        dd if="$WORK/round-$r" of="$NBD" bs=65536 seek=$((r * 4)) count=4 oflag=direct \
            conv=fsync 2>/dev/null || fail "round $r: the write or its FLUSH failed" || return 1
        dmsetup message "$LW" 0 mark "round-$r" || return 1
    done
}

lw_engine() { # ENGINE FIRST LAST
    local p=zcnbd-log-writes-$1
    if ! server_start zcnbd serve "/dev/mapper/$LW" -f raw -x lw --engine "$1" -p "$VMLAB_PORT"; then
        result "$p/start" fail "zcnbd serve did not start"
        return 1
    fi
    if check "$p/connect" 60 nbd_connect 1 lw; then
        check "$p/rounds-$2-$3" 120 rounds "$2" "$3"
        nbd_disconnect
    fi
    server_stop
}

if check zcnbd-log-writes/setup 60 lw_make; then
    lw_engine uring 1 4
    lw_engine portable 5 8
    # The target writes its last entries and the super block as it is removed.
    dmsetup remove "$LW" && sync && echo "@@VMLAB metric log-writes-done bytes=$LW_BYTES"
fi
rmmod brd 2>/dev/null
true
