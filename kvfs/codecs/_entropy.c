/* Codec 4 ("entropy"): context-modelled canonical Huffman for 16-bit floats (bf16, fp16).
 *
 * Each 16-bit little-endian element x splits into
 *     e = (x >> 7) & 0xFF                    the exponent byte (bf16: the 8 exponent bits; fp16: 5 + 3 mantissa)
 *     r = ((x >> 8) & 0x80) | (x & 0x7F)     sign + 7 low bits: noise, stored as they are
 * e is Huffman-coded with a table chosen by its context: the rounded mean of the K previous e values at a
 * stride d (d = distance between neighbouring tokens of one channel, from the shape hint; 1 otherwise).
 * That context stands in for per-channel statistics without sending any: a channel's exponents stay close
 * to their running mean. The byte-level format is docs/format.md ("codec 4"); keep the two in step.
 *
 * Safety: kvec_decode never reads or writes out of bounds on any input (every field is checked, every
 * stream is padded and its bit position bounded); it returns a negative code on any inconsistency.
 * Loaded with ctypes (kvfs/codecs/entropy.py), which releases the GIL around both calls.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define VERSION 1
#define FIXED 16          /* bytes of the fixed payload header */
#define MAX_STREAMS 8
#define MAX_CTX 64
#define MAX_LEN 11        /* longest code; decode tables have 1 << MAX_LEN entries per context */
#define MAX_STRIDE 4096
#define GROUP 4           /* stride 1: elements that share one context (and one table lookup base) */
#define PAD 16            /* zero bytes after the last stream: 8-byte loads never leave the payload */

typedef uint16_t u16_unaligned __attribute__((aligned(1), may_alias));
typedef uint32_t u32_unaligned __attribute__((aligned(1), may_alias));

enum { KVEC_ERR_CAPACITY = -1, KVEC_ERR_FORMAT = -2, KVEC_ERR_STREAM = -3, KVEC_ERR_ARGS = -4,
       KVEC_ERR_NOMEM = -5 };

/* ---- per-thread scratch: frames are ~1 MiB, so keep the buffers instead of faulting in fresh ones ---- */

typedef struct { uint8_t *buf; size_t cap; } scratch_t;
static __thread scratch_t planes_scratch, tables_scratch;

static uint8_t *grow(scratch_t *sc, size_t n) {
    if (n > sc->cap) {
        free(sc->buf);
        sc->buf = malloc(n);
        sc->cap = sc->buf ? n : 0;
    }
    return sc->buf;
}

static uint8_t *scratch(size_t n) { return grow(&planes_scratch, n); }

static inline void put_u32(uint8_t *p, uint32_t v) { p[0] = v; p[1] = v >> 8; p[2] = v >> 16; p[3] = v >> 24; }
static inline uint32_t get_u32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
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

/* ---- encoder ---- */

typedef struct { int n_streams, window_log, stride, n_ctx, ctx_lo, fill; size_t n; } params_t;

static inline size_t stream_start(size_t n, int n_streams, int s) { return n * (size_t)s / (size_t)n_streams; }

/* Stride 1: the mean of the K values before each group of GROUP, from group sums (vectorisable passes).
 * History before the stream's first element is `fill`. G has room for n / GROUP + K / GROUP + 1 sums. */
static void group_means(const uint8_t *restrict e, uint8_t *restrict m, size_t n, const params_t *p,
                        uint32_t *restrict G, uint32_t *mhist) {
    const size_t KG = (size_t)1 << (p->window_log - 2), full = n / GROUP, groups = (n + GROUP - 1) / GROUP;
    for (size_t k = 0; k < KG; k++) G[k] = (uint32_t)(GROUP * p->fill);
    const u32_unaligned *x = (const u32_unaligned *)e;
    for (size_t j = 0; j < full; j++) {
        uint32_t v = x[j];
        G[KG + j] = (v & 0xFF) + ((v >> 8) & 0xFF) + ((v >> 16) & 0xFF) + (v >> 24);
    }
    u32_unaligned *out = (u32_unaligned *)m;
    const int half = 1 << (p->window_log - 1), shift = p->window_log;
    if (KG == 4) {
        for (size_t j = 0; j < full; j++)
            out[j] = ((G[j] + G[j + 1] + G[j + 2] + G[j + 3] + half) >> shift) * 0x01010101u;
    } else {
        for (size_t j = 0; j < full; j++) {
            uint32_t S = 0;
            for (size_t t = 0; t < KG; t++) S += G[j + t];
            out[j] = ((S + half) >> shift) * 0x01010101u;
        }
    }
    if (groups > full) {  /* a last, partial group */
        uint32_t S = 0;
        for (size_t t = 0; t < KG; t++) S += G[full + t];
        memset(m + full * GROUP, (int)((S + half) >> shift), n - full * GROUP);
    }
    for (size_t j = 0; j < groups; j += 8) mhist[m[j * GROUP]]++;  /* a sample: it only places the window */
}

/* Context of every element: round(mean of the K previous e at stride d), history before a stream's first
 * element being `fill`; the encoder clamps it to a table index. Also counts (a sample of) the means in
 * mhist, which the caller zeroes. */
static void context_means(const uint8_t *e, uint8_t *m, uint16_t *sums, const params_t *p, uint32_t *mhist) {
    const int K = 1 << p->window_log, d = p->stride;
    for (int s = 0; s < p->n_streams; s++) {
        size_t a = stream_start(p->n, p->n_streams, s), b = stream_start(p->n, p->n_streams, s + 1);
        if (d == 1) {  /* one context per GROUP elements: the decoder looks up one table per group */
            group_means(e + a, m + a, b - a, p, (uint32_t *)sums, mhist);
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


/* m holds the context means; clamp maps them to table indices. */
static int64_t encode_streams(const uint8_t *restrict e, const uint8_t *restrict m, const uint8_t *clamp,
                              const params_t *p, uint8_t *dst, size_t cap, uint8_t *out) {
    /* count per (context, symbol), in four tables for the same reason as the e sample */
    const size_t cnt_bytes = 4 * sizeof(uint32_t[MAX_CTX][256]);
    uint8_t *tables = grow(&tables_scratch, cnt_bytes + sizeof(uint32_t[MAX_CTX][256]));
    if (!tables) return KVEC_ERR_NOMEM;
    uint32_t (*cnt)[MAX_CTX][256] = (uint32_t (*)[MAX_CTX][256])tables;
    uint32_t (*code)[256] = (uint32_t (*)[256])(tables + cnt_bytes);  /* code << 4 | length */
    for (int k = 0; k < 4; k++) memset(cnt[k], 0, (size_t)p->n_ctx * sizeof cnt[k][0]);
    size_t i = 0;
    if (p->stride == 1) {  /* one context per group of 4, groups counted from each stream's start */
        for (int s = 0; s < p->n_streams; s++) {
            size_t j = stream_start(p->n, p->n_streams, s), b = stream_start(p->n, p->n_streams, s + 1);
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
    uint64_t total_bits = 0;
    int64_t rc = 0;
    for (int c = 0; c < p->n_ctx; c++) {
        uint32_t count[256], codes[256];
        uint8_t lens[256];
        for (int k = 0; k < 256; k++) count[k] = cnt[0][c][k] + cnt[1][c][k] + cnt[2][c][k] + cnt[3][c][k];
        huffman_lengths(count, lens, MAX_LEN);
        canonical_codes(lens, codes);
        for (int k = 0; k < 256; k++) { code[c][k] = codes[k] << 4 | lens[k]; total_bits += (uint64_t)count[k] * lens[k]; }
        /* table: u8 first, u8 last (first > last: empty), 4-bit lengths, low nibble first */
        int first = 0, last = 255;
        while (first < 256 && !lens[first]) first++;
        while (last >= 0 && !lens[last]) last--;
        if (first > last) { first = 1; last = 0; }
        size_t nl = (size_t)(last - first + 1);
        if ((size_t)(out - dst) + 2 + (nl + 1) / 2 + PAD > cap) { rc = KVEC_ERR_CAPACITY; goto done; }
        *out++ = (uint8_t)first;
        *out++ = (uint8_t)last;
        for (size_t k = 0; k < nl; k += 2)
            *out++ = (uint8_t)(lens[first + k] | (k + 1 < nl ? lens[first + k + 1] : 0) << 4);
    }
    /* streams end on byte boundaries: at most 7 padding bits each */
    if ((size_t)(out - dst) + total_bits / 8 + (size_t)p->n_streams + PAD > cap) { rc = KVEC_ERR_CAPACITY; goto done; }
    for (int s = 0; s < p->n_streams; s++) {
        size_t a = stream_start(p->n, p->n_streams, s), b = stream_start(p->n, p->n_streams, s + 1);
        uint8_t *w = out;
        uint64_t acc = 0;
        uint32_t nb = 0;
        size_t j = a;
        for (; j + 4 <= b; j += 4) {  /* <= 7 + 4 * MAX_LEN bits in acc, then whole bytes out (8-byte store) */
            const uint32_t *group_code = code[clamp[m[j]]];  /* stride 1: one context per group of 4 */
            for (int k = 0; k < 4; k++) {
                uint32_t cl = p->stride == 1 ? group_code[e[j + k]] : code[clamp[m[j + k]]][e[j + k]];
                acc = (acc << (cl & 15)) | (cl >> 4);
                nb += cl & 15;
            }
            store_be64(w, acc << (64 - nb));
            w += nb >> 3;
            nb &= 7;
        }
        for (; j < b; j++) {
            uint32_t cl = code[clamp[m[j]]][e[j]];
            acc = (acc << (cl & 15)) | (cl >> 4);
            nb += cl & 15;
            if (nb >= 8) { store_be64(w, acc << (64 - nb)); w += nb >> 3; nb &= 7; }
        }
        if (nb) *w++ = (uint8_t)(acc << (8 - nb));
        put_u32(dst + FIXED + 4 * s, (uint32_t)(w - out));
        out = w;
    }
    memset(out, 0, PAD);
    rc = (int64_t)(out + PAD - dst);
done:
    return rc;
}

/* Encode n_bytes of src into dst (capacity cap). Returns the payload size, or a negative code
 * (KVEC_ERR_CAPACITY when the result would not fit: the caller stores the frame raw). */
int64_t kvec_encode(const uint8_t *src, size_t n_bytes, int stride, int window_log, uint8_t *dst, size_t cap) {
    if (stride < 1 || stride > MAX_STRIDE || window_log < 2 || window_log > 5 || n_bytes / 2 > 0xFFFFFFFFu)
        return KVEC_ERR_ARGS;
    params_t p = {0};
    p.n = n_bytes / 2;
    p.window_log = window_log;
    p.stride = stride;
    p.n_streams = p.n >= 4096 ? 4 : 1;
    const int tail = (int)(n_bytes & 1);
    const size_t head = FIXED + 4 * (size_t)p.n_streams;
    if (cap < head + p.n + tail + PAD) return KVEC_ERR_CAPACITY;

    uint8_t *work = scratch(p.n * 4 + 64);  /* e, m, then sums (stride > 1) or group sums (stride 1) */
    if (!work) return KVEC_ERR_NOMEM;
    uint8_t *restrict e = work, *restrict m = work + p.n;
    uint16_t *sums = (uint16_t *)(work + ((2 * p.n + 3) & ~(size_t)3));
    uint8_t *restrict r = dst + head;
    const u16_unaligned *x = (const u16_unaligned *)src;
    for (size_t i = 0; i < p.n; i++) {  /* little-endian hosts (x86, arm64) */
        uint32_t v = x[i];
        e[i] = (uint8_t)(v >> 7);
        r[i] = (uint8_t)(((v >> 8) & 0x80) | (v & 0x7F));
    }
    if (tail) r[p.n] = src[n_bytes - 1];
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
    int64_t size = encode_streams(e, m, clamp, &p, dst, cap, r + p.n + tail);
    if (size < 0) return size;
    dst[0] = VERSION; dst[1] = 0; dst[2] = (uint8_t)p.window_log; dst[3] = (uint8_t)p.n_streams;
    put_u32(dst + 4, (uint32_t)p.n);
    dst[8] = (uint8_t)(p.stride & 0xFF); dst[9] = (uint8_t)(p.stride >> 8);
    dst[10] = (uint8_t)p.ctx_lo; dst[11] = (uint8_t)p.n_ctx; dst[12] = (uint8_t)p.fill;
    dst[13] = MAX_LEN; dst[14] = (uint8_t)tail; dst[15] = 0;
    return size;
}

/* ---- decoder ---- */

typedef struct { const uint8_t *base; uint64_t pos, end; uint8_t *e; uint16_t *sums; size_t left; uint32_t S; } stream_t;

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
                   int L, int K, int d) {
    const int shift = 64 - L;
    uint64_t pos = st->pos;
    const uint64_t end = st->end;
    const uint8_t *base = st->base;
    uint8_t *e = st->e;
    uint16_t *sums = st->sums;
    uint32_t S = st->S, off = 0;
    for (size_t j = from; j < st->left; j++) {
        if (d == 1) {
            if (j % GROUP == 0) off = ctxmap[S];
            uint64_t v = load_be64(base + (pos >> 3)) << (pos & 7);
            uint16_t ent = tab[off + (uint32_t)(v >> shift)];
            pos += ent & 0xF;
            *e = (uint8_t)(ent >> 8);
            S = S + (ent >> 8) - e[-K];
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
#define FAST_GROUP(s)                                                                         \
    do {                                                                                      \
        uint64_t w = state##s;                                                                \
        uint32_t pos = (uint32_t)w, ent, acc = 0;                                             \
        uint64_t bb = load_be64(base[s] + (pos >> 3)) << (pos & 7);                           \
        const uint16_t *tb = tab + ctxmap[w >> 32];                                           \
        uint8_t *ep = e[s] + j;                                                               \
        FAST_STEP(0) FAST_STEP(1) FAST_STEP(2) FAST_STEP(3)                                   \
        /* acc: lengths summed in the low byte (<= 44), symbols from bit 8 */                 \
        int32_t sum = (int32_t)(acc >> 8) - (ep[-16] + ep[-15] + ep[-14] + ep[-13]);           \
        state##s = w + (acc & 0xFF) + ((uint64_t)(int64_t)sum << 32);                          \
        bad |= (uint32_t)state##s > end[s];                                                   \
    } while (0)

static int fast4(stream_t *st, size_t rounds, const uint16_t *restrict tab, const uint32_t *restrict ctxmap) {
    const uint8_t *base[4];
    uint8_t *e[4];
    uint64_t end[4];
    for (int s = 0; s < 4; s++) { base[s] = st[s].base; e[s] = st[s].e; end[s] = st[s].end; }
    uint64_t state0 = (uint64_t)st[0].S << 32, state1 = (uint64_t)st[1].S << 32;
    uint64_t state2 = (uint64_t)st[2].S << 32, state3 = (uint64_t)st[3].S << 32;
    for (size_t j = 0; j < rounds; j += GROUP) {
        int bad = 0;
        FAST_GROUP(0); FAST_GROUP(1); FAST_GROUP(2); FAST_GROUP(3);
        if (bad) return KVEC_ERR_STREAM;
    }
    uint64_t states[4] = {state0, state1, state2, state3};
    for (int s = 0; s < 4; s++) {
        st[s].pos = (uint32_t)states[s];
        st[s].S = (uint32_t)(states[s] >> 32);
        st[s].e += rounds;
    }
    return 0;
}

/* Symbols every one of the 4 streams still has (their lengths differ by at most one). */
static size_t common_rounds(const stream_t *st) {
    size_t rounds = st[0].left;
    for (int s = 1; s < 4; s++) if (st[s].left < rounds) rounds = st[s].left;
    return rounds;
}

static int run_streams(stream_t *st, int n_streams, const uint16_t *restrict tab,
                       const uint32_t *restrict ctxmap, int L, int K, int d) {
    size_t rounds = 0;  /* symbols of each stream the 4-stream loops decode; run_one does the rest */
    if (n_streams == 4 && d == 1 && K == 16 && L == MAX_LEN) {
        rounds = common_rounds(st);
        rounds -= rounds % GROUP;
        int rc = fast4(st, rounds, tab, ctxmap);
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
        int rc = run_one(&st[s], rounds, tab, ctxmap, L, K, d);
        if (rc) return rc;
    }
    return 0;
}

/* Decode src (src_len bytes) into dst, which must be exactly n_bytes long. 0, or a negative code. */
int kvec_decode(const uint8_t *src, size_t src_len, uint8_t *dst, size_t n_bytes) {
    if (src_len < FIXED + PAD) return KVEC_ERR_FORMAT;
    const int window_log = src[2], n_streams = src[3], stride = src[8] | src[9] << 8;
    const int ctx_lo = src[10], n_ctx = src[11], fill = src[12], L = src[13], tail = src[14];
    const size_t n = get_u32(src + 4);
    if (src[0] != VERSION || src[1] != 0 || src[15] != 0 || window_log < 2 || window_log > 5 ||
        n_streams < 1 || n_streams > MAX_STREAMS || stride < 1 || stride > MAX_STRIDE || n_ctx < 1 ||
        n_ctx > MAX_CTX || ctx_lo + n_ctx > 256 || L < 1 || L > MAX_LEN || tail != (int)(n_bytes & 1) ||
        n != n_bytes / 2)
        return KVEC_ERR_FORMAT;
    const int K = 1 << window_log, d = stride;
    size_t off = FIXED + 4 * (size_t)n_streams;
    if (off + n + tail > src_len) return KVEC_ERR_FORMAT;
    const uint8_t *r = src + off;
    off += n + tail;

    static __thread uint8_t lens[MAX_CTX][256];
    memset(lens, 0, sizeof lens);
    for (int c = 0; c < n_ctx; c++) {
        if (off + 2 > src_len) return KVEC_ERR_FORMAT;
        int first = src[off], last = src[off + 1];
        off += 2;
        if (first > last) continue;
        size_t nl = (size_t)(last - first + 1);
        if (off + (nl + 1) / 2 > src_len) return KVEC_ERR_FORMAT;
        for (size_t k = 0; k < nl; k++) lens[c][first + k] = (src[off + k / 2] >> (4 * (k & 1))) & 0xF;
        off += (nl + 1) / 2;
    }
    size_t total = 0;
    for (int s = 0; s < n_streams; s++) total += get_u32(src + FIXED + 4 * s);
    if (off + total + PAD != src_len) return KVEC_ERR_FORMAT;

    /* scratch: decode tables, sum -> table offset map, per-stream e and sum regions with history prefixes */
    const size_t tab_len = (size_t)n_ctx << L, map_len = (size_t)K * 255 + 1;
    const size_t hist = (size_t)(K + 1) * d;
    const size_t e_len = n + n_streams * hist, sums_len = n + n_streams * (size_t)d + n_streams;
    uint8_t *work = scratch(tab_len * 2 + map_len * 4 + e_len + sums_len * 2 + 64);
    if (!work) return KVEC_ERR_NOMEM;
    uint16_t *tab = (uint16_t *)work;
    uint32_t *ctxmap = (uint32_t *)(work + ((tab_len * 2 + 3) & ~(size_t)3));
    uint16_t *sums_all = (uint16_t *)((uint8_t *)(ctxmap + map_len));
    uint8_t *e_all = (uint8_t *)(sums_all + sums_len);

    for (int c = 0; c < n_ctx; c++) {
        int rc = build_decode_table(lens[c], L, tab + ((size_t)c << L));
        if (rc) return rc;
    }
    for (size_t S = 0; S < map_len; S++) {
        int m = (int)((S + (size_t)(K >> 1)) >> window_log) - ctx_lo;
        ctxmap[S] = (uint32_t)(m < 0 ? 0 : m >= n_ctx ? n_ctx - 1 : m) << L;
    }

    stream_t st[MAX_STREAMS];
    const uint8_t *streams = src + off;
    uint8_t *e_region = e_all;
    uint16_t *s_region = sums_all;
    for (int s = 0; s < n_streams; s++) {
        size_t a = stream_start(n, n_streams, s), b = stream_start(n, n_streams, s + 1);
        size_t size = get_u32(src + FIXED + 4 * s);
        memset(e_region, fill, hist);
        for (int k = 0; k < d; k++) s_region[k] = (uint16_t)(K * fill);
        st[s].base = streams;
        st[s].pos = 0;
        st[s].end = (uint64_t)size * 8;
        st[s].e = e_region + hist;
        st[s].sums = s_region;
        st[s].left = b - a;
        st[s].S = (uint32_t)K * fill;
        streams += size;
        e_region += hist + (b - a);
        s_region += d + (b - a) + 1;
    }
    uint8_t *e_first[MAX_STREAMS];
    for (int s = 0; s < n_streams; s++) e_first[s] = st[s].e;
    int rc = run_streams(st, n_streams, tab, ctxmap, L, K, d);
    if (rc) return rc;

    u16_unaligned *out16 = (u16_unaligned *)dst;
    for (int s = 0; s < n_streams; s++) {
        size_t a = stream_start(n, n_streams, s), b = stream_start(n, n_streams, s + 1);
        const uint8_t *restrict e = e_first[s] - a;
        for (size_t i = a; i < b; i++) {
            uint32_t ev = e[i], rv = r[i];
            out16[i] = (uint16_t)((rv & 0x80) << 8 | ev << 7 | (rv & 0x7F));
        }
    }
    if (tail) dst[n_bytes - 1] = r[n];
    return 0;
}
