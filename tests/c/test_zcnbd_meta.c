/* Metadata contexts through the C ABI against a real server:
 *   test_zcnbd_meta NBD-URI CONTEXT MAP-FILE
 * connects asking for base:allocation, CONTEXT and a bitmap no server has, checks which the
 * server selected, walks the whole export with zcnbd_block_status for CONTEXT (a small array,
 * so every call fills it and the next goes on from *covered) and compares the map with
 * MAP-FILE, `nbdinfo --map=CONTEXT` on the same server. Built and run by tests/c/run.sh
 * against qemu-nbd (-A -B b0) and zcnbd on a qcow2 chain with a dirty bitmap.
 * Exits non-zero on the first failed check. */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zcnbd.h>

#define CHECK(cond)                                                                     \
  do {                                                                                  \
    if (!(cond)) {                                                                      \
      fprintf(stderr, "%s:%d: check failed: %s (last error: %s)\n", __FILE__, __LINE__, \
              #cond, zcnbd_last_error());                                               \
      exit(1);                                                                          \
    }                                                                                   \
  } while (0)

enum { MAP_MAX = 4096 };

struct map {
  size_t n;
  uint64_t offset[MAP_MAX], length[MAP_MAX], flags[MAP_MAX];
};

/* Appends an extent, joined to the last one if it goes on with the same flags: servers and
 * nbdinfo may cut a map in different places without meaning anything different. */
static void add(struct map *m, uint64_t offset, uint64_t length, uint64_t flags) {
  if (m->n > 0 && m->flags[m->n - 1] == flags &&
      m->offset[m->n - 1] + m->length[m->n - 1] == offset) {
    m->length[m->n - 1] += length;
    return;
  }
  CHECK(m->n < MAP_MAX);
  m->offset[m->n] = offset;
  m->length[m->n] = length;
  m->flags[m->n] = flags;
  m->n++;
}

/* nbdinfo --map's lines: "offset length type description". */
static void read_map(const char *path, struct map *m) {
  FILE *f = fopen(path, "r");
  CHECK(f != NULL);
  char line[512];
  while (fgets(line, sizeof line, f)) {
    unsigned long long offset, length, flags;
    CHECK(sscanf(line, "%llu %llu %llu", &offset, &length, &flags) == 3);
    add(m, offset, length, flags);
  }
  fclose(f);
}

/* The client's map of `context`, in windows of `window` bytes, two extents a call. */
static void walk(struct zcnbd *h, const char *context, uint64_t window, struct map *m) {
  uint64_t size = (uint64_t)zcnbd_size(h), at = 0;
  while (at < size) {
    uint64_t len = size - at < window ? size - at : window, covered = UINT64_MAX;
    struct zcnbd_extent e[2];
    ssize_t n = zcnbd_block_status(h, context, at, len, e, 2, &covered);
    CHECK(n >= 1 && n <= 2);
    uint64_t sum = 0;
    for (ssize_t i = 0; i < n; i++) {
      CHECK(e[i].length > 0);
      add(m, at + sum, e[i].length, e[i].flags);
      sum += e[i].length;
    }
    CHECK(covered == sum && covered <= len);
    at += covered;
  }
}

static void same_map(const struct map *a, const struct map *b) {
  CHECK(a->n == b->n);
  for (size_t i = 0; i < a->n; i++)
    CHECK(a->offset[i] == b->offset[i] && a->length[i] == b->length[i] &&
          a->flags[i] == b->flags[i]);
}

static const char *absent = "qemu:dirty-bitmap:absent";

/* Refusals: bad lists at connect, bad arguments and unselected contexts afterwards. */
static void refusals(const char *uri, struct zcnbd *h) {
  const char *names[ZCNBD_META_CONTEXTS_MAX + 1];
  for (int i = 0; i <= ZCNBD_META_CONTEXTS_MAX; i++) names[i] = "base:allocation";
  errno = 0;
  CHECK(zcnbd_connect_meta(uri, 1, names, ZCNBD_META_CONTEXTS_MAX + 1) == NULL &&
        errno == EINVAL);
  const char *bad[] = {"no-namespace"};
  errno = 0;
  CHECK(zcnbd_connect_meta(uri, 1, bad, 1) == NULL && errno == EINVAL);
  errno = 0;
  CHECK(zcnbd_connect_meta(uri, 1, NULL, 1) == NULL && errno == EINVAL);

  struct zcnbd_extent e[4];
  uint64_t size = (uint64_t)zcnbd_size(h);
  CHECK(zcnbd_block_status(h, absent, 0, 4096, e, 4, NULL) == -EOPNOTSUPP);
  CHECK(zcnbd_block_status(h, NULL, 0, 4096, e, 4, NULL) == -EINVAL);
  CHECK(zcnbd_block_status(h, "base:allocation", 0, 4096, NULL, 4, NULL) == -EINVAL);
  CHECK(zcnbd_block_status(h, "base:allocation", 0, 4096, e, 0, NULL) == -EINVAL);
  CHECK(zcnbd_block_status(h, "base:allocation", size, 4096, e, 4, NULL) == -EINVAL);
  CHECK(zcnbd_block_status(NULL, "base:allocation", 0, 4096, e, 4, NULL) == -EINVAL);
  CHECK(zcnbd_has_meta_context(h, NULL) == -EINVAL);
  CHECK(zcnbd_has_meta_context(NULL, absent) == -EINVAL);
}

int main(int argc, char **argv) {
  CHECK(argc == 4);
  const char *uri = argv[1], *context = argv[2];
  struct map *expected = calloc(1, sizeof *expected), *got = calloc(1, sizeof *got);
  CHECK(expected && got);
  read_map(argv[3], expected);
  CHECK(expected->n > 0);

  /* An absent context is no error: it is simply not selected. */
  const char *names[] = {"base:allocation", context, absent};
  struct zcnbd *h = zcnbd_connect_meta(uri, 2, names, 3);
  CHECK(h != NULL);
  CHECK(zcnbd_has_meta_context(h, "base:allocation") == 1);
  CHECK(zcnbd_has_meta_context(h, context) == 1);
  CHECK(zcnbd_has_meta_context(h, absent) == 0);

  uint64_t windows[] = {UINT64_MAX, 3u << 20, 1000 * 1024};
  for (size_t i = 0; i < sizeof windows / sizeof windows[0]; i++) {
    got->n = 0;
    walk(h, context, windows[i], got);
    same_map(got, expected);
  }
  /* A range that ends inside the first extent: the one entry is cut at its end. */
  struct zcnbd_extent e[64];
  uint64_t covered = 0, len = 4096 + 512;
  CHECK(expected->length[0] > len);
  ssize_t n = zcnbd_block_status(h, context, 0, len, e, 64, &covered);
  CHECK(n == 1 && covered == len && e[0].length == len && e[0].flags == expected->flags[0]);
  refusals(uri, h);
  zcnbd_close(h);

  /* zcnbd_connect asks for base:allocation alone, as it always did. */
  h = zcnbd_connect(uri, 1);
  CHECK(h != NULL);
  CHECK(zcnbd_has_meta_context(h, "base:allocation") == 1);
  CHECK(zcnbd_has_meta_context(h, context) == 0);
  CHECK(zcnbd_block_status(h, context, 0, 4096, e, 64, NULL) == -EOPNOTSUPP);
  CHECK(zcnbd_block_status(h, "base:allocation", 0, 4096, e, 64, NULL) >= 1);
  zcnbd_close(h);

  /* No context at all. */
  h = zcnbd_connect_meta(uri, 1, NULL, 0);
  CHECK(h != NULL);
  CHECK(zcnbd_has_meta_context(h, "base:allocation") == 0);
  CHECK(zcnbd_block_status(h, "base:allocation", 0, 4096, e, 64, NULL) == -EOPNOTSUPP);
  zcnbd_close(h);

  printf("ok: %s %s (%zu extents)\n", uri, context, expected->n);
  free(expected);
  free(got);
  return 0;
}
