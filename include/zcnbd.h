/* zcnbd.h: the C ABI of zcnbd's NBD client library (libzcnbd.so / libzcnbd.a).
 *
 * Reads land directly in the caller's buffers: reply data is received by the socket call
 * straight into the iovecs you pass (each structured OFFSET_DATA chunk at its offset, holes
 * zero-filled in place), and writes go out as the request header plus your iovecs in one
 * vectored send. Nothing is copied in userspace (see zcnbd_get_stats: copied_bytes).
 * Over TLS (nbds:// URIs) the same buffers are used, but read data is decrypted into them
 * rather than received (OpenSSL copies each record out of its own buffer; the counters'
 * received_in_place_bytes stays 0) and writes are encrypted from them.
 *
 * Link with `pkg-config --cflags --libs zcnbd`.
 *
 * Threading rules
 * - A handle is thread-safe: any thread may call any function on it, except zcnbd_close,
 *   which must be the last call and must not race with others.
 * - Callbacks run in the thread that calls zcnbd_poll, or a blocking call (zcnbd_preadv,
 *   zcnbd_pwritev, zcnbd_flush, zcnbd_trim, zcnbd_zero, zcnbd_block_status), or
 *   zcnbd_close - never in a thread of the library's own (it has none). No lock is held
 *   while a callback runs, so a callback may submit new requests; it must not call
 *   zcnbd_close.
 * - The memory an async request uses (the iovec array is copied at submission, the buffers
 *   it points to are not) belongs to the request until its callback runs: do not read a
 *   read's buffer, or change a write's buffer, before then.
 *
 * Errors: functions return -errno (or NULL); zcnbd_last_error() then gives a message for
 * the calling thread. Server errors map to their errno (EIO, ENOSPC, EPERM, EINVAL, ...);
 * a server that hangs up fails every request in flight with -ENOTCONN at once; a server
 * that sends a reply the NBD spec forbids is disconnected and requests fail with -EPROTO;
 * -EAGAIN from an async call means too many requests are in flight: poll, then retry.
 * zcnbd_connect returns NULL with errno set; for TLS: EACCES when TLS refused the
 * connection (the message says why: unknown CA, host name mismatch, the pre-shared keys
 * differ, no client certificate, ...), EOPNOTSUPP when the server does not offer TLS,
 * ECONNREFUSED when the server requires TLS and the URI is not nbds://, and the file's
 * errno (ENOENT, EACCES) or EINVAL when the credentials cannot be loaded.
 */
#ifndef ZCNBD_H
#define ZCNBD_H

#include <stdint.h>
#include <sys/types.h>
#include <sys/uio.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Write flag: the data is durable when the request completes (NBD_CMD_FLAG_FUA). */
#define ZCNBD_FUA 1u
/* Zero flag: keep the range allocated (NBD_CMD_FLAG_NO_HOLE). */
#define ZCNBD_NO_HOLE 2u
/* Zero flag: fail with -ENOTSUP unless zeroing is fast (NBD_CMD_FLAG_FAST_ZERO). */
#define ZCNBD_FAST_ZERO 4u
/* Most metadata contexts zcnbd_connect_meta asks for. */
#define ZCNBD_META_CONTEXTS_MAX 32

struct zcnbd;

/* Completion callback: ret is the byte count (or 0 for flush) on success, -errno on error. */
typedef void (*zcnbd_cb)(struct zcnbd *h, ssize_t ret, void *opaque);

/* Counters of one handle. */
struct zcnbd_stats {
  uint64_t requests;                /* operations submitted */
  uint64_t received_in_place_bytes; /* read data received straight into caller buffers
                                       (0 over TLS: decrypted into them instead) */
  uint64_t zeroed_bytes;            /* hole bytes zero-filled in caller buffers */
  uint64_t written_bytes;           /* write data sent from caller buffers */
  uint64_t copied_bytes;            /* read data copied in userspace: always 0 */
  uint64_t syscalls;                /* socket send/receive calls */
};

/* One extent of block status: `length` bytes with status `flags`, which mean what the
 * metadata context says (base:allocation: 1 hole, 2 reads as zeroes; qemu:dirty-bitmap:NAME:
 * 1 dirty; qemu:allocation-depth: the backing chain's layer holding the data, 0 none). */
struct zcnbd_extent {
  uint64_t length;
  uint64_t flags;
};

/* Connects to an NBD URI: nbd://host[:port]/export, nbd+unix:///export?socket=PATH or
 * nbd+vsock://CID[:port]/export (AF_VSOCK), or over TLS (required: no fallback to plain
 * text) nbds://host[:port]/export, nbds+unix:///export?socket=PATH or
 * nbds+vsock://CID[:port]/export, with libnbd's query keys: tls-certificates=DIR
 * (ca-cert.pem, and client-cert.pem + client-key.pem if the server wants a client
 * certificate; default $HOME/.pki/libnbd, then /etc/pki/libnbd, then the system's CAs),
 * tls-psk-file=FILE (psktool's username:hexkey lines; the URI's user part is the username,
 * as in nbds://alice@host/?tls-psk-file=keys.psk), tls-verify-peer=false (check neither
 * the CA nor the name), tls-hostname=NAME (the name the server's certificate must carry;
 * default the URI's host, localhost for a Unix or vsock socket). With connections > 1 and a server
 * that advertises multi-conn, requests are spread over that many connections (each one
 * under TLS). NULL on error, with errno set (see Errors above). */
struct zcnbd *zcnbd_connect(const char *uri, int connections);

/* As zcnbd_connect (which asks for base:allocation alone), asking for exactly the ncontexts
 * metadata contexts named in contexts (at most ZCNBD_META_CONTEXTS_MAX, each namespace:leaf,
 * at most 4096 bytes, none twice), e.g. "base:allocation", "qemu:allocation-depth",
 * "qemu:dirty-bitmap:NAME". A context the server does not have is no error: it is simply not
 * selected (see zcnbd_has_meta_context). NULL on error with errno set (EINVAL for a bad
 * list). contexts may be NULL when ncontexts is 0. */
struct zcnbd *zcnbd_connect_meta(const char *uri, int connections,
                                 const char *const *contexts, size_t ncontexts);

/* 1 if the server selected metadata context `name`, 0 if not, or -errno. */
int zcnbd_has_meta_context(struct zcnbd *h, const char *name);

/* The calling thread's last error message (valid until its next failing call). */
const char *zcnbd_last_error(void);

/* The export's size in bytes, or -errno. */
int64_t zcnbd_size(struct zcnbd *h);

/* Connections in use, or -errno. */
int zcnbd_connections(struct zcnbd *h);

/* Copies the handle's counters into *out. 0 or -errno. */
int zcnbd_get_stats(struct zcnbd *h, struct zcnbd_stats *out);

/* Asynchronous requests: 0 when submitted (cb will run exactly once), or -errno (cb will
 * not run). Offsets and lengths must be multiples of the server's minimum block size
 * (-EINVAL otherwise); requests beyond the maximum payload are split for you. */
int zcnbd_preadv_async(struct zcnbd *h, const struct iovec *iov, int iovcnt, uint64_t offset,
                       zcnbd_cb cb, void *opaque);
int zcnbd_pwritev_async(struct zcnbd *h, const struct iovec *iov, int iovcnt, uint64_t offset,
                        uint32_t flags /* ZCNBD_FUA */, zcnbd_cb cb, void *opaque);
int zcnbd_flush_async(struct zcnbd *h, zcnbd_cb cb, void *opaque);

/* Blocking requests: bytes transferred (all of them) or -errno. They run other requests'
 * callbacks while they wait. */
ssize_t zcnbd_preadv(struct zcnbd *h, const struct iovec *iov, int iovcnt, uint64_t offset);
ssize_t zcnbd_pwritev(struct zcnbd *h, const struct iovec *iov, int iovcnt, uint64_t offset,
                      uint32_t flags);
int zcnbd_flush(struct zcnbd *h);
int zcnbd_trim(struct zcnbd *h, uint64_t offset, uint64_t len, uint32_t flags);
int zcnbd_zero(struct zcnbd *h, uint64_t offset, uint64_t len, uint32_t flags);

/* Block status of metadata context `context` for len bytes at offset (one request; its
 * reply carries every selected context, and this one's is picked by its id): fills at most
 * nr_extents entries of `extents`, in order from offset, the last one cut at offset + len,
 * and returns how many it filled (at least 1 when len > 0), or -errno (-EOPNOTSUPP when the
 * context was not selected, -EINVAL for a range past the end or misaligned, or a NULL or
 * empty array). If covered is not NULL, *covered gets the bytes from offset the filled
 * entries describe: the server may describe less than len, so call again from
 * offset + *covered for the rest. */
ssize_t zcnbd_block_status(struct zcnbd *h, const char *context, uint64_t offset, uint64_t len,
                           struct zcnbd_extent *extents, size_t nr_extents, uint64_t *covered);

/* Holds submissions back until as many zcnbd_unplug calls (plugs nest): requests
 * submitted meanwhile leave together, in one socket call (one TLS record when they fit),
 * as the kernel's block layer plugs a task's I/O. A blocking call or zcnbd_poll still sends
 * what is held, so a plug held across a wait cannot stall its requests. 0 or -errno. */
int zcnbd_plug(struct zcnbd *h);

/* Ends one zcnbd_plug; the last sends what was held back. 0, or -EINVAL if not plugged. */
int zcnbd_unplug(struct zcnbd *h);

/* A descriptor that becomes readable when zcnbd_poll has work (replies arrived, or queued
 * output can move): add it to your event loop, then call zcnbd_poll(h, 0). */
int zcnbd_fd(struct zcnbd *h);

/* Runs the callbacks of finished requests. Waits up to timeout_ms for at least one
 * (-1: until one finishes or nothing is in flight; 0: no wait). Returns how many ran. */
int zcnbd_poll(struct zcnbd *h, int timeout_ms);

/* Disconnects and frees the handle; requests in flight fail with -ESHUTDOWN (their
 * callbacks run in this call). */
void zcnbd_close(struct zcnbd *h);

#ifdef __cplusplus
}
#endif

#endif /* ZCNBD_H */
