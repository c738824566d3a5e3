/* Read and decode a run of whole frames of a kvfs object (docs/format.md) in one call: for each frame, read
 * its payload, check its checksum, decode it into place, check the decoded bytes' checksum. Called through
 * ctypes from kvfs/direct.py, which releases the GIL for the whole run: a reader thread that decoded frame by
 * frame in Python held the GIL between the C calls, and eight such readers decoded at the speed of three.
 *
 * Frames this file does not decode (another codec or transform, or zstd when no libzstd was handed over)
 * stop the run with KVF_UNSUPPORTED and the frame's index: the caller decodes that one itself and goes on. */
#define _POSIX_C_SOURCE 200809L /* pread under -std=c11 */
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "_scratch.h"

int kvec_decode(const uint8_t *src, size_t src_len, uint8_t *dst, size_t n_bytes);
int kf8_decode(const uint8_t *src, size_t src_len, uint8_t *dst, size_t n_bytes);
unsigned long long kvfs_xxh3_64(const void *data, size_t len);

enum { KVF_ERR_IO = -1, KVF_ERR_SHORT = -2, KVF_ERR_PAYLOAD = -3, KVF_ERR_DECODE = -4, KVF_ERR_RAW = -5,
       KVF_UNSUPPORTED = -6, KVF_ERR_NOMEM = -7, KVF_ERR_ARGS = -8 };

/* codec and transform ids (kvfs/codecs/__init__.py, transforms.py) and the frame flag of a hole */
enum { CODEC_NONE = 0, CODEC_ZSTD = 1, CODEC_ENTROPY = 4, CODEC_ENTROPY8 = 5, TRANSFORM_IDENTITY = 0, TRANSFORM_BYTEPLANE2 = 1,
       FRAME_HOLE = 1 };
#define ENTRY_SIZE 36 /* FRAME_ENTRY "<QIIBBHQQ": offset, stored_len, raw_len, codec, transform, flags, 2 x xxh3 */

typedef struct {
    uint64_t offset, stored_xxh3, raw_xxh3;
    uint32_t stored_len, raw_len;
    uint8_t codec, transform;
    uint16_t flags;
} entry_t;

static entry_t parse_entry(const uint8_t *p) {  /* little-endian, as written (x86-64 and aarch64 are) */
    entry_t e;
    memcpy(&e.offset, p, 8);
    memcpy(&e.stored_len, p + 8, 4);
    memcpy(&e.raw_len, p + 12, 4);
    e.codec = p[16];
    e.transform = p[17];
    memcpy(&e.flags, p + 18, 2);
    memcpy(&e.stored_xxh3, p + 20, 8);
    memcpy(&e.raw_xxh3, p + 28, 8);
    return e;
}

/* ZSTD_decompress of the system's libzstd, handed over by kvfs/direct.py (none: zstd frames go back to it) */
typedef size_t (*zstd_decompress_fn)(void *dst, size_t cap, const void *src, size_t len);
static zstd_decompress_fn zstd_decompress;
void kvfs_use_zstd(void *fn) { zstd_decompress = (zstd_decompress_fn)fn; }

static __thread scratch_t payload_buf, planes_buf;  /* _scratch.h: reused, freed when the thread exits */

static int read_at(int fd, uint8_t *dst, size_t len, uint64_t offset) {
    while (len) {
        ssize_t n = pread(fd, dst, len, (off_t)offset);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0)
            return KVF_ERR_IO;
        if (n == 0)
            return KVF_ERR_SHORT;
        dst += n;
        len -= (size_t)n;
        offset += (uint64_t)n;
    }
    return 0;
}

static void byteplane2_invert(const uint8_t *planes, size_t n, uint8_t *dst) {
    size_t half = n / 2;  /* high bytes first, then low bytes (transforms.py) */
    for (size_t i = 0; i < half; i++) {
        dst[2 * i] = planes[half + i];
        dst[2 * i + 1] = planes[i];
    }
    if (n % 2)
        dst[n - 1] = planes[n - 1];
}

static int supported(const entry_t *e) {
    if (e->flags & FRAME_HOLE)
        return 1;
    if (e->codec == CODEC_NONE || e->codec == CODEC_ENTROPY || e->codec == CODEC_ENTROPY8)
        return e->transform == TRANSFORM_IDENTITY;
    if (e->codec == CODEC_ZSTD)
        return zstd_decompress && (e->transform == TRANSFORM_IDENTITY || e->transform == TRANSFORM_BYTEPLANE2);
    return 0;
}

static int decode_payload(const entry_t *e, const uint8_t *payload, uint8_t *dst) {
    if (e->codec == CODEC_ENTROPY)
        return kvec_decode(payload, e->stored_len, dst, e->raw_len) ? KVF_ERR_DECODE : 0;
    if (e->codec == CODEC_ENTROPY8)
        return kf8_decode(payload, e->stored_len, dst, e->raw_len) ? KVF_ERR_DECODE : 0;
    /* zstd: an error code (a huge size_t) never equals a frame's length */
    if (e->transform == TRANSFORM_IDENTITY)
        return zstd_decompress(dst, e->raw_len, payload, e->stored_len) == e->raw_len ? 0 : KVF_ERR_DECODE;
    uint8_t *planes = scratch_reserve(&planes_buf, e->raw_len);
    if (!planes)
        return KVF_ERR_NOMEM;
    if (zstd_decompress(planes, e->raw_len, payload, e->stored_len) != e->raw_len)
        return KVF_ERR_DECODE;
    byteplane2_invert(planes, e->raw_len, dst);
    return 0;
}

static int frame(int fd, const entry_t *e, uint8_t *dst) {
    if (e->flags & FRAME_HOLE) {
        memset(dst, 0, e->raw_len);
        return 0;
    }
    if (e->codec == CODEC_NONE) {  /* stored raw: read in place, one hash for both checksums */
        if (e->stored_len != e->raw_len)
            return KVF_ERR_PAYLOAD;
        int rc = read_at(fd, dst, e->raw_len, e->offset);
        if (rc)
            return rc;
        uint64_t h = kvfs_xxh3_64(dst, e->raw_len);
        return h == e->stored_xxh3 && h == e->raw_xxh3 ? 0 : KVF_ERR_PAYLOAD;
    }
    uint8_t *payload = scratch_reserve(&payload_buf, e->stored_len);
    if (!payload)
        return KVF_ERR_NOMEM;
    int rc = read_at(fd, payload, e->stored_len, e->offset);
    if (rc)
        return rc;
    if (kvfs_xxh3_64(payload, e->stored_len) != e->stored_xxh3)
        return KVF_ERR_PAYLOAD;  /* before any decoder sees the bytes */
    rc = decode_payload(e, payload, dst);
    if (rc)
        return rc;
    return kvfs_xxh3_64(dst, e->raw_len) == e->raw_xxh3 ? 0 : KVF_ERR_RAW;
}

/* Frames [0, count) of `table` (entries in the object's own format, already checked against the object's
 * size by the caller) decoded one after another into dst, which holds exactly their raw lengths. Returns 0,
 * or an error (KVF_*) with *at set to the frame's index; on an error dst holds garbage. errno is kept for
 * KVF_ERR_IO. */
int kvfs_read_frames(int fd, const uint8_t *table, size_t count, uint8_t *dst, size_t dst_len, int64_t *at) {
    size_t done = 0;
    for (size_t i = 0; i < count; i++) {
        entry_t e = parse_entry(table + i * ENTRY_SIZE);
        *at = (int64_t)i;
        if (e.raw_len > dst_len - done)
            return KVF_ERR_ARGS;
        if (!supported(&e))
            return KVF_UNSUPPORTED;
        int rc = frame(fd, &e, dst + done);
        if (rc)
            return rc;
        done += e.raw_len;
    }
    *at = (int64_t)count;
    return done == dst_len ? 0 : KVF_ERR_ARGS;
}
