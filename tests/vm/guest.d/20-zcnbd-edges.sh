# zcnbd in the guest at the edges of the kernel client's use: export listing, a read-only
# export, and the server killed under I/O (on both engines).
mkdir -p "$WORK"
cat >"$WORK/exports.toml" <<TOML
[[export]]
name = "alpha"
memory = "64M"
[[export]]
name = "beta"
memory = "64M"
read_only = true
TOML
if server_start zcnbd serve --config "$WORK/exports.toml" -p "$VMLAB_PORT"; then
    check zcnbd/list 30 list_exports alpha beta
    check zcnbd/read-only 60 read_only_device beta
    server_stop
else
    result zcnbd/start fail "zcnbd serve --config did not start"
fi

for engine in uring portable; do
    if server_start zcnbd serve --memory "$EXPORT_SIZE" -x vmlab --engine "$engine" -p "$VMLAB_PORT"; then
        check "zcnbd-$engine/server-killed" 90 killed_server vmlab
        server_stop
    else
        result "zcnbd-$engine/start" fail "zcnbd serve did not start"
    fi
done

# Not here: -persist. With this kernel (6.1) nbd-client reconnects only when a request timed
# out (NBD_DO_IT returns -ETIMEDOUT); a server that exits closes its connections, NBD_DO_IT
# returns 0 and nbd-client ends; over netlink (the default) no nbd-client process stays to
# reconnect at all.
