# Filters under the kernel client. partition: a GPT disk image (two partitions, sfdisk) is
# served with --filter partition:partition=2; nbdinfo sees the partition's size, the kernel
# client gets a disk of that size, ext4 made and mounted on it holds a file; afterwards the
# second partition's bytes in the image are that filesystem (e2fsck clean, the file there)
# and the first partition and the GPT are untouched.
gpt_file=$WORK/gpt-filter.raw

# part_field N start|size: partition N's start or size in bytes (sfdisk's dump).
part_field() {
    local sectors
    sectors=$(sfdisk -d "$gpt_file" | tr -d ' ' | sed -n "s|^$gpt_file$1:.*$2=\([0-9]*\).*|\1|p")
    [ -n "$sectors" ] && echo $((sectors * 512))
}

partition_filter() {
    local start size got before_p1 before_gpt
    rm -f "$gpt_file"
    truncate -s "$EXPORT_BYTES" "$gpt_file"
    printf 'label: gpt\n,48M\n,\n' | sfdisk -q "$gpt_file" || return 1
    start=$(part_field 2 start) size=$(part_field 2 size)
    [ -n "$start" ] && [ -n "$size" ] || { fail "no partition 2 in sfdisk's dump"; return 1; }
    before_p1=$(dd if="$gpt_file" bs=1M count=49 status=none | sha256sum)
    SERVER_FILE=$gpt_file
    server_start zcnbd serve "$gpt_file" -x vmlab --filter partition:partition=2 \
        -p "$VMLAB_PORT" || return 1
    got=$(nbdinfo --size "nbd://127.0.0.1:$VMLAB_PORT/vmlab")
    [ "$got" = "$size" ] || { fail "nbdinfo says $got bytes; partition 2 has $size"; return 1; }
    nbd_connect 1 vmlab || return 1
    [ "$(blockdev --getsize64 "$NBD")" = "$size" ] || { fail "$NBD is not the partition's size"; return 1; }
    mkfs.ext4 -q -F "$NBD" || return 1
    mkdir -p "$MNT"
    mount -t ext4 "$NBD" "$MNT" || return 1
    echo "through the partition filter" >"$MNT/which"
    umount "$MNT" || return 1
    nbd_disconnect
    server_stop
    SERVER_FILE=
    # The partition's bytes, on their own, are the filesystem written through the filter.
    dd if="$gpt_file" of="$WORK/p2.raw" bs=512 skip=$((start / 512)) count=$((size / 512)) status=none
    e2fsck -fn "$WORK/p2.raw" || { fail "partition 2 holds no clean ext4"; return 1; }
    local loop
    loop=$(/usr/sbin/losetup -r -f --show "$WORK/p2.raw") || return 1
    mount -t ext4 -o ro "$loop" "$MNT" || { /usr/sbin/losetup -d "$loop"; return 1; }
    grep -q "through the partition filter" "$MNT/which"
    local found=$?
    umount "$MNT"
    /usr/sbin/losetup -d "$loop"
    [ $found = 0 ] || { fail "the file written through the filter is not in partition 2"; return 1; }
    [ "$(dd if="$gpt_file" bs=1M count=49 status=none | sha256sum)" = "$before_p1" ] ||
        { fail "the GPT or partition 1 changed"; return 1; }
    rm -f "$WORK/p2.raw" "$gpt_file"
}

modprobe loop 2>/dev/null
check filters/partition 300 partition_filter
