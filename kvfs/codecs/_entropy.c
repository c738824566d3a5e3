/* Codec 4 ("entropy"): context-modelled canonical Huffman for 16-bit floats (bf16, fp16).
 *
 * Each 16-bit little-endian element x splits into
 *     e = (x >> 7) & 0xFF                    the exponent byte (bf16: the 8 exponent bits; fp16: 5 + 3 mantissa)
 *     r = ((x >> 8) & 0x80) | (x & 0x7F)     sign + 7 low bits: noise, stored as they are
 * e is Huffman-coded with a table chosen by its context: the rounded mean of the K previous e values at a
 * stride d (d = distance between neighbouring tokens of one channel, from the shape hint; 1 otherwise).
 * That context stands in for per-channel statistics without sending any: a channel's exponents stay close
 * to their running mean. Version 1 stores r raw. Version 2 (stride 1) codes the signs too, four at a time
 * with a table chosen by how many of the previous eight were negative (a channel's signs persist: 0.85
 * bits per sign on real KV), in streams of their own, and packs the 7 low bits 16 elements to 14 bytes.
 * Its context sum is a moving average, S <- S - S/4 + (sum of the group's 4 values): as sharp as the
 * 16-value window (2.53 bits per exponent on real KV either way), and it needs no decoded history.
 * Frames of KV3_MIN_BYTES and more are written as version 3 (_classes.c: block classes coded by zstd's
 * huff0, 2-3x faster both ways at the same ratio); this file writes versions 1-2 for smaller frames and
 * reads all three. The byte-level format is docs/format.md ("codec 4"); keep the two in step.
 *
 * Safety: kvec_decode never reads or writes out of bounds on any input (every field is checked, every
 * stream is padded and its bit position bounded); it returns a negative code on any inconsistency.
 * Loaded with ctypes (kvfs/codecs/entropy.py), which releases the GIL around both calls.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_classes.h"
#include "_planes.h"
#include "_scratch.h"

#define VERSION_R 1      /* r stored raw */
#define VERSION_SIGNS 2  /* signs coded, low bits packed (stride 1 only) */
#define FIXED 16          /* bytes of the fixed payload header */
#define MAX_STREAMS 8
#define MAX_CTX 64
#define MAX_LEN 11        /* longest code; decode tables have 1 << MAX_LEN entries per context */
#define MAX_STRIDE 4096
#define GROUP 4           /* stride 1: elements that share one context (and one table lookup base) */
#define PAD 16            /* zero bytes after the last stream: 8-byte loads never leave the payload */
#define SIGN_CTX 9        /* version 2: sign tables, by the count of negatives among the previous 8 signs */
#define SIGN_LEN 8        /* longest sign code; sign decode tables have 1 << SIGN_LEN entries */
#define ALIGN 16          /* version 2: streams start at multiples of 16 elements (one packed low-bit group) */

typedef uint32_t u32_unaligned __attribute__((aligned(1), may_alias));

enum { KVEC_ERR_CAPACITY = -1, KVEC_ERR_FORMAT = -2, KVEC_ERR_STREAM = -3, KVEC_ERR_ARGS = -4,
       KVEC_ERR_NOMEM = -5 };

/* ---- per-thread scratch (_scratch.h: reused, freed when the thread exits) ---- */

static __thread scratch_t tables_scratch;  /* the planes buffer is kvec_scratch, shared with version 3 */

static uint8_t *scratch(size_t n) { return kvec_scratch(n); }

static inline uint64_t load_be64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return __builtin_bswap64(v);
}

/* ---- Huffman code lengths, limited to max_len by flattening the counts until they fit ---- */

static int depth_of(const int *parent, int node) {
    int d = 0;
    while (parent[node] >= 0) { node = parent[node]; d++; }
    return d;
}

static void huffman_lengths(const uint32_t *count, uint8_t *len, int max_len) {
    int sym[256], n = 0;
    uint64_t w[512];
    int parent[512];
    memset(len, 0, 256);
    for (int s = 0; s < 256; s++) if (count[s]) sym[n++] = s;
    if (n == 0) return;
    if (n == 1) { len[sym[0]] = 1; return; }
    uint64_t c[256];
    for (int i = 0; i < n; i++) c[i] = count[sym[i]];
    for (;;) {
        /* sort leaves by weight (insertion sort: n <= 256, once per context and frame) */
        int order[256];
        for (int i = 0; i < n; i++) {
            int j = i;
            while (j > 0 && c[order[j - 1]] > c[i]) { order[j] = order[j - 1]; j--; }
            order[j] = i;
        }
        for (int i = 0; i < n; i++) { w[i] = c[order[i]]; parent[i] = -1; }
        /* two-queue construction: leaves 0..n-1 ascending, internal nodes n.. created ascending */
        int leaf = 0, node = n, next = n;
        while (next < 2 * n - 1) {
            int pick[2];
            for (int k = 0; k < 2; k++) {
                if (leaf < n && (node >= next || w[leaf] <= w[node])) pick[k] = leaf++;
                else pick[k] = node++;
            }
            w[next] = w[pick[0]] + w[pick[1]];
            parent[next] = -1;
            parent[pick[0]] = parent[pick[1]] = next;
            next++;
        }
        int longest = 0;
        for (int i = 0; i < n; i++) {
            int d = depth_of(parent, i);
            len[sym[order[i]]] = (uint8_t)d;
            if (d > longest) longest = d;
        }
        if (longest <= max_len) return;
        for (int i = 0; i < n; i++) c[i] = (c[i] + 1) / 2;  /* flatten and retry */
    }
}

/* Canonical codes: by length, then by symbol. codes[s] = code value (len[s] bits). */
static void canonical_codes(const uint8_t *len, uint32_t *codes) {
    int bl_count[MAX_LEN + 2] = {0};
    uint32_t next_code[MAX_LEN + 2];
    for (int s = 0; s < 256; s++) bl_count[len[s]]++;
    bl_count[0] = 0;
    uint32_t code = 0;
    for (int b = 1; b <= MAX_LEN + 1; b++) { code = (code + bl_count[b - 1]) << 1; next_code[b] = code; }
    for (int s = 0; s < 256; s++) codes[s] = len[s] ? next_code[len[s]]++ : 0;
}

/* ---- layout shared by both directions ---- */

typedef struct { int version, n_streams, window_log, stride, n_ctx, ctx_lo, fill, tail; size_t n; } params_t;

/* First element of stream s (s = n_streams: n). Version 2 starts streams at multiples of ALIGN, so every
 * stream but the last holds whole groups of packed low bits and whole sign quads. */
static inline size_t stream_start(const params_t *p, int s) {
    if (s >= p->n_streams) return p->n;
    if (p->version == VERSION_SIGNS) return (p->n / ALIGN) * (size_t)s / (size_t)p->n_streams * ALIGN;
    return p->n * (size_t)s / (size_t)p->n_streams;
}

/* ---- encoder ---- */

/* Set bits of a byte (no popcnt instruction in baseline x86-64: the builtin would be a call). */
#define B2(k) k, k + 1, k + 1, k + 2
#define B4(k) B2(k), B2(k + 1), B2(k + 1), B2(k + 2)
#define B6(k) B4(k), B4(k + 1), B4(k + 1), B4(k + 2)
static const uint8_t POP8[256] = {B6(0), B6(1), B6(1), B6(2)};

/* A sign quad with its context, as one symbol index: ctx * 16 + quad, ctx = negatives among the stream's
 * previous 8 signs (the two quads before; none before the stream's start). `w` holds those 8 signs in its
 * low byte and the quad above them. */
static inline uint8_t sign_symbol(uint32_t w) { return (uint8_t)(POP8[w & 0xFF] * 16 + ((w >> 8) & 15)); }

/* Version 2 split: e bytes, one sign symbol per 4 elements (quad bit k = sign of element 4g + k), low 7 bits
 * packed (16 elements -> 14 bytes: bytes 0..13 hold elements 0..13 in their low 7 bits, their top bits hold
 * elements 14 and 15 as the 14-bit number low14 | low15 << 7). `low` needs 2 bytes of slack after it. */
static void split_signs(const uint8_t *src, const params_t *p, uint8_t *restrict e, uint8_t *restrict sym,
                        uint8_t *restrict low) {
    const u16_unaligned *x = (const u16_unaligned *)src;
    const size_t n = p->n, groups = n / ALIGN;
    size_t next_start = 0;
    int s = 0;
    uint32_t prev = 0;  /* the signs of the 16 elements before, within the stream */
    for (size_t k = 0; k < groups; k++) {
        const size_t i = k * ALIGN;
        if (i == next_start) { prev = 0; next_start = stream_start(p, ++s); }
        const uint32_t signs = split16(x + i, e + i, low + k * 14);
        const uint32_t w = prev >> 8 | signs << 8;  /* bits 0..7: the two quads before quad 0 */
        for (int t = 0; t < 4; t++) sym[i / 4 + t] = sign_symbol(w >> (4 * t));
        prev = signs;
    }
    if (groups * ALIGN == n) return;
    if (groups * ALIGN == next_start) prev = 0;  /* the rest starts a stream (n < 16) */
    uint32_t signs = 0;
    for (size_t i = groups * ALIGN; i < n; i++) {
        uint32_t v = x[i];
        e[i] = (uint8_t)(v >> 7);
        low[groups * 14 + (i - groups * ALIGN)] = (uint8_t)(v & 0x7F);
        signs |= (v >> 15) << (i - groups * ALIGN);
    }
    const uint32_t w = prev >> 8 | signs << 8;
    for (size_t g = groups * 4; g < (n + 3) / 4; g++) sym[g] = sign_symbol(w >> (4 * (g - groups * 4)));
}

/* Version 2: the context of each group of GROUP from the moving average S (S = 16 * fill before the
 * stream's first group); the mean is (S + 8) >> 4 as in version 1 with K = 16. */
static void moving_means(const uint8_t *restrict e, uint8_t *restrict m, size_t n, const params_t *p,
                         uint32_t *restrict G, uint32_t *mhist) {
    const u32_unaligned *x = (const u32_unaligned *)e;
    u32_unaligned *out = (u32_unaligned *)m;
    const size_t full = n / GROUP;
    for (size_t j = 0; j < full; j++) {  /* group sums first: this pass vectorises, the average cannot */
        const uint32_t v = x[j];
        G[j] = (v & 0xFF) + ((v >> 8) & 0xFF) + ((v >> 16) & 0xFF) + (v >> 24);
    }
    uint32_t S = 16u * (uint32_t)p->fill;
    for (size_t j = 0; j < full; j++) {
        out[j] = ((S + 8) >> 4) * 0x01010101u;
        S = S - (S >> 2) + G[j];
    }
    if (full * GROUP < n) memset(m + full * GROUP, (int)((S + 8) >> 4), n - full * GROUP);
    for (size_t j = 0; j < full; j += 8) mhist[m[j * GROUP]]++;  /* a sample: it only places the window */
}

/* Context of every element: version 2 (stride 1) the moving average of its group, version 1 round(mean of
 * the K previous e at stride d), history before a stream's first element being `fill`; the encoder clamps
 * it to a table index. Also counts (a sample of) the means in
 * mhist, which the caller zeroes. */
static void context_means(const uint8_t *e, uint8_t *m, uint16_t *sums, const params_t *p, uint32_t *mhist) {
    const int K = 1 << p->window_log, d = p->stride;
    for (int s = 0; s < p->n_streams; s++) {
        size_t a = stream_start(p, s), b = stream_start(p, s + 1);
        if (p->version == VERSION_SIGNS) {  /* stride 1: kvfs writes version 1 only for strides > 1 */
            moving_means(e + a, m + a, b - a, p, (uint32_t *)sums, mhist);
            continue;
        }
        for (size_t i = a; i < b; i++) {
            uint32_t S;
            if (i < a + (size_t)d) S = (uint32_t)K * p->fill;
            else {
                size_t j = i - (size_t)(K + 1) * d;  /* the value leaving the window */
                int out = (i >= a + (size_t)(K + 1) * d) ? e[j] : p->fill;
                S = sums[i - d] + e[i - d] - out;
            }
            sums[i] = (uint16_t)S;
            m[i] = (uint8_t)((S + (K >> 1)) >> p->window_log);
            mhist[m[i]]++;
        }
    }
}

static int choose_window(const uint32_t *hist, int *lo) {
    int first = 0, last = 255;
    while (first < 255 && !hist[first]) first++;
    while (last > first && !hist[last]) last--;
    int span = last - first + 1, n_ctx = span < MAX_CTX ? span : MAX_CTX;
    uint64_t best = 0, sum = 0;
    *lo = first;
    for (int i = first; i <= last; i++) {
        sum += hist[i];
        if (i - first >= n_ctx) sum -= hist[i - n_ctx];
        if (i - first >= n_ctx - 1 && sum > best) { best = sum; *lo = i - n_ctx + 1; }
    }
    return n_ctx;
}


static inline void store_be64(uint8_t *p, uint64_t v) { v = __builtin_bswap64(v); memcpy(p, &v, 8); }

/* One table's code lengths (symbols first..last, 4 bits each) at out; returns the bytes written. */
static size_t put_lengths(const uint8_t *lens, int first, int last, uint8_t *out) {
    size_t nl = first > last ? 0 : (size_t)(last - first + 1), w = 0;
    for (size_t k = 0; k < nl; k += 2)
        out[w++] = (uint8_t)(lens[first + k] | (k + 1 < nl ? lens[first + k + 1] : 0) << 4);
    return w;
}

/* Huffman-code one table's counts: codes[s] = code << 4 | length; returns the coded bits. */
static uint64_t make_codes(const uint32_t *count, int max_len, uint8_t *lens, uint32_t *code) {
    uint32_t codes[256];
    uint64_t bits = 0;
    huffman_lengths(count, lens, max_len);
    canonical_codes(lens, codes);
    for (int k = 0; k < 256; k++) { code[k] = codes[k] << 4 | lens[k]; bits += (uint64_t)count[k] * lens[k]; }
    return bits;
}

/* Append code cl (code << 4 | length) to the bit accumulator acc holding nb bits (locals: a macro, so
 * that no address of them is taken and they stay in registers). */
#define PUT_CODE(cl)                                                                          \
    do {                                                                                      \
        const uint32_t cl_ = (cl);                                                            \
        acc = (acc << (cl_ & 15)) | (cl_ >> 4);                                               \
        nb += cl_ & 15;                                                                       \
    } while (0)
/* The whole bytes of acc out at w (one 8-byte store: the payload has PAD bytes of room), the rest kept. */
#define PUT_BYTES()                                                                           \
    do {                                                                                      \
        store_be64(w, acc << (64 - nb));                                                      \
        w += nb >> 3;                                                                         \
        nb &= 7;                                                                              \
    } while (0)
/* A stream's last bits out (low bits of its last byte 0), its size into size table slot k, and the next
 * stream starts after it. */
#define END_STREAM(k)                                                                         \
    do {                                                                                      \
        if (nb) *w++ = (uint8_t)(acc << (8 - nb));                                            \
        put_u32(dst + FIXED + 4 * (k), (uint32_t)(w - out));                                  \
        out = w;                                                                              \
    } while (0)
/* Four codes at once, joined pairwise first: one shift of acc per four codes, not four in a row. */
#define PUT_CODE4(c0, c1, c2, c3)                                                             \
    do {                                                                                      \
        const uint32_t k0_ = (c0), k1_ = (c1), k2_ = (c2), k3_ = (c3);                        \
        const uint64_t p01_ = (uint64_t)(k0_ >> 4) << (k1_ & 15) | (k1_ >> 4);                \
        const uint64_t p23_ = (uint64_t)(k2_ >> 4) << (k3_ & 15) | (k3_ >> 4);                \
        const uint32_t l23_ = (k2_ & 15) + (k3_ & 15), l_ = (k0_ & 15) + (k1_ & 15) + l23_;   \
        acc = (acc << l_) | (p01_ << l23_ | p23_);                                            \
        nb += l_;                                                                             \
    } while (0)

/* m holds the context means; clamp maps them to table indices; sym the sign symbols (version 2). */
static int64_t encode_streams(const uint8_t *restrict e, const uint8_t *restrict m, const uint8_t *restrict sym,
                              const uint8_t *clamp, const params_t *p, uint8_t *dst, size_t cap, uint8_t *out) {
    /* count per (context, symbol), in four tables for the same reason as the e sample */
    const size_t cnt_bytes = 4 * sizeof(uint32_t[MAX_CTX][256]);
    uint8_t *tables = scratch_reserve(&tables_scratch, cnt_bytes + sizeof(uint32_t[MAX_CTX][256]));
    if (!tables) return KVEC_ERR_NOMEM;
    uint32_t (*cnt)[MAX_CTX][256] = (uint32_t (*)[MAX_CTX][256])tables;
    uint32_t (*code)[256] = (uint32_t (*)[256])(tables + cnt_bytes);  /* code << 4 | length */
    const int signs = p->version == VERSION_SIGNS;
    uint32_t scnt[SIGN_CTX][256], scode[SIGN_CTX * 16];
    for (int k = 0; k < 4; k++) memset(cnt[k], 0, (size_t)p->n_ctx * sizeof cnt[k][0]);
    size_t i = 0;
    if (p->stride == 1) {  /* one context per group of 4, groups counted from each stream's start */
        for (int s = 0; s < p->n_streams; s++) {
            size_t j = stream_start(p, s), b = stream_start(p, s + 1);
            for (; j + 4 <= b; j += 4) {
                const size_t c = clamp[m[j]];
                cnt[0][c][e[j]]++; cnt[1][c][e[j + 1]]++; cnt[2][c][e[j + 2]]++; cnt[3][c][e[j + 3]]++;
            }
            for (; j < b; j++) cnt[0][clamp[m[j]]][e[j]]++;
        }
    } else {
        for (; i + 4 <= p->n; i += 4) {
            uint8_t c0 = clamp[m[i]], c1 = clamp[m[i + 1]], c2 = clamp[m[i + 2]], c3 = clamp[m[i + 3]];
            cnt[0][c0][e[i]]++; cnt[1][c1][e[i + 1]]++; cnt[2][c2][e[i + 2]]++; cnt[3][c3][e[i + 3]]++;
        }
        for (; i < p->n; i++) cnt[0][clamp[m[i]]][e[i]]++;
    }
    if (signs) {  /* four count tables in turn: runs of one symbol would wait on one counter */
        uint32_t sc4[4][SIGN_CTX * 16];
        const size_t quads = (p->n + 3) / 4;
        memset(sc4, 0, sizeof sc4);
        size_t g = 0;
        for (; g + 4 <= quads; g += 4) {
            sc4[0][sym[g]]++; sc4[1][sym[g + 1]]++; sc4[2][sym[g + 2]]++; sc4[3][sym[g + 3]]++;
        }
        for (; g < quads; g++) sc4[0][sym[g]]++;
        memset(scnt, 0, sizeof scnt);
        for (int c = 0; c < SIGN_CTX; c++)
            for (int k = 0; k < 16; k++) {
                const int i = c * 16 + k;
                scnt[c][k] = sc4[0][i] + sc4[1][i] + sc4[2][i] + sc4[3][i];
            }
    }
    uint64_t total_bits = 0;
    for (int c = 0; c < p->n_ctx; c++) {
        uint32_t count[256];
        uint8_t lens[256];
        for (int k = 0; k < 256; k++) count[k] = cnt[0][c][k] + cnt[1][c][k] + cnt[2][c][k] + cnt[3][c][k];
        total_bits += make_codes(count, MAX_LEN, lens, code[c]);
        /* table: u8 first, u8 last (first > last: empty), 4-bit lengths, low nibble first */
        int first = 0, last = 255;
        while (first < 256 && !lens[first]) first++;
        while (last >= 0 && !lens[last]) last--;
        if (first > last) { first = 1; last = 0; }
        if ((size_t)(out - dst) + 2 + 128 + PAD > cap) return KVEC_ERR_CAPACITY;
        *out++ = (uint8_t)first;
        *out++ = (uint8_t)last;
        out += put_lengths(lens, first, last, out);
    }
    if (signs) {  /* SIGN_CTX tables of 16 lengths each */
        if ((size_t)(out - dst) + SIGN_CTX * 8 + PAD > cap) return KVEC_ERR_CAPACITY;
        for (int c = 0; c < SIGN_CTX; c++) {
            uint8_t lens[256];
            uint32_t codes[256];
            total_bits += make_codes(scnt[c], SIGN_LEN, lens, codes);
            memcpy(scode + c * 16, codes, 16 * sizeof codes[0]);
            out += put_lengths(lens, 0, 15, out);
        }
    }
    /* streams end on byte boundaries: at most 7 padding bits each (and 8-byte stores, within PAD) */
    if ((size_t)(out - dst) + total_bits / 8 + 2 * (size_t)p->n_streams + PAD > cap) return KVEC_ERR_CAPACITY;
    for (int s = 0; s < p->n_streams; s++) {
        size_t a = stream_start(p, s), b = stream_start(p, s + 1);
        uint8_t *w = out;
        uint64_t acc = 0;
        uint32_t nb = 0;
        size_t j = a;
        for (; j + 4 <= b; j += 4) {  /* <= 7 + 4 * MAX_LEN bits in acc, then whole bytes out (8-byte store) */
            if (p->stride == 1) {
                const uint32_t *gc = code[clamp[m[j]]];  /* stride 1: one context per group of 4 */
                PUT_CODE4(gc[e[j]], gc[e[j + 1]], gc[e[j + 2]], gc[e[j + 3]]);
            } else {
                PUT_CODE4(code[clamp[m[j]]][e[j]], code[clamp[m[j + 1]]][e[j + 1]],
                          code[clamp[m[j + 2]]][e[j + 2]], code[clamp[m[j + 3]]][e[j + 3]]);
            }
            PUT_BYTES();
        }
        for (; j < b; j++) {
            PUT_CODE(code[clamp[m[j]]][e[j]]);
            if (nb >= 8) PUT_BYTES();
        }
        END_STREAM(s);
    }
    for (int s = 0; signs && s < p->n_streams; s++) {  /* version 2: then one sign stream per stream */
        uint8_t *w = out;
        uint64_t acc = 0;
        uint32_t nb = 0;
        const size_t g0 = stream_start(p, s) / 4, g1 = (stream_start(p, s + 1) + 3) / 4;
        size_t g = g0;
        for (; g + 4 <= g1; g += 4) {  /* <= 7 + 4 * SIGN_LEN bits */
            PUT_CODE4(scode[sym[g]], scode[sym[g + 1]], scode[sym[g + 2]], scode[sym[g + 3]]);
            PUT_BYTES();
        }
        for (; g < g1; g++) PUT_CODE(scode[sym[g]]);
        if (nb >= 8) PUT_BYTES();
        END_STREAM(p->n_streams + s);
    }
    memset(out, 0, PAD);
    return (int64_t)(out + PAD - dst);
}

int64_t kvec_encode_version(const uint8_t *src, size_t n_bytes, int stride, int window_log, uint8_t *dst,
                            size_t cap, int version);

/* Encode n_bytes of src into dst (capacity cap). Returns the payload size, or a negative code
 * (KVEC_ERR_CAPACITY when the result would not fit: the caller stores the frame raw). */
int64_t kvec_encode(const uint8_t *src, size_t n_bytes, int stride, int window_log, uint8_t *dst, size_t cap) {
    return kvec_encode_version(src, n_bytes, stride, window_log, dst, cap, 0);
}

/* `version` 0: what kvfs writes (3 for frames of KV3_MIN_BYTES and more, else 2 for stride 1, 1 otherwise);
 * 1-3 force one (benchmarks and tests compare them on the same frames). Version 2 needs stride 1 and version
 * 1 a stride above 1: its stride-1 contexts (groups of 4, format.md) are only decoded, no longer written. */
int64_t kvec_encode_version(const uint8_t *src, size_t n_bytes, int stride, int window_log, uint8_t *dst,
                            size_t cap, int version) {
    if (stride < 1 || stride > MAX_STRIDE || window_log < 2 || window_log > 5 || n_bytes / 2 > 0xFFFFFFFFu ||
        version < 0 || version > KV3_VERSION || (version == VERSION_SIGNS && stride != 1) ||
        (version == VERSION_R && stride == 1))
        return KVEC_ERR_ARGS;
    if (version == KV3_VERSION || (version == 0 && n_bytes >= KV3_MIN_BYTES)) {
        if (n_bytes < 2) return KVEC_ERR_ARGS;
        return kv3_encode(src, n_bytes, dst, cap);
    }
    params_t p = {0};
    p.n = n_bytes / 2;
    p.version = version ? version : stride == 1 ? VERSION_SIGNS : VERSION_R;
    p.window_log = p.version == VERSION_SIGNS ? 4 : window_log;  /* version 2: the moving average's scale */
    p.stride = stride;
    p.n_streams = p.n >= 4096 ? 4 : 1;
    p.tail = (int)(n_bytes & 1);
    const size_t head = FIXED + 4 * (size_t)p.n_streams * (p.version == VERSION_SIGNS ? 2 : 1);
    if (cap < head + p.n + p.tail + PAD) return KVEC_ERR_CAPACITY;

    /* scratch: e, m, sign quads, then sums (stride > 1) or group sums (stride 1) */
    uint8_t *work = scratch(p.n * 4 + p.n / 4 + 128);
    if (!work) return KVEC_ERR_NOMEM;
    uint8_t *restrict e = work, *restrict m = work + p.n + 16, *restrict q = m + p.n + 16;
    uint16_t *sums = (uint16_t *)(((uintptr_t)(q + p.n / 4 + 1) + 3) & ~(uintptr_t)3);
    uint8_t *restrict r = dst + head;
    size_t r_len;
    if (p.version == VERSION_SIGNS) {
        split_signs(src, &p, e, q, r);
        r_len = packed_low_bytes(p.n);
    } else {
        const u16_unaligned *x = (const u16_unaligned *)src;
        for (size_t i = 0; i < p.n; i++) {  /* little-endian hosts (x86, arm64) */
            uint32_t v = x[i];
            e[i] = (uint8_t)(v >> 7);
            r[i] = (uint8_t)(((v >> 8) & 0x80) | (v & 0x7F));
        }
        r_len = p.n;
    }
    if (p.tail) r[r_len] = src[n_bytes - 1];
    uint32_t ehist[256] = {0};
    for (size_t i = 0; i < p.n; i += 7) ehist[e[i]]++;  /* fill: the most common value of a sample */
    int fill = 0;
    for (int s = 1; s < 256; s++) if (ehist[s] > ehist[fill]) fill = s;
    p.fill = fill;

    uint32_t mhist[256] = {0};
    context_means(e, m, sums, &p, mhist);
    p.n_ctx = choose_window(mhist, &p.ctx_lo);
    uint8_t clamp[256];
    for (int v = 0; v < 256; v++) {
        int c = v - p.ctx_lo;
        clamp[v] = (uint8_t)(c < 0 ? 0 : c >= p.n_ctx ? p.n_ctx - 1 : c);
    }
    int64_t size = encode_streams(e, m, q, clamp, &p, dst, cap, r + r_len + p.tail);
    if (size < 0) return size;
    dst[0] = (uint8_t)p.version; dst[1] = 0; dst[2] = (uint8_t)p.window_log; dst[3] = (uint8_t)p.n_streams;
    put_u32(dst + 4, (uint32_t)p.n);
    dst[8] = (uint8_t)(p.stride & 0xFF); dst[9] = (uint8_t)(p.stride >> 8);
    dst[10] = (uint8_t)p.ctx_lo; dst[11] = (uint8_t)p.n_ctx; dst[12] = (uint8_t)p.fill;
    dst[13] = MAX_LEN; dst[14] = (uint8_t)p.tail; dst[15] = 0;
    return size;
}

/* ---- decoder ---- */

typedef struct {
    const uint8_t *base; uint64_t pos, end; uint8_t *e; uint16_t *sums; size_t left; uint32_t S;
} stream_t;

/* Build the decode table of one context: entry = length | symbol << 8, 1 << L entries. (Length in the low
 * bits: shifts take the entry as their count, and summing entries sums lengths and symbols at once.) Codes must form a
 * complete prefix code (Huffman always does), except a single symbol of length 1. */
static int build_decode_table(const uint8_t *len, int L, uint16_t *tab) {
    uint32_t codes[256];
    int used = 0;
    uint64_t kraft = 0;
    for (int s = 0; s < 256; s++) {
        if (len[s] > L) return KVEC_ERR_FORMAT;
        if (len[s]) { used++; kraft += 1u << (L - len[s]); }
    }
    if (used == 0) {  /* a context no element uses: any entry is wrong data, caught by the stream checks */
        for (int i = 0; i < (1 << L); i++) tab[i] = 1;
        return 0;
    }
    if (used == 1 ? kraft != (1u << (L - 1)) : kraft != (1u << L)) return KVEC_ERR_FORMAT;
    canonical_codes(len, codes);
    for (int i = 0; i < (1 << L); i++) tab[i] = 1;
    for (int s = 0; s < 256; s++) {
        if (!len[s]) continue;
        uint32_t first = codes[s] << (L - len[s]), n = 1u << (L - len[s]);
        for (uint32_t k = 0; k < n; k++) tab[first + k] = (uint16_t)(len[s] | s << 8);
    }
    return 0;
}


/* The hot loops keep every stream's state in locals: stores through uint8_t pointers may alias anything,
 * so state in a struct would be reloaded after every symbol. */
#define STEPD(pos, base, e, sums)                                                             \
    do {                                                                                      \
        uint64_t v_ = load_be64((base) + ((pos) >> 3)) << ((pos) & 7);                        \
        uint32_t S_ = (sums)[0];                                                              \
        uint16_t ent_ = tab[ctxmap[S_] + (uint32_t)(v_ >> shift)];                            \
        uint32_t sym_ = ent_ >> 8;                                                            \
        (pos) += ent_ & 0xF;                                                                  \
        *(e) = (uint8_t)sym_;                                                                 \
        (sums)[d] = (uint16_t)(S_ + sym_ - (e)[-K * d]);                                      \
        (e)++; (sums)++;                                                                      \
    } while (0)

static int run_one(stream_t *st, size_t from, const uint16_t *restrict tab, const uint32_t *restrict ctxmap,
                   int L, int K, int d, int moving) {
    const int shift = 64 - L;
    uint64_t pos = st->pos;
    const uint64_t end = st->end;
    const uint8_t *base = st->base;
    uint8_t *e = st->e;
    uint16_t *sums = st->sums;
    uint32_t S = st->S, off = 0, group_sum = 0;
    for (size_t j = from; j < st->left; j++) {
        if (d == 1) {
            if (j % GROUP == 0) { off = ctxmap[S]; group_sum = 0; }
            uint64_t v = load_be64(base + (pos >> 3)) << (pos & 7);
            uint16_t ent = tab[off + (uint32_t)(v >> shift)];
            pos += ent & 0xF;
            *e = (uint8_t)(ent >> 8);
            if (!moving) S = S + (ent >> 8) - e[-K];
            else if ((group_sum += ent >> 8), j % GROUP == GROUP - 1) S = S - (S >> 2) + group_sum;
            e++;
        } else {
            STEPD(pos, base, e, sums);
        }
        if (pos > end) return KVEC_ERR_STREAM;
    }
    if ((pos + 7) / 8 != end / 8) return KVEC_ERR_STREAM;  /* every byte used, none more */
    return 0;
}

/* The common case (4 streams, stride 1, K = 16, L = MAX_LEN) with its state packed so it stays in
 * registers: per stream one word, bit position in the low half and the context window sum in the high. */
#define FAST_STEP(k)                                                                          \
    ent = tb[bb >> (64 - MAX_LEN)];                                                           \
    bb <<= ent & 63;                                                                          \
    acc += ent;                                                                               \
    ep[k] = (uint8_t)(ent >> 8);
#define FAST_GROUP(s, MOVING)                                                                 \
    do {                                                                                      \
        uint64_t w = state##s;                                                                \
        uint32_t pos = (uint32_t)w, ent, acc = 0;                                             \
        uint64_t bb = load_be64(base[s] + (pos >> 3)) << (pos & 7);                           \
        const uint16_t *tb = tab + ctxmap[w >> 32];                                           \
        uint8_t *ep = e[s] + j;                                                               \
        FAST_STEP(0) FAST_STEP(1) FAST_STEP(2) FAST_STEP(3)                                   \
        /* acc: lengths summed in the low byte (<= 44), symbols from bit 8 */                 \
        int32_t sum = (int32_t)(acc >> 8) -                                                   \
            (MOVING ? (int32_t)(w >> 34) : ep[-16] + ep[-15] + ep[-14] + ep[-13]);            \
        state##s = w + (acc & 0xFF) + ((uint64_t)(int64_t)sum << 32);                          \
        bad |= (uint32_t)state##s > end[s];                                                   \
    } while (0)

#define FAST4(name, MOVING)                                                                   \
static int name(stream_t *st, size_t rounds, const uint16_t *restrict tab, const uint32_t *restrict ctxmap) { \
    const uint8_t *base[4];                                                                   \
    uint8_t *e[4];                                                                            \
    uint64_t end[4];                                                                          \
    for (int s = 0; s < 4; s++) { base[s] = st[s].base; e[s] = st[s].e; end[s] = st[s].end; } \
    uint64_t state0 = (uint64_t)st[0].S << 32, state1 = (uint64_t)st[1].S << 32;              \
    uint64_t state2 = (uint64_t)st[2].S << 32, state3 = (uint64_t)st[3].S << 32;              \
    for (size_t j = 0; j < rounds; j += GROUP) {                                              \
        int bad = 0;                                                                          \
        FAST_GROUP(0, MOVING); FAST_GROUP(1, MOVING); FAST_GROUP(2, MOVING); FAST_GROUP(3, MOVING); \
        if (bad) return KVEC_ERR_STREAM;                                                      \
    }                                                                                         \
    uint64_t states[4] = {state0, state1, state2, state3};                                    \
    for (int s = 0; s < 4; s++) {                                                             \
        st[s].pos = (uint32_t)states[s];                                                      \
        st[s].S = (uint32_t)(states[s] >> 32);                                                \
        st[s].e += rounds;                                                                    \
    }                                                                                         \
    return 0;                                                                                 \
}
FAST4(fast4, 0)
FAST4(fast4_moving, 1)

/* Symbols every one of the 4 streams still has (their lengths differ by at most one). */
static size_t common_rounds(const stream_t *st) {
    size_t rounds = st[0].left;
    for (int s = 1; s < 4; s++) if (st[s].left < rounds) rounds = st[s].left;
    return rounds;
}

static int run_streams(stream_t *st, int n_streams, const uint16_t *restrict tab,
                       const uint32_t *restrict ctxmap, int L, int K, int d, int moving) {
    size_t rounds = 0;  /* symbols of each stream the 4-stream loops decode; run_one does the rest */
    if (n_streams == 4 && d == 1 && K == 16 && L == MAX_LEN) {
        rounds = common_rounds(st);
        rounds -= rounds % GROUP;
        int rc = moving ? fast4_moving(st, rounds, tab, ctxmap) : fast4(st, rounds, tab, ctxmap);
        if (rc) return rc;
    } else if (n_streams == 4 && d > 1) {
        const int shift = 64 - L;
        rounds = common_rounds(st);
        uint64_t p0 = 0, p1 = 0, p2 = 0, p3 = 0;
        const uint64_t n0 = st[0].end, n1 = st[1].end, n2 = st[2].end, n3 = st[3].end;
        const uint8_t *b0 = st[0].base, *b1 = st[1].base, *b2 = st[2].base, *b3 = st[3].base;
        uint8_t *e0 = st[0].e, *e1 = st[1].e, *e2 = st[2].e, *e3 = st[3].e;
        uint16_t *s0 = st[0].sums, *s1 = st[1].sums, *s2 = st[2].sums, *s3 = st[3].sums;
        for (size_t j = 0; j < rounds; j++) {
            STEPD(p0, b0, e0, s0); STEPD(p1, b1, e1, s1); STEPD(p2, b2, e2, s2); STEPD(p3, b3, e3, s3);
            if ((p0 > n0) | (p1 > n1) | (p2 > n2) | (p3 > n3)) return KVEC_ERR_STREAM;
        }
        st[0].sums = s0; st[1].sums = s1; st[2].sums = s2; st[3].sums = s3;
        st[0].pos = p0; st[1].pos = p1; st[2].pos = p2; st[3].pos = p3;
        st[0].e = e0; st[1].e = e1; st[2].e = e2; st[3].e = e3;
    }
    for (int s = 0; s < n_streams; s++) {
        int rc = run_one(&st[s], rounds, tab, ctxmap, L, K, d, moving);
        if (rc) return rc;
    }
    return 0;
}

/* Version 2: sign quads. An entry is length | quad << 4 | (set bits of quad) << (8 + SIGN_LEN), so the
 * next context's table offset is the sum of the last two entries' top fields: the dependency chain from one
 * quad to the next is one load and three ALU operations. Streams are decoded four at a time (independent
 * chains), four quads per refill: <= 4 * SIGN_LEN bits of the >= 57 a refill holds, and a refill happens
 * only while the position is inside the stream. */
typedef struct { const uint8_t *base; uint64_t pos, end; uint8_t *q; size_t quads; } sign_stream_t;

#define SIGN_STEP(v, pos, prev, cur, q)                                                       \
    do {                                                                                      \
        const uint32_t ent_ = stab[((prev + cur) >> 8) + (uint32_t)(v >> (64 - SIGN_LEN))];   \
        v <<= ent_ & 15;                                                                      \
        pos += ent_ & 15;                                                                     \
        *q++ = (uint8_t)(ent_ >> 4);                                                          \
        prev = cur;                                                                           \
        cur = ent_ & (0xF << (8 + SIGN_LEN));                                                 \
    } while (0)

#define SIGN_REFILL(v, pos, base) v = load_be64((base) + ((pos) >> 3)) << ((pos) & 7)

static int signs_one(sign_stream_t *ss, const uint32_t *restrict stab, uint32_t prev, uint32_t cur, size_t from) {
    uint64_t pos = ss->pos, v;
    uint8_t *q = ss->q;
    for (size_t g = from; g < ss->quads; g++) {
        SIGN_REFILL(v, pos, ss->base);
        SIGN_STEP(v, pos, prev, cur, q);
        if (pos > ss->end) return KVEC_ERR_STREAM;
    }
    return (pos + 7) / 8 == ss->end / 8 ? 0 : KVEC_ERR_STREAM;
}

static int decode_signs(sign_stream_t *ss, int n_streams, const uint32_t *restrict stab) {
    uint32_t prev[MAX_STREAMS] = {0}, cur[MAX_STREAMS] = {0};
    size_t done = 0;
    if (n_streams == 4) {
        size_t rounds = ss[0].quads;
        for (int s = 1; s < 4; s++) if (ss[s].quads < rounds) rounds = ss[s].quads;
        rounds -= rounds % 4;
        uint64_t p0 = 0, p1 = 0, p2 = 0, p3 = 0, v0, v1, v2, v3;
        uint32_t a0 = 0, a1 = 0, a2 = 0, a3 = 0, c0 = 0, c1 = 0, c2 = 0, c3 = 0;
        uint8_t *q0 = ss[0].q, *q1 = ss[1].q, *q2 = ss[2].q, *q3 = ss[3].q;
        for (size_t g = 0; g < rounds; g += 4) {
            SIGN_REFILL(v0, p0, ss[0].base); SIGN_REFILL(v1, p1, ss[1].base);
            SIGN_REFILL(v2, p2, ss[2].base); SIGN_REFILL(v3, p3, ss[3].base);
            for (int k = 0; k < 4; k++) {
                SIGN_STEP(v0, p0, a0, c0, q0); SIGN_STEP(v1, p1, a1, c1, q1);
                SIGN_STEP(v2, p2, a2, c2, q2); SIGN_STEP(v3, p3, a3, c3, q3);
            }
            if ((p0 > ss[0].end) | (p1 > ss[1].end) | (p2 > ss[2].end) | (p3 > ss[3].end)) return KVEC_ERR_STREAM;
        }
        uint64_t ps[4] = {p0, p1, p2, p3};
        uint32_t as[4] = {a0, a1, a2, a3}, cs[4] = {c0, c1, c2, c3};
        uint8_t *qs[4] = {q0, q1, q2, q3};
        for (int s = 0; s < 4; s++) { ss[s].pos = ps[s]; ss[s].q = qs[s]; prev[s] = as[s]; cur[s] = cs[s]; }
        done = rounds;
    }
    for (int s = 0; s < n_streams; s++) {
        int rc = signs_one(&ss[s], stab, prev[s], cur[s], done);
        if (rc) return rc;
    }
    return 0;
}

/* Read n_ctx tables of 4-bit lengths (u8 first, u8 last, lengths) into lens. */
static int read_tables(const uint8_t *src, size_t src_len, size_t *off, int n_ctx, uint8_t (*lens)[256]) {
    for (int c = 0; c < n_ctx; c++) {
        if (*off + 2 > src_len) return KVEC_ERR_FORMAT;
        int first = src[*off], last = src[*off + 1];
        *off += 2;
        if (first > last) continue;
        size_t nl = (size_t)(last - first + 1);
        if (*off + (nl + 1) / 2 > src_len) return KVEC_ERR_FORMAT;
        for (size_t k = 0; k < nl; k++) lens[c][first + k] = (src[*off + k / 2] >> (4 * (k & 1))) & 0xF;
        *off += (nl + 1) / 2;
    }
    return 0;
}

/* Version 2's sign tables (SIGN_CTX tables of 16 lengths, two per byte) as decode entries (see above). */
static int read_sign_tables(const uint8_t *src, size_t src_len, size_t *off, uint32_t *stab) {
    if (*off + SIGN_CTX * 8 > src_len) return KVEC_ERR_FORMAT;
    uint16_t t[1 << SIGN_LEN];
    for (int c = 0; c < SIGN_CTX; c++) {
        uint8_t lens[256] = {0};
        for (int k = 0; k < 16; k++) lens[k] = (src[*off + k / 2] >> (4 * (k & 1))) & 0xF;
        *off += 8;
        int rc = build_decode_table(lens, SIGN_LEN, t);
        if (rc) return rc;
        for (int i = 0; i < (1 << SIGN_LEN); i++) {
            uint32_t quad = (t[i] >> 8) & 15;  /* entries of unused contexts hold symbol 0 */
            stab[(c << SIGN_LEN) + i] = (t[i] & 15) | quad << 4 | (uint32_t)POP8[quad] << (8 + SIGN_LEN);
        }
    }
    return 0;
}

/* Version 2: x from e (per stream), the sign quads and the packed low bits, for elements [a, b). */
static void join_signs(const uint8_t *restrict e, const uint8_t *restrict q, const uint8_t *restrict low,
                       size_t n, size_t a, size_t b, u16_unaligned *restrict out) {
    const size_t full = n / ALIGN * ALIGN;
    size_t i = a;
    for (; i + ALIGN <= b && i + ALIGN <= full; i += ALIGN) {
        const uint32_t qw = get_u32(q + i / 4);
        const uint32_t signs = (qw & 0xF) | (qw >> 4 & 0xF0) | (qw >> 8 & 0xF00) | (qw >> 12 & 0xF000);
        join16(e + i, signs, low + i / ALIGN * 14, out + i);
    }
    for (; i < b; i++) {  /* the last stream's elements past the last whole group of 16 */
        uint32_t mv = low[full / ALIGN * 14 + (i - full)] & 0x7F;
        out[i] = (uint16_t)(((q[i / 4] >> (i % 4)) & 1) << 15 | (uint32_t)e[i] << 7 | mv);
    }
}

/* Decode src (src_len bytes) into dst, which must be exactly n_bytes long. 0, or a negative code. */
int kvec_decode(const uint8_t *src, size_t src_len, uint8_t *dst, size_t n_bytes) {
    if (src_len > 0 && src[0] == KV3_VERSION) return kv3_decode(src, src_len, dst, n_bytes);
    if (src_len < FIXED + PAD) return KVEC_ERR_FORMAT;
    params_t p = {0};
    p.version = src[0];
    p.window_log = src[2]; p.n_streams = src[3]; p.stride = src[8] | src[9] << 8;
    p.ctx_lo = src[10]; p.n_ctx = src[11]; p.fill = src[12]; p.tail = src[14];
    p.n = get_u32(src + 4);
    const int L = src[13];
    const int signs = p.version == VERSION_SIGNS;
    if ((p.version != VERSION_R && !signs) || src[1] != 0 || src[15] != 0 || p.window_log < 2 ||
        p.window_log > 5 || p.n_streams < 1 || p.n_streams > MAX_STREAMS || p.stride < 1 ||
        p.stride > MAX_STRIDE || (signs && (p.stride != 1 || p.window_log != 4)) || p.n_ctx < 1 ||
        p.n_ctx > MAX_CTX || p.ctx_lo + p.n_ctx > 256 || L < 1 || L > MAX_LEN || p.tail != (int)(n_bytes & 1) ||
        p.n != n_bytes / 2)
        return KVEC_ERR_FORMAT;
    const size_t n = p.n;
    const int K = 1 << p.window_log, d = p.stride, n_streams = p.n_streams;
    const size_t r_len = signs ? packed_low_bytes(n) : n;
    const int n_sizes = signs ? 2 * n_streams : n_streams;  /* version 2: sign streams after the others */
    size_t off = FIXED + 4 * (size_t)n_sizes;
    if (off + r_len + p.tail > src_len) return KVEC_ERR_FORMAT;
    const uint8_t *r = src + off;
    off += r_len + p.tail;

    static __thread uint8_t lens[MAX_CTX][256];
    static __thread uint32_t sign_tables[SIGN_CTX << SIGN_LEN];
    memset(lens, 0, sizeof lens);
    int rc = read_tables(src, src_len, &off, p.n_ctx, lens);
    if (rc) return rc;
    if (signs && (rc = read_sign_tables(src, src_len, &off, sign_tables))) return rc;
    size_t total = 0;
    for (int s = 0; s < n_sizes; s++) total += get_u32(src + FIXED + 4 * s);
    if (off + total + PAD != src_len) return KVEC_ERR_FORMAT;

    /* scratch: decode tables, sum -> table offset map, per-stream e and sum regions with history prefixes,
     * sign quads */
    const size_t tab_len = (size_t)p.n_ctx << L, map_len = (size_t)K * 255 + 1;
    const size_t hist = (size_t)(K + 1) * d;
    const size_t e_len = n + n_streams * hist, sums_len = n + n_streams * (size_t)d + n_streams;
    uint8_t *work = scratch(tab_len * 2 + map_len * 4 + e_len + 16 + sums_len * 2 + n / 4 + 72);
    if (!work) return KVEC_ERR_NOMEM;
    uint16_t *tab = (uint16_t *)work;
    uint32_t *ctxmap = (uint32_t *)(work + ((tab_len * 2 + 3) & ~(size_t)3));
    uint16_t *sums_all = (uint16_t *)((uint8_t *)(ctxmap + map_len));
    uint8_t *e_all = (uint8_t *)(sums_all + sums_len);
    uint8_t *q_all = e_all + e_len + 16;  /* e: 16 bytes of slack for whole-group loads */

    for (int c = 0; c < p.n_ctx; c++) {
        rc = build_decode_table(lens[c], L, tab + ((size_t)c << L));
        if (rc) return rc;
    }
    for (size_t S = 0; S < map_len; S++) {
        int m = (int)((S + (size_t)(K >> 1)) >> p.window_log) - p.ctx_lo;
        ctxmap[S] = (uint32_t)(m < 0 ? 0 : m >= p.n_ctx ? p.n_ctx - 1 : m) << L;
    }

    stream_t st[MAX_STREAMS];
    const uint8_t *streams = src + off;
    uint8_t *e_region = e_all;
    uint16_t *s_region = sums_all;
    for (int s = 0; s < n_streams; s++) {
        size_t a = stream_start(&p, s), b = stream_start(&p, s + 1);
        size_t size = get_u32(src + FIXED + 4 * s);
        memset(e_region, p.fill, hist);
        for (int k = 0; k < d; k++) s_region[k] = (uint16_t)(K * p.fill);
        st[s].base = streams;
        st[s].pos = 0;
        st[s].end = (uint64_t)size * 8;
        st[s].e = e_region + hist;
        st[s].sums = s_region;
        st[s].left = b - a;
        st[s].S = (uint32_t)K * p.fill;
        streams += size;
        e_region += hist + (b - a);
        s_region += d + (b - a) + 1;
    }
    uint8_t *e_first[MAX_STREAMS];
    for (int s = 0; s < n_streams; s++) e_first[s] = st[s].e;
    rc = run_streams(st, n_streams, tab, ctxmap, L, K, d, signs);
    if (rc) return rc;
    if (signs) {
        sign_stream_t ss[MAX_STREAMS];
        for (int s = 0; s < n_streams; s++) {
            size_t a = stream_start(&p, s), b = stream_start(&p, s + 1);
            size_t size = get_u32(src + FIXED + 4 * (n_streams + s));
            ss[s] = (sign_stream_t){streams, 0, (uint64_t)size * 8, q_all + a / GROUP, (b - a + 3) / 4};
            streams += size;
        }
        if ((rc = decode_signs(ss, n_streams, sign_tables))) return rc;
    }

    u16_unaligned *out16 = (u16_unaligned *)dst;
    for (int s = 0; s < n_streams; s++) {
        size_t a = stream_start(&p, s), b = stream_start(&p, s + 1);
        const uint8_t *restrict e = e_first[s] - a;
        if (signs) {
            join_signs(e, q_all, r, n, a, b, out16);
            continue;
        }
        for (size_t i = a; i < b; i++) {
            uint32_t ev = e[i], rv = r[i];
            out16[i] = (uint16_t)((rv & 0x80) << 8 | ev << 7 | (rv & 0x7F));
        }
    }
    if (p.tail) dst[n_bytes - 1] = r[r_len];
    return 0;
}
