// Dynamo-compatible block hashing (docs/WIRE_FORMATS.md).
#pragma once
#include <cstddef>
#include <cstdint>

namespace dfkv {

// Seed Dynamo's router uses for tokens hashes.
constexpr uint64_t kTokensHashSeed = 1337;

// out[i] = xxh3_64(tokens[i*bs : (i+1)*bs] as LE uint32, seed). Only full blocks.
void tokens_hashes(const uint32_t* tokens, size_t n_blocks, size_t block_size, uint64_t seed,
                   uint64_t* out);

// out[0] = tok[0]; out[i] = xxh3_64(LE u64 out[i-1] || LE u64 tok[i]).
// `parent` continues a chain from an earlier block (has_parent=false starts a new one).
void chain_hashes(const uint64_t* tok, size_t n, bool has_parent, uint64_t parent, uint64_t* out);

// Disk block checksum: xxh3_64 of [p, p + len), seed 0. Picks the AVX2 build of xxh3 at run time
// where the CPU has it (about twice the SSE2 baseline's speed on cached data; same values).
uint64_t block_checksum(const void* p, size_t len);

// The AVX2 build (xxh3_avx2.cpp); call only through block_checksum.
uint64_t xxh3_64_avx2(const void* p, size_t len);

}  // namespace dfkv
