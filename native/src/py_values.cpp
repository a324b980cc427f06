// Python values read into C++ for the native index's bindings (py_values.h).
#include "py_values.h"

#include <pybind11/numpy.h>

#include <cstring>
#include <string>

namespace dfkv {
namespace {

// numpy's byteorder character of arrays whose bytes this machine reads swapped ('=' is native).
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
constexpr char kForeignByteOrder = '>';
#else
constexpr char kForeignByteOrder = '<';
#endif

}  // namespace

// An int in [0, 2**64) as uint64. PyLong_AsUnsignedLongLong goes through the generic
// _PyLong_AsByteArray for values >= 2**30 (every real hash), which dominated reading batches.
bool long_to_u64(PyObject* item, uint64_t& out) {
#if PY_VERSION_HEX >= 0x030D0000
  const Py_ssize_t n = PyLong_AsNativeBytes(item, &out, sizeof(out),
                                            Py_ASNATIVEBYTES_NATIVE_ENDIAN | Py_ASNATIVEBYTES_UNSIGNED_BUFFER |
                                                Py_ASNATIVEBYTES_REJECT_NEGATIVE);
  if (n < 0) PyErr_Clear();
  return n >= 0 && static_cast<size_t>(n) <= sizeof(out);
#elif PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030C0000 && !defined(Py_LIMITED_API)
  // 3.11: the (at most three 30-bit) digits read directly, as the generic calls would do slower.
  constexpr Py_ssize_t kMaxDigits = (64 + PyLong_SHIFT - 1) / PyLong_SHIFT;
  const Py_ssize_t size = Py_SIZE(item);
  if (size < 0 || size > kMaxDigits) return false;
  const digit* digits = reinterpret_cast<PyLongObject*>(item)->ob_digit;
  uint64_t v = 0;
  for (Py_ssize_t i = size; i-- > 0;) {
    if ((v >> (64 - PyLong_SHIFT)) != 0) return false;  // the shift would drop bits: over 64
    v = (v << PyLong_SHIFT) | digits[i];
  }
  out = v;
  return true;
#else
  if (_PyLong_Sign(item) < 0) return false;
  const size_t bits = _PyLong_NumBits(item);
  if (bits == static_cast<size_t>(-1) && PyErr_Occurred()) PyErr_Clear();
  if (bits > 64) return false;
  out = PyLong_AsUnsignedLongLongMask(item);
  return true;
#endif
}

// One sequence hash: an int in [0, 2**64) (numpy integers too). False when it is none.
bool try_hash(PyObject* item, uint64_t& out) {
  if (PyLong_Check(item)) return long_to_u64(item, out);
  PyObject* index = PyNumber_Index(item);
  if (index == nullptr) {
    PyErr_Clear();
    return false;
  }
  const bool ok = long_to_u64(index, out);
  Py_DECREF(index);
  return ok;
}

uint64_t hash_of(PyObject* item) {
  uint64_t h;
  if (!try_hash(item, h)) {
    const std::string shown = py::repr(item);
    throw py::value_error("sequence hash " + shown + " is not an unsigned 64-bit integer");
  }
  return h;
}

std::vector<uint64_t> read_hashes(py::handle obj) {
  if (py::isinstance<py::array>(obj)) {
    const auto a = py::reinterpret_borrow<py::array>(obj);
    const char kind = a.dtype().kind();
    if (a.ndim() == 1 && a.itemsize() == 8 && (kind == 'u' || kind == 'i')) {
      const size_t n = static_cast<size_t>(a.shape(0));
      const py::ssize_t stride = a.strides(0);
      const char* base = static_cast<const char*>(a.data());
      // Read by value: an array in the other byte order ('>u8' here) holds its bytes swapped.
      const bool swap = a.dtype().byteorder() == kForeignByteOrder;
      std::vector<uint64_t> out(n);
      for (size_t i = 0; i < n; ++i) {
        std::memcpy(&out[i], base + static_cast<py::ssize_t>(i) * stride, 8);
        if (swap) out[i] = __builtin_bswap64(out[i]);
        if (kind == 'i' && static_cast<int64_t>(out[i]) < 0) {
          throw py::value_error("sequence hash " + std::to_string(static_cast<int64_t>(out[i])) +
                                " is not an unsigned 64-bit integer");
        }
      }
      return out;
    }
    return read_hashes(a.attr("tolist")());  // other integer dtypes: checked item by item
  }
  const auto seq = py::reinterpret_steal<py::object>(
      PySequence_Fast(obj.ptr(), "sequence hashes must be a sequence of integers"));
  if (!seq) throw py::error_already_set();
  const size_t n = static_cast<size_t>(PySequence_Fast_GET_SIZE(seq.ptr()));
  PyObject** items = PySequence_Fast_ITEMS(seq.ptr());
  std::vector<uint64_t> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = hash_of(items[i]);
  return out;
}

// Block ids (slots) of the pool, a list/tuple of ints in [0, capacity) (a run's block_ids).
std::vector<uint32_t> read_slots(py::handle obj, uint32_t capacity) {
  const auto seq = py::reinterpret_steal<py::object>(
      PySequence_Fast(obj.ptr(), "block_ids must be a sequence of integers"));
  if (!seq) throw py::error_already_set();
  const size_t n = static_cast<size_t>(PySequence_Fast_GET_SIZE(seq.ptr()));
  PyObject** items = PySequence_Fast_ITEMS(seq.ptr());
  std::vector<uint32_t> out(n);
  for (size_t i = 0; i < n; ++i) {
    uint64_t id = 0;
    if (!try_hash(items[i], id) || id >= capacity) {
      const std::string shown = py::repr(items[i]);
      throw py::value_error("block id " + shown + " is not a slot of this tier (an int in [0, " +
                            std::to_string(capacity) + ")): pass the run's block_ids");
    }
    out[i] = static_cast<uint32_t>(id);
  }
  return out;
}

}  // namespace dfkv
