/* zcnbd-cat: copies an NBD export to standard output with many reads in flight, driven by
 * an event loop on zcnbd_fd() - the way QEMU-like programs use the library.
 *   cc zcnbd-cat.c $(pkg-config --cflags --libs zcnbd) -o zcnbd-cat
 *   ./zcnbd-cat nbd://localhost/ > disk.img */
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#include <zcnbd.h>

enum { DEPTH = 16, CHUNK = 1 << 20 };

struct slot {
  unsigned char *buf;
  uint64_t offset;
  size_t len;
  int busy;
};

static struct slot slots[DEPTH];
static int failed;

static void on_read(struct zcnbd *h, ssize_t ret, void *opaque) {
  (void)h;
  struct slot *s = opaque;
  s->busy = 0;
  if (ret < 0) {
    fprintf(stderr, "read at %llu: %s\n", (unsigned long long)s->offset, zcnbd_last_error());
    failed = 1;
  }
}

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: %s NBD-URI > output\n", argv[0]);
    return 2;
  }
  struct zcnbd *h = zcnbd_connect(argv[1], 1);
  if (!h) {
    fprintf(stderr, "%s\n", zcnbd_last_error());
    return 1;
  }
  uint64_t size = (uint64_t)zcnbd_size(h), next = 0, written = 0;
  for (int i = 0; i < DEPTH; i++) slots[i].buf = malloc(CHUNK);
  /* Reads complete in any order; output is written in order, so a slot whose data is next
   * is flushed to stdout and reused. */
  while (written < size && !failed) {
    for (int i = 0; i < DEPTH && next < size; i++) {
      if (slots[i].busy || slots[i].len) continue;
      size_t len = size - next < CHUNK ? (size_t)(size - next) : CHUNK;
      struct iovec v = {slots[i].buf, len};
      slots[i] = (struct slot){slots[i].buf, next, len, 1};
      if (zcnbd_preadv_async(h, &v, 1, next, on_read, &slots[i]) < 0) {
        fprintf(stderr, "%s\n", zcnbd_last_error());
        return 1;
      }
      next += len;
    }
    struct pollfd pfd = {.fd = zcnbd_fd(h), .events = POLLIN};
    poll(&pfd, 1, 1000);
    zcnbd_poll(h, 0);
    for (int progress = 1; progress;) {
      progress = 0;
      for (int i = 0; i < DEPTH; i++) {
        struct slot *s = &slots[i];
        if (!s->busy && s->len && s->offset == written) {
          if (fwrite(s->buf, 1, s->len, stdout) != s->len) return 1;
          written += s->len;
          s->len = 0;
          progress = 1;
        }
      }
    }
  }
  zcnbd_close(h);
  return failed;
}
