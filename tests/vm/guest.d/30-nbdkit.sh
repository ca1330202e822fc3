# The same kernel-client checks against nbdkit in the guest (the suite checked against a
# peer): its file plugin (four connections: nbdkit offers multi-conn) and memory plugin.
file=$WORK/nbdkit.img
nbdkit_start() {
    server_start nbdkit -f -i 127.0.0.1 -p "$VMLAB_PORT" -e vmlab "$@"
}

rm -f "$file" && truncate -s "$EXPORT_BYTES" "$file"
SERVER_FILE=$file
if nbdkit_start file "$file"; then
    kernel_client_checks nbdkit-file 4 vmlab
    server_stop
else
    result nbdkit-file/start fail "nbdkit did not start"
fi

SERVER_FILE=
if nbdkit_start memory "$EXPORT_SIZE"; then
    kernel_client_checks nbdkit-memory 1 vmlab
    check nbdkit-memory/server-killed 90 killed_server vmlab
    server_stop
else
    result nbdkit-memory/start fail "nbdkit did not start"
fi

if nbdkit_start -r memory "$EXPORT_SIZE"; then
    check nbdkit/read-only 60 read_only_device vmlab
    server_stop
else
    result nbdkit-read-only/start fail "nbdkit -r did not start"
fi

# nbdkit's file plugin with dir= offers each file in the directory as an export, and lists them.
mkdir -p "$WORK/nbdkit-dir"
truncate -s 16M "$WORK/nbdkit-dir/one.img" "$WORK/nbdkit-dir/two.img"
if server_start nbdkit -f -i 127.0.0.1 -p "$VMLAB_PORT" file dir="$WORK/nbdkit-dir"; then
    check nbdkit/list 30 list_exports one.img two.img
    server_stop
else
    result nbdkit-list/start fail "nbdkit file dir= did not start"
fi
