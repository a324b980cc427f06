#include "io.h"

#include <endian.h>
#include <errno.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

#include "hashing.h"

#ifdef DFKV_HAVE_URING
#include <liburing.h>
#endif

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

namespace dfkv {

namespace {

// Runs fn(worker_index) on `threads` threads (the caller's thread is one of them).
template <class Fn>
void parallel(unsigned threads, Fn fn) {
  std::vector<std::thread> pool;
  for (unsigned t = 1; t < threads; ++t) pool.emplace_back(fn, t);
  fn(0u);
  for (auto& th : pool) th.join();
}

// Checksums ops the I/O loop hands over as they complete, on a thread of its own, so hashing
// never delays reaping or refilling the queue. finish() makes the caller hash beside that
// thread: a disk may complete a batch in a few clumps (a VM's virtio disk here: 3 per 512 MiB),
// and what arrives last is hashed after the I/O, as the only work left. Without a thread
// (creation failed) push() hashes inline. finish() (or the destructor) returns only after every
// pushed op is hashed, so nothing touches the buffers after the batch returns.
class CompletionHasher {
 public:
  CompletionHasher(const IoOp* ops, uint64_t* sums) : ops_(ops), sums_(sums) {
    if (sums_ == nullptr) return;
    try {
      thread_ = std::thread([this] { loop(); });
    } catch (const std::system_error&) {  // no thread to be had: hash on the caller's
    }
  }
  ~CompletionHasher() { finish(); }
  CompletionHasher(const CompletionHasher&) = delete;
  CompletionHasher& operator=(const CompletionHasher&) = delete;

  void push(const std::vector<size_t>& completed) {
    if (sums_ == nullptr || completed.empty()) return;
    if (!thread_.joinable()) {
      for (size_t i : completed) hash(i);
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.insert(queue_.end(), completed.begin(), completed.end());
    }
    cv_.notify_one();
  }

  void finish() {
    if (!thread_.joinable()) return;
    {
      std::lock_guard<std::mutex> lock(mu_);
      closed_ = true;
    }
    cv_.notify_one();
    for (size_t i; take(&i, false);) hash(i);
    thread_.join();
  }

 private:
  void hash(size_t i) { sums_[i] = block_checksum(ops_[i].buf, ops_[i].len); }

  // The next op to hash, one at a time so the two hashers share the last clump; false once
  // there is none (after close, when `wait`).
  bool take(size_t* i, bool wait) {
    std::unique_lock<std::mutex> lock(mu_);
    if (wait) cv_.wait(lock, [this] { return closed_ || head_ < queue_.size(); });
    if (head_ == queue_.size()) return false;
    *i = queue_[head_++];
    return true;
  }

  void loop() {
    for (size_t i; take(&i, true);) hash(i);
  }

  const IoOp* ops_;
  uint64_t* sums_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<size_t> queue_;  // every op pushed, in order; [head_, end) still to hash
  size_t head_ = 0;
  bool closed_ = false;
  std::thread thread_;
};

#ifdef DFKV_HAVE_URING
// One ring per thread, reused across calls; rebuilt when a different depth is asked for.
struct Ring {
  io_uring ring{};
  unsigned depth = 0;
  bool ok = false;
  ~Ring() {
    if (ok) io_uring_queue_exit(&ring);
  }
  bool ensure(unsigned want) {
    if (ok && depth == want) return true;
    if (ok) io_uring_queue_exit(&ring);
    ok = io_uring_queue_init(want, &ring, 0) == 0;
    depth = ok ? want : 0;
    return ok;
  }
};
thread_local Ring tl_ring;
#endif

struct Run {
  uint64_t dst, src, len;
};

// How far ahead of the copy, in the source stream, the next run is prefetched. A gather's runs
// start at scattered addresses, where the hardware prefetcher starts cold every time: on the
// 2-vCPU EPYC VM, one thread copying 16 KiB runs that skip 16 KiB between them ran at 0.5 of a
// contiguous copy, and prefetching the next run's first 16 KiB into L2 while the current run's
// last 16 KiB is copied brought it to 0.88-0.97; in bench links' 128 KiB-block D2H (16 KiB runs)
// 0.71-0.75 -> 0.82-0.84 of the same-run copy. Runs of 64 KiB and more gained nothing (2 MiB
// blocks lost 2-5% with it), and inside a run software prefetches only cost: a contiguous copy
// runs the same tight loop as before.
constexpr uint64_t kLookahead = 16 << 10;
constexpr uint64_t kShortRun = 64 << 10;  // runs this long or longer amortise the prefetcher's ramp

// Large moves: streaming (non-temporal) stores skip the read-for-ownership of destination lines
// and keep the copy from flushing the caches, which is what glibc's memcpy does only for single
// copies above its threshold, never for the many mid-sized chunks of a block gather. Copies
// runs[0, n) in order.
void copy_runs_stream(const Run* runs, size_t n) {
#if defined(__x86_64__)
  auto copy64 = [](char* dst, const char* src, uint64_t from, uint64_t to) {
    for (uint64_t i = from; i < to; i += 64) {
      __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
      __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
      __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
      __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
    }
  };
  for (size_t r = 0; r < n; ++r) {
    char* dst = reinterpret_cast<char*>(runs[r].dst);
    const char* src = reinterpret_cast<const char*>(runs[r].src);
    uint64_t len = runs[r].len;
    const uint64_t head = (16 - (reinterpret_cast<uintptr_t>(dst) & 15)) & 15;
    if (len < 4096 || head > len) {
      std::memcpy(dst, src, len);
      continue;
    }
    std::memcpy(dst, src, head);
    dst += head;
    src += head;
    len -= head;
    const uint64_t body = len & ~uint64_t(63);
    // The run's body in a tight loop (the hardware prefetcher streams it), then, for a short
    // run, its last kLookahead bytes, each 64 of them prefetching 64 of the runs that follow.
    const uint64_t ahead = runs[r].len < kShortRun ? kLookahead : 0;
    const uint64_t tail = body > ahead ? body - ahead : 0;
    copy64(dst, src, 0, tail);
    size_t pr = r + 1;
    uint64_t pq = 0;
    for (uint64_t i = tail; i < body; i += 64) {
      if (pr < n) {
        _mm_prefetch(reinterpret_cast<const char*>(runs[pr].src) + pq, _MM_HINT_T1);
        pq += 64;
        if (pq >= runs[pr].len) {
          ++pr;
          pq = 0;
        }
      }
      copy64(dst, src, i, i + 64);
    }
    std::memcpy(dst + body, src + body, len - body);
  }
#else
  for (size_t r = 0; r < n; ++r) {
    std::memcpy(reinterpret_cast<void*>(runs[r].dst), reinterpret_cast<const void*>(runs[r].src), runs[r].len);
  }
#endif
}

void fence_streams() {
#if defined(__x86_64__)
  _mm_sfence();  // streaming stores are weakly ordered: publish them before reporting completion
#endif
}

}  // namespace

bool uring_available() {
#ifdef DFKV_HAVE_URING
  io_uring probe;  // a throwaway ring: probing must not leave a descriptor behind
  if (io_uring_queue_init(4, &probe, 0) != 0) return false;
  io_uring_queue_exit(&probe);
  return true;
#else
  return false;
#endif
}

IoResult uring_rw(const IoOp* ops, size_t n, bool write, unsigned depth, uint64_t* sums) {
  IoResult res;
#ifdef DFKV_HAVE_URING
  if (n == 0) return res;
  depth = std::max(1u, std::min<unsigned>(depth, 32768));
  if (!tl_ring.ensure(depth)) {
    res.error = ENOSYS;
    res.what = "io_uring_queue_init";
    return res;
  }
  io_uring* ring = &tl_ring.ring;
  std::vector<uint64_t> done(n, 0);
  size_t next = 0, inflight = 0, finished = 0;
  auto prep = [&](size_t i) {
    io_uring_sqe* sqe = io_uring_get_sqe(ring);
    const IoOp& op = ops[i];
    const uint64_t off = done[i];
    if (write) {
      io_uring_prep_write(sqe, op.fd, op.buf + off, static_cast<unsigned>(op.len - off),
                          op.file_offset + off);
    } else {
      io_uring_prep_read(sqe, op.fd, op.buf + off, static_cast<unsigned>(op.len - off),
                         op.file_offset + off);
    }
    io_uring_sqe_set_data64(sqe, i);
    ++inflight;
  };
  CompletionHasher hasher(ops, sums);
  std::vector<size_t> completed;  // ops that ended in this round
  if (write) {
    // A write's source must not change while it is in flight (the callers lock it), so it can
    // be hashed from the start instead of clump by clump as the writes complete.
    for (size_t i = 0; i < n; ++i) completed.push_back(i);
    hasher.push(completed);
  }
  while (finished < n) {
    while (res.error == 0 && next < n && inflight < depth && io_uring_sq_space_left(ring) > 0) {
      prep(next++);
    }
    if (inflight == 0) break;  // only after an error: nothing left to drain
    int rc = io_uring_submit_and_wait(ring, 1);
    if (rc < 0 && rc != -EINTR) {
      // Submission itself failed; what was queued is still owned by the kernel only if it was
      // submitted, which rc < 0 says it was not.
      res.error = -rc;
      res.what = "io_uring_submit";
      return res;
    }
    io_uring_cqe* cqe;
    unsigned head, seen = 0;
    completed.clear();
    io_uring_for_each_cqe(ring, head, cqe) {
      ++seen;
      --inflight;
      const size_t i = static_cast<size_t>(io_uring_cqe_get_data64(cqe));
      const int r = cqe->res;
      if (r < 0 || (r == 0 && ops[i].len > done[i])) {
        if (res.error == 0) {
          res.error = r < 0 ? -r : EIO;  // a read at end of file: the file is shorter than its index says
          res.failed_op = i;
          res.what = write ? "write" : "read";
        }
        ++finished;
        continue;
      }
      done[i] += static_cast<uint64_t>(r);
      if (done[i] < ops[i].len && res.error == 0) {
        prep(i);  // short transfer: ask for the rest
      } else {
        ++finished;
        if (!write) completed.push_back(i);
      }
    }
    io_uring_cq_advance(ring, seen);
    if (res.error == 0) hasher.push(completed);  // after an error the sums are not wanted
    if (res.error != 0 && inflight == 0) break;
  }
  hasher.finish();
#else
  (void)ops; (void)n; (void)write; (void)depth; (void)sums;
  res.error = ENOSYS;
  res.what = "io_uring (not built)";
#endif
  return res;
}

IoResult pool_rw(const IoOp* ops, size_t n, bool write, unsigned threads, uint64_t* sums) {
  IoResult res;
  threads = std::max(1u, std::min<unsigned>(threads, static_cast<unsigned>(std::max<size_t>(n, 1))));
  std::atomic<size_t> next{0};
  std::atomic<int> first_error{0};
  std::atomic<size_t> failed_op{0};
  parallel(threads, [&](unsigned) {
    for (size_t i = next++; i < n && first_error.load() == 0; i = next++) {
      const IoOp& op = ops[i];
      uint64_t done = 0;
      while (done < op.len) {
        ssize_t r = write ? pwrite(op.fd, op.buf + done, op.len - done, op.file_offset + done)
                          : pread(op.fd, op.buf + done, op.len - done, op.file_offset + done);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) {
          int expected = 0;
          if (first_error.compare_exchange_strong(expected, r < 0 ? errno : EIO)) failed_op = i;
          break;
        }
        done += static_cast<uint64_t>(r);
      }
      if (sums != nullptr && done == op.len) sums[i] = block_checksum(op.buf, op.len);
    }
  });
  res.error = first_error.load();
  res.failed_op = failed_op.load();
  if (res.error) res.what = write ? "pwrite" : "pread";
  return res;
}

namespace {

// Copies runs (adjacent ones already merged; `total` bytes in all), split by bytes over threads.
void copy_runs(const std::vector<Run>& runs, uint64_t total, unsigned threads) {
  // Threads only pay off for large moves; below ~4 MiB one thread is faster than spawning more.
  const uint64_t min_per_thread = 4ull << 20;
  threads = static_cast<unsigned>(std::max<uint64_t>(1, std::min<uint64_t>(threads, total / min_per_thread)));
  // Small moves stay in cache (the reader is near); large ones stream past it.
  const bool stream = total >= (8ull << 20);
  auto copy = [stream](const Run* rs, size_t k) {
    if (stream) {
      copy_runs_stream(rs, k);
      fence_streams();
    } else {
      for (size_t i = 0; i < k; ++i) {
        std::memcpy(reinterpret_cast<void*>(rs[i].dst), reinterpret_cast<const void*>(rs[i].src), rs[i].len);
      }
    }
  };
  if (threads == 1) {
    copy(runs.data(), runs.size());
    return;
  }
  // Split the byte range [0, total) evenly; a thread copies the parts of runs inside its slice.
  parallel(threads, [&](unsigned t) {
    const uint64_t lo = total * t / threads, hi = total * (t + 1) / threads;
    std::vector<Run> mine;
    uint64_t pos = 0;
    for (const Run& r : runs) {
      const uint64_t a = std::max(lo, pos), b = std::min(hi, pos + r.len);
      if (a < b) mine.push_back({r.dst + (a - pos), r.src + (a - pos), b - a});
      pos += r.len;
      if (pos >= hi) break;
    }
    copy(mine.data(), mine.size());
  });
}

// Appends a chunk, merged into the last run when it continues it on both sides.
inline void add_chunk(std::vector<Run>& runs, uint64_t dst, uint64_t src, uint64_t len) {
  if (!runs.empty() && runs.back().dst + runs.back().len == dst && runs.back().src + runs.back().len == src) {
    runs.back().len += len;
  } else {
    runs.push_back({dst, src, len});
  }
}

}  // namespace

void copy_chunks(const uint64_t* dst, const uint64_t* src, const uint64_t* len, size_t n,
                 unsigned threads) {
  // Chunks are copied in the order given (callers list them in source order: scattered reads
  // defeat the hardware prefetcher, scattered streaming writes cost little); neighbours that are
  // adjacent on both sides merge into one run.
  std::vector<Run> runs;
  runs.reserve(n);
  uint64_t total = 0;
  for (size_t i = 0; i < n; ++i) {
    add_chunk(runs, dst[i], src[i], len[i]);
    total += len[i];
  }
  copy_runs(runs, total, threads);
}

void copy_kv_grid(const GridSide& dst, const GridSide& src, size_t layers, size_t blocks, size_t kv,
                  uint64_t chunk_bytes, bool block_major, unsigned threads) {
  std::vector<Run> runs;
  runs.reserve(layers * blocks);
  auto add = [&](size_t l, size_t i) {
    const uint64_t d = dst.layer_base[l] + dst.ids[i] * dst.block_stride;
    const uint64_t s = src.layer_base[l] + src.ids[i] * src.block_stride;
    for (size_t k = 0; k < kv; ++k) add_chunk(runs, d + k * dst.kv_stride, s + k * src.kv_stride, chunk_bytes);
  };
  if (block_major) {
    for (size_t i = 0; i < blocks; ++i)
      for (size_t l = 0; l < layers; ++l) add(l, i);
  } else {
    for (size_t l = 0; l < layers; ++l)
      for (size_t i = 0; i < blocks; ++i) add(l, i);
  }
  copy_runs(runs, static_cast<uint64_t>(layers) * blocks * kv * chunk_bytes, threads);
}

void checksums(const char* base, const uint64_t* offsets, size_t n, uint64_t len, uint64_t* out) {
  for (size_t i = 0; i < n; ++i) out[i] = block_checksum(base + offsets[i], len);
}

void kv_block_checksums(const uint64_t* layer_addrs, size_t layers, uint64_t block_bytes,
                        const uint64_t* blocks, size_t n, uint64_t* out) {
  // Block-major: a block's spans in every layer, then their digests, while they are in cache.
  std::vector<uint64_t> per_layer(layers);
  for (size_t i = 0; i < n; ++i) {
    for (size_t l = 0; l < layers; ++l) {
      const char* p = reinterpret_cast<const char*>(layer_addrs[l]) + blocks[i] * block_bytes;
      per_layer[l] = htole64(block_checksum(p, block_bytes));
    }
    out[i] = block_checksum(per_layer.data(), layers * sizeof(uint64_t));
  }
}

}  // namespace dfkv
