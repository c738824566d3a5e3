/* Sections, the container of codec 4 version 3 (_classes.c) and codec 5 (_entropy8.c): a byte string cut into
 * pieces of at most 128 KiB, each stored raw, as one repeated byte, or Huffman-coded by zstd's huff0
 * (vendored in huf0/). Byte-level format: docs/format.md, codec 4 version 3, "Sections". Moved here from
 * _classes.c unchanged when codec 5 came to share it.
 *
 * Safety: get_section checks every size before it reads or writes; huff0's decoder is bounds-checked (it is
 * zstd's, fuzzed as part of zstd). It refuses a piece written otherwise than put_section writes it, as far as
 * that is cheap to tell (see huf_table_canonical), so that a changed payload is refused rather than decoded
 * to the same bytes.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define HUF_STATIC_LINKING_ONLY
#include "huf0/common/huf.h"
#include "huf0/common/cpu.h"
#include "huf0/common/error_private.h"

#include "_planes.h"
#include "_sections.h"

#define PIECE HUF_BLOCKSIZE_MAX   /* huff0 codes at most 128 KiB at a time */
#define MODE_RAW 0
#define MODE_RLE 1
#define MODE_HUF 2

enum { ERR_CAPACITY = SECTION_ERR_CAPACITY, ERR_FORMAT = SECTION_ERR_FORMAT, ERR_STREAM = SECTION_ERR_STREAM };

_Static_assert(PIECE == SECTION_PIECE, "section pieces are huff0's largest block");

static __thread uint64_t huf_wksp[(HUF_WORKSPACE_SIZE + 64) / 8];
static __thread HUF_DTable huf_dtable[HUF_DTABLE_SIZE(HUF_TABLELOG_MAX)];
/* huff0's BMI2 code paths, chosen once at load: cpuid traps to the hypervisor in a VM (tens of µs), and the
 * compiler may hoist it out of a lazy check, since zstd's cpuid asm is not volatile. */
static int huf_flags_bmi2;
__attribute__((constructor)) static void detect_cpu(void) {
    huf_flags_bmi2 = ZSTD_cpuid_bmi2(ZSTD_cpuid()) ? HUF_flags_bmi2 : 0;
}
static inline int huf_flags(void) { return huf_flags_bmi2; }

/* ---- sections: a byte string in pieces of <= PIECE, each a u32 (size << 2 | mode) and its payload ---- */

int64_t put_section(const uint8_t *s, size_t m, uint8_t *out, size_t cap) {
    size_t off = 0;
    for (size_t i = 0; i < m; i += PIECE) {
        const size_t len = m - i < PIECE ? m - i : PIECE;
        if (cap - off < 4 + len) return ERR_CAPACITY;
        size_t c = HUF_compress4X_repeat(out + off + 4, len - 1, s + i, len, 255, HUF_TABLELOG_DEFAULT,
                                         huf_wksp, sizeof huf_wksp, NULL, NULL, huf_flags());
        if (HUF_isError(c)) c = 0;  /* not compressible by its heuristics: store */
        uint32_t mode = c == 0 ? MODE_RAW : c == 1 ? MODE_RLE : MODE_HUF;
        if (mode == MODE_RAW) { memcpy(out + off + 4, s + i, len); c = len; }
        put_u32(out + off, (uint32_t)(c << 2) | mode);
        off += 4 + c;
    }
    return (int64_t)off;
}

/* Whether a piece of 2 or more bytes is one byte repeated (put_section stores that as RLE, never raw). Raw
 * pieces are incompressible data: this stops at the first byte that differs, in practice the second. */
static int all_equal(const uint8_t *p, size_t len) {
    if (len < 2) return 0;
    for (size_t i = 1; i < len; i++)
        if (p[i] != p[0]) return 0;
    return 1;
}

/* Whether the table description at the start of a Huffman piece is written as huff0's encoder writes it, as far
 * as that is cheap to tell: its weights' FSE header (normalized counts) as FSE_writeNCount writes those counts,
 * the unused bits of its last byte included; or, with the weights stored as 4-bit values, the unused half of
 * the last byte 0. huff0's decoder ignores both, so a change there would decode to the same bytes. A count of
 * -1 ("less than 1") is refused too: huff0 never writes one for weights, and a 1 turned into -1 often decodes
 * the same weights. (Whether the encoder would have chosen those counts, or those weights, or wrote the FSE
 * stream of the weights as it is, is not checked: that is coding them again, 6-10% of the decode time.) */
static int huf_table_canonical(const uint8_t *src, size_t c) {
    const size_t i_size = src[0];
    if (i_size >= 128) {  /* i_size - 127 weights, two per byte */
        const size_t weights = i_size - 127;
        return weights % 2 == 0 || (weights / 2 + 1 < c && (src[1 + weights / 2] & 15) == 0);
    }
    short norm[HUF_TABLELOG_MAX + 1];
    unsigned max_weight = HUF_TABLELOG_MAX, log;
    const size_t h = FSE_readNCount(norm, &max_weight, &log, src + 1, i_size < c - 1 ? i_size : c - 1);
    if (FSE_isError(h)) return 0;
    for (unsigned v = 0; v <= max_weight; v++)
        if (norm[v] < 0) return 0;  /* "less than 1": huff0 normalizes weights without (useLowProbCount 0) */
    uint8_t again[64];
    const size_t w = FSE_writeNCount(again, sizeof again, norm, max_weight, log);
    return !FSE_isError(w) && w == h && memcmp(again, src + 1, h) == 0;
}

/* A section as put_section writes it, and only so: each piece's mode is the one huff0 gives its bytes as far
 * as that can be told without coding them again (a piece of 2 or more bytes that is one byte repeated is
 * RLE, a single byte is raw, a Huffman piece is at least 2 bytes shorter than its input), so that a changed
 * piece header is refused rather than decoded to the same bytes. */
int64_t get_section(const uint8_t *src, size_t src_len, uint8_t *s, size_t m) {
    size_t off = 0;
    for (size_t i = 0; i < m; i += PIECE) {
        const size_t len = m - i < PIECE ? m - i : PIECE;
        if (src_len - off < 4) return ERR_FORMAT;
        const uint32_t h = get_u32(src + off), mode = h & 3;
        const size_t c = h >> 2;
        off += 4;
        if (c > src_len - off) return ERR_FORMAT;
        if (mode == MODE_RAW) {
            if (c != len || all_equal(src + off, len)) return ERR_FORMAT;
            memcpy(s + i, src + off, len);
        } else if (mode == MODE_RLE) {
            if (c != 1 || len < 2) return ERR_FORMAT;
            memset(s + i, src[off], len);
        } else if (mode == MODE_HUF) {
            if (c + 2 > len) return ERR_FORMAT;
            huf_dtable[0] = (HUF_DTable)HUF_TABLELOG_MAX * 0x01000001;  /* HUF_CREATE_STATIC_DTABLEX2 */
            size_t r = HUF_decompress4X_hufOnly_wksp(huf_dtable, s + i, len, src + off, c, huf_wksp,
                                                     sizeof huf_wksp, huf_flags());
            if (HUF_isError(r) || r != len) return ERR_STREAM;
            if (!huf_table_canonical(src + off, c)) return ERR_FORMAT;
        } else {
            return ERR_FORMAT;
        }
        off += c;
    }
    return (int64_t)off;
}
