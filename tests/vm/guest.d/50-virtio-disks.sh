# A QEMU guest whose disks are zcnbd exports on the host: /dev/vda is
# nbd://127.0.0.1:PORT/vm-tcp (a memory export), /dev/vdb nbd+unix:///vm-unix?socket=...
# (a file export), both `-drive ...,format=raw,if=virtio,cache=none`. The guest makes an ext4
# filesystem, writes files, syncs and prints what it wrote; after the guest has stopped, the
# host checks the exports hold exactly that (tests/vm/lab.sh, verify_disk).

# virtio_disk DEV: mkfs, files, sync, then the device's and each file's sha256.
virtio_disk() {
    local dev=$1
    make_reference_files || return 1
    mkfs.ext4 -q -F -E lazy_itable_init=0,lazy_journal_init=0 "/dev/$dev" || return 1
    mkdir -p "$MNT"
    mount -t ext4 "/dev/$dev" "$MNT" || return 1
    copy_reference_files "$MNT" || return 1
    sync
    umount "$MNT" || return 1
    mount -t ext4 "/dev/$dev" "$MNT" || return 1
    verify_reference_files "$MNT" || { umount "$MNT"; return 1; }
    local f
    for f in "$MNT"/dir/*; do
        metric virtio-file "$dev" "/dir/${f##*/}" "sha256=$(sha256sum <"$f" | cut -d' ' -f1)"
    done
    umount "$MNT" || return 1
    e2fsck -fn "/dev/$dev" || return 1
    metric virtio-device "$dev" \
        "sha256=$(dd if="/dev/$dev" bs=1M iflag=direct 2>/dev/null | sha256sum | cut -d' ' -f1)"
}

for dev in vda vdb; do
    if [ -b "/dev/$dev" ]; then
        log "/dev/$dev: $(cat /sys/block/$dev/size) sectors"
        check "virtio-$dev/ext4" 300 virtio_disk "$dev"
    else
        skip "virtio-$dev/ext4" "no /dev/$dev (the host gave the guest no such disk)"
    fi
done
