/* Codec 5 ("entropy8"): lossless coding of 1-byte floats (fp8 E4M3 / E5M2 KV caches) by block class.
 *
 * A byte x splits into its sign (x >> 7) and its 7-bit magnitude m = x & 0x7F (exponent and mantissa
 * together: E4M3 4 + 3 bits, E5M2 5 + 2). The magnitudes form blocks of 64; each block gets a *class*, its
 * mean magnitude rounded to steps of 3 (3/8 of an octave in E4M3, 3/4 in E5M2), and the magnitudes of all
 * blocks of one class are Huffman-coded together by zstd's huff0 with one table. In channel-major KV (the
 * connector's chunks: a channel's tokens contiguous) a block is one channel's run of tokens, whose values
 * share a magnitude: the class tables are much sharper than one per frame (real-derived E4M3 KV: 5.3 bits per
 * magnitude against 5.85). Exponent and mantissa are one symbol: within an octave small mantissas are more
 * likely, and a subnormal's "mantissa" is a magnitude of its own. The class sequence is sent, so decoding
 * needs no context and the symbol loop is huff0's. Classes with few blocks cost more table than they save: a
 * level holding fewer than MIN_CLASS_BYTES magnitudes joins the nearest kept level.
 *
 * Signs: one bit per element, 8 per byte, either as they are or as the XOR of each sign with the one before
 * (a channel's signs persist, and RoPE'd K channels alternate: XOR turns both into runs of equal bits; the
 * encoder picks the plane whose bytes have the smaller order-0 entropy, measured on a quarter of them). The
 * sign bytes of each block are huff0-coded in SIGN_GROUPS groups of classes: large channels (outliers,
 * offsets) keep their sign, small ones flip, so a table per range of levels is sharper (0.0012-0.0035 of
 * stored/raw).
 *
 * Optionally the k lowest magnitude bits are stored raw as bit planes (k = 0..3: shorter codes, so a faster
 * huff0 decode; kvfs writes k = 0, the smallest). Byte-level format: docs/format.md ("codec 5"). Sections
 * (pieces of raw / repeated / huff0 bytes) are codec 4 version 3's, in _sections.c. STEP, MIN_CLASS_BYTES and
 * SIGN_GROUPS are the encoder's choices (any value in range decodes), overridable with -D for experiments.
 *
 * Safety: kf8_decode checks every size before it reads or writes, every class id against the class count,
 * every decoded magnitude against 7 - k bits and the unused bits of the bit planes; any inconsistency
 * returns a negative code (the output is then garbage). Loaded with ctypes (kvfs/codecs/entropy8.py), which
 * releases the GIL.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_planes.h"
#include "_scratch.h"
#include "_sections.h"

#define K8_VERSION 1
#define K8_HEADER 16
#define BLOCK_LOG 6
#define BLOCK (1 << BLOCK_LOG)   /* magnitudes per class block */
#ifndef STEP
#define STEP 3                   /* class = round(mean magnitude / STEP): 0..42 */
#endif
#define MAX_CLASSES 64
#ifndef MIN_CLASS_BYTES
#define MIN_CLASS_BYTES 1024     /* a class with fewer magnitudes joins its nearest neighbour */
#endif
#define FLAG_SIGN_XOR 1
#ifndef SIGN_GROUPS
#define SIGN_GROUPS 4            /* sign planes coded in this many groups of classes */
#endif
#define MAX_SIGN_GROUPS 7        /* group bounds fill header bytes 10..15 */
_Static_assert(SIGN_GROUPS >= 1 && SIGN_GROUPS <= MAX_SIGN_GROUPS, "1..7 sign groups");
_Static_assert(STEP >= 2 && 128 / STEP + 1 <= MAX_CLASSES, "at most 64 levels");
#define MAX_LOW_BITS 3           /* magnitude bits stored raw, as bit planes */
#define DEFAULT_LOW_BITS 0

enum { ERR_CAPACITY = -1, ERR_FORMAT = -2, ERR_STREAM = -3, ERR_ARGS = -4, ERR_NOMEM = -5 };

/* ---- encoder ---- */

/* The coded part of each magnitude (m >> k), the sign bits and the k low-bit planes (bit j of byte b: element
 * 8b + j; unused bits of the last byte 0; plane p at low + p * ceil(n/8) holds bit p of each magnitude), and
 * the magnitude sum of each block. */
static void split8(const uint8_t *restrict src, size_t n, unsigned k, uint8_t *restrict mag, uint8_t *restrict sg,
                   uint8_t *restrict low, uint32_t *restrict sums) {
    const size_t nb = (n + BLOCK - 1) / BLOCK, len8 = (n + 7) / 8;
    memset(sums, 0, nb * sizeof *sums);
    memset(sg, 0, len8);
    memset(low, 0, k * len8);
    size_t i = 0;
#ifdef KVEC_SIMD
    const __m128i seven = _mm_set1_epi8(0x7F), zero = _mm_setzero_si128();
    const __m128i keep = _mm_set1_epi8((char)(0x7F >> k));
    const __m128i count = _mm_cvtsi32_si128((int)k);
    for (; i + 16 <= n; i += 16) {
        __builtin_prefetch(src + i + 2048);
        const __m128i v = _mm_loadu_si128((const __m128i *)(src + i));
        const __m128i m = _mm_and_si128(v, seven);
        _mm_storeu_si128((__m128i *)(mag + i), _mm_and_si128(_mm_srl_epi16(m, count), keep));
        const uint32_t signs = (uint32_t)_mm_movemask_epi8(v);
        sg[i / 8] = (uint8_t)signs;
        sg[i / 8 + 1] = (uint8_t)(signs >> 8);
        for (unsigned p = 0; p < k; p++) {
            const uint32_t bits = (uint32_t)_mm_movemask_epi8(_mm_sll_epi16(m, _mm_cvtsi32_si128((int)(7 - p))));
            low[p * len8 + i / 8] = (uint8_t)bits;
            low[p * len8 + i / 8 + 1] = (uint8_t)(bits >> 8);
        }
        const __m128i sad = _mm_sad_epu8(m, zero);
        sums[i / BLOCK] += (uint32_t)(_mm_cvtsi128_si32(sad) + _mm_extract_epi16(sad, 4));
    }
#endif
    for (; i < n; i++) {
        const unsigned m = src[i] & 0x7F;
        mag[i] = (uint8_t)(m >> k);
        sums[i / BLOCK] += m;
        sg[i / 8] |= (uint8_t)((src[i] >> 7) << (i % 8));
        for (unsigned p = 0; p < k; p++) low[p * len8 + i / 8] |= (uint8_t)(((m >> p) & 1) << (i % 8));
    }
}

/* The plane of d[i] = sign[i] ^ sign[i - 1] (sign[-1] = 0), its unused bits 0. */
static void xor_signs(const uint8_t *sg, size_t n, uint8_t *out) {
    const size_t len = (n + 7) / 8;
    uint64_t carry = 0;
    size_t i = 0;
    for (; i + 8 <= len; i += 8) {
        uint64_t w;
        memcpy(&w, sg + i, 8);
        const uint64_t d = w ^ (w << 1 | carry);
        carry = w >> 63;
        memcpy(out + i, &d, 8);
    }
    for (; i < len; i++) {
        const uint32_t b = sg[i];
        out[i] = (uint8_t)(b ^ ((b << 1) | (uint32_t)carry));
        carry = b >> 7;
    }
    if (n % 8) out[len - 1] &= (uint8_t)((1u << (n % 8)) - 1);
}

/* Order-0 cost of a byte plane in bits, up to a constant common to planes of one length: -sum c log2 c, over
 * runs of 256 bytes, one in every SAMPLE_EVERY (all of a plane shorter than that many runs). */
#ifndef SAMPLE_EVERY
#define SAMPLE_EVERY 4
#endif
static double plane_cost(const uint8_t *p, size_t len) {
    uint32_t h[4][256] = {{0}};  /* four histograms: no store-to-load stall on runs of one byte */
    const size_t every = len >= SAMPLE_EVERY * 256 * 16 ? SAMPLE_EVERY * 256 : 256;
    for (size_t a = 0; a < len; a += every) {
        const size_t b = a + 256 < len ? a + 256 : len;
        size_t i = a;
        for (; i + 4 <= b; i += 4) h[0][p[i]]++, h[1][p[i + 1]]++, h[2][p[i + 2]]++, h[3][p[i + 3]]++;
        for (; i < b; i++) h[0][p[i]]++;
    }
    double cost = 0;
    for (int v = 0; v < 256; v++) {
        const uint32_t c = h[0][v] + h[1][v] + h[2][v] + h[3][v];
        if (c) cost -= c * __builtin_log2(c);
    }
    return cost;
}

static inline size_t block_len(size_t t, size_t nb, size_t n) { return t + 1 < nb ? BLOCK : n - t * BLOCK; }
/* Bytes of block t in a plane of one bit per element (len8 bytes in all). */
static inline size_t sign_bytes(size_t t, size_t nb, size_t len8) {
    return t + 1 < nb ? BLOCK / 8 : len8 - t * (BLOCK / 8);
}

/* Block classes: level = round(mean / STEP); levels holding fewer than MIN_CLASS_BYTES magnitudes join the
 * nearest kept level (the lower on a tie); the most common level is always kept. Class ids follow the levels'
 * order, so neighbouring blocks' ids differ little (their deltas are coded). */
static unsigned classify8(const uint32_t *sums, size_t n, uint8_t *cls) {
    enum { LEVELS = 128 / STEP + 1 };
    const size_t nb = (n + BLOCK - 1) / BLOCK;
    size_t bytes[LEVELS] = {0};
    for (size_t t = 0; t < nb; t++) {
        const size_t len = block_len(t, nb, n);
        cls[t] = (uint8_t)((2 * sums[t] + STEP * len) / (2 * STEP * len));
        bytes[cls[t]] += len;
    }
    unsigned most = 0;
    for (unsigned v = 1; v < LEVELS; v++)
        if (bytes[v] > bytes[most]) most = v;
    uint8_t keep[LEVELS], id_of[LEVELS];
    unsigned n_cls = 0;
    for (unsigned v = 0; v < LEVELS; v++) {
        keep[v] = v == most || bytes[v] >= MIN_CLASS_BYTES;
        if (keep[v]) id_of[v] = (uint8_t)n_cls++;
    }
    for (unsigned v = 0; v < LEVELS; v++) {
        if (keep[v] || !bytes[v]) continue;
        for (unsigned d = 1;; d++) {
            if (v >= d && keep[v - d]) { id_of[v] = id_of[v - d]; break; }
            if (v + d < LEVELS && keep[v + d]) { id_of[v] = id_of[v + d]; break; }
        }
    }
    for (size_t t = 0; t < nb; t++) cls[t] = id_of[cls[t]];
    return n_cls;
}

/* The payload of n bytes at src, at most cap bytes at dst, with k magnitude bits stored raw (0..3; -1: the
 * encoder's choice): its length, or ERR_CAPACITY when it does not fit (the caller stores the frame raw), or
 * another negative code. */
int64_t kf8_encode_k(const uint8_t *src, size_t n, uint8_t *dst, size_t cap, int k) {
    if (n == 0 || n > 0xFFFFFFFFu || k > MAX_LOW_BITS) return ERR_ARGS;
    if (k < 0) k = DEFAULT_LOW_BITS;
    const size_t nb = (n + BLOCK - 1) / BLOCK, len8 = (n + 7) / 8, low_len = (size_t)k * len8;
    if (cap < K8_HEADER + low_len) return ERR_CAPACITY;
    uint8_t *buf = kvec_scratch(nb * sizeof(uint32_t) + 2 * n + 3 * len8 + 2 * nb + 64);
    if (!buf) return ERR_NOMEM;
    uint32_t *sums = (uint32_t *)buf;
    uint8_t *mag = (uint8_t *)(sums + nb), *by_class = mag + n, *sg = by_class + n, *sx = sg + len8;
    uint8_t *cls = sx + len8, *deltas = cls + nb, *by_group = deltas + nb;

    split8(src, n, (unsigned)k, mag, sg, dst + K8_HEADER, sums);
    const unsigned n_cls = classify8(sums, n, cls);
    xor_signs(sg, n, sx);
    const int use_xor = plane_cost(sx, len8) < plane_cost(sg, len8);

    size_t start[MAX_CLASSES + 1] = {0}, fill[MAX_CLASSES];
    uint8_t prev = 0;
    for (size_t t = 0; t < nb; t++) {
        deltas[t] = (uint8_t)(cls[t] - prev);
        prev = cls[t];
        start[cls[t] + 1] += block_len(t, nb, n);
    }
    for (unsigned c = 0; c < n_cls; c++) start[c + 1] += start[c];
    memcpy(fill, start, sizeof fill);
    for (size_t t = 0; t + 1 < nb; t++) {
        memcpy(by_class + fill[cls[t]], mag + t * BLOCK, BLOCK);
        fill[cls[t]] += BLOCK;
    }
    memcpy(by_class + fill[cls[nb - 1]], mag + (nb - 1) * BLOCK, n - (nb - 1) * BLOCK);

    /* sign groups: runs of class ids (so of levels) holding about equal numbers of blocks */
    size_t blocks[MAX_CLASSES] = {0}, gstart[MAX_SIGN_GROUPS + 1] = {0};
    for (size_t t = 0; t < nb; t++) blocks[cls[t]]++;
    const unsigned n_sg = SIGN_GROUPS < n_cls ? SIGN_GROUPS : n_cls;
    uint8_t group_of[MAX_CLASSES], bounds[MAX_SIGN_GROUPS] = {0};
    size_t cum = 0;
    for (unsigned c = 0, g = 0; c < n_cls && c < MAX_CLASSES; c++) {
        group_of[c] = (uint8_t)g;
        cum += blocks[c];
        const unsigned groups_left = n_sg - 1 - g, classes_left = n_cls - 1 - c;
        if (groups_left && (classes_left == groups_left || cum * n_sg >= (g + 1) * nb)) bounds[++g] = (uint8_t)(c + 1);
    }
    const uint8_t *plane = use_xor ? sx : sg;
    for (size_t t = 0; t < nb; t++) gstart[group_of[cls[t]] + 1] += sign_bytes(t, nb, len8);
    for (unsigned g = 0; g < n_sg; g++) gstart[g + 1] += gstart[g];
    size_t gfill[MAX_SIGN_GROUPS];
    memcpy(gfill, gstart, sizeof gfill);
    for (size_t t = 0; t < nb; t++) {
        const size_t len = sign_bytes(t, nb, len8);
        memcpy(by_group + gfill[group_of[cls[t]]], plane + t * (BLOCK / 8), len);
        gfill[group_of[cls[t]]] += len;
    }

    memset(dst, 0, K8_HEADER);
    dst[0] = K8_VERSION;
    dst[1] = use_xor ? FLAG_SIGN_XOR : 0;
    dst[2] = BLOCK_LOG;
    dst[3] = (uint8_t)n_cls;
    put_u32(dst + 4, (uint32_t)n);
    dst[8] = (uint8_t)k;
    dst[9] = (uint8_t)n_sg;
    for (unsigned g = 1; g < n_sg; g++) dst[9 + g] = bounds[g];
    size_t off = K8_HEADER + low_len;
    int64_t r = put_section(deltas, nb, dst + off, cap - off);
    for (unsigned c = 0; r >= 0 && c < n_cls; c++) {
        off += (size_t)r;
        r = put_section(by_class + start[c], start[c + 1] - start[c], dst + off, cap - off);
    }
    for (unsigned g = 0; r >= 0 && g < n_sg; g++) {
        off += (size_t)r;
        r = put_section(by_group + gstart[g], gstart[g + 1] - gstart[g], dst + off, cap - off);
    }
    if (r < 0) return r;
    return (int64_t)(off + (size_t)r);
}

int64_t kf8_encode(const uint8_t *src, size_t n, uint8_t *dst, size_t cap) {
    return kf8_encode_k(src, n, dst, cap, -1);
}

/* ---- decoder ---- */

/* Undo xor_signs in place: sign[i] = XOR of d[0..i] (a prefix XOR, 64 bits at a time). */
static void unxor_signs(uint8_t *sg, size_t len) {
    uint64_t carry = 0;
    size_t i = 0;
    for (; i + 8 <= len; i += 8) {
        uint64_t w;
        memcpy(&w, sg + i, 8);
        w ^= w << 1, w ^= w << 2, w ^= w << 4, w ^= w << 8, w ^= w << 16, w ^= w << 32;
        w ^= carry;
        carry = 0 - (w >> 63);
        memcpy(sg + i, &w, 8);
    }
    for (; i < len; i++) {
        uint32_t b = sg[i];
        b ^= b << 1, b ^= b << 2, b ^= b << 4;
        b = (b ^ (uint32_t)carry) & 0xFF;
        carry = 0 - (uint64_t)(b >> 7);
        sg[i] = (uint8_t)b;
    }
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(KVEC_NO_SIMD) && !defined(KV3_NO_AVX512)
#include <immintrin.h>
#define K8_AVX512 1
/* A block of 64: (coded part << k) | low bits | sign << 7; returns the coded parts' bits that do not fit. */
__attribute__((target("avx512f,avx512bw")))
static uint64_t join64_avx512(const uint8_t *restrict m, uint64_t signs, const uint8_t *restrict low, size_t len8,
                              unsigned k, uint8_t *restrict out) {
    __m512i v = _mm512_loadu_si512(m);
    const uint64_t big = _mm512_test_epi8_mask(v, _mm512_set1_epi8((char)(0xFF << (7 - k))));
    for (unsigned p = 0; p < k; p++) v = _mm512_add_epi8(v, v);
    for (unsigned p = 0; p < k; p++) {
        uint64_t bits;
        memcpy(&bits, low + p * len8, 8);
        v = _mm512_or_si512(v, _mm512_maskz_mov_epi8(bits, _mm512_set1_epi8((char)(1 << p))));
    }
    _mm512_storeu_si512(out, _mm512_or_si512(v, _mm512_maskz_mov_epi8(signs, _mm512_set1_epi8((char)0x80))));
    return big;
}
static int have_avx512bw;
__attribute__((constructor)) static void detect_avx512bw(void) {
    __builtin_cpu_init();
    have_avx512bw = __builtin_cpu_supports("avx512bw");
}
#endif

static inline unsigned bit_at(const uint8_t *plane, size_t j) { return (plane[j / 8] >> (j % 8)) & 1; }

/* Each block's magnitudes from its class's stream, joined with their low bits and signs. ERR_FORMAT when a
 * coded part does not fit in 7 - k bits. */
static int join8(const uint8_t *by_class, const size_t *start, const uint8_t *cls, const uint8_t *sg,
                 const uint8_t *low, unsigned k, size_t n, uint8_t *out) {
    const size_t nb = (n + BLOCK - 1) / BLOCK, len8 = (n + 7) / 8;
    size_t pos[MAX_CLASSES];
    memcpy(pos, start, sizeof pos);
    uint64_t bad = 0;
    size_t t = 0;
#ifdef K8_AVX512
    if (have_avx512bw) {
        for (; t + 1 < nb; t++) {  /* whole blocks; the last one (maybe short) below */
            __builtin_prefetch(out + t * BLOCK + 16 * BLOCK, 1);
            const uint8_t *m = by_class + pos[cls[t]];
            pos[cls[t]] += BLOCK;
            uint64_t signs;
            memcpy(&signs, sg + t * (BLOCK / 8), 8);
            bad |= join64_avx512(m, signs, low + t * (BLOCK / 8), len8, k, out + t * BLOCK);
        }
    }
#endif
    const uint8_t limit = (uint8_t)(0x7F >> k);
    for (; t < nb; t++) {
        const size_t a = t * BLOCK, len = block_len(t, nb, n);
        const uint8_t *m = by_class + pos[cls[t]];
        pos[cls[t]] += len;
        size_t i = 0;
#ifdef KVEC_SIMD
        const __m128i top = _mm_set1_epi8((char)0x80);
        __m128i most = _mm_setzero_si128();
        for (; i + 16 <= len; i += 16) {
            const size_t j = (a + i) / 8;
            __m128i v = _mm_loadu_si128((const __m128i *)(m + i));
            most = _mm_max_epu8(most, v);
            for (unsigned p = 0; p < k; p++) v = _mm_add_epi8(v, v);
            for (unsigned p = 0; p < k; p++) {
                const uint32_t bits = low[p * len8 + j] | (uint32_t)low[p * len8 + j + 1] << 8;
                v = _mm_or_si128(v, _mm_and_si128(bits_to_bytes(bits), _mm_set1_epi8((char)(1 << p))));
            }
            const uint32_t signs = sg[j] | (uint32_t)sg[j + 1] << 8;
            _mm_storeu_si128((__m128i *)(out + a + i), _mm_or_si128(v, _mm_and_si128(bits_to_bytes(signs), top)));
        }
        const __m128i lim = _mm_set1_epi8((char)limit);
        bad |= _mm_movemask_epi8(_mm_cmpeq_epi8(_mm_max_epu8(most, lim), lim)) != 0xFFFF;
#endif
        for (; i < len; i++) {
            const size_t j = a + i;
            unsigned x = m[i];
            bad |= x > limit;
            x <<= k;
            for (unsigned p = 0; p < k; p++) x |= bit_at(low + p * len8, j) << p;
            out[j] = (uint8_t)(x | bit_at(sg, j) << 7);
        }
    }
    return bad ? ERR_FORMAT : 0;
}

/* Decode a payload into exactly n bytes at dst. 0, or a negative code. */
int kf8_decode(const uint8_t *src, size_t src_len, uint8_t *dst, size_t n_bytes) {
    if (src_len < K8_HEADER) return ERR_FORMAT;
    const size_t n = get_u32(src + 4), nb = (n + BLOCK - 1) / BLOCK, len8 = (n + 7) / 8;
    const unsigned n_cls = src[3], flags = src[1], k = src[8], n_sg = src[9];
    if (src[0] != K8_VERSION || (flags & ~FLAG_SIGN_XOR) || src[2] != BLOCK_LOG || n_cls < 1 || n_cls > MAX_CLASSES ||
        n == 0 || n != n_bytes || k > MAX_LOW_BITS || n_sg < 1 || n_sg > MAX_SIGN_GROUPS || n_sg > n_cls)
        return ERR_FORMAT;
    uint8_t group_of[MAX_CLASSES];
    for (unsigned c = 0, g = 0, i = 10; i < K8_HEADER; i++) {  /* group bounds, increasing; then zeros */
        const unsigned b = src[i];
        if (i - 9 < n_sg) {
            if (b <= c || b >= n_cls) return ERR_FORMAT;
            for (; c < b; c++) group_of[c] = (uint8_t)g;
            g++;
        } else if (b) {
            return ERR_FORMAT;
        }
        if (i + 1 == K8_HEADER)
            for (; c < n_cls; c++) group_of[c] = (uint8_t)g;
    }
    size_t off = K8_HEADER + k * len8;
    if (off > src_len) return ERR_FORMAT;
    const uint8_t *low = src + K8_HEADER;
    for (unsigned p = 0; p < k && n % 8; p++)
        if (low[p * len8 + n / 8] >> (n % 8)) return ERR_FORMAT;  /* the unused bits are 0 */
    uint8_t *buf = kvec_scratch(n + 2 * len8 + nb + 16);
    if (!buf) return ERR_NOMEM;
    uint8_t *by_class = buf, *sg = by_class + n, *by_group = sg + len8, *cls = by_group + len8;

    int64_t r = get_section(src + off, src_len - off, cls, nb);
    if (r < 0) return (int)r;
    off += (size_t)r;
    size_t start[MAX_CLASSES + 1] = {0}, gstart[MAX_SIGN_GROUPS + 1] = {0};
    uint8_t c = 0;
    for (size_t t = 0; t < nb; t++) {
        c = cls[t] = (uint8_t)(c + cls[t]);
        if (c >= n_cls) return ERR_FORMAT;
        start[c + 1] += block_len(t, nb, n);
        gstart[group_of[c] + 1] += sign_bytes(t, nb, len8);
    }
    for (unsigned q = 0; q < n_cls; q++) {  /* every class holds a block: the encoder's n_cls, no more */
        if (start[q + 1] == 0) return ERR_FORMAT;
        start[q + 1] += start[q];
    }
    for (unsigned g = 0; g < n_sg; g++) gstart[g + 1] += gstart[g];
    for (unsigned q = 0; q < n_cls; q++) {
        r = get_section(src + off, src_len - off, by_class + start[q], start[q + 1] - start[q]);
        if (r < 0) return (int)r;
        off += (size_t)r;
    }
    for (unsigned g = 0; g < n_sg; g++) {
        r = get_section(src + off, src_len - off, by_group + gstart[g], gstart[g + 1] - gstart[g]);
        if (r < 0) return (int)r;
        off += (size_t)r;
    }
    if (off != src_len) return ERR_FORMAT;
    for (size_t t = 0; t < nb; t++) {  /* the sign plane in element order */
        const size_t len = sign_bytes(t, nb, len8);
        memcpy(sg + t * (BLOCK / 8), by_group + gstart[group_of[cls[t]]], len);
        gstart[group_of[cls[t]]] += len;
    }
    if (n % 8 && sg[n / 8] >> (n % 8)) return ERR_FORMAT;  /* the unused sign bits are 0 */
    if (flags & FLAG_SIGN_XOR) unxor_signs(sg, len8);
    return join8(by_class, start, cls, sg, low, k, n, dst);
}
