/* Encode frames of a kvfs object (docs/format.md) in C, as kvfs/format.py's encode_frame does with a policy's
 * codec and transform (kvfs/openfile.py EncodingPolicy), and choose that codec from a frame's sample as
 * EncodingPolicy._choose does. The native front end's writers (kvfs/frontend/_loop.c) get these functions'
 * addresses from the loaded kernel (set_writer): one copy of the coders, with the libzstd kernel.py handed over.
 *
 * - kvfs_encode_frame: an all-zero frame is a hole; otherwise the raw xxh3, the transform (byteplane2 for zstd),
 *   the codec; a payload not smaller than the raw bytes means the frame is stored raw (its payload is the raw
 *   bytes themselves: nothing is written to dst). The same output capacity as the Python wrappers (entropy.py,
 *   entropy8.py), so a payload is kept exactly when Python would keep it.
 * - kvfs_choose: the sample (SAMPLE_BYTES in SAMPLE_PIECES element-aligned pieces, openfile._sample) coded by
 *   each candidate; the smallest wins (the first of equals); with `auto`, a sample no candidate shrinks below
 *   INCOMPRESSIBLE of its size is stored raw (-1).
 *
 * zstd frames are written with the parameters of codecs.ZstdCodec (fast strategy, window 2^17, hash and chain
 * 2^8, search 1, min match 7), through the system libzstd whose compression functions kernel.py hands over
 * (kvfs_use_zstd_compress); without them a zstd candidate cannot be encoded here (KVFS_ENC_UNSUPPORTED).
 */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_scratch.h"

int64_t kvec_encode_version(const uint8_t *src, size_t n_bytes, int stride, int window_log, uint8_t *dst, size_t cap,
                            int version);
int64_t kf8_encode_k(const uint8_t *src, size_t n, uint8_t *dst, size_t cap, int k);
unsigned long long kvfs_xxh3_64(const void *data, size_t len);

enum { CODEC_NONE = 0, CODEC_ZSTD = 1, CODEC_ENTROPY = 4, CODEC_ENTROPY8 = 5, TRANSFORM_IDENTITY = 0,
       TRANSFORM_BYTEPLANE2 = 1, FRAME_HOLE = 1 };
/* results (-1 is kvfs_choose's "stored raw") */
enum { KVFS_ENC_OK = 0, KVFS_ENC_UNSUPPORTED = -2, KVFS_ENC_NOMEM = -3, KVFS_ENC_CODEC = -4, KVFS_ENC_ARGS = -5 };

#define ENTROPY_WINDOW_LOG 4                               /* entropy.py WINDOW_LOG */
#define ENTROPY_OVERHEAD (16 + 8 * 8 + 64 * 130 + 72 + 16)  /* entropy.py OVERHEAD */
#define ENTROPY8_OVERHEAD (16 + 4 * 66 + 4 * 16)           /* entropy8.py OVERHEAD */
#define SAMPLE_BYTES (64 << 10)                            /* openfile.py SAMPLE_BYTES, SAMPLE_PIECES */
#define SAMPLE_PIECES 4
#define INCOMPRESSIBLE 0.98

/* what a frame-table entry holds, but its offset (the object's layout assigns it) */
typedef struct {
    uint32_t stored_len, raw_len;
    uint8_t codec, transform;
    uint16_t flags;
    uint64_t stored_xxh3, raw_xxh3;
} kvfs_frame_t;

/* ---- zstd through the system libzstd (kernel.py hands its functions over) ---------------------------------- */

typedef void *(*zstd_create_fn)(void);
typedef size_t (*zstd_free_fn)(void *);
typedef size_t (*zstd_set_fn)(void *, int, int);
typedef size_t (*zstd_compress2_fn)(void *, void *, size_t, const void *, size_t);
typedef unsigned (*zstd_is_error_fn)(size_t);
static struct {
    zstd_create_fn create;
    zstd_free_fn free_;
    zstd_set_fn set;
    zstd_compress2_fn compress2;
    zstd_is_error_fn is_error;
} Z;
/* ZSTD_cParameter values (zstd.h, stable API) and ZSTD_fast */
enum { ZSTD_c_windowLog = 101, ZSTD_c_hashLog = 102, ZSTD_c_chainLog = 103, ZSTD_c_searchLog = 104,
       ZSTD_c_minMatch = 105, ZSTD_c_targetLength = 106, ZSTD_c_strategy = 107, ZSTD_fast = 1 };

void kvfs_use_zstd_compress(void *create, void *free_, void *set, void *compress2, void *is_error) {
    Z.create = (zstd_create_fn)create;
    Z.free_ = (zstd_free_fn)free_;
    Z.set = (zstd_set_fn)set;
    Z.compress2 = (zstd_compress2_fn)compress2;
    Z.is_error = (zstd_is_error_fn)is_error;
}

int kvfs_zstd_compress_ready(void) { return Z.create && Z.free_ && Z.set && Z.compress2 && Z.is_error; }

static pthread_key_t cctx_key;
static pthread_once_t cctx_once = PTHREAD_ONCE_INIT;
static int have_cctx_key;
static void cctx_free(void *c) {
    if (c && Z.free_)
        Z.free_(c);
}
static void cctx_key_make(void) { have_cctx_key = pthread_key_create(&cctx_key, cctx_free) == 0; }

/* this thread's compression context with ZstdCodec's parameters (freed when the thread exits) */
static void *cctx_get(void) {
    if (!kvfs_zstd_compress_ready())
        return NULL;
    pthread_once(&cctx_once, cctx_key_make);
    if (!have_cctx_key)
        return NULL;
    void *c = pthread_getspecific(cctx_key);
    if (c)
        return c;
    c = Z.create();
    if (c == NULL)
        return NULL;
    static const int params[][2] = {{ZSTD_c_windowLog, 17}, {ZSTD_c_hashLog, 8}, {ZSTD_c_chainLog, 8},
                                    {ZSTD_c_searchLog, 1}, {ZSTD_c_minMatch, 7}, {ZSTD_c_targetLength, 0},
                                    {ZSTD_c_strategy, ZSTD_fast}};
    for (size_t i = 0; i < sizeof(params) / sizeof(params[0]); i++) {
        if (Z.is_error(Z.set(c, params[i][0], params[i][1]))) {
            Z.free_(c);
            return NULL;
        }
    }
    if (pthread_setspecific(cctx_key, c) != 0) {
        Z.free_(c);
        return NULL;
    }
    return c;
}

/* ---- coding ------------------------------------------------------------------------------------------------ */

static __thread scratch_t planes_buf, sample_buf, trial_buf;  /* _scratch.h: reused, freed when the thread exits */

static void byteplane2(const uint8_t *raw, size_t n, uint8_t *out) {
    size_t half = n / 2;  /* high bytes first, then low bytes (transforms.py) */
    for (size_t i = 0; i < half; i++) {
        out[i] = raw[2 * i + 1];
        out[half + i] = raw[2 * i];
    }
    if (n % 2)
        out[n - 1] = raw[n - 1];
}

/* what the codec's Python wrapper gives its coder as output capacity */
static size_t capacity_for(int codec, size_t n) {
    return n + (codec == CODEC_ENTROPY8 ? ENTROPY8_OVERHEAD : ENTROPY_OVERHEAD);
}

size_t kvfs_encode_bound(size_t n) { return n + ENTROPY_OVERHEAD; }

/* Code src[0, n) (already transformed) with a codec into dst (capacity cap). The payload size, which the caller
 * keeps only when below n; n when the coder found nothing smaller (a result that would not fit); a negative
 * KVFS_ENC_* on failure. */
static int64_t code(int codec, int param, const uint8_t *src, size_t n, uint8_t *dst, size_t cap) {
    int64_t size;
    if (codec == CODEC_ENTROPY) {
        size = kvec_encode_version(src, n, param > 0 ? param : 1, ENTROPY_WINDOW_LOG, dst, cap, 0);
        if (size == -1)
            return (int64_t)n;
        return size < 0 ? KVFS_ENC_CODEC : size;
    }
    if (codec == CODEC_ENTROPY8) {
        if (n == 0)
            return 0;
        size = kf8_encode_k(src, n, dst, cap, -1);
        if (size == -1)
            return (int64_t)n;
        return size < 0 ? KVFS_ENC_CODEC : size;
    }
    if (codec == CODEC_ZSTD) {
        void *c = cctx_get();
        if (c == NULL)
            return kvfs_zstd_compress_ready() ? KVFS_ENC_NOMEM : KVFS_ENC_UNSUPPORTED;
        size_t r = Z.compress2(c, dst, cap, src, n);
        if (Z.is_error(r))
            return (int64_t)n;  /* dstSize_tooSmall: larger than the capacity, so larger than raw */
        return (int64_t)r;
    }
    if (codec == CODEC_NONE)
        return (int64_t)n;
    return KVFS_ENC_UNSUPPORTED;
}

static int supported(int codec, int transform) {
    if (codec == CODEC_ENTROPY || codec == CODEC_ENTROPY8 || codec == CODEC_NONE)
        return transform == TRANSFORM_IDENTITY;
    if (codec == CODEC_ZSTD)
        return kvfs_zstd_compress_ready() && (transform == TRANSFORM_IDENTITY || transform == TRANSFORM_BYTEPLANE2);
    return 0;
}

/* 1 when kvfs_encode_frame encodes frames of (codec, transform) */
int kvfs_encode_supported(int codec, int transform) { return supported(codec, transform); }

static int all_zero(const uint8_t *p, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, p + i, 8);
        if (w)
            return 0;
    }
    for (; i < n; i++)
        if (p[i])
            return 0;
    return 1;
}

/* Encode raw[0, n) with (codec, transform, param: the entropy coder's channel stride) into dst (capacity cap, at
 * least kvfs_encode_bound(n)). Returns 0 with *f filled: a hole (flags FRAME_HOLE, no payload), a frame stored
 * raw (codec 0: its payload is raw itself, dst untouched) or a coded one (its payload in dst[0, stored_len)).
 * Otherwise a negative KVFS_ENC_*. */
int kvfs_encode_frame(const uint8_t *raw, size_t n, int codec, int transform, int param, uint8_t *dst, size_t cap,
                      kvfs_frame_t *f) {
    memset(f, 0, sizeof(*f));
    if (n > UINT32_MAX || cap < kvfs_encode_bound(n))
        return KVFS_ENC_ARGS;
    if (!supported(codec, transform))
        return KVFS_ENC_UNSUPPORTED;
    f->raw_len = (uint32_t)n;
    if (n == 0 || all_zero(raw, n)) {
        f->flags = FRAME_HOLE;
        return KVFS_ENC_OK;
    }
    uint64_t raw_hash = kvfs_xxh3_64(raw, n);
    if (codec != CODEC_NONE) {
        const uint8_t *src = raw;
        if (transform == TRANSFORM_BYTEPLANE2) {
            uint8_t *planes = scratch_reserve(&planes_buf, n);
            if (planes == NULL)
                return KVFS_ENC_NOMEM;
            byteplane2(raw, n, planes);
            src = planes;
        }
        int64_t size = code(codec, param, src, n, dst, capacity_for(codec, n));
        if (size < 0)
            return (int)size;
        if ((uint64_t)size < n) {
            f->stored_len = (uint32_t)size;
            f->codec = (uint8_t)codec;
            f->transform = (uint8_t)transform;
            f->stored_xxh3 = kvfs_xxh3_64(dst, (size_t)size);
            f->raw_xxh3 = raw_hash;
            return KVFS_ENC_OK;
        }
    }
    f->stored_len = (uint32_t)n;   /* stored raw */
    f->codec = CODEC_NONE;
    f->transform = TRANSFORM_IDENTITY;
    f->stored_xxh3 = f->raw_xxh3 = raw_hash;
    return KVFS_ENC_OK;
}

/* The candidate that codes the frame's sample smallest, as EncodingPolicy._choose: cands holds count triples
 * (codec, transform, param). -1: stored raw (`auto_mode` and no candidate below INCOMPRESSIBLE of the sample). A
 * candidate that fails to code counts as not shrinking; KVFS_ENC_UNSUPPORTED when one cannot be coded here, KVFS_ENC_NOMEM
 * without memory. */
int kvfs_choose(const uint8_t *raw, size_t n, const int32_t *cands, int count, int auto_mode) {
    if (count < 1)
        return KVFS_ENC_ARGS;
    for (int c = 0; c < count; c++)
        if (!supported(cands[3 * c], cands[3 * c + 1]))
            return KVFS_ENC_UNSUPPORTED;
    /* openfile._sample: SAMPLE_PIECES element-aligned pieces spread over the frame's even length */
    size_t n2 = n / 2 * 2, piece = SAMPLE_BYTES / SAMPLE_PIECES, starts[SAMPLE_PIECES];
    int n_starts = 0;
    for (int k = 0; k < SAMPLE_PIECES; k++) {
        size_t s = (n2 * (size_t)k / SAMPLE_PIECES) / 2 * 2;
        int dup = 0;
        for (int j = 0; j < n_starts; j++)
            dup |= starts[j] == s;
        if (!dup)
            starts[n_starts++] = s;   /* increasing in k: already sorted */
    }
    uint8_t *sample = scratch_reserve(&sample_buf, SAMPLE_BYTES);
    if (sample == NULL)
        return KVFS_ENC_NOMEM;
    size_t len = 0;
    for (int j = 0; j < n_starts; j++) {
        size_t end = starts[j] + piece < n2 ? starts[j] + piece : n2;
        size_t m = (end - starts[j]) / 2 * 2;
        memcpy(sample + len, raw + starts[j], m);
        len += m;
    }
    if (count == 1 || len < 512)
        return 0;
    uint8_t *trial = scratch_reserve(&trial_buf, kvfs_encode_bound(len) + len);
    if (trial == NULL)
        return KVFS_ENC_NOMEM;
    uint8_t *planes = trial + kvfs_encode_bound(len);
    int best = 0;
    int64_t best_size = 0;
    for (int c = 0; c < count; c++) {
        int codec = cands[3 * c], transform = cands[3 * c + 1], param = cands[3 * c + 2];
        const uint8_t *src = sample;
        if (transform == TRANSFORM_BYTEPLANE2) {
            byteplane2(sample, len, planes);
            src = planes;
        }
        int64_t size = codec == CODEC_ZSTD ? code(codec, param, src, len, trial, kvfs_encode_bound(len))
                                           : code(codec, param, src, len, trial, capacity_for(codec, len));
        if (size == KVFS_ENC_NOMEM || size == KVFS_ENC_UNSUPPORTED)
            return (int)size;
        if (size < 0 || (codec != CODEC_ZSTD && size > (int64_t)len))
            size = (int64_t)len;   /* the Python codecs hand back the input when coding does not shrink it */
        if (c == 0 || size < best_size) {
            best = c;
            best_size = size;
        }
    }
    if (auto_mode && (double)best_size > INCOMPRESSIBLE * (double)len)
        return -1;
    return best;
}
