/* What codec 4's versions share (_entropy.c: versions 1-2, _classes.c: version 3): little-endian u32s and
 * the split and join of 16 elements in the 7-low-bit layout (e byte, sign bit, 7 low bits packed 16 elements
 * to 14 bytes: bytes 0..13 hold elements 0..13 in their low 7 bits, their top bits hold elements 14 and 15 as
 * the 14-bit number low14 | low15 << 7). Build with -DKVEC_NO_SIMD for the portable path; both paths give
 * the same bytes. Their shared scratch buffer is kvec_scratch (_scratch.h). */
#ifndef KVFS_PLANES_H
#define KVFS_PLANES_H
#include <stddef.h>
#include <stdint.h>

#if defined(__SSE2__) && !defined(KVEC_NO_SIMD)
#include <emmintrin.h>
#define KVEC_SIMD 1
#endif

typedef uint16_t u16_unaligned __attribute__((aligned(1), may_alias));

static inline void put_u32(uint8_t *p, uint32_t v) { p[0] = v; p[1] = v >> 8; p[2] = v >> 16; p[3] = v >> 24; }
static inline uint32_t get_u32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* Bytes of the packed low bits of n elements: 14 per 16, then one per remaining element. */
static inline size_t packed_low_bytes(size_t n) { return n / 16 * 14 + n % 16; }

#ifdef KVEC_SIMD
/* 16 bits -> 16 bytes, byte j = 0xFF when bit j is set. */
static inline __m128i bits_to_bytes(uint32_t bits) {
    const __m128i sel = _mm_set_epi8(-128, 64, 32, 16, 8, 4, 2, 1, -128, 64, 32, 16, 8, 4, 2, 1);
    const __m128i v = _mm_set_epi64x((int64_t)(((bits >> 8) & 0xFF) * 0x0101010101010101ull),
                                     (int64_t)((bits & 0xFF) * 0x0101010101010101ull));
    return _mm_cmpeq_epi8(_mm_and_si128(v, sel), sel);
}
#endif

/* 16 elements -> their e bytes and 14 packed low bytes (`low` needs 2 bytes of slack); returns their signs
 * (bit j: element j). */
static inline uint32_t split16(const u16_unaligned *restrict x, uint8_t *restrict e, uint8_t *restrict low) {
#ifdef KVEC_SIMD
    const __m128i a = _mm_loadu_si128((const __m128i *)x), b = _mm_loadu_si128((const __m128i *)(x + 8));
    const __m128i byte = _mm_set1_epi16(0xFF), seven = _mm_set1_epi16(0x7F);
    const __m128i ev = _mm_packus_epi16(_mm_and_si128(_mm_srli_epi16(a, 7), byte),
                                        _mm_and_si128(_mm_srli_epi16(b, 7), byte));
    const __m128i mv = _mm_packus_epi16(_mm_and_si128(a, seven), _mm_and_si128(b, seven));
    const uint32_t top = (uint32_t)_mm_extract_epi16(mv, 7);
    const uint32_t extra = (top & 0x7F) | ((top >> 8) & 0x7F) << 7;
    _mm_storeu_si128((__m128i *)e, ev);
    _mm_storeu_si128((__m128i *)low, _mm_or_si128(mv, _mm_and_si128(bits_to_bytes(extra), _mm_set1_epi8((char)0x80))));
    return (uint32_t)_mm_movemask_epi8(_mm_packs_epi16(a, b));
#else
    uint8_t m[16];
    uint32_t signs = 0;
    for (int j = 0; j < 16; j++) {
        const uint32_t v = x[j];
        e[j] = (uint8_t)(v >> 7);
        m[j] = (uint8_t)(v & 0x7F);
        signs |= (v >> 15) << j;
    }
    const uint32_t extra = m[14] | (uint32_t)m[15] << 7;
    for (int j = 0; j < 14; j++) low[j] = (uint8_t)(m[j] | ((extra >> j) & 1) << 7);
    return signs;
#endif
}

/* x for 16 elements from their e bytes, 16 sign bits and 14 packed low bytes (read as 16: 2 bytes of slack). */
static inline void join16(const uint8_t *restrict e, uint32_t signs, const uint8_t *restrict lp,
                          u16_unaligned *restrict out) {
#ifdef KVEC_SIMD
    const __m128i lb = _mm_loadu_si128((const __m128i *)lp);
    const uint32_t top = (uint32_t)_mm_movemask_epi8(lb) & 0x3FFF;
    __m128i mv = _mm_and_si128(lb, _mm_set1_epi8(0x7F));
    mv = _mm_insert_epi16(mv, (int)((top & 0x7F) | (top >> 7) << 8), 7);
    const __m128i ev = _mm_loadu_si128((const __m128i *)e);
    const __m128i sv = _mm_and_si128(bits_to_bytes(signs), _mm_set1_epi8((char)0x80));
    const __m128i lo = _mm_or_si128(mv, _mm_and_si128(_mm_slli_epi16(ev, 7), _mm_set1_epi8((char)0x80)));
    const __m128i hi = _mm_or_si128(sv, _mm_and_si128(_mm_srli_epi16(ev, 1), _mm_set1_epi8(0x7F)));
    _mm_storeu_si128((__m128i *)out, _mm_unpacklo_epi8(lo, hi));
    _mm_storeu_si128((__m128i *)(out + 8), _mm_unpackhi_epi8(lo, hi));
#else
    uint32_t top = 0;
    for (int j = 0; j < 14; j++) top |= (uint32_t)(lp[j] >> 7) << j;
    for (int j = 0; j < 16; j++) {
        const uint32_t mv = j < 14 ? lp[j] & 0x7F : j == 14 ? top & 0x7F : top >> 7;
        out[j] = (uint16_t)(((signs >> j) & 1) << 15 | (uint32_t)e[j] << 7 | mv);
    }
#endif
}

#endif
