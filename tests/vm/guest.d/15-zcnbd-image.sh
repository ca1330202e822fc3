# The kernel client against zcnbd serving a qcow2 image whose backing file is a raw file with
# data in it (made here by qemu-img): on the io_uring engine every kernel-client check (ext4,
# fstrim giving the clusters' blocks back to the image file, zeroing, FLUSH/FUA, fio
# verified), on the portable engine ext4 and fstrim; after each, the image and its base as
# QEMU sees them: `qemu-img check` clean, the base unchanged.
base=$WORK/image-base.raw
top=$WORK/image-top.qcow2

# image_make: a fresh 128 MiB raw base (4 MiB of data at the start) and a qcow2 over it.
image_make() {
    rm -f "$base" "$top"
    truncate -s "$EXPORT_BYTES" "$base"
    dd if=/dev/urandom of="$base" bs=1M count=4 conv=notrunc 2>/dev/null
    qemu-img create -q -f qcow2 -b "$(basename "$base")" -F raw "$top" >/dev/null 2>&1 ||
        qemu-img create -q -f qcow2 -b "$base" -F raw "$top"
}

image_clean() {
    qemu-img check "$top" || return 1
    [ "$(sha256sum <"$base")" = "$BASE_SHA" ] || fail "the backing file was written"
}

# image_checks PREFIX ENGINE full|ext4
image_checks() {
    local p=$1 engine=$2 depth=$3
    VMLAB_T0=$(now)
    if ! image_make; then
        result "$p/make" fail "qemu-img create failed"
        return 1
    fi
    BASE_SHA=$(sha256sum <"$base")
    SERVER_FILE=$top SERVER_SOCKET=
    if ! server_start zcnbd serve "$top" -x vmlab --engine "$engine" -p "$VMLAB_PORT" --stats; then
        result "$p/start" fail "zcnbd serve did not start on the qcow2 image"
        SERVER_FILE=
        return 1
    fi
    if [ "$depth" = full ]; then
        kernel_client_checks "$p" 1 vmlab
    elif check "$p/connect" 60 nbd_connect 1 vmlab; then
        check "$p/ext4" 300 fs_cycle
        check "$p/fstrim" 120 fs_trim
        nbd_disconnect
    fi
    server_stop
    check "$p/qemu-img-check" 60 image_clean
    SERVER_FILE=
}

image_checks zcnbd-qcow2-uring uring full
image_checks zcnbd-qcow2-portable portable ext4
rm -f "$base" "$top"
