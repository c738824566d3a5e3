/* XXH3-64 (seed 0) for kvfs's checksums, called through ctypes, which releases the GIL while it runs:
 * python-xxhash holds it, so reader threads hashing megabytes each ran one at a time. The same function and
 * value as python-xxhash's xxh3_64_intdigest; xxHash is vendored in xxhash/ (README.md there). */
#define XXH_INLINE_ALL
#include "xxhash/xxhash.h"

unsigned long long kvfs_xxh3_64(const void *data, size_t len) {
    return (unsigned long long)XXH3_64bits(data, len);
}
