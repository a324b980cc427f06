// Prefix index of one local tier (host or disk; dynamo_flexkv/core/index/tier_index.py wraps it): the
// block table, the slot pool, per-block state and the eviction order, in plain C++ so the bindings
// can run every operation without the GIL.
//
// Semantics are those of the Python model in tests/index_model.py (the oracle the randomized tests
// compare against): a block is inserted unready by one owner, becomes ready on commit, is rolled
// back, locked, touched, evicted (ready, unlocked leaves only, smallest policy key first) or
// discarded. Every mutation checks all of its input before it changes anything.
//
// Not thread-safe: the bindings serialize calls with a mutex.
#pragma once
#include <sys/mman.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

namespace dfkv {

constexpr uint32_t kNoSlot = UINT32_MAX;
constexpr uint32_t kPendingSlot = UINT32_MAX - 1;  // a key claimed by an insert in progress
constexpr uint32_t kMaxCapacity = UINT32_MAX - 1;  // slots are below both markers
constexpr int64_t kNoOwner = -1;       // ready blocks have no owner
constexpr int64_t kUnknownOwner = -2;  // an owner that holds no block: matches nothing
constexpr size_t kPrefetchAhead = 8;   // batch loops prefetch the bucket / block this far ahead

enum class EvictionPolicy : uint8_t { kLru, kLfu, kSlru, kFifo, kFilo, kMru };

// Big tables on transparent huge pages (where the kernel allows it, madvise mode included):
// lookups are random, and with 4 KiB pages nearly every one also missed the TLB. The one
// allocator of big tables: zeroed memory (anonymous pages read as zero until written), from
// calloc below one huge page, from a huge-page-aligned mapping above; huge_page_free takes the
// same byte count back.
void* huge_page_alloc(size_t bytes);
void huge_page_free(void* p, size_t bytes);

// std::vector's allocator over huge_page_alloc.
template <class T>
struct HugePageAllocator {
  using value_type = T;
  HugePageAllocator() = default;
  template <class U>
  HugePageAllocator(const HugePageAllocator<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(huge_page_alloc(n * sizeof(T))); }
  void deallocate(T* p, size_t n) { huge_page_free(p, n * sizeof(T)); }
  template <class U>
  bool operator==(const HugePageAllocator<U>&) const { return true; }
  template <class U>
  bool operator!=(const HugePageAllocator<U>&) const { return false; }
};

// A request that would break an index invariant (a caller bug). When `names_owner` is set the
// message ends where the owner belongs; the bindings append it (owners are Python objects).
struct IndexViolation : std::runtime_error {
  IndexViolation(const std::string& what, bool names_owner_)
      : std::runtime_error(what), names_owner(names_owner_) {}
  bool names_owner;
};

// A slot the pool cannot hand over (adopt of an id out of range, in use, or repeated).
struct PoolViolation : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct TierIndexOptions {
  std::string name;
  uint32_t capacity = 0;
  EvictionPolicy policy = EvictionPolicy::kLru;
  double hit_reward_seconds = 0.0;
  int64_t slru_protected_hits = 2;
  double evict_start_threshold = 1.0;
  double evict_ratio = 0.05;
};

struct Block {  // 64 bytes: one cache line
  uint64_t hash = 0;
  uint64_t version = 0;  // matches the block's live eviction-heap entry
  uint64_t tick = 0;     // the policy's tick: last insert/commit/touch (fifo, filo: insert)
  double last_access = 0.0;
  int64_t owner = kNoOwner;
  uint32_t hits = 0;
  uint32_t parent_slot = kNoSlot;  // the parent outlives its children, so its slot stays valid
  uint32_t children = 0;
  int32_t locks = 0;
  uint32_t mark = 0;  // scratch for checking a batch; 0 between calls
  bool live = false;
  bool ready = false;
};
static_assert(sizeof(Block) == 64, "a block should fill one cache line");

// Blocks removed by one operation, in removal order; slots[i] held hashes[i].
struct Removed {
  std::vector<uint64_t> hashes;
  std::vector<uint32_t> slots;
  bool empty() const { return hashes.empty(); }
};

// What a tier holds now, by state (an operator's listing; what a clear leaves behind and why).
struct Census {
  uint64_t ready = 0;    // landed: what a get can find
  uint64_t filling = 0;  // unready: a copy into it is in flight
  uint64_t in_use = 0;   // ready and locked: a load or a tier write reads it
  uint64_t parents = 0;  // ready, unlocked, with children: the prefix of blocks below it
  bool any = false;      // a ready block exists (oldest / newest are set)
  double oldest = 0.0;   // smallest last_access of a ready block
  double newest = 0.0;   // largest
};

// A restart's ready block that already sits in its slot.
struct AdoptEntry {
  uint64_t hash;
  bool has_parent;
  uint64_t parent;
  uint32_t slot;
};

// Open addressing (linear probing, backward-shift deletion) from sequence hash to slot.
// Buckets come zeroed from the kernel (an empty bucket is all zero bytes), so a table sized for
// the tier up front costs memory only as buckets are first written, and filling the tier does
// not rehash (tables for more than kEagerEntries blocks start at that size and grow).
class HashSlotTable {
 public:
  static constexpr size_t kEagerEntries = size_t{1} << 20;  // 2M buckets, 32 MiB
  explicit HashSlotTable(size_t expected = 0);
  ~HashSlotTable();
  HashSlotTable(const HashSlotTable&) = delete;
  HashSlotTable& operator=(const HashSlotTable&) = delete;
  uint32_t find(uint64_t key) const;              // kNoSlot if absent
  // out[i] = find(keys[i]); the cache misses overlap (each key's bucket is prefetched ahead).
  void find_all(const uint64_t* keys, size_t n, uint32_t* out) const;
  void prefetch(uint64_t key) const { __builtin_prefetch(&entries_[home(key)]); }
  bool insert_new(uint64_t key, uint32_t slot) { return claim(key, slot) != kAbsent; }  // false if present
  // insert_new returning the key's position (kAbsent, and no change, if present). A position stays
  // valid until the next rehash or erase; reserve(n) first keeps n claims from rehashing.
  size_t claim(uint64_t key, uint32_t slot);
  void reserve(size_t more);                      // room for `more` keys without a rehash
  void assign(uint64_t key, uint32_t slot);       // key must be present
  void assign_at(size_t position, uint32_t slot) { entries_[position].tag = slot + 1; }
  void erase(uint64_t key);                       // key must be present
  void erase_all(const uint64_t* keys, size_t n);  // each present; prefetched like find_all
  void clear();
  size_t size() const { return size_; }
  static constexpr size_t kAbsent = SIZE_MAX;

 private:
  struct Entry {
    uint64_t key;
    uint32_t tag;  // slot + 1; 0: empty
  };
  size_t home(uint64_t key) const { return static_cast<size_t>((key * 0x9E3779B97F4A7C15ull) >> shift_); }
  size_t position(uint64_t key) const;  // key must be present
  void rehash(size_t buckets);
  static size_t buckets_for(size_t keys);  // a power of two keeping the load <= 1/2
  static Entry* allocate_zeroed(size_t buckets);
  static void release(Entry* entries, size_t buckets);

  Entry* entries_ = nullptr;
  size_t buckets_ = 0;
  size_t initial_buckets_ = 0;  // clear() returns to this size
  size_t mask_ = 0;
  unsigned shift_ = 64;
  size_t size_ = 0;
};

class TierIndexCore {
 public:
  explicit TierIndexCore(TierIndexOptions options);

  // ---- queries --------------------------------------------------------------------------------
  const TierIndexOptions& options() const { return opt_; }
  size_t size() const { return table_.size(); }
  size_t num_ready() const { return num_ready_; }
  size_t num_free() const { return free_.size(); }
  size_t num_used() const { return opt_.capacity - free_.size(); }
  uint64_t evictions() const { return evictions_; }
  bool slot_used(int64_t slot) const;
  const Block* find(uint64_t hash) const;
  uint32_t slot_of(const Block& b) const { return static_cast<uint32_t>(&b - blocks_.data()); }
  uint64_t parent_of(const Block& b) const { return blocks_[b.parent_slot].hash; }  // has a parent
  bool can_extend(bool has_parent, uint64_t parent, int64_t owner) const;
  std::vector<uint64_t> hashes() const;  // by slot
  Census census() const;  // one pass over the block table
  int64_t owned_by(int64_t owner) const;  // unready blocks `owner` holds

  // Longest prefix of get(0..n) held (ready, or present when !ready_only): a binary search,
  // valid because the index is prefix-closed.
  template <class Get>
  size_t match_length(size_t n, Get&& get, bool ready_only) const {
    size_t lo = 0, hi = n;
    while (lo < hi) {
      const size_t mid = lo + (hi - lo) / 2;
      const Block* b = find(get(mid));
      if (b != nullptr && (b->ready || !ready_only)) {
        lo = mid + 1;
      } else {
        hi = mid;
      }
    }
    return lo;
  }

  // ---- mutations (each checks all of its input first) -------------------------------------------
  // Inserts the chain after `parent` as unready blocks of `owner`, evicting to make room (into
  // `evicted`). Returns the slots of the prefix that fit.
  std::vector<uint32_t> insert(const uint64_t* hashes, size_t n, bool has_parent, uint64_t parent,
                               int64_t owner, double now, Removed& evicted);
  // A put's plan on this tier in one call: `held`, the longest present prefix, is touched (an
  // access, no hit); the rest of the chain is inserted after it as unready blocks of `owner` when
  // the owner may extend it. The same as match_length(present) + touch + can_extend + insert.
  std::vector<uint32_t> put(const uint64_t* hashes, size_t n, int64_t owner, double now, size_t& held,
                            Removed& evicted);
  void commit(const uint64_t* hashes, size_t n, int64_t owner, double now);
  // commit() of blocks whose slots the caller knows (a run's block ids): no table lookups; each
  // slot must hold the block of the same position's hash.
  void commit_slots(const uint32_t* slots, const uint64_t* hashes, size_t n, int64_t owner, double now);
  void rollback(const uint64_t* hashes, size_t n, int64_t owner);
  void lock(const uint64_t* hashes, size_t n);
  void unlock(const uint64_t* hashes, size_t n);
  void touch(const uint64_t* hashes, size_t n, bool hit, double now);
  std::vector<uint32_t> slots_of(const uint64_t* hashes, size_t n) const;
  Removed evict(size_t count);
  Removed clear();
  Removed discard_slots(const int64_t* slots, size_t n);
  void adopt(const std::vector<AdoptEntry>& entries, double now);

 private:
  struct EvictKey {
    double a, b;
    int64_t tick;
  };
  struct HeapEntry {
    EvictKey key;
    uint32_t slot;
    uint64_t version;
  };
  static bool later(const HeapEntry& x, const HeapEntry& y);  // heap order: smallest key on top
  struct Later {  // a functor, so the heap algorithms inline the comparison (a function pointer is not)
    bool operator()(const HeapEntry& x, const HeapEntry& y) const { return later(x, y); }
  };

  [[noreturn]] void fail(const std::string& what, bool names_owner = false) const;
  std::vector<uint32_t> lookup(const uint64_t* hashes, size_t n) const;  // table_.find_all
  Block& present(uint32_t slot, uint64_t hash);  // the block `hash` found in `slot`, or IndexViolation
  // A caller-given slot (< kPendingSlot) holds `hash`, or an IndexViolation naming the slot.
  void check_slot_holds(uint32_t slot, uint64_t hash) const;
  Block& owned_unready(uint32_t slot, uint64_t hash, int64_t owner);
  Block& block_at(uint32_t slot);  // grows the block table to hold `slot`
  EvictKey key_of(const Block& b) const;
  static bool candidate(const Block& b) { return b.ready && b.locks == 0 && b.children == 0; }
  // An access: advances the clock; the block's tick follows unless the policy orders by insert.
  void stamp(Block& b) {
    ++tick_;
    if (!by_insert_) b.tick = tick_;
  }
  void maybe_push(Block& b);
  void compact_heap();
  void sift_down_top();  // restores heap order after the top entry was replaced
  void unlock_block(Block& b);
  // A leaf; its slot goes back to the pool. Its key leaves the table unless the caller erases
  // a batch of keys itself (erase_key = false).
  void remove(Block& b, bool erase_key = true);
  void evict_into(size_t count, Removed& out);
  void make_room(size_t n, Removed& evicted);
  uint32_t allocate_slot() {
    const uint32_t s = free_.back();
    free_.pop_back();
    return s;
  }

  TierIndexOptions opt_;
  HashSlotTable table_;
  std::vector<Block, HugePageAllocator<Block>> blocks_;  // by slot; grows as slots are first used
  std::vector<uint32_t> free_;   // a stack: the next slot handed out is free_.back()
  std::vector<HeapEntry> heap_;  // eviction candidates; entries with an old version are skipped
  bool top_taken_ = false;       // evict_into removes the top's block: the next push replaces it
  std::unordered_map<int64_t, int64_t> owned_;  // owner -> unready blocks it holds
  uint64_t tick_ = 0;
  bool by_insert_ = false;  // fifo / filo
  uint64_t versions_ = 0;  // one counter for the index, so an entry never matches a later block
  size_t num_ready_ = 0;
  uint64_t evictions_ = 0;
};

// "0x1f" for 31, like Python's f"{h:#x}".
std::string hex(uint64_t value);

}  // namespace dfkv
