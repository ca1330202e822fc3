# A qcow2 image on a block device (a RAM disk), as QEMU serves one: zcnbd probes it, serves it
# writable (the kernel client writes 1 MiB with a FLUSH and reads it back), and `qemu-img
# check` finds the device's image clean afterwards. (The bitmap directory used to be read
# with the device's length from its metadata, which says 0.)
IMAGE_DEV=/dev/ram0

device_image() {
    modprobe brd rd_nr=1 rd_size=32768 || return 1
    qemu-img create -q -f qcow2 "$WORK/dev.qcow2" 24M || return 1
    dd if="$WORK/dev.qcow2" of="$IMAGE_DEV" bs=64k conv=fsync 2>/dev/null
}

device_write_read() {
    dd if=/dev/urandom of="$WORK/dev-data" bs=1M count=1 2>/dev/null &&
        dd if="$WORK/dev-data" of="$NBD" bs=64k seek=16 oflag=direct conv=fsync 2>/dev/null &&
        dd if="$NBD" of="$WORK/dev-back" bs=64k skip=16 count=16 iflag=direct 2>/dev/null &&
        cmp "$WORK/dev-data" "$WORK/dev-back"
}

if check zcnbd-qcow2-device/make 60 device_image; then
    if server_start zcnbd serve "$IMAGE_DEV" -x vmlab -p "$VMLAB_PORT"; then
        if check zcnbd-qcow2-device/connect 60 nbd_connect 1 vmlab; then
            check zcnbd-qcow2-device/write-flush-read 60 device_write_read
            nbd_disconnect
        fi
        server_stop
        check zcnbd-qcow2-device/qemu-img-check 60 qemu-img check -f qcow2 "$IMAGE_DEV"
    else
        result zcnbd-qcow2-device/start fail "zcnbd serve refused a qcow2 image on a block device"
    fi
fi
rmmod brd 2>/dev/null
true
