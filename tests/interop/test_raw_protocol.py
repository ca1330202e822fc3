"""Protocol-level tests over plain sockets (tests/interop/nbdproto.py), for
what libnbd cannot send or does not show: exact handshake bytes, unknown
options and commands, garbage, bad magic, oversized option headers, silent
clients, extended headers."""

import errno
import struct
import time

import pytest

import nbdproto as P
from nbdproto import RawClient, connect_and_go
from support import BACKEND, EXPORT_SIZE, ZCNBD_SERVE_ARGS, MAX_PAYLOAD, PREFERRED_BLOCK, Export, MiB, handle, pattern

# Transmission flags zcnbd advertises for a writable memory export, once
# structured replies are negotiated (SEND_DF requires them).
RW_FLAGS = (P.FLAG_HAS_FLAGS | P.FLAG_SEND_FLUSH | P.FLAG_SEND_FUA | P.FLAG_SEND_TRIM
            | P.FLAG_SEND_WRITE_ZEROES | P.FLAG_SEND_DF | P.FLAG_SEND_CACHE
            | P.FLAG_SEND_FAST_ZERO | P.FLAG_CAN_MULTI_CONN)
RO_FLAGS = (P.FLAG_HAS_FLAGS | P.FLAG_READ_ONLY | P.FLAG_SEND_FLUSH | P.FLAG_SEND_DF
            | P.FLAG_SEND_CACHE | P.FLAG_CAN_MULTI_CONN)
P_BASE_ALLOC = "base:allocation"


@pytest.fixture
def named_server(servers):
    return servers(Export(kind="memory", name="disk", description="a memory disk"))


def assert_still_serving(server):
    """A fresh client can still negotiate and do I/O."""
    with connect_and_go(server.address, server.export.name) as c:
        assert c.write(4096, b"alive").error == 0
        reply = c.read(4096, 5)
        assert (reply.error, reply.data) == (0, b"alive")
        c.disconnect()
        c.wait_closed()


def assert_closed(client, timeout=5.0):
    """The server hangs up (maybe after an error reply); it must not hang."""
    try:
        client.wait_closed(timeout)
    except TimeoutError:
        pytest.fail(f"server neither answered nor closed the connection within {timeout}s")


# --- handshake -----------------------------------------------------------------
def test_greeting(mem_server):
    with RawClient.connect(mem_server.address) as c:
        assert c.read_greeting() == P.FLAG_FIXED_NEWSTYLE | P.FLAG_NO_ZEROES


def test_unknown_client_flags_disconnect(mem_server):
    with RawClient.connect(mem_server.address) as c:
        c.read_greeting()
        c.send_client_flags(P.FLAG_C_FIXED_NEWSTYLE | 0x80000000)
        assert_closed(c)
    assert_still_serving(mem_server)


@pytest.mark.parametrize("when", ["instead-of-client-flags", "instead-of-option"])
def test_garbage_during_handshake(mem_server, when):
    with RawClient.connect(mem_server.address) as c:
        if when == "instead-of-client-flags":
            c.read_greeting()
        else:
            c.handshake()
        c.send(b"GET / HTTP/1.1\r\nHost: example\r\n\r\n" * 4)
        assert_closed(c)
    assert_still_serving(mem_server)


def test_unknown_option_then_continue(named_server):
    with RawClient.connect(named_server.address) as c:
        c.handshake()
        for option in (99, 0x7FFFFFFF, 0xFFFFFFFF):
            reply = c.option(option, b"some data")
            assert (reply.option, reply.type) == (option, P.REP_ERR_UNSUP)
        # ... and the handshake goes on.
        assert c.list_exports() == [("disk", "a memory disk")]
        reply = c.abort()
        assert reply.type == P.REP_ACK
        assert_closed(c)


def test_abort_right_away(mem_server):
    with RawClient.connect(mem_server.address) as c:
        c.handshake()
        assert c.abort().type == P.REP_ACK
        assert_closed(c)
    assert_still_serving(mem_server)


def test_unknown_option_with_1mib_of_data(mem_server):
    """1 MiB of option data, really sent: an error reply (then the handshake
    continues) or a disconnect; never a hang."""
    with RawClient.connect(mem_server.address) as c:
        c.handshake()
        try:
            c.send_option(99, bytes(1 * MiB))
            reply = c.recv_option_reply()
        except (P.Closed, BrokenPipeError, ConnectionResetError):
            reply = None
        if reply is not None:
            assert reply.option == 99 and reply.is_error, reply
            try:
                assert c.abort().type == P.REP_ACK
            except (P.Closed, BrokenPipeError, ConnectionResetError):
                pass  # an error reply, then a hang-up: fine too
    assert_still_serving(mem_server)


def test_huge_option_length(mem_server):
    """An option header claiming ~4 GiB of data (never sent): an error reply
    or a disconnect right away, not waiting for the data."""
    with RawClient.connect(mem_server.address) as c:
        c.handshake()
        c.send_option(99, length=0xFFFFFFF0)
        try:
            reply = c.recv_option_reply()
        except P.Closed:
            pass
        except TimeoutError:
            pytest.fail("server waited for ~4 GiB of option data")
        else:
            assert reply.option == 99 and reply.is_error, reply
    assert_still_serving(mem_server)


@pytest.mark.zcnbd_only(reason="nbdkit accepts up to 64 MiB of option data and waits for it")
def test_option_length_over_limit(mem_server):
    """zcnbd limits option data to less than 1 MiB: a header claiming more
    gets an error reply or a disconnect without the data being sent."""
    with RawClient.connect(mem_server.address) as c:
        c.handshake()
        c.send_option(P.OPT_GO, length=1 * MiB + 1)
        try:
            reply = c.recv_option_reply()
        except P.Closed:
            pass
        except TimeoutError:
            pytest.fail("server waited for 1 MiB of option data")
        else:
            assert reply.option == P.OPT_GO and reply.is_error, reply
    assert_still_serving(mem_server)


def test_bad_option_magic(mem_server):
    with RawClient.connect(mem_server.address) as c:
        c.handshake()
        c.send(struct.pack(">QII", 0x1122334455667788, P.OPT_LIST, 0))
        assert_closed(c)
    assert_still_serving(mem_server)


def test_starttls_refused(mem_server):
    with RawClient.connect(mem_server.address) as c:
        c.handshake()
        # Without --tls, both zcnbd and nbdkit refuse it for policy reasons.
        assert c.option(P.OPT_STARTTLS).type == P.REP_ERR_POLICY
        # Still plain text, still negotiating.
        assert c.structured_reply().type == P.REP_ACK
        c.go("")
        assert c.write(0, b"plain").error == 0


def test_list_with_data_is_invalid(named_server):
    with RawClient.connect(named_server.address) as c:
        c.handshake()
        replies = c.option_replies(P.OPT_LIST, b"unexpected")
        assert [r.type for r in replies] == [P.REP_ERR_INVALID]
        assert c.list_exports() == [("disk", "a memory disk")]


def test_set_meta_context_needs_structured_replies(mem_server):
    with RawClient.connect(mem_server.address) as c:
        c.handshake()
        contexts, final = c.meta_context(P.OPT_SET_META_CONTEXT, "", [P_BASE_ALLOC])
        assert contexts == [] and final.type == P.REP_ERR_INVALID


def test_go_information(named_server):
    with RawClient.connect(named_server.address) as c:
        c.handshake()
        assert c.structured_reply().type == P.REP_ACK
        info, final = c.info_or_go(
            P.OPT_GO, "disk", [P.INFO_EXPORT, P.INFO_NAME, P.INFO_DESCRIPTION, P.INFO_BLOCK_SIZE])
        assert final.type == P.REP_ACK
        assert info.size == EXPORT_SIZE
        assert info.flags == RW_FLAGS, f"{info.flags:#x} != {RW_FLAGS:#x}"
        assert info.description == "a memory disk"
        assert info.name in (None, "disk")  # may be omitted: we used the canonical name
        assert info.block_size == (1, PREFERRED_BLOCK, MAX_PAYLOAD)
        assert c.write(0, b"go").error == 0


def test_payloads_up_to_the_maximum_without_block_size_negotiation(servers):
    """Old clients never ask for block sizes (NBD_OPT_EXPORT_NAME) and send reads and writes
    as large as they like; zcnbd takes them up to --payload-max (64 MiB by default, as
    nbdkit), and refuses larger reads with EINVAL. --payload-max is what is advertised."""
    server = servers(Export(kind="memory"))
    data = pattern(48 * MiB, seed=48)
    with RawClient.connect(server.address, 30) as c:
        c.handshake()
        c.export_name("")
        assert c.write(0, data).error == 0
        got = c.read(0, len(data))
        assert got.error == 0 and got.data == data
        assert c.read(0, MAX_PAYLOAD).error == 0
        assert c.read(0, MAX_PAYLOAD + 4096).error == errno.EINVAL
        assert c.write(0, b"still served").error == 0
    if BACKEND != "zcnbd":
        return
    small = servers(Export(kind="memory", max_payload=16 * MiB))
    with RawClient.connect(small.address) as c:
        c.handshake()
        info, final = c.info_or_go(P.OPT_GO, "", [P.INFO_BLOCK_SIZE])
        assert final.type == P.REP_ACK and info.block_size == (1, PREFERRED_BLOCK, 16 * MiB)
        assert c.read(0, 16 * MiB + 4096).error == errno.EINVAL


def test_go_without_structured_replies_has_no_df(mem_server):
    """SEND_DF MUST be clear unless structured replies were negotiated."""
    with RawClient.connect(mem_server.address) as c:
        c.handshake()
        info = c.go("")
        assert info.flags == RW_FLAGS & ~P.FLAG_SEND_DF, f"{info.flags:#x}"
        reply = c.read(0, 4096)
        assert reply.kind == "simple" and reply.data == bytes(4096)


def test_read_only_flags(servers):
    server = servers(Export(kind="memory", read_only=True))
    with RawClient.connect(server.address) as c:
        c.handshake()
        c.structured_reply()
        info = c.go("")
        assert info.flags == RO_FLAGS, f"{info.flags:#x} != {RO_FLAGS:#x}"


def test_info_then_go(named_server):
    with RawClient.connect(named_server.address) as c:
        c.handshake()
        info, final = c.info_or_go(P.OPT_INFO, "no-such-export", [P.INFO_BLOCK_SIZE])
        assert final.type == P.REP_ERR_UNKNOWN
        info, final = c.info_or_go(P.OPT_INFO, "disk", [P.INFO_BLOCK_SIZE])
        assert final.type == P.REP_ACK and info.size == EXPORT_SIZE
        # Still negotiating: more options are fine.
        assert c.structured_reply().type == P.REP_ACK
        go = c.go("disk")
        assert go.size == EXPORT_SIZE
        assert c.read(0, 16).data == bytes(16)


def test_meta_context_negotiation_and_block_status(mem_server):
    with RawClient.connect(mem_server.address) as c:
        c.handshake()
        assert c.structured_reply().type == P.REP_ACK
        contexts, final = c.meta_context(P.OPT_LIST_META_CONTEXT, "", ["base:"])
        assert final.type == P.REP_ACK and [n for _, n in contexts] == [P_BASE_ALLOC]
        contexts, final = c.meta_context(
            P.OPT_SET_META_CONTEXT, "", [P_BASE_ALLOC, "base:", "x-unknown:thing"])
        assert final.type == P.REP_ACK
        assert [n for _, n in contexts] == [P_BASE_ALLOC]
        (ctx_id, _), = contexts
        c.go("")
        assert c.write(1 * MiB, pattern(64 * 1024, seed=1)).error == 0
        reply = c.command(P.CMD_BLOCK_STATUS, 0, 2 * MiB)
        assert reply.error == 0 and reply.kind == "structured"
        status = [ch for ch in reply.chunks if ch.type == P.REPLY_TYPE_BLOCK_STATUS]
        assert len(status) == 1
        payload = status[0].payload
        assert (len(payload) - 4) % 8 == 0 and len(payload) >= 12
        assert struct.unpack(">I", payload[:4])[0] == ctx_id
        descriptors = [struct.unpack(">II", payload[i:i + 8]) for i in range(4, len(payload), 8)]
        assert all(length > 0 for length, _ in descriptors)
        # 0..1 MiB was never written: a hole reading as zeroes.
        assert descriptors[0][1] == 3 and descriptors[0][0] <= 1 * MiB


def test_block_status_without_meta_context(mem_server):
    with connect_and_go(mem_server.address) as c:
        reply = c.command(P.CMD_BLOCK_STATUS, 0, 4096)
        assert reply.error == P.EINVAL
        assert c.read(0, 4).error == 0


# --- NBD_OPT_EXPORT_NAME and simple replies ---------------------------------------
@pytest.mark.parametrize("no_zeroes", [True, False])
def test_export_name_and_simple_replies(mem_server, no_zeroes):
    with RawClient.connect(mem_server.address) as c:
        c.handshake(no_zeroes=no_zeroes)
        info = c.export_name("")
        assert info.size == EXPORT_SIZE
        # No structured replies: no SEND_DF.
        assert info.flags == RW_FLAGS & ~P.FLAG_SEND_DF, f"{info.flags:#x}"
        data = pattern(5000, seed=2)
        assert c.write(12345, data).error == 0
        reply = c.read(12345, 5000)
        assert reply.kind == "simple" and (reply.error, reply.data) == (0, data)
        # An error reply to a read carries no data: the next reply parses.
        assert c.read(EXPORT_SIZE, 512).error == P.EINVAL
        assert c.command(P.CMD_FLUSH).error == 0
        assert c.read(12345, 10).data == data[:10]
        c.disconnect()
        assert_closed(c)


def test_export_name_unknown_disconnects(named_server):
    with RawClient.connect(named_server.address) as c:
        c.handshake()
        c.send_option(P.OPT_EXPORT_NAME, b"no-such-export")
        assert_closed(c)
    assert_still_serving(named_server)


# --- transmission -------------------------------------------------------------------
def test_structured_read_error_is_structured(mem_server):
    with connect_and_go(mem_server.address) as c:
        reply = c.read(EXPORT_SIZE, 512)  # a simple reply raises ProtocolError
        assert reply.error == P.EINVAL and reply.kind == "structured"
        assert any(ch.type in (P.REPLY_TYPE_ERROR, P.REPLY_TYPE_ERROR_OFFSET) for ch in reply.chunks)


def test_unknown_command(mem_server):
    with connect_and_go(mem_server.address) as c:
        for cmd in (8, 99, 0xFFFF):
            assert c.command(cmd, 0, 512).error == P.EINVAL
        assert c.write(0, b"still here").error == 0
        assert c.read(0, 10).data == b"still here"


def test_disc_closes_connection(mem_server):
    with connect_and_go(mem_server.address) as c:
        assert c.write(0, b"before disc").error == 0
        c.disconnect()
        assert_closed(c)
    with connect_and_go(mem_server.address) as c:
        assert c.read(0, 11).data == b"before disc"


def test_bad_request_magic_drops_only_that_client(mem_server):
    bystander = connect_and_go(mem_server.address)
    culprit = connect_and_go(mem_server.address)
    with bystander, culprit:
        assert bystander.write(0, b"bystander").error == 0
        culprit.send_request(P.CMD_READ, 0, 512, magic=0xDEADBEEF)
        assert_closed(culprit)
        reply = bystander.read(0, 9)
        assert (reply.error, reply.data) == (0, b"bystander")
    assert_still_serving(mem_server)


def test_client_vanishes_mid_write(mem_server):
    """A client announcing a 1 MiB write, sending 100 bytes and hanging up
    must not disturb the server."""
    with connect_and_go(mem_server.address) as c:
        c.send(struct.pack(">IHHQQI", P.REQUEST_MAGIC, 0, P.CMD_WRITE, 1, 0, 1 * MiB) + bytes(100))
    assert_still_serving(mem_server)


@pytest.mark.parametrize("kind", ["file", "memory"])
def test_client_stalled_mid_write(servers, export_factory, kind):
    """A client that announces 1 MiB writes (to a buffered file, or to memory) and stops sending partway
    through the payload (on io_uring, while a worker waits in the socket -> pipe splice;
    to a memory export, while the payload is received straight into the export's pages)
    must not hold up other clients, nor the server's shutdown (status 0 within the stop
    timeout, checked by stop())."""
    flag = "--receive-splice-min-bytes"
    args = [flag, "1"] if BACKEND == "zcnbd" and flag not in ZCNBD_SERVE_ARGS and kind == "file" else []
    server = servers(export_factory(kind), extra_args=args)
    stalled = []
    for sent in (0, 100, 512 * 1024):
        c = connect_and_go(server.address)
        c.send(struct.pack(">IHHQQI", P.REQUEST_MAGIC, 0, P.CMD_WRITE, 1, 0, 1 * MiB) + bytes(sent))
        stalled.append(c)
    time.sleep(0.2)
    assert_still_serving(server)
    server.stop()
    for c in stalled:
        c.close()


def test_pipelined_raw_requests(mem_server):
    """Requests sent back to back before reading any reply."""
    with connect_and_go(mem_server.address) as c:
        cookies = {}
        for i in range(32):
            cookies[c.send_request(P.CMD_WRITE, i * 4096, 4096, payload=pattern(4096, seed=i))] = i
        for _ in range(32):
            reply = c.recv_reply()
            assert reply.error == 0
            assert cookies.pop(reply.cookie) is not None
        for i in range(32):
            assert c.read(i * 4096, 4096).data == pattern(4096, seed=i)


def test_pipelined_small_writes_then_a_stall_mid_payload(mem_server):
    """A burst of small writes sent at once (received in bulk on io_uring, their replies
    held while more bytes wait in the socket), the last one cut off mid-payload: every
    complete write is answered and landed without the client sending another byte, and
    other clients are served meanwhile."""
    base = 16 * MiB  # clear of assert_still_serving's write
    with connect_and_go(mem_server.address) as c:
        burst = b""
        for i in range(24):
            header = struct.pack(">IHHQQI", P.REQUEST_MAGIC, 0, P.CMD_WRITE, 100 + i,
                                 base + i * 4096, 4096)
            burst += header + pattern(4096, seed=300 + i)
        c.send(burst[:-1000])
        cookies = {c.recv_reply().cookie for _ in range(23)}
        assert cookies == set(range(100, 123))
        assert_still_serving(mem_server)
        with connect_and_go(mem_server.address) as other:
            for i in range(23):
                assert other.read(base + i * 4096, 4096).data == pattern(4096, seed=300 + i)


def test_pipelined_reads_then_writes_in_one_burst(mem_server):
    """Runs of reads, each followed by a write (and a refused write whose payload must be
    skipped) sent in one burst: a server that receives many request headers at once after
    a run of reads finds payload bytes among them, which must land where they belong."""
    base = 8 * MiB
    with connect_and_go(mem_server.address) as c:
        for i in range(20):
            assert c.write(base + i * 4096, pattern(4096, seed=200 + i)).error == 0
        burst, send = [], c.send
        c.send = burst.append  # collect the requests, then send them as one
        expected = {}  # cookie -> (kind, detail)
        for round_ in range(3):
            for i in range(20):
                cookie = c.send_request(P.CMD_READ, base + i * 4096, 4096)
                expected[cookie] = ("read", 200 + i)
            offset = base + (32 + round_) * 4096
            cookie = c.send_request(P.CMD_WRITE, offset, 4096, payload=pattern(4096, seed=300 + round_))
            expected[cookie] = ("write", 0)
            cookie = c.send_request(P.CMD_WRITE, EXPORT_SIZE, 4096, payload=pattern(4096, seed=1))
            expected[cookie] = ("refused", 0)
        c.send = send
        c.send(b"".join(burst))
        for _ in range(len(expected)):
            reply = c.recv_reply()
            kind, seed = expected.pop(reply.cookie)
            if kind == "read":
                data = b"".join(ch.payload[8:] for ch in reply.chunks
                                if ch.type == P.REPLY_TYPE_OFFSET_DATA)
                assert reply.error == 0 and data == pattern(4096, seed=seed)
            elif kind == "write":
                assert reply.error == 0
            else:
                assert reply.error != 0
        for round_ in range(3):
            assert c.read(base + (32 + round_) * 4096, 4096).data == pattern(4096, seed=300 + round_)




def test_writes_trickled_across_request_boundaries(mem_server):
    """Requests sent in pieces that end mid-payload and mid-header, with pauses so the
    server sees every piece alone: a server that receives a payload together with the next
    request's header must put each byte where it belongs, whatever arrives when."""
    base = 12 * MiB
    with connect_and_go(mem_server.address) as c:
        stream, send = [], c.send
        c.send = stream.append  # collect the requests, then trickle them
        cookies = []
        for i in range(4):
            cookies.append(c.send_request(P.CMD_WRITE, base + i * 8192, 8192,
                                          payload=pattern(8192, seed=400 + i)))
        cookies.append(c.send_request(P.CMD_READ, base, 8192))
        c.send = send
        data = b"".join(stream)
        # Cut points: inside the first payload, 10 bytes into the second header, right after
        # the second header, inside the third header, and then single bytes at the end.
        request = 28 + 8192
        cuts = [100, request + 10, request + 28, 2 * request + 5, 2 * request + 27,
                3 * request + 8192, 3 * request + 8200]
        cuts += list(range(4 * request, len(data)))
        start = 0
        for cut in cuts + [len(data)]:
            c.send(data[start:cut])
            start = cut
            time.sleep(0.005)
        for _ in range(4):
            reply = c.recv_reply()
            assert reply.error == 0 and reply.cookie in cookies[:4]
        reply = c.recv_reply()
        assert reply.cookie == cookies[4]
        got = b"".join(ch.payload[8:] for ch in reply.chunks if ch.type == P.REPLY_TYPE_OFFSET_DATA)
        assert got == pattern(8192, seed=400)
        for i in range(4):
            assert c.read(base + i * 8192, 8192).data == pattern(8192, seed=400 + i)
# --- zcnbd-only -----------------------------------------------------------------------
@pytest.mark.zcnbd_only(reason="--handshake-timeout-ms is a zcnbd option")
def test_silent_client_dropped_after_handshake_timeout(servers):
    server = servers(Export(kind="memory"), extra_args=["--handshake-timeout-ms", "500"])
    with RawClient.connect(server.address) as silent, RawClient.connect(server.address) as slow:
        start = time.monotonic()
        # One says nothing at all; one stops after the greeting.
        slow.read_greeting()
        assert_closed(silent, timeout=5.0)
        assert_closed(slow, timeout=5.0)
        assert time.monotonic() - start < 4.0
    # A client that completed the handshake may stay idle for longer.
    with connect_and_go(server.address) as idle:
        time.sleep(1.5)
        assert idle.write(0, b"idle ok").error == 0
    assert_still_serving(server)


@pytest.mark.zcnbd_only(reason="nbdkit 1.32 and libnbd 1.14 predate extended headers")
def test_extended_headers(mem_server):
    with RawClient.connect(mem_server.address) as c:
        c.handshake()
        assert c.structured_reply().type == P.REP_ACK
        assert c.extended_headers().type == P.REP_ACK
        c.meta_context(P.OPT_SET_META_CONTEXT, "", [P_BASE_ALLOC])
        c.go("")
        data = pattern(100000, seed=3)
        reply = c.write(3 * MiB + 1, data)
        assert reply.kind == "extended" and reply.error == 0
        reply = c.read(3 * MiB + 1, len(data))
        assert reply.kind == "extended" and reply.data == data
        assert c.read(EXPORT_SIZE, 1).error == P.EINVAL
        assert c.write(EXPORT_SIZE, b"x").error == P.ENOSPC
        assert c.command(P.CMD_FLUSH).error == 0
        # Block status uses 64-bit descriptors with extended headers.
        reply = c.command(P.CMD_BLOCK_STATUS, 0, 4 * MiB)
        assert reply.error == 0
        status = [ch for ch in reply.chunks if ch.type == P.REPLY_TYPE_BLOCK_STATUS_EXT]
        assert len(status) == 1, [ch.type for ch in reply.chunks]
        payload = status[0].payload
        _ctx, count = struct.unpack(">II", payload[:8])
        assert count >= 1 and len(payload) == 8 + 16 * count
        descriptors = [struct.unpack(">QQ", payload[8 + 16 * i: 24 + 16 * i]) for i in range(count)]
        # 0..3 MiB was never written: a hole reading as zeroes.
        assert descriptors[0][1] == 3 and 0 < descriptors[0][0] <= 3 * MiB
        c.disconnect()
        assert_closed(c)
    with handle(mem_server.uri()) as h:
        assert h.pread(len(data), 3 * MiB + 1) == data
