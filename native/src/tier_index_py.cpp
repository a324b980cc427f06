// Python bindings of the tier index; dynamo_flexkv/core/index/tier_index.py is the typed wrapper.
//
// Hashes come in as lists/tuples of ints or integer numpy arrays. Calls are serialized by a
// mutex; batches (and anything that may evict) run without the GIL. Owners are Python objects
// (task ids): each gets an int id while it holds unready blocks.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstring>
#include <memory>
#include <new>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "py_values.h"
#include "tier_index.h"

namespace py = pybind11;

namespace dfkv {
namespace {

// Shorter batches finish in less time than handing the GIL over would take.
constexpr size_t kReleaseGilFrom = 64;

// The Python exception classes (IndexInvariantError, PoolError) set by set_error_types; never freed.
PyObject* g_index_error = nullptr;
PyObject* g_pool_error = nullptr;

[[noreturn]] void raise_index_error(const std::string& message) {
  PyErr_SetString(g_index_error != nullptr ? g_index_error : PyExc_RuntimeError, message.c_str());
  throw py::error_already_set();
}

[[noreturn]] void raise_pool_error(const std::string& message) {
  PyErr_SetString(g_pool_error != nullptr ? g_pool_error : PyExc_RuntimeError, message.c_str());
  throw py::error_already_set();
}

py::tuple removed_tuple(const Removed& r) { return py::make_tuple(to_list(r.hashes), to_list(r.slots)); }

EvictionPolicy parse_policy(const std::string& name) {
  static const std::unordered_map<std::string, EvictionPolicy> kPolicies = {
      {"lru", EvictionPolicy::kLru},   {"lfu", EvictionPolicy::kLfu},
      {"slru", EvictionPolicy::kSlru}, {"fifo", EvictionPolicy::kFifo},
      {"filo", EvictionPolicy::kFilo}, {"mru", EvictionPolicy::kMru}};
  const auto it = kPolicies.find(name);
  if (it == kPolicies.end()) {
    throw py::value_error("unknown eviction policy '" + name + "': use one of lru, lfu, slru, fifo, filo, mru");
  }
  return it->second;
}

TierIndexOptions make_options(const std::string& name, int64_t capacity, const std::string& policy,
                              double hit_reward_seconds, int64_t slru_protected_hits,
                              double evict_start_threshold, double evict_ratio) {
  if (capacity < 0 || capacity > static_cast<int64_t>(kMaxCapacity)) {
    throw py::value_error("pool capacity must be in [0, " + std::to_string(kMaxCapacity) + "], got " +
                          std::to_string(capacity));
  }
  TierIndexOptions o;
  o.name = name;
  o.capacity = static_cast<uint32_t>(capacity);
  o.policy = parse_policy(policy);
  o.hit_reward_seconds = hit_reward_seconds;
  o.slru_protected_hits = slru_protected_hits;
  o.evict_start_threshold = evict_start_threshold;
  o.evict_ratio = evict_ratio;
  return o;
}

class NativeTierIndex {
 public:
  NativeTierIndex(const std::string& name, int64_t capacity, const std::string& policy,
                  double hit_reward_seconds, int64_t slru_protected_hits, double evict_start_threshold,
                  double evict_ratio)
      : core_(make_options(name, capacity, policy, hit_reward_seconds, slru_protected_hits,
                           evict_start_threshold, evict_ratio)) {}

  // ---- queries ---------------------------------------------------------------------------------
  template <class F>
  auto query(F&& f) {
    std::lock_guard<std::mutex> guard(mu_);
    return f();
  }
  size_t len() { return query([&] { return core_.size(); }); }
  size_t num_ready() { return query([&] { return core_.num_ready(); }); }
  size_t num_used() { return query([&] { return core_.num_used(); }); }
  size_t num_free() { return query([&] { return core_.num_free(); }); }
  uint64_t evictions() { return query([&] { return core_.evictions(); }); }
  uint32_t capacity() const { return core_.options().capacity; }
  const TierIndexOptions& options() const { return core_.options(); }
  bool is_used(int64_t slot) { return query([&] { return core_.slot_used(slot); }); }

  bool contains(py::handle hash) {
    uint64_t h;
    return try_hash(hash.ptr(), h) && query([&] { return core_.find(h) != nullptr; });
  }

  bool is_ready(py::handle hash) {
    uint64_t h;
    if (!try_hash(hash.ptr(), h)) return false;
    return query([&] {
      const Block* b = core_.find(h);
      return b != nullptr && b->ready;
    });
  }

  // (block_id, parent, ready, locks, children, hits, owner) or None.
  py::object info(py::handle hash) {
    uint64_t h;
    if (!try_hash(hash.ptr(), h)) return py::none();
    bool found = false;
    Block b;
    uint32_t slot = 0;
    uint64_t parent_hash = 0;
    query([&] {
      const Block* p = core_.find(h);
      if (p != nullptr) {
        found = true;
        b = *p;
        slot = core_.slot_of(*p);
        if (p->parent_slot != kNoSlot) parent_hash = core_.parent_of(*p);
      }
      return 0;
    });
    if (!found) return py::none();
    py::object parent = b.parent_slot == kNoSlot ? py::none() : py::object(py::int_(parent_hash));
    py::object owner = py::none();
    if (!b.ready) {
      const auto it = owners_.find(b.owner);
      if (it != owners_.end()) owner = it->second.owner;
    }
    return py::make_tuple(slot, parent, b.ready, b.locks, b.children, b.hits, owner);
  }

  size_t match_length(py::handle hashes, bool ready_only) {
    if (PyList_Check(hashes.ptr()) || PyTuple_Check(hashes.ptr())) {
      // Reads only the O(log n) items the binary search visits.
      PyObject** items = PySequence_Fast_ITEMS(hashes.ptr());
      const size_t n = static_cast<size_t>(PySequence_Fast_GET_SIZE(hashes.ptr()));
      return query([&] { return core_.match_length(n, [&](size_t i) { return hash_of(items[i]); }, ready_only); });
    }
    const std::vector<uint64_t> hs = read_hashes(hashes);
    return query([&] { return core_.match_length(hs.size(), [&](size_t i) { return hs[i]; }, ready_only); });
  }

  bool can_extend(py::handle parent, py::handle owner) {
    if (parent.is_none()) return true;
    const uint64_t p = hash_of(parent.ptr());
    const int64_t id = owner_id(owner);
    return query([&] { return core_.can_extend(true, p, id); });
  }

  py::list hashes() {
    std::vector<uint64_t> out;
    locked(kReleaseGilFrom, [&] { out = core_.hashes(); });
    return to_list(out);
  }

  // (ready, filling, in_use, parents, oldest last access or None, newest or None).
  py::tuple census() {
    Census c;
    locked(kReleaseGilFrom, [&] { c = core_.census(); });
    py::object oldest = c.any ? py::object(py::float_(c.oldest)) : py::none();
    py::object newest = c.any ? py::object(py::float_(c.newest)) : py::none();
    return py::make_tuple(c.ready, c.filling, c.in_use, c.parents, oldest, newest);
  }

  py::list block_ids(py::handle hashes) {
    const std::vector<uint64_t> hs = read_hashes(hashes);
    std::vector<uint32_t> out;
    locked(hs.size(), [&] { out = core_.slots_of(hs.data(), hs.size()); });
    return to_list(out);
  }

  // ---- mutations -------------------------------------------------------------------------------
  // (slots, (evicted hashes, evicted slots) or None)
  py::tuple insert(py::handle hashes, py::handle parent, py::handle owner, double now) {
    const std::vector<uint64_t> hs = read_hashes(hashes);
    const bool has_parent = !parent.is_none();
    const uint64_t p = has_parent ? hash_of(parent.ptr()) : 0;
    OwnerUse use(*this, owner);
    std::vector<uint32_t> slots;
    Removed evicted;
    // Without the GIL whatever the length: making room may evict many blocks.
    locked(kReleaseGilFrom, [&] { slots = core_.insert(hs.data(), hs.size(), has_parent, p, use.id, now, evicted); });
    return py::make_tuple(to_list(slots), evicted.empty() ? py::object(py::none()) : removed_tuple(evicted));
  }

  // match_length(present) + touch(held) + can_extend + insert in one call (CacheEngine.plan_put):
  // (held, slots, their hashes, the parent of the first (None at the root), (evicted hashes,
  // evicted slots) or None). The run's hashes come back as ints, so the caller converts nothing.
  py::tuple put(py::handle hashes, py::handle owner, double now) {
    const std::vector<uint64_t> hs = read_hashes(hashes);
    OwnerUse use(*this, owner);
    size_t held = 0;
    std::vector<uint32_t> slots;
    Removed evicted;
    locked(kReleaseGilFrom, [&] { slots = core_.put(hs.data(), hs.size(), use.id, now, held, evicted); });
    const std::vector<uint64_t> run(hs.begin() + static_cast<std::ptrdiff_t>(held),
                                    hs.begin() + static_cast<std::ptrdiff_t>(held + slots.size()));
    py::object parent = held > 0 ? py::object(py::int_(hs[held - 1])) : py::object(py::none());
    return py::make_tuple(held, to_list(slots), to_list(run), parent,
                          evicted.empty() ? py::object(py::none()) : removed_tuple(evicted));
  }

  // commit() of a run whose block ids are known: slots[i] must hold hashes[i].
  void commit_slots(py::handle slots, py::handle hashes, py::handle owner, double now) {
    const std::vector<uint64_t> hs = read_hashes(hashes);
    const std::vector<uint32_t> ss = read_slots(slots, capacity());
    if (ss.size() != hs.size()) {
      throw py::value_error("commit_slots got " + std::to_string(ss.size()) + " block ids for " +
                            std::to_string(hs.size()) + " hashes: pass one per hash");
    }
    OwnerUse use(*this, owner, false);
    with_owner(owner, [&] {
      locked(hs.size(), [&] { core_.commit_slots(ss.data(), hs.data(), hs.size(), use.id, now); });
    });
  }

  void commit(py::handle hashes, py::handle owner, double now) {
    const std::vector<uint64_t> hs = read_hashes(hashes);
    OwnerUse use(*this, owner, false);
    with_owner(owner, [&] { locked(hs.size(), [&] { core_.commit(hs.data(), hs.size(), use.id, now); }); });
  }

  void rollback(py::handle hashes, py::handle owner) {
    const std::vector<uint64_t> hs = read_hashes(hashes);
    OwnerUse use(*this, owner, false);
    with_owner(owner, [&] { locked(hs.size(), [&] { core_.rollback(hs.data(), hs.size(), use.id); }); });
  }

  void lock(py::handle hashes) {
    const std::vector<uint64_t> hs = read_hashes(hashes);
    locked(hs.size(), [&] { core_.lock(hs.data(), hs.size()); });
  }

  void unlock(py::handle hashes) {
    const std::vector<uint64_t> hs = read_hashes(hashes);
    locked(hs.size(), [&] { core_.unlock(hs.data(), hs.size()); });
  }

  void touch(py::handle hashes, bool hit, double now) {
    const std::vector<uint64_t> hs = read_hashes(hashes);
    locked(hs.size(), [&] { core_.touch(hs.data(), hs.size(), hit, now); });
  }

  py::tuple evict(int64_t count) {
    Removed out;
    if (count > 0) locked(static_cast<size_t>(count), [&] { out = core_.evict(static_cast<size_t>(count)); });
    return removed_tuple(out);
  }

  py::tuple clear() {
    Removed out;
    locked(kReleaseGilFrom, [&] { out = core_.clear(); });
    return removed_tuple(out);
  }

  py::tuple discard_slots(py::handle block_ids) {
    const auto seq = py::reinterpret_steal<py::object>(
        PySequence_Fast(block_ids.ptr(), "block_ids must be a sequence of integers"));
    if (!seq) throw py::error_already_set();
    const size_t n = static_cast<size_t>(PySequence_Fast_GET_SIZE(seq.ptr()));
    std::vector<int64_t> ids(n);
    for (size_t i = 0; i < n; ++i) ids[i] = py::cast<int64_t>(py::handle(PySequence_Fast_GET_ITEM(seq.ptr(), i)));
    Removed out;
    locked(kReleaseGilFrom, [&] { out = core_.discard_slots(ids.data(), n); });
    return removed_tuple(out);
  }

  // entries: (seq_hash, parent or None, block_id), parents first.
  void adopt(py::handle entries, double now) {
    std::vector<AdoptEntry> parsed;
    for (py::handle item : entries) {
      const auto t = py::reinterpret_borrow<py::sequence>(item);
      if (t.size() != 3) throw py::value_error("adopt entries are (seq_hash, parent, block_id) triples");
      AdoptEntry e{};
      e.hash = hash_of(t[0].ptr());
      const py::object parent = t[1];
      e.has_parent = !parent.is_none();
      e.parent = e.has_parent ? hash_of(parent.ptr()) : 0;
      const auto slot = py::cast<int64_t>(t[2]);
      if (slot < 0 || slot >= static_cast<int64_t>(capacity())) {
        raise_pool_error("block id " + std::to_string(slot) + " cannot be claimed: out of range or in use");
      }
      e.slot = static_cast<uint32_t>(slot);
      parsed.push_back(e);
    }
    locked(kReleaseGilFrom, [&] { core_.adopt(parsed, now); });
  }

 private:
  struct Owner {
    py::object owner;
    int calls = 0;  // calls in flight that use this id
  };

  // Marks an owner's id in use for one call (creating the id if asked); afterwards drops it
  // when the owner holds no block and no call uses it.
  class OwnerUse {
   public:
    OwnerUse(NativeTierIndex& index, py::handle owner, bool create = true) : index_(index) {
      id = index.owner_id(owner);
      if (id == kUnknownOwner && create) id = index.new_owner(owner);
      if (id != kUnknownOwner) ++index.owners_[id].calls;
    }
    ~OwnerUse() {
      if (id != kUnknownOwner) index_.release_owner(id);
    }
    OwnerUse(const OwnerUse&) = delete;
    OwnerUse& operator=(const OwnerUse&) = delete;
    int64_t id = kUnknownOwner;

   private:
    NativeTierIndex& index_;
  };

  int64_t owner_id(py::handle owner) {
    PyObject* id = PyDict_GetItemWithError(owner_ids_.ptr(), owner.ptr());
    if (id == nullptr) {
      if (PyErr_Occurred()) throw py::error_already_set();
      return kUnknownOwner;
    }
    return PyLong_AsLongLong(id);
  }

  int64_t new_owner(py::handle owner) {
    const int64_t id = next_owner_++;
    owner_ids_[owner] = py::int_(id);
    owners_[id] = Owner{py::reinterpret_borrow<py::object>(owner), 0};
    return id;
  }

  void release_owner(int64_t id) {
    const auto it = owners_.find(id);
    if (it == owners_.end() || --it->second.calls > 0) return;
    if (query([&] { return core_.owned_by(id); }) > 0) return;
    if (PyDict_DelItem(owner_ids_.ptr(), it->second.owner.ptr()) != 0) PyErr_Clear();
    owners_.erase(it);
  }

  // A violation that names the owner gets the owner's repr appended.
  template <class F>
  void with_owner(py::handle owner, F&& f) {
    try {
      f();
    } catch (const IndexViolation& e) {
      if (!e.names_owner) throw;
      const std::string shown = py::repr(owner);
      raise_index_error(std::string(e.what()) + shown);
    }
  }

  // Runs `f` under the mutex, without the GIL for `work` >= kReleaseGilFrom. The mutex goes
  // before the GIL comes back (members destroy in reverse), so its holder never waits for the
  // GIL, which a thread waiting for the mutex may hold.
  template <class F>
  void locked(size_t work, F&& f) {
    if (work < kReleaseGilFrom) {
      std::lock_guard<std::mutex> guard(mu_);
      f();
      return;
    }
    py::gil_scoped_release release;
    std::lock_guard<std::mutex> guard(mu_);
    f();
  }

  TierIndexCore core_;
  std::mutex mu_;
  py::dict owner_ids_;                         // owner -> id, while it holds blocks or is in a call
  std::unordered_map<int64_t, Owner> owners_;  // id -> owner
  int64_t next_owner_ = 0;
};

// A capacity the index memory cannot be had for raises MemoryError naming both (not bare bad_alloc).
std::unique_ptr<NativeTierIndex> make_index(const std::string& name, int64_t capacity, const std::string& policy,
                                            double hit_reward_seconds, int64_t slru_protected_hits,
                                            double evict_start_threshold, double evict_ratio) {
  try {
    return std::make_unique<NativeTierIndex>(name, capacity, policy, hit_reward_seconds, slru_protected_hits,
                                             evict_start_threshold, evict_ratio);
  } catch (const std::bad_alloc&) {
    constexpr size_t kPerBlock = sizeof(Block) + sizeof(uint32_t);  // block table + free-slot stack
    const std::string message =
        "tier '" + name + "': capacity=" + std::to_string(capacity) + " blocks needs about " +
        std::to_string(static_cast<uint64_t>(capacity) * kPerBlock) + " bytes of index memory (" +
        std::to_string(kPerBlock) + " per block), which could not be allocated: lower the tier's capacity";
    PyErr_SetString(PyExc_MemoryError, message.c_str());
    throw py::error_already_set();
  }
}

}  // namespace

void bind_tier_index(py::module_& m) {
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const IndexViolation& e) {
      PyErr_SetString(g_index_error != nullptr ? g_index_error : PyExc_RuntimeError, e.what());
    } catch (const PoolViolation& e) {
      PyErr_SetString(g_pool_error != nullptr ? g_pool_error : PyExc_RuntimeError, e.what());
    }
  });
  m.def(
      "set_index_error_types",
      [](py::object index_error, py::object pool_error) {
        g_index_error = index_error.release().ptr();  // kept for the life of the process
        g_pool_error = pool_error.release().ptr();
      },
      py::arg("index_error"), py::arg("pool_error"),
      "The exception classes TierIndex raises for index and pool violations.");

  py::class_<NativeTierIndex>(m, "TierIndex", "Prefix index of one tier (see dynamo_flexkv.core.index.tier_index).")
      .def(py::init(&make_index), py::arg("name"), py::arg("capacity"), py::arg("policy"), py::arg("hit_reward_seconds"),
           py::arg("slru_protected_hits"), py::arg("evict_start_threshold"), py::arg("evict_ratio"))
      .def("__len__", &NativeTierIndex::len)
      .def("__contains__", &NativeTierIndex::contains)
      .def_property_readonly("capacity", &NativeTierIndex::capacity)
      .def_property_readonly("num_ready", &NativeTierIndex::num_ready)
      .def_property_readonly("num_used", &NativeTierIndex::num_used)
      .def_property_readonly("num_free", &NativeTierIndex::num_free)
      .def_property_readonly("evictions", &NativeTierIndex::evictions)
      .def_property_readonly("evict_start_threshold",
                             [](NativeTierIndex& t) { return t.options().evict_start_threshold; })
      .def_property_readonly("evict_ratio", [](NativeTierIndex& t) { return t.options().evict_ratio; })
      .def("is_used", &NativeTierIndex::is_used, py::arg("block_id"))
      .def("is_ready", &NativeTierIndex::is_ready, py::arg("seq_hash"))
      .def("info", &NativeTierIndex::info, py::arg("seq_hash"))
      .def("match_length", &NativeTierIndex::match_length, py::arg("hashes"), py::arg("ready_only") = true)
      .def("can_extend", &NativeTierIndex::can_extend, py::arg("parent"), py::arg("owner"))
      .def("hashes", &NativeTierIndex::hashes)
      .def("census", &NativeTierIndex::census)
      .def("block_ids", &NativeTierIndex::block_ids, py::arg("hashes"))
      .def("insert", &NativeTierIndex::insert, py::arg("hashes"), py::arg("parent"), py::arg("owner"),
           py::arg("now"))
      .def("put", &NativeTierIndex::put, py::arg("hashes"), py::arg("owner"), py::arg("now"))
      .def("commit", &NativeTierIndex::commit, py::arg("hashes"), py::arg("owner"), py::arg("now"))
      .def("commit_slots", &NativeTierIndex::commit_slots, py::arg("block_ids"), py::arg("hashes"),
           py::arg("owner"), py::arg("now"))
      .def("rollback", &NativeTierIndex::rollback, py::arg("hashes"), py::arg("owner"))
      .def("lock", &NativeTierIndex::lock, py::arg("hashes"))
      .def("unlock", &NativeTierIndex::unlock, py::arg("hashes"))
      .def("touch", &NativeTierIndex::touch, py::arg("hashes"), py::arg("hit"), py::arg("now"))
      .def("evict", &NativeTierIndex::evict, py::arg("count"))
      .def("clear", &NativeTierIndex::clear)
      .def("discard_slots", &NativeTierIndex::discard_slots, py::arg("block_ids"))
      .def("adopt", &NativeTierIndex::adopt, py::arg("entries"), py::arg("now"));
}

}  // namespace dfkv
