"""TLS (STARTTLS, X.509 and PSK) with real clients: qemu-img and qemu-io (GnuTLS),
nbdinfo, nbdsh, nbdcopy and fio (libnbd, GnuTLS); and every way a TLS client can be
refused.  The server options are nbdkit's (`--tls`, `--tls-certificates`,
`--tls-verify-peer`, `--tls-psk`), so the client-side checks also run against nbdkit
(ZCNBD_TEST_SERVER=nbdkit); log lines and zcnbd's extras are zcnbd-only.

Runs once per engine and data path, like the rest of the suite."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import ssl
import struct
import time

import pytest

import nbdproto as P
import tls_creds
from nbdproto import RawClient
from support import (
    BACKEND, KiB, MiB, Export, files_equal, missing, pattern, require_tools, run,
)
from support import close_handle, new_handle, write_sparse_file

zcnbd_only = pytest.mark.zcnbd_only


@pytest.fixture(scope="module")
def creds(tmp_path_factory) -> tls_creds.Creds:
    return tls_creds.make(tmp_path_factory.mktemp("tls"))


def x509_args(creds, mode="require", *extra) -> list[str]:
    return [f"--tls={mode}", f"--tls-certificates={creds.server}", *extra]


def psk_args(creds, mode="require") -> list[str]:
    return [f"--tls={mode}", f"--tls-psk={creds.psk}"]


def tls_server(servers, args, export: Export | None = None):
    return servers(export or Export(kind="memory"), transport="tcp", extra_args=args)


def uri_x509(server, client_dir, name="") -> str:
    return f"nbds://localhost:{server.port}/{name}?tls-certificates={client_dir}"


def uri_psk(server, psk_file, user=tls_creds.PSK_USER) -> str:
    return f"nbds://{user}@localhost:{server.port}/?tls-psk-file={psk_file}"


def qemu_x509(creds_dir) -> list[str]:
    return ["--object", f"tls-creds-x509,id=tls0,endpoint=client,dir={creds_dir}"]


def qemu_psk(creds) -> list[str]:
    return ["--object", f"tls-creds-psk,id=tls0,endpoint=client,dir={creds.psk_dir},"
                        f"username={tls_creds.PSK_USER}"]


def qemu_image(server, name="") -> str:
    return (f"driver=nbd,server.type=inet,server.host=localhost,server.port={server.port},"
            f"export={name},tls-creds=tls0")


@contextlib.contextmanager
def handle(uri: str):
    """A libnbd handle connected to an nbds:// URI that names local files."""
    h = new_handle()
    h.set_uri_allow_local_file(True)
    try:
        h.connect_uri(uri)
        yield h
    finally:
        close_handle(h)


def nbdinfo_json(uri, check=True):
    p = run(["nbdinfo", "--json", uri], check=check)
    return json.loads(p.stdout) if p.returncode == 0 else None


def assert_refused_and_logged(server, client_argv, *words):
    """The client fails, the server logs why (zcnbd) and keeps serving."""
    p = run(client_argv, check=False, timeout=30)
    assert p.returncode != 0, f"{client_argv} should have been refused:\n{p.stdout}"
    if BACKEND == "zcnbd":
        wait_logged(server, *words)
    assert server.running()


def plain_log(server) -> str:
    """The server's log in lower case, without the terminal colours tracing may add."""
    return re.sub(r"\x1b\[[0-9;]*m", "", server.log()).lower()


def wait_logged(server, *words, timeout=5.0):
    deadline = time.monotonic() + timeout
    while True:
        log = plain_log(server)
        if all(w.lower() in log for w in words):
            return
        if time.monotonic() > deadline:
            pytest.fail(f"server log lacks {words!r}\n{server.log()}")
        time.sleep(0.05)


# --- real clients, X.509 -------------------------------------------------------------------
def test_nbdinfo_x509(servers, creds):
    require_tools("nbdinfo")
    server = tls_server(servers, x509_args(creds))
    info = nbdinfo_json(uri_x509(server, creds.client))
    assert info["TLS"] is True
    assert info["exports"][0]["export-size"] == 64 * MiB


def test_nbdsh_x509_reads_and_writes(servers, creds):
    server = tls_server(servers, x509_args(creds))
    data = pattern(3 * MiB + 5, seed=12)
    with handle(uri_x509(server, creds.client)) as h:
        assert h.get_tls_negotiated()
        h.pwrite(data, 7)
        assert h.pread(len(data), 7) == data
        for length in (4 * KiB, 64 * KiB, 1 * MiB):
            assert h.pread(length, 7) == data[:length]


def test_qemu_img_and_qemu_io_x509(servers, creds, data_dir):
    require_tools("qemu-img", "qemu-io")
    server = tls_server(servers, x509_args(creds))
    opts = qemu_x509(creds.client)
    p = run(["qemu-img", "info", "--output=json", *opts, "--image-opts", qemu_image(server)])
    assert json.loads(p.stdout)["virtual-size"] == 64 * MiB
    run(["qemu-io", *opts, "--image-opts", qemu_image(server),
         "-c", "write -P 0xab 1M 2M", "-c", "read -P 0xab 1M 2M", "-c", "read -P 0 0 1M"])
    src = data_dir / "src.img"
    write_sparse_file(src, 64 * MiB, {5 * MiB: pattern(MiB, seed=4)})
    run(["qemu-img", "convert", "-n", "-f", "raw", *opts, "--target-image-opts", src,
         qemu_image(server)])
    dst = data_dir / "dst.img"
    run(["qemu-img", "convert", *opts, "--image-opts", qemu_image(server), "-O", "raw", dst])
    assert files_equal(src, dst)


def test_nbdcopy_x509(servers, creds, data_dir):
    require_tools("nbdcopy")
    server = tls_server(servers, x509_args(creds))
    src = data_dir / "src.img"
    write_sparse_file(src, 64 * MiB, {0: pattern(MiB, 1), 33 * MiB + 3: pattern(2 * MiB, 2)})
    uri = uri_x509(server, creds.client)
    run(["nbdcopy", "--connections=2", src, uri])
    dst = data_dir / "dst.img"
    run(["nbdcopy", "--connections=2", uri, dst])
    assert files_equal(src, dst)


def test_fio_verify_x509(servers, creds, data_dir, monkeypatch):
    require_tools("fio")
    if run(["fio", "--enghelp=nbd"], check=False).returncode != 0:
        missing("fio was built without the nbd ioengine")
    server = tls_server(servers, x509_args(creds))
    # fio's URI may not name local files: libnbd then reads $HOME/.pki/libnbd.
    home = data_dir / "home"
    shutil.copytree(creds.client, home / ".pki" / "libnbd")
    monkeypatch.setenv("HOME", str(home))
    run(["fio", "--name=tls", "--ioengine=nbd", f"--uri=nbds://localhost:{server.port}/",
         "--rw=randrw", "--bs=64k", "--iodepth=16", "--size=16M", "--runtime=3",
         "--verify=crc32c", "--verify_fatal=1", "--verify_backlog=256"], cwd=data_dir,
        timeout=60)


# --- real clients, PSK --------------------------------------------------------------------
def test_nbdinfo_psk(servers, creds):
    require_tools("nbdinfo")
    server = tls_server(servers, psk_args(creds))
    assert nbdinfo_json(uri_psk(server, creds.psk))["TLS"] is True


def test_nbdsh_psk_reads_and_writes(servers, creds):
    server = tls_server(servers, psk_args(creds))
    data = pattern(MiB + 1, seed=5)
    with handle(uri_psk(server, creds.psk)) as h:
        assert h.get_tls_negotiated()
        h.pwrite(data, 4095)
        assert h.pread(len(data), 4095) == data


def test_qemu_io_psk(servers, creds):
    require_tools("qemu-io")
    server = tls_server(servers, psk_args(creds))
    run(["qemu-io", *qemu_psk(creds), "--image-opts", qemu_image(server),
         "-c", "write -P 0x5a 0 1M", "-c", "read -P 0x5a 0 1M"])


# --- modes ----------------------------------------------------------------------------------
def test_require_refuses_plaintext_options(servers, creds):
    server = tls_server(servers, x509_args(creds))
    with RawClient.connect(server.address) as c:
        c.handshake()
        for option, data in ((P.OPT_GO, RawClient.go_data("", [])),
                             (P.OPT_INFO, RawClient.go_data("", [])),
                             (P.OPT_LIST, b""), (P.OPT_STRUCTURED_REPLY, b"")):
            assert c.option(option, data).type == P.REP_ERR_TLS_REQD, option
        assert c.abort().type == P.REP_ACK
    p = run(["nbdinfo", f"nbd://localhost:{server.port}/"], check=False)
    assert p.returncode != 0
    assert server.running()


def test_require_closes_export_name_before_tls(servers, creds):
    server = tls_server(servers, x509_args(creds))
    with RawClient.connect(server.address) as c:
        c.handshake()
        c.send_option(P.OPT_EXPORT_NAME, b"")
        assert c.wait_closed() == b""


@zcnbd_only(reason="nbdkit 1.32 leaves such a client waiting; zcnbd closes it")
def test_require_closes_a_client_that_cannot_do_tls(servers, creds):
    """Without NBD_FLAG_C_FIXED_NEWSTYLE a client cannot start TLS; under --tls=require it
    is closed before any option is answered (as nbdkit does), so it cannot tell which
    export names exist (NBD_REP_ERR_UNKNOWN against NBD_REP_ERR_POLICY)."""
    server = tls_server(servers, x509_args(creds))
    for name in ("", "no-such-export"):
        with RawClient.connect(server.address) as c:
            c.read_greeting()
            c.send_client_flags(0)
            c.send_option(P.OPT_INFO, RawClient.go_data(name, []))
            assert c.wait_closed() == b"", name
    assert server.running()


def test_on_serves_both(servers, creds):
    server = tls_server(servers, x509_args(creds, "on"))
    assert nbdinfo_json(f"nbd://localhost:{server.port}/")["TLS"] is False
    assert nbdinfo_json(uri_x509(server, creds.client))["TLS"] is True


@zcnbd_only(reason="tls_only exports are zcnbd's (nbd-server's tlsonly)")
def test_tls_only_export_is_hidden_from_plaintext(servers, creds):
    exports = [Export(kind="memory", size=MiB, name="open"),
               Export(kind="memory", size=MiB, name="secret", tls_only=True)]
    server = servers(exports, transport="tcp", extra_args=x509_args(creds, "on"))
    with RawClient.connect(server.address) as c:
        c.handshake()
        assert [name for name, _ in c.list_exports()] == ["open"]
        assert c.option(P.OPT_GO, RawClient.go_data("secret", [])).type == P.REP_ERR_TLS_REQD
        assert c.option_replies(P.OPT_INFO, RawClient.go_data("open", []))[-1].type == P.REP_ACK
    p = run(["nbdinfo", "--list", "--json", uri_x509(server, creds.client)])
    assert sorted(e["export-name"] for e in json.loads(p.stdout)["exports"]) == ["open", "secret"]
    assert nbdinfo_json(uri_x509(server, creds.client, "secret"))["TLS"] is True


# --- refusals -------------------------------------------------------------------------------
def test_wrong_psk_is_refused(servers, creds):
    server = tls_server(servers, psk_args(creds))
    assert_refused_and_logged(server, ["nbdinfo", uri_psk(server, creds.psk_wrong)],
                              "psk-mismatch")
    assert_refused_and_logged(server, ["nbdinfo", uri_psk(server, creds.psk_unknown, user="mallory")],
                              "unknown-psk-identity")
    assert nbdinfo_json(uri_psk(server, creds.psk))["TLS"] is True


def test_client_certificates_under_verify_peer(servers, creds):
    server = tls_server(servers, x509_args(creds, "require", "--tls-verify-peer"))
    assert_refused_and_logged(server, ["nbdinfo", uri_x509(server, creds.client_no_cert)],
                              "no-client-certificate")
    # GnuTLS clients keep a certificate the server's CA list does not name to themselves,
    # so present it with Python's OpenSSL client to see the server refuse it.
    assert_refused_and_logged(server, ["nbdinfo", uri_x509(server, creds.client_other_ca)],
                              "no-client-certificate")
    c = starttls(server)
    ctx = ssl.create_default_context(cafile=str(creds.server / "ca-cert.pem"))
    ctx.load_cert_chain(creds.client_other_ca / "client-cert.pem",
                        creds.client_other_ca / "client-key.pem")
    with pytest.raises((ssl.SSLError, ConnectionError)):
        with ctx.wrap_socket(c.sock, server_hostname="localhost") as tls:
            RawClient(tls).option(P.OPT_LIST)  # TLS 1.3: the refusal comes after the handshake
    c.close()
    if BACKEND == "zcnbd":
        wait_logged(server, "unknown-ca")
    assert_refused_and_logged(server, ["nbdinfo", uri_x509(server, creds.client_expired)],
                              "certificate-expired")
    assert nbdinfo_json(uri_x509(server, creds.client))["TLS"] is True


def test_revoked_client_certificates_are_refused(servers, creds, tmp_path):
    """ca-crl.pem in the certificates directory (nbdkit's and QEMU's name) is loaded: a
    client whose certificate it revokes is refused under --tls-verify-peer, others served."""
    d = tmp_path / "certs"
    shutil.copytree(creds.server, d)
    tls_creds.revoke(creds, creds.client_revoked, d / "ca-crl.pem")
    server = tls_server(servers, x509_args(type("C", (), {"server": d}), "require",
                                           "--tls-verify-peer"))
    assert_refused_and_logged(server, ["nbdinfo", uri_x509(server, creds.client_revoked)],
                              "certificate-revoked")
    assert nbdinfo_json(uri_x509(server, creds.client))["TLS"] is True


@zcnbd_only(reason="zcnbd re-reads its credentials on SIGHUP")
def test_a_revocation_list_added_later_applies_after_sighup(servers, creds, tmp_path):
    d = tmp_path / "certs"
    shutil.copytree(creds.server, d)
    server = tls_server(servers, x509_args(type("C", (), {"server": d}), "require",
                                           "--tls-verify-peer"))
    assert nbdinfo_json(uri_x509(server, creds.client_revoked))["TLS"] is True
    tls_creds.revoke(creds, creds.client_revoked, d / "ca-crl.pem")
    server.send_signal(signal.SIGHUP)
    wait_logged(server, "revocation list loaded")
    assert_refused_and_logged(server, ["nbdinfo", uri_x509(server, creds.client_revoked)],
                              "certificate-revoked")
    assert nbdinfo_json(uri_x509(server, creds.client))["TLS"] is True


@zcnbd_only(reason="--tls-authz is qemu-nbd's; nbdkit only checks the CA")
def test_authz(servers, creds):
    server = tls_server(servers, x509_args(creds, "require", "--tls-verify-peer",
                                           "--tls-authz", "O=zcnbd tests,CN=someone-else"))
    assert_refused_and_logged(server, ["nbdinfo", uri_x509(server, creds.client)],
                              "not-authorized", "CN=client")
    allowed = tls_server(servers, x509_args(creds, "require", "--tls-verify-peer",
                                            "--tls-authz", tls_creds.CLIENT_DN))
    assert nbdinfo_json(uri_x509(allowed, creds.client))["TLS"] is True


@zcnbd_only(reason="qemu-nbd's rule, which nbdkit does not have")
def test_client_restrictions_make_tls_mandatory(servers, creds):
    """--tls-authz and --tls-verify-peer restrict who may connect: a plain-text client must
    not go around them. With either, TLS is required by default; --tls=on with them is
    refused at start, saying why."""
    for args in (["--tls-psk", str(creds.psk), "--tls-authz", tls_creds.PSK_USER],
                 ["--tls-certificates", str(creds.server), "--tls-verify-peer"]):
        server = tls_server(servers, args)
        wait_logged(server, "mode=require")
        with RawClient.connect(server.address) as c:
            c.handshake()
            assert c.option(P.OPT_GO, RawClient.go_data("", [])).type == P.REP_ERR_TLS_REQD
            assert c.option(P.OPT_LIST).type == P.REP_ERR_TLS_REQD
        p = run(["nbdinfo", f"nbd://localhost:{server.port}/"], check=False)
        assert p.returncode != 0
    import subprocess

    import support
    for mode in ("on", "off"):
        p = subprocess.run([str(support.ZCNBD_BIN), "serve", "-p", str(support.free_tcp_port()),
                            f"--tls={mode}", f"--tls-psk={creds.psk}", "--tls-authz",
                            tls_creds.PSK_USER], capture_output=True, text=True, timeout=20)
        assert p.returncode != 0, p.stderr
        assert "--tls=require" in p.stderr and f"--tls={mode}" in p.stderr, p.stderr


def starttls(server) -> RawClient:
    c = RawClient.connect(server.address)
    c.handshake()
    assert c.option(P.OPT_STARTTLS).type == P.REP_ACK
    return c


def test_garbage_and_stalls_in_the_tls_handshake_do_not_block_others(servers, creds):
    server = tls_server(servers, x509_args(creds, "require", "--handshake-timeout-ms=1500")
                        if BACKEND == "zcnbd" else x509_args(creds))
    garbage = starttls(server)
    garbage.send(b"\x16\x03\x01\x00\x05hello" + os.urandom(300))
    stalled = [starttls(server) for _ in range(4)]
    start = time.monotonic()
    assert nbdinfo_json(uri_x509(server, creds.client))["TLS"] is True
    assert time.monotonic() - start < 5
    garbage.wait_closed(timeout=5)
    if BACKEND == "zcnbd":
        for c in stalled:
            c.wait_closed(timeout=5)
        wait_logged(server, "handshake")
    for c in [garbage, *stalled]:
        c.close()


@zcnbd_only(reason="zcnbd's write timeout and its log line")
def test_tls_client_that_stops_reading_is_cut_off_and_others_served(servers, creds):
    """A TLS client pipelines 32 reads of 1 MiB and never reads a reply (a tiny receive
    buffer, so the server's sends block at once: on the portable engine, the thread that
    also reads this client's requests and encrypts its replies). Another TLS client is served
    meanwhile, and the stalled one is cut off at the write timeout."""
    server = tls_server(servers, [*x509_args(creds), "--write-timeout-ms", "1000"])
    sock = socket.socket(socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(5)
    sock.connect(("127.0.0.1", server.port))
    stalled = RawClient(sock)
    stalled.handshake()
    assert stalled.option(P.OPT_STARTTLS).type == P.REP_ACK
    context = ssl.create_default_context(cafile=str(creds.client_no_cert / "ca-cert.pem"))
    stalled.sock = context.wrap_socket(stalled.sock, server_hostname="localhost")
    try:
        stalled.export = stalled.go("")
        for i in range(32):
            stalled.send_request(P.CMD_READ, offset=i * MiB, length=MiB)
        start = time.monotonic()
        with handle(uri_x509(server, creds.client)) as h:
            h.pwrite(pattern(64 * KiB, 5), 0)
            assert h.pread(64 * KiB, 0) == pattern(64 * KiB, 5)
        assert time.monotonic() - start < 5
        wait_logged(server, "write timeout", timeout=10)
    finally:
        stalled.close()
    assert nbdinfo_json(uri_x509(server, creds.client))["TLS"] is True


@pytest.mark.parametrize("mode", ["on", "require"])
def test_plaintext_after_starttls_in_one_write_is_never_answered(servers, creds, mode):
    """The STARTTLS-injection class (CVE-2021-3716 in nbdkit): a client sends
    NBD_OPT_STARTTLS and a plain-text option in one write. The bytes after STARTTLS belong to
    the TLS layer: the server acknowledges STARTTLS and then takes what follows for the start
    of a TLS handshake (which fails), never for an option to answer in plain text."""
    server = tls_server(servers, x509_args(creds, mode))
    with RawClient.connect(server.address) as c:
        c.handshake()
        starttls = struct.pack(">QII", P.IHAVEOPT, P.OPT_STARTTLS, 0)
        listed = struct.pack(">QII", P.IHAVEOPT, P.OPT_LIST, 0)
        c.send(starttls + listed)
        ack = c.recv_option_reply()
        assert (ack.option, ack.type) == (P.OPT_STARTTLS, P.REP_ACK)
        rest = c.wait_closed(timeout=20)
        # What follows the ACK, if anything, is TLS (an alert record), never an option reply.
        assert struct.pack(">Q", P.OPT_REPLY_MAGIC) not in rest, rest
        assert not rest or rest[0] == 0x15, f"not a TLS alert: {rest[:16]!r}"
    assert server.running()
    assert nbdinfo_json(uri_x509(server, creds.client))["TLS"] is True


@zcnbd_only(reason="zcnbd's handshake budget (--handshakes-max)")
def test_a_tls_handshake_in_progress_is_not_taken_for_a_silent_one(servers, creds):
    """With a handshake budget of 4, a client that trickles its TLS ClientHello while idle
    connections keep arriving is never the one closed: every byte it sends during the TLS
    handshake refreshes its place, as option bytes do before STARTTLS."""
    server = tls_server(servers, x509_args(creds, "require", "--handshakes-max", "4"))
    c = starttls(server)
    ctx = ssl.create_default_context(cafile=str(creds.server / "ca-cert.pem"))
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ctx.wrap_bio(incoming, outgoing, server_hostname="localhost")
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    hello = outgoing.read()
    idle = []
    try:
        pieces = 12
        step = -(-len(hello) // pieces)
        for i in range(0, len(hello), step):
            c.sock.sendall(hello[i:i + step])
            time.sleep(0.05)
            idle.append(RawClient.connect(server.address))
        # Finish the handshake, then one option under TLS: the connection was kept.
        c.sock.settimeout(10)
        while True:
            try:
                tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                c.sock.sendall(outgoing.read())
                data = c.sock.recv(65536)
                assert data, "closed during the TLS handshake"
                incoming.write(data)
        tls.write(struct.pack(">QII", P.IHAVEOPT, P.OPT_ABORT, 0))
        c.sock.sendall(outgoing.read())
        reply = b""
        while len(reply) < 20:
            try:
                reply += tls.read(20 - len(reply))
            except ssl.SSLWantReadError:
                data = c.sock.recv(65536)
                assert data, "closed before the reply"
                incoming.write(data)
        magic, option, kind, _ = struct.unpack(">QIII", reply)
        assert (magic, option, kind) == (P.OPT_REPLY_MAGIC, P.OPT_ABORT, P.REP_ACK)
        assert "handshake limit (4) reached" in server.log()
    finally:
        c.close()
        for s in idle:
            s.close()


def test_starttls_twice_is_invalid(servers, creds):
    server = tls_server(servers, x509_args(creds))
    c = starttls(server)
    ctx = ssl.create_default_context(cafile=str(creds.server / "ca-cert.pem"))
    with ctx.wrap_socket(c.sock, server_hostname="localhost") as tls:
        t = RawClient(tls)
        assert t.option(P.OPT_STARTTLS).type == P.REP_ERR_INVALID
        assert t.option_replies(P.OPT_INFO, RawClient.go_data("", []))[-1].type == P.REP_ACK
        t.abort()


@zcnbd_only(reason="zcnbd's start-up checks")
@pytest.mark.parametrize("case", ["missing-key", "mismatched-key", "bad-psk-file"])
def test_bad_credentials_fail_at_start(creds, tmp_path, case):
    import subprocess

    import support

    d = tmp_path / "certs"
    shutil.copytree(creds.server, d)
    if case == "missing-key":
        (d / "server-key.pem").unlink()
        args = x509_args(type("C", (), {"server": d}))
    elif case == "mismatched-key":
        shutil.copy(creds.client / "client-key.pem", d / "server-key.pem")
        args = x509_args(type("C", (), {"server": d}))
    else:
        bad = tmp_path / "keys.psk"
        bad.write_text("alice:not-hex\n")
        args = ["--tls=require", f"--tls-psk={bad}"]
    p = subprocess.run([str(support.ZCNBD_BIN), "serve", "-p", str(support.free_tcp_port()),
                        *args], capture_output=True, text=True, timeout=20)
    assert p.returncode != 0
    err = p.stderr.lower()
    assert {"missing-key": "server-key.pem", "mismatched-key": "does not match",
            "bad-psk-file": "line 1"}[case] in err, p.stderr
    assert "not-hex" not in p.stderr  # never the key


@zcnbd_only(reason="zcnbd's warning")
def test_readable_private_key_is_warned_about(servers, creds, tmp_path):
    d = tmp_path / "certs"
    shutil.copytree(creds.server, d)
    os.chmod(d / "server-key.pem", 0o644)
    server = tls_server(servers, x509_args(type("C", (), {"server": d})))
    wait_logged(server, "server-key.pem", "mode 644")


@zcnbd_only(reason="zcnbd's counters")
def test_tls_bytes_are_counted(servers, creds):
    import urllib.request

    import support

    port = support.free_tcp_port()
    server = tls_server(servers, [*x509_args(creds), f"--metrics=127.0.0.1:{port}"])
    with handle(uri_x509(server, creds.client)) as h:
        h.pwrite(pattern(MiB, 3), 0)
        h.pread(MiB, 0)

    def counters() -> dict:
        url = f"http://127.0.0.1:{port}/metrics"
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        return dict(line.split() for line in text.splitlines() if line.startswith("zcnbd_"))

    # A session's bytes are counted once the server has closed the connection, which may be
    # a moment after the client has.
    deadline = time.monotonic() + 10
    while True:
        now = counters()
        if int(now["zcnbd_tls_decrypted_bytes_total"]) > 0:
            break
        assert time.monotonic() < deadline, now
        time.sleep(0.05)
    # Records are always read in user space; the kernel sends them where it has kTLS.
    assert int(now["zcnbd_tls_decrypted_bytes_total"]) >= MiB
    assert int(now["zcnbd_tls_connections_total"]) >= 1
    if int(now["zcnbd_tls_kernel_connections_total"]) == 0:
        assert int(now["zcnbd_tls_encrypted_bytes_total"]) >= MiB
    else:
        assert int(now["zcnbd_tls_encrypted_bytes_total"]) == 0


@zcnbd_only(reason="zcnbd's kTLS choice")
@pytest.mark.parametrize("ktls", ["auto", "off"])
def test_start_line_says_where_records_are_made(servers, creds, ktls):
    server = tls_server(servers, [*x509_args(creds), f"--tls-ktls={ktls}"])
    with handle(uri_x509(server, creds.client)) as h:
        assert h.pread(4 * KiB, 0) == bytes(4 * KiB)
    if ktls == "off":
        wait_logged(server, "records made in user space (--tls-ktls=off)", "kernel=false")
        return
    ulps = open("/proc/sys/net/ipv4/tcp_available_ulp").read().split()
    # The kernel loads the module on demand, so an absent "tls" may still come to be.
    if "tls" in ulps:
        wait_logged(server, "records sent by the kernel (ktls)", "kernel=true")
    else:
        wait_logged(server, "tls established", "kernel=")
        log = plain_log(server)
        assert ("records made in user space (no ktls" in log) != ("kernel=true" in log), log
