// splice_write_probe: how fast can a receiver move N bytes from a loopback TCP socket into a
// buffered file, with recv()+pwrite() (two copies) or splice() socket -> pipe -> file (one)?
// Plain blocking syscalls on one thread, no io_uring: the upper bound for what the server's
// socket -> pipe -> file write path can gain (docs/benchmarks/history.md, section 10).
//
//   gcc -O2 -o /tmp/splice_write_probe bench/splice_write_probe.c -lpthread
//   for bs in 4096 16384 65536 1048576; do for m in recv splice; do
//     /tmp/splice_write_probe $bs $((2<<30)) $m /var/tmp/probe.img; done; done
//
// Prints one line per run: MiB/s, the receiving thread's CPU seconds per GiB, syscalls per
// block. The file is 256 MiB and rewritten in a loop (the page cache absorbs it).
#define _GNU_SOURCE
#include <fcntl.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define FILE_BYTES (256UL << 20)
#define PIPE_BYTES (1 << 20)

static size_t block_bytes, total_bytes;
static int port;

static void die(const char *what) {
  perror(what);
  exit(1);
}

static void *sender(void *arg) {
  (void)arg;
  int s = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port),
                          .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  if (connect(s, (void *)&a, sizeof a)) die("connect");
  char *buf = malloc(block_bytes);
  if (!buf) die("malloc");
  memset(buf, 'x', block_bytes);
  for (size_t done = 0; done < total_bytes; done += block_bytes) {
    for (size_t off = 0; off < block_bytes;) {
      ssize_t n = send(s, buf + off, block_bytes - off, 0);
      if (n <= 0) die("send");
      off += n;
    }
  }
  close(s);
  free(buf);
  return NULL;
}

static double seconds(clockid_t clock) {
  struct timespec t;
  clock_gettime(clock, &t);
  return t.tv_sec + t.tv_nsec / 1e9;
}

int main(int argc, char **argv) {
  if (argc != 5 || (strcmp(argv[3], "recv") && strcmp(argv[3], "splice"))) {
    fprintf(stderr, "usage: %s BLOCK_BYTES TOTAL_BYTES recv|splice FILE\n", argv[0]);
    return 2;
  }
  block_bytes = strtoul(argv[1], 0, 0);
  total_bytes = strtoul(argv[2], 0, 0);
  int use_splice = !strcmp(argv[3], "splice");
  if (block_bytes == 0 || block_bytes > FILE_BYTES) {
    fprintf(stderr, "BLOCK_BYTES must be 1..%lu\n", FILE_BYTES);
    return 2;
  }
  int l = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t alen = sizeof a;
  if (bind(l, (void *)&a, sizeof a) || getsockname(l, (void *)&a, &alen) || listen(l, 1))
    die("listen");
  port = ntohs(a.sin_port);
  int f = open(argv[4], O_RDWR | O_CREAT, 0600);
  if (f < 0 || ftruncate(f, FILE_BYTES)) die(argv[4]);
  pthread_t t;
  pthread_create(&t, 0, sender, 0);
  int s = accept(l, 0, 0);
  int p[2];
  if (s < 0 || pipe(p)) die("accept/pipe");
  fcntl(p[1], F_SETPIPE_SZ, PIPE_BYTES);
  char *buf = aligned_alloc(4096, (block_bytes + 4095) / 4096 * 4096);
  if (!buf) die("aligned_alloc");
  double t0 = seconds(CLOCK_MONOTONIC), c0 = seconds(CLOCK_THREAD_CPUTIME_ID);
  size_t file_off = 0, calls = 0;
  for (size_t done = 0; done < total_bytes; done += block_bytes) {
    size_t at = file_off;
    file_off = (file_off + block_bytes) % (FILE_BYTES - FILE_BYTES % block_bytes);
    for (size_t got = 0; got < block_bytes;) {
      size_t want = block_bytes - got;
      if (!use_splice) {
        ssize_t n = recv(s, buf + got, want, MSG_WAITALL);
        if (n <= 0) die("recv");
        calls++;
        got += n;
        continue;
      }
      ssize_t n = splice(s, 0, p[1], 0, want < PIPE_BYTES ? want : PIPE_BYTES, SPLICE_F_MOVE);
      if (n <= 0) die("splice socket -> pipe");
      calls++;
      for (ssize_t out = 0; out < n;) {
        loff_t o = at + got + out;
        ssize_t m = splice(p[0], 0, f, &o, n - out, SPLICE_F_MOVE);
        if (m <= 0) die("splice pipe -> file");
        calls++;
        out += m;
      }
      got += n;
    }
    for (size_t w = 0; !use_splice && w < block_bytes;) {
      ssize_t n = pwrite(f, buf + w, block_bytes - w, at + w);
      if (n <= 0) die("pwrite");
      calls++;
      w += n;
    }
  }
  double secs = seconds(CLOCK_MONOTONIC) - t0, cpu = seconds(CLOCK_THREAD_CPUTIME_ID) - c0;
  pthread_join(t, 0);
  printf("%-6s bs=%-8zu %7.0f MiB/s  receiver CPU %.3f s/GiB  syscalls/block %.2f\n",
         argv[3], block_bytes, total_bytes / secs / 1048576, cpu / (total_bytes / 1073741824.0),
         (double)calls / (total_bytes / block_bytes));
  return 0;
}
