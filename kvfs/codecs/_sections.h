/* Sections (_sections.c): a byte string in pieces of <= 128 KiB, each a u32 (size << 2 | mode) and its payload
 * (raw, one repeated byte, or huff0-coded). Shared by codec 4 version 3 (_classes.c) and codec 5 (_entropy8.c). */
#ifndef KVFS_SECTIONS_H
#define KVFS_SECTIONS_H
#include <stddef.h>
#include <stdint.h>

#define SECTION_PIECE (128 * 1024)
enum { SECTION_ERR_CAPACITY = -1, SECTION_ERR_FORMAT = -2, SECTION_ERR_STREAM = -3 };

/* The m bytes at s as a section at out (cap bytes): its length, or SECTION_ERR_CAPACITY. */
__attribute__((visibility("hidden"))) int64_t put_section(const uint8_t *s, size_t m, uint8_t *out, size_t cap);
/* A section of m decoded bytes from src (src_len bytes available) into s: the bytes it took, or an error. */
__attribute__((visibility("hidden"))) int64_t get_section(const uint8_t *src, size_t src_len, uint8_t *s, size_t m);
#endif
