/* Codec 4, version 3 (block classes, kvfs/codecs/_classes.c), as called by _entropy.c. */
#ifndef KVFS_CLASSES_H
#define KVFS_CLASSES_H
#include <stddef.h>
#include <stdint.h>

#define KV3_VERSION 3
#define KV3_MAX_CLASSES 64
#define KV3_MIN_BYTES 65536  /* smaller frames keep version 2: the section headers and tables cost ~1 KiB */

int64_t kv3_encode(const uint8_t *src, size_t n_bytes, uint8_t *dst, size_t cap);
int kv3_decode(const uint8_t *src, size_t src_len, uint8_t *dst, size_t n_bytes);

#endif
