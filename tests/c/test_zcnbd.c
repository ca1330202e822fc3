/* The C ABI against a real server: test_zcnbd NBD-URI.
 * Built against the installed header and library (tests/c/run.sh), run against zcnbd,
 * nbdkit and qemu-nbd, and over TLS (an nbds+unix:// URI) against zcnbd and nbdkit.
 * Exits non-zero on the first failed check. */
#include <errno.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <zcnbd.h>

#define CHECK(cond)                                                                     \
  do {                                                                                  \
    if (!(cond)) {                                                                      \
      fprintf(stderr, "%s:%d: check failed: %s (last error: %s)\n", __FILE__, __LINE__, \
              #cond, zcnbd_last_error());                                               \
      exit(1);                                                                          \
    }                                                                                   \
  } while (0)

static void fill(unsigned char *p, size_t n, uint64_t seed) {
  uint64_t x = seed * 0x9e3779b97f4a7c15ull | 1;
  for (size_t i = 0; i < n; i++) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    p[i] = (unsigned char)x;
  }
}

struct pending {
  int done;
  ssize_t ret;
};

static int completed;
/* Set while this thread is inside a submitting call: no callback may run then. */
static int submitting;

static void on_done(struct zcnbd *h, ssize_t ret, void *opaque) {
  struct pending *p = opaque;
  (void)h;
  CHECK(!submitting);
  p->done = 1;
  p->ret = ret;
  completed++;
}

/* Runs an event loop on zcnbd_fd until `want` callbacks have run. */
static void loop_until(struct zcnbd *h, int want) {
  int fd = zcnbd_fd(h);
  CHECK(fd >= 0);
  while (completed < want) {
    struct pollfd pfd = {.fd = fd, .events = POLLIN};
    int r = poll(&pfd, 1, 5000);
    CHECK(r > 0); /* a 5 s silence means a hang */
    CHECK(zcnbd_poll(h, 0) >= 0);
  }
}

enum { BLOCK = 65536, COUNT = 32 };

int main(int argc, char **argv) {
  CHECK(argc == 2);
  int tls = strncmp(argv[1], "nbds", 4) == 0;
  /* A TLS failure: NULL, errno, and a message that says TLS and why. */
  errno = 0;
  CHECK(zcnbd_connect("nbds+unix:///?socket=/nonexistent&tls-psk-file=/nonexistent/k.psk", 1) ==
        NULL);
  CHECK(errno == ENOENT);
  CHECK(strstr(zcnbd_last_error(), "TLS") != NULL);
  errno = 0;
  CHECK(zcnbd_connect("nbd://", 1) == NULL && errno == EINVAL);

  struct zcnbd *h = zcnbd_connect(argv[1], 2);
  CHECK(h != NULL);
  int64_t size = zcnbd_size(h);
  CHECK(size >= 8 << 20);

  /* Blocking, vectored, odd iovec sizes on both sides. */
  size_t len = 1 << 20;
  unsigned char *data = malloc(len), *back = malloc(len);
  fill(data, len, 1);
  struct iovec w[3] = {{data, 1}, {data + 1, 4095}, {data + 4096, len - 4096}};
  CHECK(zcnbd_pwritev(h, w, 3, 0, 0) == (ssize_t)len);
  memset(back, 0xaa, len);
  struct iovec r[2] = {{back, 3}, {back + 3, len - 3}};
  CHECK(zcnbd_preadv(h, r, 2, 0) == (ssize_t)len);
  CHECK(memcmp(data, back, len) == 0);

  /* Asynchronous writes (FUA), a flush, then reads, driven by an event loop. */
  unsigned char *blocks = malloc((size_t)BLOCK * COUNT), *reads = calloc(COUNT, BLOCK);
  struct pending wp[COUNT], rp[COUNT], fp = {0};
  struct iovec wv[COUNT], rv[COUNT];
  fill(blocks, (size_t)BLOCK * COUNT, 2);
  memset(wp, 0, sizeof wp);
  memset(rp, 0, sizeof rp);
  completed = 0;
  for (int i = 0; i < COUNT; i++) {
    wv[i] = (struct iovec){blocks + (size_t)i * BLOCK, BLOCK};
    CHECK(zcnbd_pwritev_async(h, &wv[i], 1, (2u << 20) + (uint64_t)i * BLOCK, ZCNBD_FUA,
                              on_done, &wp[i]) == 0);
  }
  loop_until(h, COUNT);
  for (int i = 0; i < COUNT; i++) CHECK(wp[i].done && wp[i].ret == BLOCK);
  CHECK(zcnbd_flush_async(h, on_done, &fp) == 0);
  loop_until(h, COUNT + 1);
  CHECK(fp.done && fp.ret == 0);
  completed = 0;
  for (int i = 0; i < COUNT; i++) {
    rv[i] = (struct iovec){reads + (size_t)i * BLOCK, BLOCK};
    CHECK(zcnbd_preadv_async(h, &rv[i], 1, (2u << 20) + (uint64_t)i * BLOCK, on_done, &rp[i]) ==
          0);
  }
  loop_until(h, COUNT);
  for (int i = 0; i < COUNT; i++) CHECK(rp[i].done && rp[i].ret == BLOCK);
  CHECK(memcmp(blocks, reads, (size_t)BLOCK * COUNT) == 0);

  /* Zeroing, trimming, flushing. */
  CHECK(zcnbd_zero(h, 4096, 8192, 0) == 0);
  CHECK(zcnbd_preadv(h, r, 2, 0) == (ssize_t)len);
  for (size_t i = 4096; i < 12288; i++) CHECK(back[i] == 0);
  CHECK(back[0] == data[0] && back[12288] == data[12288]);
  CHECK(zcnbd_trim(h, 4 << 20, 65536, 0) == 0);
  CHECK(zcnbd_flush(h) == 0);

  /* Errors come back as -errno with a message. */
  struct iovec past = {back, 4096};
  CHECK(zcnbd_preadv(h, &past, 1, (uint64_t)size) == -EINVAL);
  CHECK(strlen(zcnbd_last_error()) > 0);
  CHECK(zcnbd_pwritev(h, w, 3, 0, 0x80) == -EINVAL);

  /* Every read byte went straight into our buffers (over TLS: was decrypted into them). */
  struct zcnbd_stats st;
  CHECK(zcnbd_get_stats(h, &st) == 0);
  CHECK(st.copied_bytes == 0);
  if (tls)
    CHECK(st.received_in_place_bytes == 0);
  else
    CHECK(st.received_in_place_bytes + st.zeroed_bytes >= 2 * len + (uint64_t)BLOCK * COUNT);

  /* Callbacks run only from zcnbd_poll: a reply already waiting in the socket when the
   * next request is submitted is not completed inside that submitting call. */
  completed = 0;
  rp[0].done = rp[1].done = 0;
  CHECK(zcnbd_preadv_async(h, &rv[0], 1, 0, on_done, &rp[0]) == 0);
  nanosleep(&(struct timespec){.tv_nsec = 100 * 1000 * 1000}, NULL);
  submitting = 1;
  CHECK(zcnbd_preadv_async(h, &rv[1], 1, BLOCK, on_done, &rp[1]) == 0);
  submitting = 0;
  CHECK(completed == 0);
  loop_until(h, 2);
  CHECK(rp[0].ret == BLOCK && rp[1].ret == BLOCK);

  /* Plugged, requests wait in the handle; unplugged, they leave in one socket call. */
  completed = 0;
  CHECK(zcnbd_unplug(h) == -EINVAL);
  CHECK(zcnbd_plug(h) == 0);
  CHECK(zcnbd_plug(h) == 0);
  struct zcnbd_stats before, after;
  CHECK(zcnbd_get_stats(h, &before) == 0);
  memset(reads, 0, 16 * (size_t)BLOCK);
  for (int i = 0; i < 16; i++) {
    rp[i].done = 0;
    CHECK(zcnbd_preadv_async(h, &rv[i], 1, (2u << 20) + (uint64_t)i * BLOCK, on_done, &rp[i]) ==
          0);
  }
  CHECK(zcnbd_get_stats(h, &after) == 0);
  CHECK(after.syscalls == before.syscalls);
  CHECK(zcnbd_unplug(h) == 0);
  CHECK(zcnbd_get_stats(h, &after) == 0);
  CHECK(after.syscalls == before.syscalls);
  CHECK(zcnbd_unplug(h) == 0);
  CHECK(zcnbd_get_stats(h, &after) == 0);
  /* One send per connection. */
  CHECK(after.syscalls > before.syscalls &&
        after.syscalls - before.syscalls <= (uint64_t)zcnbd_connections(h));
  loop_until(h, 16);
  for (int i = 0; i < 16; i++) CHECK(rp[i].ret == BLOCK);
  CHECK(memcmp(reads, blocks, 16 * (size_t)BLOCK) == 0);

  /* Closing with requests in flight fails them with -ESHUTDOWN (or they finished first). */
  completed = 0;
  for (int i = 0; i < COUNT; i++) {
    rp[i].done = 0;
    CHECK(zcnbd_preadv_async(h, &rv[i], 1, (uint64_t)i * BLOCK, on_done, &rp[i]) == 0);
  }
  zcnbd_close(h);
  CHECK(completed == COUNT);
  for (int i = 0; i < COUNT; i++) CHECK(rp[i].ret == BLOCK || rp[i].ret == -ESHUTDOWN);

  free(data);
  free(back);
  free(blocks);
  free(reads);
  printf("ok: %s\n", argv[1]);
  return 0;
}
