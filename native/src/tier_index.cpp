#include "tier_index.h"

#include <algorithm>
#include <cmath>
#include <unordered_map>
#include <utility>

namespace dfkv {

std::string hex(uint64_t value) {
  static const char kDigits[] = "0123456789abcdef";
  char buf[19];
  size_t pos = sizeof(buf);
  do {
    buf[--pos] = kDigits[value & 0xF];
    value >>= 4;
  } while (value != 0);
  buf[--pos] = 'x';
  buf[--pos] = '0';
  return std::string(buf + pos, sizeof(buf) - pos);
}

// ---- HashSlotTable ----------------------------------------------------------------------------

HashSlotTable::HashSlotTable(size_t expected) {
  initial_buckets_ = buckets_for(std::min(expected, kEagerEntries));
  rehash(initial_buckets_);
}

HashSlotTable::~HashSlotTable() { release(entries_, buckets_); }

size_t HashSlotTable::buckets_for(size_t keys) {
  size_t buckets = 16;
  while (keys * 2 > buckets) buckets *= 2;
  return buckets;
}

namespace {
constexpr size_t kHugePage = size_t{2} << 20;
}  // namespace

void* huge_page_alloc(size_t bytes) {
  if (bytes < kHugePage) {
    void* p = std::calloc(bytes == 0 ? 1 : bytes, 1);
    if (p == nullptr) throw std::bad_alloc();
    return p;
  }
  // Mapped with a huge page of slack and trimmed to a huge-page boundary, so transparent huge
  // pages can back it.
  void* raw = mmap(nullptr, bytes + kHugePage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) throw std::bad_alloc();
  const uintptr_t start = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t aligned = (start + kHugePage - 1) & ~(kHugePage - 1);
  if (aligned > start) munmap(raw, aligned - start);
  const uintptr_t end = start + bytes + kHugePage;
  if (end > aligned + bytes) munmap(reinterpret_cast<void*>(aligned + bytes), end - (aligned + bytes));
  madvise(reinterpret_cast<void*>(aligned), bytes, MADV_HUGEPAGE);  // advice only: fine if refused
  return reinterpret_cast<void*>(aligned);
}

void huge_page_free(void* p, size_t bytes) {
  if (p == nullptr) return;
  if (bytes < kHugePage) {
    std::free(p);
  } else {
    munmap(p, bytes);
  }
}

HashSlotTable::Entry* HashSlotTable::allocate_zeroed(size_t buckets) {
  return static_cast<Entry*>(huge_page_alloc(buckets * sizeof(Entry)));
}

void HashSlotTable::release(Entry* entries, size_t buckets) { huge_page_free(entries, buckets * sizeof(Entry)); }

void HashSlotTable::rehash(size_t buckets) {
  Entry* old = entries_;
  const size_t old_buckets = buckets_;
  entries_ = allocate_zeroed(buckets);
  buckets_ = buckets;
  mask_ = buckets - 1;
  shift_ = 64;
  for (size_t b = buckets; b > 1; b >>= 1) --shift_;
  for (size_t j = 0; j < old_buckets; ++j) {
    const Entry& e = old[j];
    if (e.tag == 0) continue;
    size_t i = home(e.key);
    while (entries_[i].tag != 0) i = (i + 1) & mask_;
    entries_[i] = e;
  }
  release(old, old_buckets);
}

uint32_t HashSlotTable::find(uint64_t key) const {
  for (size_t i = home(key);; i = (i + 1) & mask_) {
    const Entry& e = entries_[i];
    if (e.tag == 0) return kNoSlot;
    if (e.key == key) return e.tag - 1;
  }
}

void HashSlotTable::find_all(const uint64_t* keys, size_t n, uint32_t* out) const {
  for (size_t i = 0; i < std::min(n, kPrefetchAhead); ++i) prefetch(keys[i]);
  for (size_t i = 0; i < n; ++i) {
    if (i + kPrefetchAhead < n) prefetch(keys[i + kPrefetchAhead]);
    out[i] = find(keys[i]);
  }
}

size_t HashSlotTable::claim(uint64_t key, uint32_t slot) {
  if ((size_ + 1) * 2 > buckets_) rehash(buckets_ * 2);  // load <= 1/2
  size_t i = home(key);
  for (; entries_[i].tag != 0; i = (i + 1) & mask_) {
    if (entries_[i].key == key) return kAbsent;
  }
  entries_[i] = Entry{key, slot + 1};
  ++size_;
  return i;
}

void HashSlotTable::reserve(size_t more) {
  size_t buckets = buckets_;
  while ((size_ + more) * 2 > buckets) buckets *= 2;
  if (buckets != buckets_) rehash(buckets);
}

size_t HashSlotTable::position(uint64_t key) const {
  size_t i = home(key);
  while (entries_[i].key != key || entries_[i].tag == 0) i = (i + 1) & mask_;
  return i;
}

void HashSlotTable::assign(uint64_t key, uint32_t slot) { entries_[position(key)].tag = slot + 1; }

void HashSlotTable::erase(uint64_t key) {
  size_t hole = position(key);
  // Backward shift: pull later entries of the probe run into the hole unless that would move
  // one before its home bucket.
  for (size_t j = (hole + 1) & mask_; entries_[j].tag != 0; j = (j + 1) & mask_) {
    const size_t h = home(entries_[j].key);
    if (((j - h) & mask_) >= ((j - hole) & mask_)) {
      entries_[hole] = entries_[j];
      hole = j;
    }
  }
  entries_[hole] = Entry{0, 0};
  --size_;
}

void HashSlotTable::erase_all(const uint64_t* keys, size_t n) {
  for (size_t i = 0; i < std::min(n, kPrefetchAhead); ++i) prefetch(keys[i]);
  for (size_t i = 0; i < n; ++i) {
    if (i + kPrefetchAhead < n) prefetch(keys[i + kPrefetchAhead]);
    erase(keys[i]);
  }
}

void HashSlotTable::clear() {
  release(entries_, buckets_);
  entries_ = nullptr;
  buckets_ = 0;
  size_ = 0;
  rehash(initial_buckets_);
}

// ---- TierIndexCore: queries --------------------------------------------------------------------

TierIndexCore::TierIndexCore(TierIndexOptions options)
    : opt_(std::move(options)),
      table_(opt_.capacity),
      by_insert_(opt_.policy == EvictionPolicy::kFifo || opt_.policy == EvictionPolicy::kFilo) {
  // Reserved, not built: the memory is touched only as slots are first used, and references to
  // blocks stay valid while the table grows.
  blocks_.reserve(opt_.capacity);
  free_.resize(opt_.capacity);
  // A stack handing out low slots first, so a fresh tier fills its files front to back.
  for (uint32_t i = 0; i < opt_.capacity; ++i) free_[i] = opt_.capacity - 1 - i;
}

bool TierIndexCore::slot_used(int64_t slot) const {
  return slot >= 0 && static_cast<size_t>(slot) < blocks_.size() && blocks_[slot].live;
}

const Block* TierIndexCore::find(uint64_t hash) const {
  const uint32_t slot = table_.find(hash);
  return slot < blocks_.size() ? &blocks_[slot] : nullptr;  // kNoSlot / kPendingSlot: absent
}

bool TierIndexCore::can_extend(bool has_parent, uint64_t parent, int64_t owner) const {
  if (!has_parent) return true;
  const Block* p = find(parent);
  return p != nullptr && (p->ready || p->owner == owner);
}

std::vector<uint64_t> TierIndexCore::hashes() const {
  std::vector<uint64_t> out;
  out.reserve(size());
  for (const Block& b : blocks_) {
    if (b.live) out.push_back(b.hash);
  }
  return out;
}

Census TierIndexCore::census() const {
  Census c;
  for (const Block& b : blocks_) {
    if (!b.live) continue;
    if (!b.ready) {
      ++c.filling;
      continue;
    }
    ++c.ready;
    if (b.locks != 0) {
      ++c.in_use;
    } else if (b.children != 0) {
      ++c.parents;
    }
    if (!c.any || b.last_access < c.oldest) c.oldest = b.last_access;
    if (!c.any || b.last_access > c.newest) c.newest = b.last_access;
    c.any = true;
  }
  return c;
}

int64_t TierIndexCore::owned_by(int64_t owner) const {
  const auto it = owned_.find(owner);
  return it == owned_.end() ? 0 : it->second;
}

std::vector<uint32_t> TierIndexCore::slots_of(const uint64_t* hashes, size_t n) const {
  std::vector<uint32_t> out = lookup(hashes, n);
  for (size_t i = 0; i < n; ++i) {
    if (out[i] >= blocks_.size()) fail("block " + hex(hashes[i]) + " is not present");
  }
  return out;
}

// ---- TierIndexCore: checks -----------------------------------------------------------------------

void TierIndexCore::fail(const std::string& what, bool names_owner) const {
  throw IndexViolation(opt_.name + ": " + what, names_owner);
}

std::vector<uint32_t> TierIndexCore::lookup(const uint64_t* hashes, size_t n) const {
  std::vector<uint32_t> slots(n);
  table_.find_all(hashes, n, slots.data());
  return slots;
}

Block& TierIndexCore::present(uint32_t slot, uint64_t hash) {
  // kNoSlot from a lookup, or a caller's slot that holds another block (or none)
  if (slot >= blocks_.size() || !blocks_[slot].live || blocks_[slot].hash != hash) {
    fail("block " + hex(hash) + " is not present");
  }
  return blocks_[slot];
}

void TierIndexCore::check_slot_holds(uint32_t slot, uint64_t hash) const {
  const std::string id = "block id " + std::to_string(slot);
  if (slot >= opt_.capacity) {
    fail(id + " is out of range [0, " + std::to_string(opt_.capacity) + ") of this tier: pass the run's block_ids");
  }
  if (slot >= blocks_.size() || !blocks_[slot].live) {
    fail(id + " is a free slot (it holds no block, so not " + hex(hash) + "): pass each block's own id");
  }
  if (blocks_[slot].hash != hash) {
    fail(id + " holds block " + hex(blocks_[slot].hash) + ", not " + hex(hash) + ": pass each block's own id");
  }
}

Block& TierIndexCore::owned_unready(uint32_t slot, uint64_t hash, int64_t owner) {
  Block& b = present(slot, hash);
  if (b.ready || b.owner != owner) fail("block " + hex(hash) + " is not an unready block of ", true);
  return b;
}

namespace {

// Clears the scratch marks of the blocks a check visited, however the check ends.
struct MarkGuard {
  std::vector<Block*>& blocks;
  ~MarkGuard() {
    for (Block* b : blocks) b->mark = 0;
  }
};

}  // namespace

// ---- TierIndexCore: eviction order ------------------------------------------------------------

TierIndexCore::EvictKey TierIndexCore::key_of(const Block& b) const {
  // The order of EvictionPolicy (dynamo_flexkv/core/enums.py): smallest key first; each key ends in a
  // tick no other block shares (Block::tick: fifo, filo the insert's; the others the last insert,
  // commit or touch).
  const int64_t tick = static_cast<int64_t>(b.tick);
  switch (opt_.policy) {
    case EvictionPolicy::kLru:
      return {b.last_access + opt_.hit_reward_seconds * static_cast<double>(b.hits), 0.0, tick};
    case EvictionPolicy::kMru:
      return {-b.last_access, 0.0, -tick};
    case EvictionPolicy::kLfu:
      return {static_cast<double>(b.hits), b.last_access, tick};
    case EvictionPolicy::kFifo:
      return {0.0, 0.0, tick};
    case EvictionPolicy::kFilo:
      return {0.0, 0.0, -tick};
    case EvictionPolicy::kSlru:
      return {static_cast<int64_t>(b.hits) >= opt_.slru_protected_hits ? 1.0 : 0.0, b.last_access, tick};
  }
  return {0.0, 0.0, tick};
}

bool TierIndexCore::later(const HeapEntry& x, const HeapEntry& y) {
  if (x.key.a != y.key.a) return x.key.a > y.key.a;
  if (x.key.b != y.key.b) return x.key.b > y.key.b;
  if (x.key.tick != y.key.tick) return x.key.tick > y.key.tick;
  if (x.slot != y.slot) return x.slot > y.slot;
  return x.version > y.version;
}

void TierIndexCore::maybe_push(Block& b) {
  // Every change that can alter a candidate's key or make a block a candidate comes through
  // here, so the live entry of a candidate always carries its current key.
  b.version = ++versions_;
  if (!candidate(b)) return;
  const HeapEntry entry{key_of(b), slot_of(b), b.version};
  if (top_taken_) {  // evict_into took the top: the entry replaces it (one sift, not two)
    top_taken_ = false;
    heap_.front() = entry;
    sift_down_top();
    return;
  }
  heap_.push_back(entry);
  std::push_heap(heap_.begin(), heap_.end(), Later{});
  if (heap_.size() > 2 * size() + 1024) compact_heap();
}

void TierIndexCore::sift_down_top() {
  // The heap below the top is in order; the top's entry moves down to its place. An evicted
  // leaf's parent usually has the smallest key left (older than its child), so it stays on top.
  const size_t n = heap_.size();
  const HeapEntry x = heap_.front();
  size_t i = 0;
  for (size_t c = 1; c < n; c = 2 * i + 1) {
    if (c + 1 < n && later(heap_[c], heap_[c + 1])) ++c;  // the child with the smaller key
    if (!later(x, heap_[c])) break;
    heap_[i] = heap_[c];
    i = c;
  }
  heap_[i] = x;
}

void TierIndexCore::compact_heap() {
  auto stale = [this](const HeapEntry& e) {
    const Block& b = blocks_[e.slot];
    return !b.live || b.version != e.version || !candidate(b);
  };
  heap_.erase(std::remove_if(heap_.begin(), heap_.end(), stale), heap_.end());
  std::make_heap(heap_.begin(), heap_.end(), Later{});
}

void TierIndexCore::unlock_block(Block& b) {
  if (--b.locks == 0) maybe_push(b);
}

void TierIndexCore::remove(Block& b, bool erase_key) {
  if (erase_key) table_.erase(b.hash);
  free_.push_back(slot_of(b));
  b.live = false;
  if (b.ready) --num_ready_;
  if (b.parent_slot != kNoSlot) {
    Block& p = blocks_[b.parent_slot];
    if (--p.children == 0) maybe_push(p);
  }
}

void TierIndexCore::evict_into(size_t count, Removed& out) {
  // Nothing looks keys up while this runs, so their table entries go in one prefetched batch.
  const size_t start = out.hashes.size();
  size_t taken = 0;
  auto pop_top = [this] {
    std::pop_heap(heap_.begin(), heap_.end(), Later{});
    heap_.pop_back();
  };
  while (taken < count && !heap_.empty()) {
    const HeapEntry e = heap_.front();
    Block& b = blocks_[e.slot];
    if (!b.live || b.version != e.version || !candidate(b)) {  // stale entry
      pop_top();
      continue;
    }
    out.hashes.push_back(b.hash);
    out.slots.push_back(e.slot);
    // A parent that becomes a candidate takes the top's place in the heap (maybe_push).
    top_taken_ = true;
    remove(b, false);
    if (top_taken_) {
      top_taken_ = false;
      pop_top();
    }
    if (!heap_.empty()) __builtin_prefetch(&blocks_[heap_.front().slot]);  // likely the next one
    ++taken;
  }
  table_.erase_all(out.hashes.data() + start, taken);
  evictions_ += taken;
}

Removed TierIndexCore::evict(size_t count) {
  Removed out;
  evict_into(count, out);
  return out;
}

void TierIndexCore::make_room(size_t n, Removed& evicted) {
  // Keeps usage within evict_start_threshold, freeing evict_ratio of the tier per step
  // (batching keeps eviction off the per-block path).
  const double cap = static_cast<double>(opt_.capacity);
  const double limit = std::floor(opt_.evict_start_threshold * cap);
  if (static_cast<double>(num_used() + n) <= limit) return;
  const size_t step = std::max<size_t>(1, static_cast<size_t>(std::ceil(opt_.evict_ratio * cap)));
  while (static_cast<double>(num_used() + n) > limit) {
    const size_t before = evicted.hashes.size();
    evict_into(step, evicted);
    if (evicted.hashes.size() == before) break;
  }
}

// ---- TierIndexCore: mutations -----------------------------------------------------------------

Block& TierIndexCore::block_at(uint32_t slot) {
  if (slot >= blocks_.size()) blocks_.resize(slot + 1);  // within the reserve: no move
  return blocks_[slot];
}

std::vector<uint32_t> TierIndexCore::insert(const uint64_t* hashes, size_t n, bool has_parent,
                                            uint64_t parent, int64_t owner, double now,
                                            Removed& evicted) {
  Block* p = nullptr;
  if (has_parent) {
    const uint32_t ps = table_.find(parent);
    p = ps < blocks_.size() ? &blocks_[ps] : nullptr;
    if (p == nullptr || !(p->ready || p->owner == owner)) {
      const char* state = p == nullptr ? "absent" : "unready and owned by another task";
      fail("cannot insert after parent " + hex(parent) + ": it is " + state);
    }
  }
  // Claim the keys first (one probe each finds both present blocks and repeats in the chain),
  // keeping their table positions for the slots below.
  table_.reserve(n);
  std::vector<size_t> positions(n);
  for (size_t i = 0; i < std::min(n, kPrefetchAhead); ++i) table_.prefetch(hashes[i]);
  for (size_t i = 0; i < n; ++i) {
    if (i + kPrefetchAhead < n) table_.prefetch(hashes[i + kPrefetchAhead]);
    positions[i] = table_.claim(hashes[i], kPendingSlot);
    if (positions[i] == HashSlotTable::kAbsent) {
      const bool repeat = table_.find(hashes[i]) == kPendingSlot;
      for (size_t j = 0; j < i; ++j) table_.erase(hashes[j]);
      fail("block " + hex(hashes[i]) + (repeat ? " appears twice in the chain" : " is already present"));
    }
  }
  if (p != nullptr) ++p->locks;  // the parent is a leaf; keep eviction away from it meanwhile
  const size_t evicted_before = evicted.hashes.size();
  make_room(n, evicted);
  const bool moved = evicted.hashes.size() != evicted_before;  // erases shift table entries
  if (p != nullptr) unlock_block(*p);

  const size_t take = std::min(n, free_.size());
  std::vector<uint32_t> slots(take);
  uint32_t prev_slot = p != nullptr ? slot_of(*p) : kNoSlot;
  for (size_t i = 0; i < take; ++i) {
    const uint32_t s = allocate_slot();
    Block& b = block_at(s);
    b = Block{};
    b.hash = hashes[i];
    b.parent_slot = prev_slot;
    b.owner = owner;
    b.last_access = now;
    b.tick = ++tick_;
    b.children = i + 1 < take ? 1 : 0;  // the next block of the chain
    b.live = true;
    if (moved) {
      table_.assign(hashes[i], s);
    } else {
      table_.assign_at(positions[i], s);
    }
    slots[i] = s;
    prev_slot = s;
  }
  for (size_t i = take; i < n; ++i) table_.erase(hashes[i]);  // did not fit
  if (take > 0) {
    if (p != nullptr) ++p->children;
    owned_[owner] += static_cast<int64_t>(take);
  }
  return slots;
}

std::vector<uint32_t> TierIndexCore::put(const uint64_t* hashes, size_t n, int64_t owner, double now,
                                         size_t& held, Removed& evicted) {
  held = match_length(n, [&](size_t i) { return hashes[i]; }, false);
  touch(hashes, held, false, now);
  const bool has_parent = held > 0;
  const uint64_t parent = has_parent ? hashes[held - 1] : 0;
  if (held == n || !can_extend(has_parent, parent, owner)) return {};
  return insert(hashes + held, n - held, has_parent, parent, owner, now, evicted);
}

void TierIndexCore::commit(const uint64_t* hashes, size_t n, int64_t owner, double now) {
  const std::vector<uint32_t> slots = lookup(hashes, n);
  commit_slots(slots.data(), hashes, n, owner, now);
}

void TierIndexCore::commit_slots(const uint32_t* slots, const uint64_t* hashes, size_t n, int64_t owner,
                                 double now) {
  std::vector<Block*> bs;
  bs.reserve(n);
  {
    MarkGuard guard{bs};
    for (size_t i = 0; i < n; ++i) {
      const uint32_t s = slots[i];
      // A caller's id (commit() passes lookups: kNoSlot / kPendingSlot mean "hash not present").
      if (s < kPendingSlot) check_slot_holds(s, hashes[i]);
      Block& b = owned_unready(s, hashes[i], owner);
      if (b.mark) fail("block " + hex(hashes[i]) + " appears twice in one commit");
      // Parents first: the parent is ready already or committed earlier in this call.
      if (b.parent_slot != kNoSlot) {
        const Block& p = blocks_[b.parent_slot];
        if (!p.ready && !p.mark) fail("commit of " + hex(hashes[i]) + " before its parent");
      }
      b.mark = 1;
      bs.push_back(&b);
    }
  }
  for (Block* b : bs) {
    b->ready = true;
    b->owner = kNoOwner;
    b->last_access = now;
    stamp(*b);
  }
  num_ready_ += n;
  if (n > 0 && (owned_[owner] -= static_cast<int64_t>(n)) == 0) owned_.erase(owner);
  for (Block* b : bs) {
    if (b->children == 0 && b->locks == 0) maybe_push(*b);  // only leaves become candidates
  }
}

void TierIndexCore::rollback(const uint64_t* hashes, size_t n, int64_t owner) {
  // Removal runs last to first; a block may go once its children in this call went before it.
  std::vector<Block*> bs;
  bs.reserve(n);
  std::vector<uint32_t> children_here(n, 0);
  const std::vector<uint32_t> slots = lookup(hashes, n);
  {
    MarkGuard guard{bs};
    for (size_t i = 0; i < n; ++i) {
      Block& b = owned_unready(slots[i], hashes[i], owner);
      if (b.mark) fail("block " + hex(hashes[i]) + " appears twice in one rollback");
      b.mark = static_cast<uint32_t>(i + 1);
      bs.push_back(&b);
      if (b.parent_slot != kNoSlot && blocks_[b.parent_slot].mark) {
        ++children_here[blocks_[b.parent_slot].mark - 1];
      }
    }
    for (size_t i = n; i-- > 0;) {
      if (bs[i]->children != children_here[i] || bs[i]->locks != 0) {
        fail("rollback of " + hex(hashes[i]) + " while it has children or locks");
      }
    }
  }
  for (size_t i = n; i-- > 0;) remove(*bs[i]);
  if (n > 0 && (owned_[owner] -= static_cast<int64_t>(n)) == 0) owned_.erase(owner);
}

void TierIndexCore::lock(const uint64_t* hashes, size_t n) {
  const std::vector<uint32_t> slots = lookup(hashes, n);
  for (size_t i = 0; i < n; ++i) present(slots[i], hashes[i]);
  for (uint32_t s : slots) ++blocks_[s].locks;
}

void TierIndexCore::unlock(const uint64_t* hashes, size_t n) {
  const std::vector<uint32_t> slots = lookup(hashes, n);
  std::vector<Block*> bs;
  bs.reserve(n);
  {
    MarkGuard guard{bs};
    for (size_t i = 0; i < n; ++i) {
      Block& b = present(slots[i], hashes[i]);
      bs.push_back(&b);
      // mark counts this call's unlocks of the block: a repeat needs as many locks.
      if (static_cast<int64_t>(++b.mark) > b.locks) fail("unlock of " + hex(hashes[i]) + " which is not locked");
    }
  }
  for (Block* b : bs) unlock_block(*b);
}

void TierIndexCore::touch(const uint64_t* hashes, size_t n, bool hit, double now) {
  const std::vector<uint32_t> slots = lookup(hashes, n);
  for (size_t i = 0; i < n; ++i) {
    if (i + kPrefetchAhead < n && slots[i + kPrefetchAhead] < blocks_.size()) {
      __builtin_prefetch(&blocks_[slots[i + kPrefetchAhead]]);
    }
    const uint32_t s = slots[i];
    if (s >= blocks_.size()) continue;
    Block& b = blocks_[s];
    if (!b.ready) continue;
    b.last_access = now;
    stamp(b);
    if (hit) ++b.hits;
    if (b.children == 0 && b.locks == 0) maybe_push(b);
  }
}

Removed TierIndexCore::clear() {
  size_t busy = 0;
  for (const Block& b : blocks_) busy += b.live && (b.locks != 0 || !b.ready);
  if (busy) fail("clear with " + std::to_string(busy) + " blocks in use by tasks");
  Removed out;
  for (uint32_t s = 0; s < blocks_.size(); ++s) {
    Block& b = blocks_[s];
    if (!b.live) continue;
    out.hashes.push_back(b.hash);
    out.slots.push_back(s);
    b.live = false;
    free_.push_back(s);
  }
  table_.clear();
  heap_.clear();
  num_ready_ = 0;
  return out;
}

Removed TierIndexCore::discard_slots(const int64_t* slots, size_t n) {
  // Doomed: the blocks in these slots and everything below them (children found by one scan).
  const size_t used = blocks_.size();
  std::vector<uint32_t> first_child(used + 1, 0), child_list;
  for (const Block& b : blocks_) {
    if (b.live && b.parent_slot != kNoSlot) ++first_child[b.parent_slot + 1];
  }
  for (size_t s = 0; s < used; ++s) first_child[s + 1] += first_child[s];
  child_list.resize(first_child[used]);
  {
    std::vector<uint32_t> fill(first_child.begin(), first_child.end() - 1);
    for (uint32_t s = 0; s < used; ++s) {
      const Block& b = blocks_[s];
      if (b.live && b.parent_slot != kNoSlot) child_list[fill[b.parent_slot]++] = s;
    }
  }
  std::vector<uint32_t> doomed;
  for (size_t i = 0; i < n; ++i) {
    if (slot_used(slots[i]) && !blocks_[slots[i]].mark) {
      blocks_[slots[i]].mark = 1;
      doomed.push_back(static_cast<uint32_t>(slots[i]));
    }
  }
  for (size_t i = 0; i < doomed.size(); ++i) {
    const uint32_t s = doomed[i];
    for (uint32_t c = first_child[s]; c < first_child[s + 1]; ++c) {
      Block& child = blocks_[child_list[c]];
      if (!child.mark) {
        child.mark = 1;
        doomed.push_back(child_list[c]);
      }
    }
  }
  // Leaves first; a removal may free its parent. Locked or unready blocks stay (and so do
  // their ancestors) until a later call.
  auto removable = [](const Block& b) { return b.children == 0 && b.locks == 0 && b.ready; };
  std::vector<uint32_t> ready_now;
  for (uint32_t s : doomed) {
    if (removable(blocks_[s])) ready_now.push_back(s);
  }
  Removed out;
  for (size_t i = 0; i < ready_now.size(); ++i) {
    Block& b = blocks_[ready_now[i]];
    const uint32_t parent = b.parent_slot;
    out.hashes.push_back(b.hash);
    out.slots.push_back(ready_now[i]);
    remove(b);
    if (parent != kNoSlot && blocks_[parent].mark && removable(blocks_[parent])) ready_now.push_back(parent);
  }
  for (uint32_t s : doomed) blocks_[s].mark = 0;
  return out;
}

void TierIndexCore::adopt(const std::vector<AdoptEntry>& entries, double now) {
  std::unordered_map<uint64_t, size_t> position;
  position.reserve(entries.size());
  for (size_t i = 0; i < entries.size(); ++i) {
    const uint64_t h = entries[i].hash;
    if (table_.find(h) != kNoSlot) fail("block " + hex(h) + " is already present");
    if (!position.emplace(h, i).second) fail("block " + hex(h) + " appears twice in one adopt");
  }
  std::vector<bool> claimed(opt_.capacity, false);
  for (const AdoptEntry& e : entries) {
    if (e.slot >= opt_.capacity || slot_used(e.slot)) {
      throw PoolViolation("block id " + std::to_string(e.slot) +
                          " cannot be claimed: out of range or in use");
    }
    if (claimed[e.slot]) {
      throw PoolViolation("block id " + std::to_string(e.slot) + " is claimed twice: each may be claimed once");
    }
    claimed[e.slot] = true;
  }
  for (size_t i = 0; i < entries.size(); ++i) {
    const AdoptEntry& e = entries[i];
    if (!e.has_parent) continue;
    const Block* p = find(e.parent);
    const auto earlier = position.find(e.parent);
    if (!(p != nullptr && p->ready) && !(earlier != position.end() && earlier->second < i)) {
      fail("adopt of " + hex(e.hash) + " before its parent");
    }
  }
  free_.erase(std::remove_if(free_.begin(), free_.end(), [&](uint32_t s) { return claimed[s]; }),
              free_.end());
  for (const AdoptEntry& e : entries) {
    Block& b = block_at(e.slot);
    b = Block{};
    b.hash = e.hash;
    b.ready = true;
    b.live = true;
    b.last_access = now;
    b.tick = ++tick_;
    if (e.has_parent) {
      b.parent_slot = table_.find(e.parent);
      ++blocks_[b.parent_slot].children;
    }
    table_.insert_new(e.hash, e.slot);
    ++num_ready_;
  }
  for (const AdoptEntry& e : entries) maybe_push(blocks_[e.slot]);
}

}  // namespace dfkv
