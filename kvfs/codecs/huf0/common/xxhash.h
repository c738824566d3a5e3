/* kvfs: zstd's own copy of xxhash.h is not vendored; zstd_internal.h's `#include "xxhash.h"` lands here and
 * takes kvfs's single copy (kvfs/codecs/xxhash, the same xxHash 0.8.2). huff0 uses none of its functions,
 * only the declarations zstd_internal.h pulls in, so zstd's local adaptations of that header (XXH_NAMESPACE
 * ZSTD_, XXH_NO_XXH3) are not needed: nothing here defines a symbol. See ../README.md. */
#include "../../xxhash/xxhash.h"
