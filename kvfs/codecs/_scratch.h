/* Per-thread scratch buffers of the codec kernel (frames are ~1 MiB: reused, a fresh buffer per call would
 * cost a page fault per 4 KiB), freed when their thread exits: threads come and go (trio's thread cache lets
 * idle workers exit after 10 s), and each one that had decoded a frame used to leave ~1 MiB behind. */
#ifndef KVFS_SCRATCH_H
#define KVFS_SCRATCH_H
#include <stddef.h>
#include <stdint.h>

typedef struct { uint8_t *buf; size_t cap; } scratch_t;  /* declare as `static __thread scratch_t` */

/* At least n bytes of this thread's buffer *sc (contents not kept), or NULL when out of memory. */
uint8_t *scratch_reserve(scratch_t *sc, size_t n);

/* The planes buffer codec 4's versions share (_entropy.c: versions 1-2, _classes.c: version 3), and codec 5
 * (_entropy8.c): a frame is coded by one of them, so one buffer serves all. Kept here, below them all, so that
 * no codec file depends on another for it. At least n bytes, valid until this thread's next call; NULL when out of memory. */
__attribute__((visibility("hidden"))) uint8_t *kvec_scratch(size_t n);
#endif
