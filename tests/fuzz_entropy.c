/* Corrupt-payload driver for tests/test_entropy.py, built with AddressSanitizer and UBSan around the codec
 * kernel: every frame (64 KiB to 1 MiB slices of the given files, odd lengths too) round-trips, then its
 * payload, copied into a buffer of exactly its size, gets bytes flipped and is cut short; each must be
 * rejected or decoded (to other bytes) without any read or write out of bounds. Prints the counts. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int64_t kvec_encode(const uint8_t *src, size_t n_bytes, int stride, int window_log, uint8_t *dst, size_t cap);
int kvec_decode(const uint8_t *src, size_t src_len, uint8_t *dst, size_t n_bytes);

static uint64_t state = 88172645463325252ull;
static uint64_t rnd(void) { state ^= state << 13; state ^= state >> 7; state ^= state << 17; return state; }

static uint8_t *copy_of(const uint8_t *p, size_t n) {
    uint8_t *q = malloc(n ? n : 1);
    memcpy(q, p, n);
    return q;
}

int main(int argc, char **argv) {
    const int frames = atoi(argv[1]);
    long rejected = 0, decoded = 0;
    for (int a = 2; a < argc; a++) {
        FILE *f = fopen(argv[a], "rb");
        if (!f) return 2;
        fseek(f, 0, SEEK_END);
        const size_t size = (size_t)ftell(f);
        fseek(f, 0, SEEK_SET);
        uint8_t *data = malloc(size);
        if (size < (1 << 17) || fread(data, 1, size, f) != size) return 2;
        fclose(f);
        for (int it = 0; it < frames; it++) {
            const size_t most = size < (1 << 20) ? size : (1 << 20);
            size_t len = 65536 + rnd() % (most - 65536), start = rnd() % (size - len + 1);
            if (rnd() % 2 && start + (len | 1) <= size) len |= 1;
            uint8_t *src = copy_of(data + start, len), *out = malloc(len), *pay = malloc(len + 9000);
            const int64_t c = kvec_encode(src, len, 1, 4, pay, len + 9000);
            if (c > 0) {
                uint8_t *exact = copy_of(pay, (size_t)c);
                if (kvec_decode(exact, (size_t)c, out, len) != 0 || memcmp(out, src, len) != 0) return 3;
                for (int k = 0; k < 20; k++) {
                    uint8_t *bad = copy_of(exact, (size_t)c);
                    for (int j = 1 + (int)(rnd() % 4); j > 0; j--) bad[rnd() % (size_t)c] ^= (uint8_t)(1 + rnd() % 255);
                    const size_t cut = rnd() % 3 ? (size_t)c : rnd() % (size_t)c;
                    uint8_t *piece = copy_of(bad, cut);
                    if (kvec_decode(piece, cut, out, len)) rejected++; else decoded++;
                    free(bad);
                    free(piece);
                }
                free(exact);
            }
            free(src);
            free(out);
            free(pay);
        }
        free(data);
    }
    printf("%ld rejected %ld decoded\n", rejected, decoded);
    return 0;
}
