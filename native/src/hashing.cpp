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

namespace {
bool have_avx2() {
#if defined(DFKV_HAVE_AVX2_XXH3)
  static const bool avx2 = __builtin_cpu_supports("avx2");
  return avx2;
#else
  return false;
#endif
}
}  // namespace

uint64_t block_checksum(const void* p, size_t len) {
#if defined(DFKV_HAVE_AVX2_XXH3)
  if (have_avx2()) return xxh3_64_avx2(p, len);
#endif
  return XXH3_64bits(p, len);
}

static_assert(sizeof(XXH3_state_t) <= 1024, "BlockHasher::state_ is too small for XXH3_state_t");
static_assert(alignof(XXH3_state_t) <= 64, "BlockHasher::state_ is under-aligned for XXH3_state_t");

BlockHasher::BlockHasher() : avx2_(have_avx2()) {
#if defined(DFKV_HAVE_AVX2_XXH3)
  if (avx2_) {
    xxh3_avx2_reset(state_);
    return;
  }
#endif
  XXH3_64bits_reset(reinterpret_cast<XXH3_state_t*>(state_));
}

void BlockHasher::update(const void* p, size_t len) {
#if defined(DFKV_HAVE_AVX2_XXH3)
  if (avx2_) {
    xxh3_avx2_update(state_, p, len);
    return;
  }
#endif
  XXH3_64bits_update(reinterpret_cast<XXH3_state_t*>(state_), p, len);
}

uint64_t BlockHasher::digest() const {
#if defined(DFKV_HAVE_AVX2_XXH3)
  if (avx2_) return xxh3_avx2_digest(state_);
#endif
  return XXH3_64bits_digest(reinterpret_cast<const XXH3_state_t*>(state_));
}

}  // namespace dfkv
