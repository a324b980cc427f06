// xxh3_64 built for AVX2, in its own translation unit: only this file is compiled with -mavx2,
// and hashing.cpp calls it only after the CPU said it has AVX2. Keep this file to xxhash's
// static inline functions and plain declarations: an inline function or template with external
// (COMDAT) linkage built here could be the copy the linker keeps for the whole module, and run
// AVX2 code on a CPU without it.
#if !defined(__AVX2__)
#error "xxh3_avx2.cpp must be compiled with -mavx2 (see native/CMakeLists.txt)"
#endif
#define XXH_INLINE_ALL  // xxhash picks its AVX2 kernels from __AVX2__
#include <xxhash.h>

#include "hashing.h"

namespace dfkv {

uint64_t xxh3_64_avx2(const void* p, size_t len) { return XXH3_64bits(p, len); }

}  // namespace dfkv
