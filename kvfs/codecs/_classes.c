/* Codec 4, version 3 ("block classes"): 16-bit floats with the exponent bytes Huffman-coded by zstd's huff0.
 *
 * Each element x splits as in versions 1-2: e = (x >> 7) & 0xFF, sign = x >> 15, low = x & 0x7F. The frame's
 * elements form blocks of 64; each block gets a *class*, the rounded mean of its own exponents (in half
 * steps for bf16, whole steps when the means spread too far, as fp16's do), and the exponents of all blocks
 * of one class are coded together with one order-0 Huffman table. The class sequence is sent (as deltas,
 * ~0.3% of the raw size), so the decoder knows every table before it decodes a symbol: nothing depends on
 * earlier decoded values, and the symbol loop is huff0's 4-stream decoder (~1 cycle per symbol). Versions
 * 1-2 chose tables from the running mean of decoded exponents, which put a table lookup and the context
 * arithmetic on one serial chain (4.4 cycles per element). The class is the block's own mean, not an
 * estimate from the past, so the tables are as sharp: real bf16 KV stores at the same 0.656.
 *
 * Signs are packed 8 per byte and that plane is huff0-coded too (a channel's signs persist, so whole bytes
 * repeat in channel-major data); the 7 low bits are packed 16 elements to 14 bytes as in version 2.
 * Byte-level format: docs/format.md ("codec 4", version 3).
 *
 * Safety: kv3_decode checks every size before it reads or writes; huff0's decoder is bounds-checked (it is
 * zstd's, fuzzed as part of zstd). Any inconsistency returns a negative code, and so does a field that differs
 * from what kv3_encode writes where the decoder can tell cheaply (the header, n_cls = the classes the blocks
 * use, each piece's mode and size, the slack in huff0's table descriptions): a payload changed there is
 * refused, not decoded to the original bytes.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_classes.h"
#include "_planes.h"
#include "_scratch.h"
#include "_sections.h"

#define V3_HEADER 16
#define BLOCK 64                  /* elements per class block */
#define GROUP 16                  /* packed low bits: 16 elements -> 14 bytes */

enum { ERR_CAPACITY = -1, ERR_FORMAT = -2, ERR_STREAM = -3, ERR_NOMEM = -5 };

/* The low-bit section: 7 bits packed 16 to 14; 9 bits as a byte plane and a plane of bit 8. */
static size_t kv3_low_bytes(size_t n, unsigned w) { return w == 7 ? packed_low_bytes(n) : n + (n + 7) / 8; }

/* ---- encoder ---- */

/* e bytes, sign bytes (bit j of byte b: element 8b + j), low bits packed, and the exponent sum of each
 * block. `low` needs 2 bytes of slack. */
static void split(const uint8_t *src, size_t n, uint8_t *restrict e, uint8_t *restrict sg, uint8_t *restrict low,
                  uint32_t *restrict sums) {
    const u16_unaligned *x = (const u16_unaligned *)src;
    const size_t groups = n / GROUP;
    memset(sums, 0, (n + BLOCK - 1) / BLOCK * sizeof *sums);
    for (size_t k = 0; k < groups; k++) {
        const size_t i = k * GROUP;
        __builtin_prefetch(x + i + 1024);  /* 2 KiB ahead: +30% encode on cold frames in this VM */
        const uint32_t signs = split16(x + i, e + i, low + k * 14);
        uint32_t sum = 0;
#ifdef KVEC_SIMD
        const __m128i sad = _mm_sad_epu8(_mm_loadu_si128((const __m128i *)(e + i)), _mm_setzero_si128());
        sum = (uint32_t)(_mm_cvtsi128_si32(sad) + _mm_extract_epi16(sad, 4));
#else
        for (int j = 0; j < GROUP; j++) sum += e[i + j];
#endif
        sg[2 * k] = (uint8_t)signs;
        sg[2 * k + 1] = (uint8_t)(signs >> 8);
        sums[i / BLOCK] += sum;
    }
    memset(sg + 2 * groups, 0, (n + 7) / 8 - 2 * groups);
    for (size_t i = groups * GROUP; i < n; i++) {
        const uint32_t v = x[i];
        e[i] = (uint8_t)(v >> 7);
        sums[i / BLOCK] += e[i];
        low[groups * 14 + (i - groups * GROUP)] = (uint8_t)(v & 0x7F);
        sg[i / 8] |= (uint8_t)((v >> 15) << (i % 8));
    }
}

/* The 9-low-bit layout (fp16): e = bits 9..14 (5 exponent bits + the top mantissa bit), the low byte as a
 * plane, bit 8 as a bit plane like the signs. `hi8` needs ceil(n/8) bytes. */
static void split9(const uint8_t *src, size_t n, uint8_t *restrict e, uint8_t *restrict sg, uint8_t *restrict low8,
                   uint8_t *restrict hi8, uint32_t *restrict sums) {
    const u16_unaligned *x = (const u16_unaligned *)src;
    memset(sums, 0, (n + BLOCK - 1) / BLOCK * sizeof *sums);
    memset(sg, 0, (n + 7) / 8);
    memset(hi8, 0, (n + 7) / 8);
    size_t i = 0;
#ifdef KVEC_SIMD
    for (; i + GROUP <= n; i += GROUP) {
        __builtin_prefetch(x + i + 1024);
        __m128i a = _mm_loadu_si128((const __m128i *)(x + i)), b = _mm_loadu_si128((const __m128i *)(x + i + 8));
        const __m128i byte = _mm_set1_epi16(0xFF), six = _mm_set1_epi16(0x3F);
        __m128i ev = _mm_packus_epi16(_mm_and_si128(_mm_srli_epi16(a, 9), six), _mm_and_si128(_mm_srli_epi16(b, 9), six));
        __m128i lv = _mm_packus_epi16(_mm_and_si128(a, byte), _mm_and_si128(b, byte));
        const uint32_t signs = (uint32_t)_mm_movemask_epi8(_mm_packs_epi16(a, b));
        const uint32_t bit8 = (uint32_t)_mm_movemask_epi8(_mm_packs_epi16(_mm_slli_epi16(a, 7), _mm_slli_epi16(b, 7)));
        __m128i sad = _mm_sad_epu8(ev, _mm_setzero_si128());
        sums[i / BLOCK] += (uint32_t)(_mm_cvtsi128_si32(sad) + _mm_extract_epi16(sad, 4));
        _mm_storeu_si128((__m128i *)(e + i), ev);
        _mm_storeu_si128((__m128i *)(low8 + i), lv);
        sg[i / 8] = (uint8_t)signs, sg[i / 8 + 1] = (uint8_t)(signs >> 8);
        hi8[i / 8] = (uint8_t)bit8, hi8[i / 8 + 1] = (uint8_t)(bit8 >> 8);
    }
#endif
    for (; i < n; i++) {
        const uint32_t v = x[i];
        e[i] = (uint8_t)((v >> 9) & 0x3F);
        sums[i / BLOCK] += e[i];
        low8[i] = (uint8_t)v;
        sg[i / 8] |= (uint8_t)((v >> 15) << (i % 8));
        hi8[i / 8] |= (uint8_t)(((v >> 8) & 1) << (i % 8));
    }
}

/* 7 low bits (bf16: e is the whole exponent) or 9 (fp16: e = 5 exponent bits + 1 mantissa bit; the 3 bits of
 * mantissa in a 7-bit split are nearly uniform, and coding them slows huff0 by a third for 0.001 of
 * stored/raw). Chosen from the order-0 entropy of e in 16 runs of 1024 elements spread over the frame (runs,
 * not scattered blocks: a frame is cold, and only runs get prefetched): 9 when it costs less than 0.05 bits
 * per element (real KV, 1 MiB frames: fp16 0.014-0.027, bf16 0.20 and more). */
static unsigned choose_low_bits(const uint8_t *src, size_t n) {
    const u16_unaligned *x = (const u16_unaligned *)src;
    enum { RUNS = 16, RUN = 1024 };
    uint32_t h8[256] = {0}, h6[64] = {0}, total = 0;
    for (size_t r = 0; r < RUNS; r++) {
        const size_t a = n > RUN ? (n - RUN) * r / (RUNS - 1) : 0, b = a + RUN < n ? a + RUN : n;
        for (size_t i = a; i < b; i++, total++) {
            h8[(x[i] >> 7) & 0xFF]++;
            h6[(x[i] >> 9) & 0x3F]++;
        }
        if (b == n) break;
    }
    if (total < 1024) return 7;
    double bits8 = 0, bits6 = 0;  /* sum of c * log2(c): entropy = log2(total) - that / total */
    for (int v = 0; v < 256; v++) bits8 += h8[v] ? h8[v] * __builtin_log2(h8[v]) : 0;
    for (int v = 0; v < 64; v++) bits6 += h6[v] ? h6[v] * __builtin_log2(h6[v]) : 0;
    const double cost = (bits8 - bits6) / total + 2.0;  /* H(e6) + 2 - H(e8) */
    return cost < 0.05 ? 9 : 7;
}

/* Block classes. A block's level is its rounded mean exponent in half steps (0..510). Levels become classes
 * one to one when there are at most KV3_MAX_CLASSES of them (bf16 KV: ~20); otherwise whole steps are
 * tried (fp16's e carries 3 mantissa bits, so its means spread over ~75 half steps); if still too many,
 * the KV3_MAX_CLASSES - 1 most common levels keep a class each and every other level joins its nearest kept
 * one. Class ids follow the levels' order, so neighbouring blocks' ids differ little (their deltas are
 * coded). Any assignment decodes: the classes are sent, never derived. (A contiguous window of levels
 * would not do: a 4 KiB JSON header in a frame puts a few blocks at level 0, far below the data.) */
static inline unsigned level(uint32_t sum, size_t len) { return (unsigned)(((sum << 1) + len / 2) / len); }

static unsigned classify(const uint32_t *sums, size_t n, uint8_t *cls) {
    const size_t nb = (n + BLOCK - 1) / BLOCK;
    uint32_t hist[512] = {0};
    for (size_t t = 0; t < nb; t++) hist[level(sums[t], t + 1 < nb ? BLOCK : n - t * BLOCK)]++;
    unsigned shift = 0, levels = 511, distinct = 0;
    for (unsigned v = 0; v < levels; v++) distinct += hist[v] != 0;
    if (distinct > KV3_MAX_CLASSES) {  /* whole steps */
        shift = 1, levels = 256, distinct = 0;
        for (unsigned v = 0; v < levels; v++) {
            hist[v] = hist[2 * v] + (2 * v + 1 < 511 ? hist[2 * v + 1] : 0);
            distinct += hist[v] != 0;
        }
    }
    uint8_t keep[512] = {0};
    if (distinct <= KV3_MAX_CLASSES) {
        for (unsigned v = 0; v < levels; v++) keep[v] = hist[v] != 0;
    } else {  /* the most common levels, ties to the lower level */
        for (unsigned k = 0; k < KV3_MAX_CLASSES - 1; k++) {
            unsigned best = levels;
            for (unsigned v = 0; v < levels; v++)
                if (!keep[v] && hist[v] && (best == levels || hist[v] > hist[best])) best = v;
            keep[best] = 1;
        }
    }
    uint8_t id_of[512];
    unsigned n_cls = 0;
    for (unsigned v = 0; v < levels; v++)
        if (keep[v]) id_of[v] = (uint8_t)n_cls++;
    for (unsigned v = 0; v < levels; v++) {  /* a dropped level: the nearest kept one (the lower on a tie) */
        if (keep[v] || !hist[v]) continue;
        for (unsigned d = 1;; d++) {
            if (v >= d && keep[v - d]) { id_of[v] = id_of[v - d]; break; }
            if (v + d < levels && keep[v + d]) { id_of[v] = id_of[v + d]; break; }
        }
    }
    for (size_t t = 0; t < nb; t++) cls[t] = id_of[level(sums[t], t + 1 < nb ? BLOCK : n - t * BLOCK) >> shift];
    return n_cls;
}

int64_t kv3_encode(const uint8_t *src, size_t n_bytes, uint8_t *dst, size_t cap) {
    const size_t n = n_bytes / 2, nb = (n + BLOCK - 1) / BLOCK, sg_len = (n + 7) / 8;
    if (n == 0 || n > 0xFFFFFFFFu) return ERR_FORMAT;
    const unsigned w = choose_low_bits(src, n);
    const size_t low_len = kv3_low_bytes(n, w);
    if (cap < V3_HEADER + low_len + 2 + (n_bytes & 1)) return ERR_CAPACITY;
    uint8_t *buf = kvec_scratch(2 * n + sg_len + 2 * nb + nb * sizeof(uint32_t) + 64);
    if (!buf) return ERR_NOMEM;
    uint32_t *sums = (uint32_t *)buf;
    uint8_t *e = (uint8_t *)(sums + nb), *by_class = e + n + 16, *sg = by_class + n, *cls = sg + sg_len + 8;
    uint8_t *deltas = cls + nb;

    if (w == 7)  /* low bits straight into place (the 2 bytes of slack fit: a section header follows) */
        split(src, n, e, sg, dst + V3_HEADER, sums);
    else
        split9(src, n, e, sg, dst + V3_HEADER, dst + V3_HEADER + n, sums);
    const unsigned n_cls = classify(sums, n, cls);

    memset(dst, 0, V3_HEADER);
    dst[0] = KV3_VERSION;
    dst[2] = 6;  /* log2 BLOCK */
    dst[3] = (uint8_t)w;
    put_u32(dst + 4, (uint32_t)n);
    dst[10] = (uint8_t)n_cls;
    dst[11] = n_bytes & 1;
    size_t off = V3_HEADER + low_len;
    if (n_bytes & 1) dst[off++] = src[n_bytes - 1];

    uint8_t prev = 0;
    size_t start[KV3_MAX_CLASSES + 1] = {0}, fill[KV3_MAX_CLASSES];
    for (size_t t = 0; t < nb; t++) {
        deltas[t] = (uint8_t)(cls[t] - prev);
        prev = cls[t];
        start[cls[t] + 1] += t + 1 < nb ? BLOCK : n - t * BLOCK;
    }
    for (unsigned c = 0; c < n_cls; c++) start[c + 1] += start[c];
    memcpy(fill, start, sizeof fill);
    for (size_t t = 0; t + 1 < nb; t++) {
        memcpy(by_class + fill[cls[t]], e + t * BLOCK, BLOCK);
        fill[cls[t]] += BLOCK;
    }
    memcpy(by_class + fill[cls[nb - 1]], e + (nb - 1) * BLOCK, n - (nb - 1) * BLOCK);

    int64_t r = put_section(deltas, nb, dst + off, cap - off);
    for (unsigned c = 0; r >= 0 && c < n_cls; c++) {
        off += (size_t)r;
        r = put_section(by_class + start[c], start[c + 1] - start[c], dst + off, cap - off);
    }
    if (r >= 0) {
        off += (size_t)r;
        r = put_section(sg, sg_len, dst + off, cap - off);
    }
    if (r < 0) return r;
    return (int64_t)(off + (size_t)r);
}

/* ---- decoder ---- */

/* The 9-low-bit layout: x from 16 e bytes (< 64), 16 sign bits, 16 bits of bit 8 and 16 low bytes. 0, or -1 when
 * an e value does not fit in 6 bits. */
static inline int join16_9(const uint8_t *restrict e, uint32_t signs, uint32_t hi, const uint8_t *restrict low8,
                           u16_unaligned *restrict out) {
#ifdef KVEC_SIMD
    const __m128i ev = _mm_loadu_si128((const __m128i *)e), lv = _mm_loadu_si128((const __m128i *)low8);
    const __m128i sv = _mm_and_si128(bits_to_bytes(signs), _mm_set1_epi8((char)0x80));
    const __m128i hv = _mm_and_si128(bits_to_bytes(hi), _mm_set1_epi8(1));
    const __m128i hb = _mm_or_si128(_mm_add_epi8(ev, ev), _mm_or_si128(sv, hv));
    _mm_storeu_si128((__m128i *)out, _mm_unpacklo_epi8(lv, hb));
    _mm_storeu_si128((__m128i *)(out + 8), _mm_unpackhi_epi8(lv, hb));
    const __m128i max = _mm_set1_epi8(0x3F);
    return _mm_movemask_epi8(_mm_cmpeq_epi8(_mm_max_epu8(ev, max), max)) == 0xFFFF ? 0 : -1;
#else
    uint32_t big = 0;
    for (int j = 0; j < GROUP; j++) {
        big |= e[j] >> 6;
        out[j] = (uint16_t)(((signs >> j) & 1) << 15 | (uint32_t)e[j] << 9 | ((hi >> j) & 1) << 8 | low8[j]);
    }
    return big ? -1 : 0;
#endif
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(KVEC_NO_SIMD) && !defined(KV3_NO_AVX512)
#include <immintrin.h>
#define KV3_AVX512 1
/* A whole block of 64 with AVX-512 (BW, VBMI) and BMI2: 4 joins of 16 in ~20 instructions. The low bytes of
 * 4 groups are spread to 16 lanes each by one byte permute; the top bits of each group's 14 bytes become
 * its elements 14 and 15 by pext (the 4 x 14 top bits) and pdep (7 bits per byte). */
__attribute__((target("avx512f,avx512bw,avx512vbmi,bmi,bmi2")))
static void join64_avx512(const uint8_t *restrict e, uint64_t signs, const uint8_t *restrict lp, u16_unaligned *restrict out) {
    const __m512i spread = _mm512_set_epi8(
        0, 0, 55, 54, 53, 52, 51, 50, 49, 48, 47, 46, 45, 44, 43, 42,
        0, 0, 41, 40, 39, 38, 37, 36, 35, 34, 33, 32, 31, 30, 29, 28,
        0, 0, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15, 14,
        0, 0, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i extra_at = _mm512_set_epi8(
        7, 6, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 5, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
        3, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    const __mmask64 extra_lanes = 0xC000C000C000C000ull;
    __m512i raw = _mm512_permutexvar_epi8(spread, _mm512_maskz_loadu_epi8((1ull << 56) - 1, lp));
    const uint64_t tops = _pext_u64((uint64_t)_mm512_movepi8_mask(raw), ~extra_lanes);
    const __m512i extra = _mm512_castsi128_si512(_mm_cvtsi64_si128((long long)_pdep_u64(tops, 0x7F7F7F7F7F7F7F7Full)));
    __m512i low = _mm512_and_si512(raw, _mm512_set1_epi8(0x7F));
    low = _mm512_mask_permutexvar_epi8(low, extra_lanes, extra_at, extra);
    const __m512i ev = _mm512_loadu_si512(e);
    const __m512i top = _mm512_set1_epi16((short)0x8000);
    for (int h = 0; h < 2; h++) {
        const __m512i eh = _mm512_cvtepu8_epi16(h ? _mm512_extracti64x4_epi64(ev, 1) : _mm512_castsi512_si256(ev));
        const __m512i lh = _mm512_cvtepu8_epi16(h ? _mm512_extracti64x4_epi64(low, 1) : _mm512_castsi512_si256(low));
        __m512i x = _mm512_or_si512(_mm512_slli_epi16(eh, 7), lh);
        x = _mm512_mask_mov_epi16(x, (__mmask32)(signs >> (32 * h)), _mm512_or_si512(x, top));
        _mm512_storeu_si512((void *)(out + 32 * h), x);
    }
}

__attribute__((target("avx512f,avx512bw")))
static int join64_9_avx512(const uint8_t *restrict e, uint64_t signs, uint64_t hi, const uint8_t *restrict low8,
                           u16_unaligned *restrict out) {
    const __m512i ev = _mm512_loadu_si512(e), lv = _mm512_loadu_si512(low8);
    for (int h = 0; h < 2; h++) {
        const __m512i eh = _mm512_cvtepu8_epi16(h ? _mm512_extracti64x4_epi64(ev, 1) : _mm512_castsi512_si256(ev));
        const __m512i lh = _mm512_cvtepu8_epi16(h ? _mm512_extracti64x4_epi64(lv, 1) : _mm512_castsi512_si256(lv));
        __m512i x = _mm512_or_si512(_mm512_slli_epi16(eh, 9), lh);
        x = _mm512_mask_mov_epi16(x, (__mmask32)(hi >> (32 * h)), _mm512_or_si512(x, _mm512_set1_epi16(0x100)));
        x = _mm512_mask_mov_epi16(x, (__mmask32)(signs >> (32 * h)), _mm512_or_si512(x, _mm512_set1_epi16((short)0x8000)));
        _mm512_storeu_si512((void *)(out + 32 * h), x);
    }
    return _mm512_cmpgt_epu8_mask(ev, _mm512_set1_epi8(0x3F)) ? -1 : 0;
}

static int have_avx512;
__attribute__((constructor)) static void detect_avx512(void) {
    __builtin_cpu_init();
    have_avx512 = __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vbmi") &&
                  __builtin_cpu_supports("bmi2");
}
#endif

/* The next `len` exponents of block t's class; the last block's are copied out first (its class's stream
 * may end there, and the joins load 16 or 64 bytes). */
static inline const uint8_t *block_exponents(const uint8_t *by_class, size_t *pos, uint8_t c, size_t len,
                                             uint8_t *last) {
    const uint8_t *e = by_class + pos[c];
    pos[c] += len;
    if (len == BLOCK) return e;
    memcpy(last, e, len);
    return last;
}

static int join_blocks7(const uint8_t *by_class, const size_t *start, const uint8_t *cls, const uint8_t *sg,
                        const uint8_t *low, size_t n, u16_unaligned *out) {
    const size_t nb = (n + BLOCK - 1) / BLOCK, whole = n / GROUP * GROUP;
    size_t pos[KV3_MAX_CLASSES];
    memcpy(pos, start, sizeof pos);
    uint8_t last[BLOCK + 16];
    for (size_t t = 0; t < nb; t++) {
        const size_t a = t * BLOCK, len = t + 1 < nb ? BLOCK : n - a;
        __builtin_prefetch(low + (a + 16 * BLOCK) / GROUP * 14);  /* a VM's prefetcher lags these streams */
        __builtin_prefetch(out + a + 16 * BLOCK, 1);
        __builtin_prefetch(out + a + 16 * BLOCK + 32, 1);
        const uint8_t *e = block_exponents(by_class, pos, cls[t], len, last);
        size_t i = 0;
#ifdef KV3_AVX512
        if (have_avx512 && len == BLOCK && a + BLOCK <= whole) {
            uint64_t signs;
            memcpy(&signs, sg + a / 8, 8);
            join64_avx512(e, signs, low + a / GROUP * 14, out + a);
            continue;
        }
#endif
        for (; a + i + GROUP <= whole && i < len; i += GROUP) {
            const uint32_t signs = sg[(a + i) / 8] | (uint32_t)sg[(a + i) / 8 + 1] << 8;
            join16(e + i, signs, low + (a + i) / GROUP * 14, out + a + i);
        }
        for (; i < len; i++) {
            const size_t j = a + i;
            const uint32_t mv = low[whole / GROUP * 14 + (j - whole)];
            if (mv > 0x7F) return ERR_FORMAT;
            out[j] = (uint16_t)(((sg[j / 8] >> (j % 8)) & 1) << 15 | (uint32_t)e[i] << 7 | mv);
        }
    }
    return 0;
}

static int join_blocks9(const uint8_t *by_class, const size_t *start, const uint8_t *cls, const uint8_t *sg,
                        const uint8_t *low, size_t n, u16_unaligned *out) {
    const size_t nb = (n + BLOCK - 1) / BLOCK, whole = n / GROUP * GROUP;
    const uint8_t *hi8 = low + n;
    size_t pos[KV3_MAX_CLASSES];
    memcpy(pos, start, sizeof pos);
    uint8_t last[BLOCK + 16];
    int bad = 0;
    for (size_t t = 0; t < nb; t++) {
        const size_t a = t * BLOCK, len = t + 1 < nb ? BLOCK : n - a;
        __builtin_prefetch(low + a + 16 * BLOCK);
        __builtin_prefetch(out + a + 16 * BLOCK, 1);
        __builtin_prefetch(out + a + 16 * BLOCK + 32, 1);
        const uint8_t *e = block_exponents(by_class, pos, cls[t], len, last);
        size_t i = 0;
#ifdef KV3_AVX512
        if (have_avx512 && len == BLOCK && a + BLOCK <= whole) {
            uint64_t signs, hi;
            memcpy(&signs, sg + a / 8, 8);
            memcpy(&hi, hi8 + a / 8, 8);
            bad |= join64_9_avx512(e, signs, hi, low + a, out + a);
            continue;
        }
#endif
        for (; a + i + GROUP <= whole && i < len; i += GROUP) {
            const size_t j = (a + i) / 8;
            bad |= join16_9(e + i, sg[j] | (uint32_t)sg[j + 1] << 8, hi8[j] | (uint32_t)hi8[j + 1] << 8, low + a + i,
                            out + a + i);
        }
        for (; i < len; i++) {
            const size_t j = a + i;
            bad |= e[i] >> 6;
            out[j] = (uint16_t)(((sg[j / 8] >> (j % 8)) & 1) << 15 | (uint32_t)e[i] << 9 |
                                ((hi8[j / 8] >> (j % 8)) & 1) << 8 | low[j]);
        }
    }
    return bad ? ERR_FORMAT : 0;
}

int kv3_decode(const uint8_t *src, size_t src_len, uint8_t *dst, size_t n_bytes) {
    if (src_len < V3_HEADER) return ERR_FORMAT;
    const size_t n = get_u32(src + 4), nb = (n + BLOCK - 1) / BLOCK, sg_len = (n + 7) / 8, tail = src[11];
    const unsigned n_cls = src[10], w = src[3];
    const size_t low_len = kv3_low_bytes(n, w);
    if (src[0] != KV3_VERSION || src[1] != 0 || src[2] != 6 || (w != 7 && w != 9) || src[8] || src[9] ||
        get_u32(src + 12) != 0 || n == 0 || n != n_bytes / 2 || tail != (n_bytes & 1) || n_cls < 1 ||
        n_cls > KV3_MAX_CLASSES)
        return ERR_FORMAT;
    size_t off = V3_HEADER + low_len + tail;
    if (off > src_len) return ERR_FORMAT;
    const uint8_t *low = src + V3_HEADER;

    uint8_t *buf = kvec_scratch(n + 16 + sg_len + 8 + nb + 16);
    if (!buf) return ERR_NOMEM;
    uint8_t *by_class = buf, *sg = by_class + n + 16, *cls = sg + sg_len + 8;

    int64_t r = get_section(src + off, src_len - off, cls, nb);
    if (r < 0) return (int)r;
    off += (size_t)r;
    size_t start[KV3_MAX_CLASSES + 1] = {0};
    uint8_t c = 0;
    for (size_t t = 0; t < nb; t++) {
        c = cls[t] = (uint8_t)(c + cls[t]);
        if (c >= n_cls) return ERR_FORMAT;
        start[c + 1] += t + 1 < nb ? BLOCK : n - t * BLOCK;
    }
    for (unsigned k = 0; k < n_cls; k++) {  /* every class holds a block: the encoder's n_cls, no more */
        if (start[k + 1] == 0) return ERR_FORMAT;
        start[k + 1] += start[k];
    }
    for (unsigned k = 0; k < n_cls; k++) {
        r = get_section(src + off, src_len - off, by_class + start[k], start[k + 1] - start[k]);
        if (r < 0) return (int)r;
        off += (size_t)r;
    }
    r = get_section(src + off, src_len - off, sg, sg_len);
    if (r < 0) return (int)r;
    if (off + (size_t)r != src_len) return ERR_FORMAT;
    if (n % 8 && sg[n / 8] >> (n % 8)) return ERR_FORMAT;  /* the unused sign bits are 0 */
    if (w == 9 && n % 8 && low[n + n / 8] >> (n % 8)) return ERR_FORMAT;  /* and those of bit 8 */

    /* each block's exponents from its class's stream, joined with its signs and low bits */
    int rc = w == 7 ? join_blocks7(by_class, start, cls, sg, low, n, (u16_unaligned *)dst)
                    : join_blocks9(by_class, start, cls, sg, low, n, (u16_unaligned *)dst);
    if (rc) return rc;
    if (tail) dst[n_bytes - 1] = src[V3_HEADER + low_len];
    return 0;
}
