# A failing disk under zcnbd (issue 34): a RAM disk behind device-mapper, served as a block
# device beside a memory export. While the disk fails its writes (dm-flakey error_writes),
# writes land in the page cache and the FLUSH that should make them durable fails; once the
# disk works again, a FLUSH must still fail - the kernel may have dropped the pages it could
# not write, and its next fdatasync says 0 - until zcnbd opens the export again. Reads of the
# failed export and the other export's writes and flushes go on meanwhile.
DISK=zcnbd-flaky
DISK_DEV=/dev/mapper/$DISK
DISK_SECTORS=$((64 * 2048))
export DM_DISABLE_UDEV=1

disk_table() { # healthy | failing
    case $1 in
    healthy) echo "0 $DISK_SECTORS linear /dev/ram0 0" ;;
    failing) echo "0 $DISK_SECTORS flakey /dev/ram0 0 0 1 1 error_writes" ;;
    esac
}

disk_set() {
    dmsetup suspend "$DISK" && dmsetup reload "$DISK" --table "$(disk_table "$1")" &&
        dmsetup resume "$DISK"
}

disk_make() {
    modprobe brd rd_nr=1 rd_size=65536 || return 1
    modprobe dm_flakey || return 1
    dmsetup create "$DISK" --table "$(disk_table healthy)" || return 1
    [ -b "$DISK_DEV" ] || dmsetup mknodes "$DISK"
    [ -b "$DISK_DEV" ] || fail "no $DISK_DEV"
}

disk_remove() {
    dmsetup remove "$DISK" 2>/dev/null
    rmmod brd 2>/dev/null
    true
}

# uri NAME
uri() { echo "nbd://127.0.0.1:$VMLAB_PORT/$1"; }

# writes_flushed NAME: 16 writes of 64 KiB, a FLUSH after every 4 (qemu-img bench: exit
# status 0 only if every request succeeded).
writes_flushed() {
    qemu-img bench -w -f raw -d 1 -c 16 -s 65536 --flush-interval=4 "$(uri "$1")" \
        >"$WORK/bench.out" 2>&1 || { cat "$WORK/bench.out"; return 1; }
}

reads() { qemu-img bench -f raw -d 1 -c 16 -s 65536 "$(uri "$1")" >"$WORK/bench.out" 2>&1; }

flush_fails() {
    if writes_flushed disk; then
        fail "writes and FLUSH succeeded on a disk that lost writes"
        return 1
    fi
    grep -q -i "failed" "$WORK/bench.out" || fail "qemu-img bench failed, not a request"
}

config_write() {
    cat >"$WORK/failing.toml" <<TOML
[[export]]
name = "disk"
file = "$DISK_DEV"
format = "raw"

[[export]]
name = "mem"
memory = "64M"
TOML
}

failing_disk_checks() { # ENGINE
    local p=zcnbd-failing-disk-$1
    VMLAB_T0=$(now)
    if ! disk_make; then
        skip "$p/setup" "no device-mapper, dm-flakey or brd in this kernel"
        disk_remove
        return 0
    fi
    config_write
    if ! server_start zcnbd serve --config "$WORK/failing.toml" --engine "$1" -p "$VMLAB_PORT"; then
        result "$p/start" fail "zcnbd serve did not start"
        disk_remove
        return 1
    fi
    check "$p/healthy-writes-flush" 60 writes_flushed disk
    disk_set failing
    check "$p/flush-fails-while-failing" 60 flush_fails
    disk_set healthy
    check "$p/flush-still-fails-once-healthy" 60 flush_fails
    check "$p/reads-go-on" 60 reads disk
    check "$p/other-export-goes-on" 60 writes_flushed mem
    check "$p/logged-once" 10 grep -q "a sync failed" "$SERVER_LOG"
    server_stop
    # Opened again: a new start.
    server_start zcnbd serve --config "$WORK/failing.toml" --engine "$1" -p "$VMLAB_PORT" &&
        check "$p/reopened-flushes" 60 writes_flushed disk
    server_stop
    disk_remove
}

failing_disk_checks uring
failing_disk_checks portable
