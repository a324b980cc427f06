#include "hashing.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "hash inputs are defined as little-endian bytes; add byte swaps for big-endian hosts");

namespace dfkv {

void tokens_hashes(const uint32_t* tokens, size_t n_blocks, size_t block_size, uint64_t seed,
                   uint64_t* out) {
  const size_t stride = block_size * sizeof(uint32_t);
  const char* p = reinterpret_cast<const char*>(tokens);
  for (size_t i = 0; i < n_blocks; ++i) out[i] = XXH3_64bits_withSeed(p + i * stride, stride, seed);
}

void chain_hashes(const uint64_t* tok, size_t n, bool has_parent, uint64_t parent, uint64_t* out) {
  uint64_t buf[2];
  for (size_t i = 0; i < n; ++i) {
    if (i == 0 && !has_parent) {
      out[0] = tok[0];
      continue;
    }
    buf[0] = i == 0 ? parent : out[i - 1];
    buf[1] = tok[i];
    out[i] = XXH3_64bits(buf, sizeof(buf));
  }
}

uint64_t block_checksum(const void* p, size_t len) {
#if defined(DFKV_HAVE_AVX2_XXH3)
  static const bool avx2 = __builtin_cpu_supports("avx2");
  if (avx2) return xxh3_64_avx2(p, len);
#endif
  return XXH3_64bits(p, len);
}

}  // namespace dfkv
