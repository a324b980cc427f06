// Python values read into C++ (and back) for the native index's bindings: sequence hashes and
// block ids from lists, tuples or integer numpy arrays, each value checked with an error that
// names it, and lists of ints built without a conversion per call.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <vector>

namespace dfkv {

namespace py = pybind11;

// An int in [0, 2**64) as uint64 (false when it is not one); fast paths per CPython version.
bool long_to_u64(PyObject* item, uint64_t& out);
// One sequence hash: an int in [0, 2**64) (numpy integers too). False when it is none.
bool try_hash(PyObject* item, uint64_t& out);
// try_hash, or a ValueError naming the value.
uint64_t hash_of(PyObject* item);
// Sequence hashes from a list/tuple of ints or a 1-D 64-bit integer array (either byte order).
std::vector<uint64_t> read_hashes(py::handle obj);
// Block ids (slots) of a pool: a list/tuple of ints in [0, capacity) (a run's block_ids).
std::vector<uint32_t> read_slots(py::handle obj, uint32_t capacity);

template <class T>
py::list to_list(const std::vector<T>& values) {
  auto out = py::reinterpret_steal<py::list>(PyList_New(static_cast<py::ssize_t>(values.size())));
  if (!out) throw py::error_already_set();
  for (size_t i = 0; i < values.size(); ++i) {
    PyObject* v = PyLong_FromUnsignedLongLong(values[i]);
    if (v == nullptr) throw py::error_already_set();
    PyList_SET_ITEM(out.ptr(), static_cast<py::ssize_t>(i), v);
  }
  return out;
}

}  // namespace dfkv
