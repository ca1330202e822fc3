"""A minimal raw NBD client (plain sockets, no libnbd).

Used for what libnbd cannot or will not send: unknown options and commands,
bad magic numbers, garbage, oversized option headers, extended headers (libnbd
1.14 predates them), and for checking the exact bytes a server sends.

Only the protocol as described in the NBD spec is implemented; every message
is checked strictly so that a server bug shows up as a ProtocolError here.
"""

from __future__ import annotations

import socket
import struct
import time
from dataclasses import dataclass, field

# --- magic numbers -----------------------------------------------------------
NBDMAGIC = 0x4E42444D41474943  # "NBDMAGIC"
IHAVEOPT = 0x49484156454F5054  # "IHAVEOPT"
OPT_REPLY_MAGIC = 0x3E889045565A9
REQUEST_MAGIC = 0x25609513
SIMPLE_REPLY_MAGIC = 0x67446698
STRUCTURED_REPLY_MAGIC = 0x668E33EF
EXTENDED_REQUEST_MAGIC = 0x21E41C71
EXTENDED_REPLY_MAGIC = 0x6E8A278C

# --- handshake flags ---------------------------------------------------------
FLAG_FIXED_NEWSTYLE = 1 << 0
FLAG_NO_ZEROES = 1 << 1
FLAG_C_FIXED_NEWSTYLE = 1 << 0
FLAG_C_NO_ZEROES = 1 << 1

# --- transmission flags ------------------------------------------------------
FLAG_HAS_FLAGS = 1 << 0
FLAG_READ_ONLY = 1 << 1
FLAG_SEND_FLUSH = 1 << 2
FLAG_SEND_FUA = 1 << 3
FLAG_ROTATIONAL = 1 << 4
FLAG_SEND_TRIM = 1 << 5
FLAG_SEND_WRITE_ZEROES = 1 << 6
FLAG_SEND_DF = 1 << 7
FLAG_CAN_MULTI_CONN = 1 << 8
FLAG_SEND_RESIZE = 1 << 9
FLAG_SEND_CACHE = 1 << 10
FLAG_SEND_FAST_ZERO = 1 << 11
FLAG_BLOCK_STATUS_PAYLOAD = 1 << 12

# --- options -----------------------------------------------------------------
OPT_EXPORT_NAME = 1
OPT_ABORT = 2
OPT_LIST = 3
OPT_STARTTLS = 5
OPT_INFO = 6
OPT_GO = 7
OPT_STRUCTURED_REPLY = 8
OPT_LIST_META_CONTEXT = 9
OPT_SET_META_CONTEXT = 10
OPT_EXTENDED_HEADERS = 11

# --- option replies ----------------------------------------------------------
REP_ACK = 1
REP_SERVER = 2
REP_INFO = 3
REP_META_CONTEXT = 4
REP_ERR_UNSUP = 0x80000001
REP_ERR_POLICY = 0x80000002
REP_ERR_INVALID = 0x80000003
REP_ERR_PLATFORM = 0x80000004
REP_ERR_TLS_REQD = 0x80000005
REP_ERR_UNKNOWN = 0x80000006
REP_ERR_SHUTDOWN = 0x80000007
REP_ERR_BLOCK_SIZE_REQD = 0x80000008
REP_ERR_TOO_BIG = 0x80000009
REP_ERR_EXT_HEADER_REQD = 0x8000000A

INFO_EXPORT = 0
INFO_NAME = 1
INFO_DESCRIPTION = 2
INFO_BLOCK_SIZE = 3

# --- commands ----------------------------------------------------------------
CMD_READ = 0
CMD_WRITE = 1
CMD_DISC = 2
CMD_FLUSH = 3
CMD_TRIM = 4
CMD_CACHE = 5
CMD_WRITE_ZEROES = 6
CMD_BLOCK_STATUS = 7

CMD_FLAG_FUA = 1 << 0
CMD_FLAG_NO_HOLE = 1 << 1
CMD_FLAG_DF = 1 << 2
CMD_FLAG_REQ_ONE = 1 << 3
CMD_FLAG_FAST_ZERO = 1 << 4

# --- structured replies ------------------------------------------------------
REPLY_FLAG_DONE = 1 << 0
REPLY_TYPE_NONE = 0
REPLY_TYPE_OFFSET_DATA = 1
REPLY_TYPE_OFFSET_HOLE = 2
REPLY_TYPE_BLOCK_STATUS = 5
REPLY_TYPE_BLOCK_STATUS_EXT = 6
REPLY_TYPE_ERROR = (1 << 15) + 1
REPLY_TYPE_ERROR_OFFSET = (1 << 15) + 2

# --- errors ------------------------------------------------------------------
EPERM = 1
EIO = 5
ENOMEM = 12
EINVAL = 22
ENOSPC = 28
EOVERFLOW = 75
ENOTSUP = 95
ESHUTDOWN = 108


class ProtocolError(AssertionError):
    """The server sent something the NBD spec does not allow."""


class Closed(ConnectionError):
    """The server closed the connection."""


@dataclass
class OptionReply:
    option: int
    type: int
    data: bytes

    @property
    def is_error(self) -> bool:
        return bool(self.type & 0x80000000)


@dataclass
class ExportInfo:
    """What an NBD_OPT_GO / NBD_OPT_INFO / NBD_OPT_EXPORT_NAME told us."""

    size: int = 0
    flags: int = 0
    name: str | None = None
    description: str | None = None
    block_size: tuple[int, int, int] | None = None  # (minimum, preferred, maximum)
    info_types: list[int] = field(default_factory=list)


@dataclass
class Chunk:
    flags: int
    type: int
    cookie: int
    payload: bytes
    offset: int = 0  # only meaningful for extended replies


@dataclass
class Reply:
    """One complete reply to a request (simple, or all structured chunks)."""

    cookie: int
    error: int
    data: bytes = b""  # reassembled read data (simple reply or content chunks)
    chunks: list[Chunk] = field(default_factory=list)
    kind: str = "simple"  # "simple" | "structured" | "extended"


class RawClient:
    """One NBD connection driven by hand.

    Every receive has a deadline (``timeout`` seconds); a server that hangs
    makes the calling test fail instead of blocking forever.
    """

    def __init__(self, sock: socket.socket, timeout: float = 5.0):
        self.sock = sock
        self.timeout = timeout
        self.sock.settimeout(timeout)
        self.structured = False
        self.extended = False
        self._next_cookie = 1
        self.handshake_flags: int | None = None
        self.no_zeroes = False  # NBD_FLAG_C_NO_ZEROES was sent
        self.export: ExportInfo | None = None  # set by connect_and_go()

    # -- connection -----------------------------------------------------------
    @classmethod
    def connect(cls, address, timeout: float = 5.0) -> "RawClient":
        """address: a Unix socket path (str) or a (host, port) tuple."""
        if isinstance(address, tuple):
            sock = socket.create_connection(address, timeout=timeout)
        else:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(timeout)
            sock.connect(address)
        return cls(sock, timeout)

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> "RawClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- bytes ----------------------------------------------------------------
    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def recv_exact(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            try:
                chunk = self.sock.recv(n - len(buf))
            except (ConnectionResetError, BrokenPipeError) as e:
                raise Closed(f"connection reset after {len(buf)}/{n} bytes") from e
            if not chunk:
                raise Closed(f"connection closed after {len(buf)}/{n} bytes")
            buf += chunk
        return bytes(buf)

    def wait_closed(self, timeout: float | None = None) -> bytes:
        """Wait until the server closes the connection; return what it sent
        before closing.  Raises socket.timeout (TimeoutError) if it doesn't."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        received = bytearray()
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"server did not close the connection (got {bytes(received[:64])!r})"
                    )
                self.sock.settimeout(left)
                try:
                    chunk = self.sock.recv(65536)
                except (ConnectionResetError, BrokenPipeError):
                    return bytes(received)
                if not chunk:
                    return bytes(received)
                received += chunk
        finally:
            self.sock.settimeout(self.timeout)

    # -- handshake ------------------------------------------------------------
    def read_greeting(self) -> int:
        magic, opt_magic, flags = struct.unpack(">QQH", self.recv_exact(18))
        if magic != NBDMAGIC:
            raise ProtocolError(f"bad NBDMAGIC {magic:#x}")
        if opt_magic != IHAVEOPT:
            raise ProtocolError(f"not a newstyle server: {opt_magic:#x}")
        self.handshake_flags = flags
        return flags

    def send_client_flags(self, flags: int) -> None:
        self.send(struct.pack(">I", flags))

    def handshake(self, no_zeroes: bool = True) -> int:
        """Read the greeting and answer with fixed-newstyle client flags."""
        flags = self.read_greeting()
        cflags = FLAG_C_FIXED_NEWSTYLE
        if no_zeroes and flags & FLAG_NO_ZEROES:
            cflags |= FLAG_C_NO_ZEROES
        self.send_client_flags(cflags)
        self.no_zeroes = bool(cflags & FLAG_C_NO_ZEROES)
        return flags

    def send_option(self, option: int, data: bytes = b"", length: int | None = None) -> None:
        """Send an option header (length defaults to len(data)) and data."""
        if length is None:
            length = len(data)
        self.send(struct.pack(">QII", IHAVEOPT, option, length) + data)

    def recv_option_reply(self, max_len: int = 1 << 20) -> OptionReply:
        magic, option, rtype, length = struct.unpack(">QIII", self.recv_exact(20))
        if magic != OPT_REPLY_MAGIC:
            raise ProtocolError(f"bad option reply magic {magic:#x}")
        if length > max_len:
            raise ProtocolError(f"option reply length {length} is unreasonable")
        return OptionReply(option, rtype, self.recv_exact(length))

    def option(self, option: int, data: bytes = b"") -> OptionReply:
        """Send an option that has exactly one reply; check it is for us."""
        self.send_option(option, data)
        reply = self.recv_option_reply()
        if reply.option != option:
            raise ProtocolError(f"reply for option {reply.option}, expected {option}")
        return reply

    def option_replies(self, option: int, data: bytes = b"") -> list[OptionReply]:
        """Send an option and collect replies up to the final ACK or error."""
        self.send_option(option, data)
        replies = []
        while True:
            reply = self.recv_option_reply()
            if reply.option != option:
                raise ProtocolError(f"reply for option {reply.option}, expected {option}")
            replies.append(reply)
            if reply.type == REP_ACK or reply.is_error:
                return replies

    def abort(self) -> OptionReply:
        return self.option(OPT_ABORT)

    def list_exports(self) -> list[tuple[str, str]]:
        """NBD_OPT_LIST -> [(name, details)]."""
        replies = self.option_replies(OPT_LIST)
        final = replies[-1]
        if final.type != REP_ACK:
            raise ProtocolError(f"NBD_OPT_LIST failed with {final.type:#x}")
        exports = []
        for r in replies[:-1]:
            if r.type != REP_SERVER:
                raise ProtocolError(f"unexpected reply type {r.type:#x} to NBD_OPT_LIST")
            (nlen,) = struct.unpack(">I", r.data[:4])
            if nlen > len(r.data) - 4:
                raise ProtocolError("NBD_REP_SERVER name length exceeds reply")
            exports.append((r.data[4 : 4 + nlen].decode(), r.data[4 + nlen :].decode()))
        return exports

    @staticmethod
    def go_data(name: str, infos: list[int]) -> bytes:
        n = name.encode()
        return struct.pack(">I", len(n)) + n + struct.pack(f">H{len(infos)}H", len(infos), *infos)

    def info_or_go(
        self, option: int, name: str = "", infos: list[int] | tuple[int, ...] = ()
    ) -> tuple[ExportInfo, OptionReply]:
        """NBD_OPT_INFO / NBD_OPT_GO; returns (info, final reply)."""
        replies = self.option_replies(option, self.go_data(name, list(infos)))
        info = ExportInfo()
        for r in replies[:-1]:
            if r.type != REP_INFO:
                raise ProtocolError(f"unexpected reply type {r.type:#x} to INFO/GO")
            (itype,) = struct.unpack(">H", r.data[:2])
            info.info_types.append(itype)
            body = r.data[2:]
            if itype == INFO_EXPORT:
                if len(r.data) != 12:
                    raise ProtocolError(f"NBD_INFO_EXPORT length {len(r.data)} != 12")
                info.size, info.flags = struct.unpack(">QH", body)
            elif itype == INFO_NAME:
                info.name = body.decode()
            elif itype == INFO_DESCRIPTION:
                info.description = body.decode()
            elif itype == INFO_BLOCK_SIZE:
                if len(r.data) != 14:
                    raise ProtocolError(f"NBD_INFO_BLOCK_SIZE length {len(r.data)} != 14")
                info.block_size = struct.unpack(">III", body)
        final = replies[-1]
        if final.type == REP_ACK and INFO_EXPORT not in info.info_types:
            raise ProtocolError("successful INFO/GO without NBD_INFO_EXPORT")
        return info, final

    def go(self, name: str = "", infos=(INFO_BLOCK_SIZE,)) -> ExportInfo:
        info, final = self.info_or_go(OPT_GO, name, infos)
        if final.type != REP_ACK:
            raise ProtocolError(f"NBD_OPT_GO failed: {final.type:#x} {final.data!r}")
        return info

    def export_name(self, name: str = "") -> ExportInfo:
        """Old-style NBD_OPT_EXPORT_NAME: no reply header, just size+flags."""
        self.send_option(OPT_EXPORT_NAME, name.encode())
        size, flags = struct.unpack(">QH", self.recv_exact(10))
        if not self.no_zeroes:
            zeroes = self.recv_exact(124)
            if zeroes != bytes(124):
                raise ProtocolError("non-zero reserved bytes after NBD_OPT_EXPORT_NAME")
        return ExportInfo(size=size, flags=flags)

    def structured_reply(self) -> OptionReply:
        reply = self.option(OPT_STRUCTURED_REPLY)
        if reply.type == REP_ACK:
            self.structured = True
        return reply

    def extended_headers(self) -> OptionReply:
        reply = self.option(OPT_EXTENDED_HEADERS)
        if reply.type == REP_ACK:
            self.extended = True
            self.structured = True
        return reply

    @staticmethod
    def meta_context_data(name: str, queries: list[str]) -> bytes:
        n = name.encode()
        data = struct.pack(">I", len(n)) + n + struct.pack(">I", len(queries))
        for q in queries:
            qb = q.encode()
            data += struct.pack(">I", len(qb)) + qb
        return data

    def meta_context(self, option: int, name: str, queries: list[str]):
        """LIST/SET_META_CONTEXT -> ([(id, context name)], final reply)."""
        replies = self.option_replies(option, self.meta_context_data(name, queries))
        contexts = []
        for r in replies[:-1]:
            if r.type != REP_META_CONTEXT:
                raise ProtocolError(f"unexpected reply type {r.type:#x} to META_CONTEXT")
            (cid,) = struct.unpack(">I", r.data[:4])
            contexts.append((cid, r.data[4:].decode()))
        return contexts, replies[-1]

    # -- transmission ---------------------------------------------------------
    def new_cookie(self) -> int:
        cookie = self._next_cookie
        self._next_cookie += 1
        return cookie

    def send_request(
        self,
        cmd: int,
        offset: int = 0,
        length: int = 0,
        flags: int = 0,
        payload: bytes = b"",
        cookie: int | None = None,
        magic: int | None = None,
    ) -> int:
        if cookie is None:
            cookie = self.new_cookie()
        if self.extended:
            header = struct.pack(
                ">IHHQQQ", magic or EXTENDED_REQUEST_MAGIC, flags, cmd, cookie, offset, length
            )
        else:
            header = struct.pack(">IHHQQI", magic or REQUEST_MAGIC, flags, cmd, cookie, offset, length)
        self.send(header + payload)
        return cookie

    def recv_reply(self, read_length: int = 0) -> Reply:
        """Receive one whole reply.  read_length: for simple replies to a
        successful NBD_CMD_READ, how many data bytes follow."""
        (magic,) = struct.unpack(">I", self.recv_exact(4))
        if magic == SIMPLE_REPLY_MAGIC:
            if self.structured and read_length:
                raise ProtocolError("simple reply to a read after structured replies")
            if self.extended:
                raise ProtocolError("simple reply after extended headers were negotiated")
            error, cookie = struct.unpack(">IQ", self.recv_exact(12))
            data = self.recv_exact(read_length) if read_length and not error else b""
            return Reply(cookie, error, data)
        if magic not in (STRUCTURED_REPLY_MAGIC, EXTENDED_REPLY_MAGIC):
            raise ProtocolError(f"bad reply magic {magic:#x}")
        if not self.structured:
            raise ProtocolError("structured reply although none was negotiated")
        if (magic == EXTENDED_REPLY_MAGIC) != self.extended:
            raise ProtocolError(f"reply magic {magic:#x} does not match negotiated headers")
        reply = Reply(cookie=-1, error=0, kind="extended" if self.extended else "structured")
        while True:
            chunk = self._recv_chunk_body()
            if reply.cookie == -1:
                reply.cookie = chunk.cookie
            elif chunk.cookie != reply.cookie:
                raise ProtocolError("interleaved replies are not handled by this test client")
            reply.chunks.append(chunk)
            if chunk.type & 0x8000:
                (err,) = struct.unpack(">I", chunk.payload[:4])
                if err == 0:
                    raise ProtocolError("error chunk with error 0")
                reply.error = reply.error or err
            if chunk.flags & REPLY_FLAG_DONE:
                return reply
            (magic,) = struct.unpack(">I", self.recv_exact(4))
            expected = EXTENDED_REPLY_MAGIC if self.extended else STRUCTURED_REPLY_MAGIC
            if magic != expected:
                raise ProtocolError(f"bad chunk magic {magic:#x}")

    def _recv_chunk_body(self) -> Chunk:
        if self.extended:
            flags, ctype, cookie, offset, length = struct.unpack(">HHQQQ", self.recv_exact(28))
        else:
            flags, ctype, cookie, length = struct.unpack(">HHQI", self.recv_exact(16))
            offset = 0
        if length > (64 << 20):
            raise ProtocolError(f"chunk length {length} is unreasonable")
        return Chunk(flags, ctype, cookie, self.recv_exact(length), offset)

    def command(self, cmd: int, offset: int = 0, length: int = 0, flags: int = 0, payload=b"") -> Reply:
        cookie = self.send_request(cmd, offset, length, flags, payload)
        reply = self.recv_reply(length if cmd == CMD_READ else 0)
        if reply.cookie != cookie:
            raise ProtocolError(f"reply cookie {reply.cookie} != {cookie}")
        return reply

    def read(self, offset: int, length: int, flags: int = 0) -> Reply:
        """NBD_CMD_READ; reply.data is the reassembled data on success."""
        reply = self.command(CMD_READ, offset, length, flags)
        if reply.kind == "simple" or reply.error:
            return reply
        buf = bytearray(length)
        covered = 0
        for c in reply.chunks:
            if c.type == REPLY_TYPE_OFFSET_DATA:
                (off,) = struct.unpack(">Q", c.payload[:8])
                data = c.payload[8:]
                if not (offset <= off and off + len(data) <= offset + length):
                    raise ProtocolError("OFFSET_DATA chunk outside the request")
                buf[off - offset : off - offset + len(data)] = data
                covered += len(data)
            elif c.type == REPLY_TYPE_OFFSET_HOLE:
                off, size = struct.unpack(">QI", c.payload)
                if not (offset <= off and off + size <= offset + length) or size == 0:
                    raise ProtocolError("OFFSET_HOLE chunk outside the request")
                covered += size  # buf is already zero there
            elif c.type != REPLY_TYPE_NONE:
                raise ProtocolError(f"unexpected chunk type {c.type} in a read reply")
        if covered != length:
            raise ProtocolError(f"read reply covered {covered} of {length} bytes")
        reply.data = bytes(buf)
        return reply

    def write(self, offset: int, data: bytes, flags: int = 0) -> Reply:
        return self.command(CMD_WRITE, offset, len(data), flags, data)

    def disconnect(self) -> None:
        self.send_request(CMD_DISC)


def connect_and_go(address, name: str = "", structured: bool = True, timeout: float = 5.0) -> RawClient:
    """Convenience: handshake, optionally structured replies, then GO."""
    client = RawClient.connect(address, timeout)
    client.handshake()
    if structured:
        reply = client.structured_reply()
        if reply.type != REP_ACK:
            raise ProtocolError(f"NBD_OPT_STRUCTURED_REPLY failed: {reply.type:#x}")
    client.export = client.go(name)
    return client
