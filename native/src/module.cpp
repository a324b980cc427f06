// Python bindings for dynamo_flexkv._native. Every call that walks bulk data releases the GIL.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstring>
#include <string>
#include <vector>

#include "hashing.h"
#include "io.h"
#include "net.h"

namespace py = pybind11;

namespace dfkv {
void bind_tier_index(py::module_& m);  // tier_index_py.cpp
}  // namespace dfkv

namespace {

using U64Array = py::array_t<uint64_t, py::array::c_style>;

// Reads a list/tuple of Python ints into uint32, rejecting anything outside [0, 2**32) with the
// index of the offending item (the partial tail block too, though it is never hashed).
std::vector<uint32_t> tokens_from_sequence(PyObject* seq) {
  PyObject** items = PySequence_Fast_ITEMS(seq);
  const size_t take = static_cast<size_t>(PySequence_Fast_GET_SIZE(seq));
  std::vector<uint32_t> out(take);
  for (size_t i = 0; i < take; ++i) {
    PyObject* item = items[i];
    if (!PyLong_Check(item)) {
      throw py::type_error("token_ids[" + std::to_string(i) + "] is " +
                           std::string(Py_TYPE(item)->tp_name) +
                           ", not int: pass integer token ids");
    }
    int overflow = 0;
    const long long v = PyLong_AsLongLongAndOverflow(item, &overflow);
    if (overflow != 0 || v < 0 || v > 0xFFFFFFFFLL) {
      const std::string shown = py::str(item);
      throw py::value_error("token_ids[" + std::to_string(i) + "] = " + shown +
                            " is out of range: token ids must be in [0, 2**32)");
    }
    out[i] = static_cast<uint32_t>(v);
  }
  return out;
}

py::tuple hash_into_arrays(const uint32_t* tokens, size_t n_blocks, size_t block_size,
                           uint64_t seed) {
  U64Array toks(static_cast<py::ssize_t>(n_blocks));
  U64Array seqs(static_cast<py::ssize_t>(n_blocks));
  uint64_t* t = toks.mutable_data();
  uint64_t* s = seqs.mutable_data();
  {
    py::gil_scoped_release release;
    dfkv::tokens_hashes(tokens, n_blocks, block_size, seed, t);
    dfkv::chain_hashes(t, n_blocks, false, 0, s);
  }
  return py::make_tuple(toks, seqs);
}

// block_hashes(tokens, block_size, seed) -> (tokens_hashes, sequence_hashes), both uint64 arrays.
// `tokens` is a list/tuple of ints or a C-contiguous uint32 buffer (the Python layer converts
// other integer dtypes after its range checks).
py::tuple block_hashes(py::handle tokens, size_t block_size, uint64_t seed) {
  if (block_size == 0) throw py::value_error("block_size must be positive");
  if (PyList_Check(tokens.ptr()) || PyTuple_Check(tokens.ptr())) {
    const size_t n = static_cast<size_t>(PySequence_Fast_GET_SIZE(tokens.ptr()));
    const size_t n_blocks = n / block_size;
    std::vector<uint32_t> buf = tokens_from_sequence(tokens.ptr());
    return hash_into_arrays(buf.data(), n_blocks, block_size, seed);
  }
  py::buffer_info info = py::reinterpret_borrow<py::buffer>(tokens).request();
  const bool u32 = info.itemsize == 4 && (info.format == "I" || info.format == "=I" ||
                                          info.format == "<I");
  if (info.ndim != 1 || !u32) {
    throw py::type_error("native block_hashes takes a 1-D uint32 buffer, got format '" +
                         info.format + "' with ndim " + std::to_string(info.ndim));
  }
  if (info.shape[0] > 1 && info.strides[0] != 4) {
    throw py::value_error("token buffer must be contiguous");
  }
  const size_t n_blocks = static_cast<size_t>(info.shape[0]) / block_size;
  return hash_into_arrays(static_cast<const uint32_t*>(info.ptr), n_blocks, block_size, seed);
}

U64Array chain(const U64Array& tokens_hashes, const py::object& parent) {
  const size_t n = static_cast<size_t>(tokens_hashes.size());
  U64Array out(static_cast<py::ssize_t>(n));
  const bool has_parent = !parent.is_none();
  const uint64_t p = has_parent ? parent.cast<uint64_t>() : 0;
  const uint64_t* src = tokens_hashes.data();
  uint64_t* dst = out.mutable_data();
  {
    py::gil_scoped_release release;
    dfkv::chain_hashes(src, n, has_parent, p, dst);
  }
  return out;
}

template <class T>
using CArray = py::array_t<T, py::array::c_style | py::array::forcecast>;

// Bulk I/O on raw addresses. The Python layer owns the buffers and checks every range against
// them before calling: these functions trust their inputs.
// With checksums=true it returns each op's block_checksum (taken as the op completes, while the
// others are in flight), else None.
py::object file_io(const CArray<int32_t>& fds, const CArray<uint64_t>& file_offsets,
                   const CArray<uint64_t>& addrs, const CArray<uint64_t>& lengths, bool write,
                   unsigned depth, bool use_uring, unsigned threads, bool checksums) {
  const size_t n = static_cast<size_t>(fds.size());
  if (static_cast<size_t>(file_offsets.size()) != n || static_cast<size_t>(addrs.size()) != n ||
      static_cast<size_t>(lengths.size()) != n) {
    throw py::value_error("file_io: fds, file_offsets, addrs and lengths must have one entry per op");
  }
  std::vector<dfkv::IoOp> ops(n);
  for (size_t i = 0; i < n; ++i) {
    ops[i] = {fds.data()[i], file_offsets.data()[i], reinterpret_cast<char*>(addrs.data()[i]),
              lengths.data()[i]};
  }
  U64Array sums(static_cast<py::ssize_t>(checksums ? n : 0));
  uint64_t* sums_out = checksums ? sums.mutable_data() : nullptr;
  dfkv::IoResult res;
  {
    py::gil_scoped_release release;
    res = use_uring ? dfkv::uring_rw(ops.data(), n, write, depth, sums_out)
                    : dfkv::pool_rw(ops.data(), n, write, threads, sums_out);
  }
  if (res.error != 0) {
    const dfkv::IoOp& op = ops[res.failed_op];
    const std::string msg = res.what + " failed on op " + std::to_string(res.failed_op) + " (fd " +
                            std::to_string(op.fd) + ", offset " + std::to_string(op.file_offset) +
                            ", " + std::to_string(op.len) + " bytes): " + std::strerror(res.error);
    PyErr_SetObject(PyExc_OSError, py::make_tuple(res.error, msg).ptr());
    throw py::error_already_set();
  }
  if (!checksums) return py::none();
  return std::move(sums);
}

// The copies take only unsigned 64-bit arrays (no forced cast): a negative length or id would
// otherwise wrap to a huge one, and a float one would be truncated, without a word.
void copy_chunks(const U64Array& dst, const U64Array& src, const U64Array& lengths, unsigned threads) {
  const size_t n = static_cast<size_t>(dst.size());
  if (static_cast<size_t>(src.size()) != n || static_cast<size_t>(lengths.size()) != n) {
    throw py::value_error("copy_chunks: dst, src and lengths must have one entry per chunk");
  }
  py::gil_scoped_release release;
  dfkv::copy_chunks(dst.data(), src.data(), lengths.data(), n, threads);
}

void copy_kv_grid(const U64Array& dst_layer_base, const U64Array& dst_ids, uint64_t dst_block_stride,
                  uint64_t dst_kv_stride, const U64Array& src_layer_base, const U64Array& src_ids,
                  uint64_t src_block_stride, uint64_t src_kv_stride, size_t kv, uint64_t chunk_bytes,
                  bool block_major, unsigned threads) {
  if (dst_layer_base.size() != src_layer_base.size() || dst_ids.size() != src_ids.size()) {
    throw py::value_error("copy_kv_grid: both sides need one base per layer and one id per block (got " +
                          std::to_string(dst_layer_base.size()) + "/" + std::to_string(src_layer_base.size()) +
                          " layers, " + std::to_string(dst_ids.size()) + "/" + std::to_string(src_ids.size()) +
                          " blocks)");
  }
  const dfkv::GridSide dst{dst_layer_base.data(), dst_ids.data(), dst_block_stride, dst_kv_stride};
  const dfkv::GridSide src{src_layer_base.data(), src_ids.data(), src_block_stride, src_kv_stride};
  py::gil_scoped_release release;
  dfkv::copy_kv_grid(dst, src, static_cast<size_t>(dst_layer_base.size()), static_cast<size_t>(dst_ids.size()), kv,
                     chunk_bytes, block_major, threads);
}

U64Array checksums(uint64_t base, const CArray<uint64_t>& offsets, uint64_t length) {
  const size_t n = static_cast<size_t>(offsets.size());
  U64Array out(static_cast<py::ssize_t>(n));
  uint64_t* dst = out.mutable_data();
  {
    py::gil_scoped_release release;
    dfkv::checksums(reinterpret_cast<const char*>(base), offsets.data(), n, length, dst);
  }
  return out;
}

U64Array kv_block_checksums(const CArray<uint64_t>& layer_addrs, uint64_t block_bytes,
                            const CArray<uint64_t>& blocks) {
  const size_t n = static_cast<size_t>(blocks.size());
  U64Array out(static_cast<py::ssize_t>(n));
  uint64_t* dst = out.mutable_data();
  {
    py::gil_scoped_release release;
    dfkv::kv_block_checksums(layer_addrs.data(), static_cast<size_t>(layer_addrs.size()), block_bytes,
                             blocks.data(), n, dst);
  }
  return out;
}

// A writable C-contiguous buffer's bytes, or a TypeError naming `what`. Holds the buffer's export
// for its lifetime, so that nobody can resize or free the memory while the GIL is released.
struct WritableBytes {
  py::buffer_info info;
  char* data;
  size_t size;

  WritableBytes(const py::buffer& b, const char* what) : info(b.request(true)) {
    py::ssize_t expect = info.itemsize;
    for (py::ssize_t d = info.ndim - 1; d >= 0; --d) {
      if (info.shape[d] > 1 && info.strides[d] != expect) {
        throw py::type_error(std::string(what) + " must be a C-contiguous buffer");
      }
      expect *= info.shape[d];
    }
    data = static_cast<char*>(info.ptr);
    size = static_cast<size_t>(info.size * info.itemsize);
  }
};

// The receive buffer as Python holds it (a bytearray and its unread [r, w)), checked.
dfkv::RxBuffer rx_buffer(const WritableBytes& buf, size_t r, size_t w) {
  if (r > w || w > buf.size) {
    throw py::value_error("rx: unread range [" + std::to_string(r) + ", " + std::to_string(w) +
                          ") does not fit its " + std::to_string(buf.size) + "-byte buffer");
  }
  return {buf.data, buf.size, r, w};
}

py::tuple recv_reply(const dfkv::RecvResult& res, const dfkv::RxBuffer& rx) {
  return py::make_tuple(static_cast<int>(res.status), res.error, rx.r, rx.w, res.checksum);
}

py::tuple recv_exact(int fd, const py::buffer& rx_buf, size_t r, size_t w, size_t spill, int timeout_ms,
                     const py::buffer& dest, bool checksum) {
  const WritableBytes rx_bytes(rx_buf, "rx"), d(dest, "dest");
  dfkv::RxBuffer rx = rx_buffer(rx_bytes, r, w);
  dfkv::RecvResult res;
  {
    py::gil_scoped_release release;
    res = dfkv::recv_exact(fd, rx, d.data, d.size, spill, timeout_ms, checksum);
  }
  return recv_reply(res, rx);
}

py::tuple recv_bulk(int fd, const py::buffer& rx_buf, size_t r, size_t w, size_t spill, int timeout_ms,
                    const py::buffer& header, const py::buffer& dest) {
  const WritableBytes rx_bytes(rx_buf, "rx"), h(header, "header"), d(dest, "dest");
  dfkv::RxBuffer rx = rx_buffer(rx_bytes, r, w);
  dfkv::RecvResult res;
  {
    py::gil_scoped_release release;
    res = dfkv::recv_bulk(fd, rx, h.data, h.size, d.data, d.size, spill, timeout_ms);
  }
  return recv_reply(res, rx);
}

}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "dynamo_flexkv native core: hashing, the tier index, batched I/O and block copies";
  m.attr("TOKENS_HASH_SEED") = py::int_(dfkv::kTokensHashSeed);
  m.def("block_hashes", &block_hashes, py::arg("tokens"), py::arg("block_size"), py::arg("seed"),
        "Tokens hashes and chained sequence hashes of every full block.");
  m.def("chain_hashes", &chain, py::arg("tokens_hashes"), py::arg("parent") = py::none(),
        "Chain tokens hashes into sequence hashes, optionally continuing from `parent`.");
  m.def("uring_available", &dfkv::uring_available, "Whether io_uring works here and was built in.");
  m.def("file_io", &file_io, py::arg("fds"), py::arg("file_offsets"), py::arg("addrs"),
        py::arg("lengths"), py::arg("write"), py::arg("depth") = 512, py::arg("use_uring") = true,
        py::arg("threads") = 8, py::arg("checksums") = false,
        "Reads or writes every (fd, offset, addr, length) op; raises OSError on the first failure. "
        "checksums=True returns the xxh3_64 of each op's buffer, hashed as the op completes.");
  m.def("copy_chunks", &copy_chunks, py::arg("dst"), py::arg("src"), py::arg("lengths"),
        py::arg("threads") = 4, "memcpy each (dst, src, length) chunk, merged and multi-threaded.");
  m.def("copy_kv_grid", &copy_kv_grid, py::arg("dst_layer_base"), py::arg("dst_ids"), py::arg("dst_block_stride"),
        py::arg("dst_kv_stride"), py::arg("src_layer_base"), py::arg("src_ids"), py::arg("src_block_stride"),
        py::arg("src_kv_stride"), py::arg("kv"), py::arg("chunk_bytes"), py::arg("block_major"),
        py::arg("threads") = 4,
        "Copy chunk (l, i, k) at src_layer_base[l] + src_ids[i] * src_block_stride + k * src_kv_stride to the "
        "same formula on dst, for every layer, block and kv, in [layer][block][kv] order ([block][layer][kv] "
        "with block_major); adjacent chunks merge. The caller checks the bounds.");
  m.def("checksums", &checksums, py::arg("base"), py::arg("offsets"), py::arg("length"),
        "xxh3_64 of `length` bytes at base + each offset.");
  m.def("kv_block_checksums", &kv_block_checksums, py::arg("layer_addrs"), py::arg("block_bytes"),
        py::arg("blocks"),
        "Per block: xxh3_64 over the LE u64 xxh3_64 of its `block_bytes` span in each layer "
        "(layer_addrs[l] + block * block_bytes), in layer order. The caller checks the bounds.");
  // The receive side of the remote tier's RESP connection (core/remote/resp.py). Both return
  // (status, errno, r, w, checksum): status as dfkv::RecvStatus, [r, w) the buffer's new unread bytes.
  m.def("recv_exact", &recv_exact, py::arg("fd"), py::arg("rx"), py::arg("r"), py::arg("w"), py::arg("spill"),
        py::arg("timeout_ms"), py::arg("dest"), py::arg("checksum"),
        "Fill dest from rx[r:w] and then the socket (each wait bounded by timeout_ms), then take what already "
        "arrived, up to spill bytes, into rx; with checksum, the xxh3_64 of dest.");
  m.def("recv_bulk", &recv_bulk, py::arg("fd"), py::arg("rx"), py::arg("r"), py::arg("w"), py::arg("spill"),
        py::arg("timeout_ms"), py::arg("header"), py::arg("dest"),
        "Read a bulk reply of exactly len(header) + len(dest) bytes into header and dest, checksumming dest; "
        "status 4 (nothing consumed) when the next reply in rx is anything else, 5 when no CRLF ends it.");
  dfkv::bind_tier_index(m);
}
