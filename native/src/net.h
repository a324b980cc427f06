// Socket reads for the remote tier: a bulk reply's payload received straight into its block.
#pragma once
#include <cstddef>
#include <cstdint>

namespace dfkv {

enum class RecvStatus : int { kOk = 0, kClosed = 1, kTimeout = 2, kError = 3, kOther = 4, kBadEnd = 5 };

// A connection's receive buffer: bytes [r, w) of buf[0, cap) are read from the socket, not yet
// consumed. Reply lines and the few bytes after a payload land here; payloads never do.
struct RxBuffer {
  char* buf;
  size_t cap, r, w;
};

struct RecvResult {
  RecvStatus status = RecvStatus::kOk;
  int error = 0;          // errno, with kError
  uint64_t checksum = 0;  // block_checksum of the payload, when asked and it landed
};

// Receives the next `n` bytes of the stream into dest: first from `rx`, the rest straight from
// the socket `fd`, waiting at most `timeout_ms` for each piece (the timeout of one socket read,
// as Python's sockets apply it; negative: no limit). Then, without waiting, whatever has already
// arrived, up to `spill` bytes, lands in `rx` (in a pipeline, the next reply's line, read without
// a further call). With `checksum`, hashes dest while it is still in cache. EINTR retries.
RecvResult recv_exact(int fd, RxBuffer& rx, char* dest, size_t n, size_t spill, int timeout_ms, bool checksum);

// One bulk reply of exactly header_len + n bytes ("$<len>\r\n" header payload "\r\n"): the header
// into `header`, the payload into `dest`, hashed as with recv_exact. When the reply line in `rx`
// is anything else, or not all there yet, returns kOther having consumed nothing (the caller reads
// that reply its general way); kBadEnd when the payload is not followed by CRLF.
RecvResult recv_bulk(int fd, RxBuffer& rx, char* header, size_t header_len, char* dest, size_t n, size_t spill,
                     int timeout_ms);

}  // namespace dfkv
