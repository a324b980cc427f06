// Bulk data movement: batched file I/O (io_uring, or a pread/pwrite thread pool) and chunk copies.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace dfkv {

struct IoOp {
  int fd;
  uint64_t file_offset;
  char* buf;
  uint64_t len;
};

struct IoResult {
  int error = 0;          // 0, or a positive errno of the first failed op
  size_t failed_op = 0;   // index of that op
  std::string what;       // which call failed
};

// True when io_uring_setup works here (kernel support, no seccomp block) and we were built with it.
bool uring_available();

// Runs every op (all reads or all writes), keeping up to `depth` in flight; short transfers are
// resubmitted for the rest. On an error the ops already in flight are drained before returning.
// With `sums`, sums[i] = block_checksum of op i's buffer, taken on a hashing thread while the
// I/O is in flight (the hashing hides behind the I/O instead of following it): a read's as soon
// as it has completed, a write's from the start (its source must not change until the batch
// returns). All hashing has ended when this returns. On an error `sums` is unspecified.
IoResult uring_rw(const IoOp* ops, size_t n, bool write, unsigned depth, uint64_t* sums = nullptr);

// The same contract with blocking pread/pwrite on `threads` threads (no io_uring); each thread
// hashes the ops it moved.
IoResult pool_rw(const IoOp* ops, size_t n, bool write, unsigned threads, uint64_t* sums = nullptr);

// memcpy(dst[i], src[i], len[i]) for all i, adjacent runs merged, split by bytes over `threads`.
void copy_chunks(const uint64_t* dst, const uint64_t* src, const uint64_t* len, size_t n,
                 unsigned threads);

// One side of a paged-KV copy: chunk (layer l, block i, kv k) lies at
// layer_base[l] + ids[i] * block_stride + k * kv_stride.
struct GridSide {
  const uint64_t* layer_base;
  const uint64_t* ids;
  uint64_t block_stride, kv_stride;
};

// Copies chunk_bytes of every (layer, block, kv) chunk from `src` to `dst` ([layers][blocks][kv],
// or [blocks][layers][kv] with block_major), chunks adjacent on both sides merged into one run, as
// copy_chunks does with the same addresses listed in that order.
void copy_kv_grid(const GridSide& dst, const GridSide& src, size_t layers, size_t blocks, size_t kv,
                  uint64_t chunk_bytes, bool block_major, unsigned threads);

// out[i] = block_checksum of [base + offsets[i], + len).
void checksums(const char* base, const uint64_t* offsets, size_t n, uint64_t len, uint64_t* out);

// A paged KV cache's block checksum over every layer: out[i] = xxh3_64 of the LE u64 digests
// block_checksum(layer_addrs[l] + blocks[i] * block_bytes, block_bytes), l in layer order.
void kv_block_checksums(const uint64_t* layer_addrs, size_t layers, uint64_t block_bytes,
                        const uint64_t* blocks, size_t n, uint64_t* out);

}  // namespace dfkv
