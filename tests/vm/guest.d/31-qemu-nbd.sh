# The same kernel-client checks against qemu-nbd in the guest: a raw file, discards passed on
# (--discard=unmap, so fstrim punches holes in the file), up to four clients (-e 4).
file=$WORK/qemu-nbd.img
qemu_nbd_start() {
    server_start qemu-nbd -f raw -x vmlab -b 127.0.0.1 -p "$VMLAB_PORT" -t -e 4 "$@" "$file"
}

rm -f "$file" && truncate -s "$EXPORT_BYTES" "$file"
SERVER_FILE=$file
if qemu_nbd_start --discard=unmap; then
    check qemu-nbd/list 30 list_exports vmlab
    kernel_client_checks qemu-nbd 4 vmlab
    check qemu-nbd/server-killed 90 killed_server vmlab
    server_stop
else
    result qemu-nbd/start fail "qemu-nbd did not start"
fi

if qemu_nbd_start -r; then
    check qemu-nbd/read-only 60 read_only_device vmlab
    server_stop
else
    result qemu-nbd-read-only/start fail "qemu-nbd -r did not start"
fi
