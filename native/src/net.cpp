#include "net.h"

#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>

#include "hashing.h"

namespace dfkv {

namespace {

// Waits until `fd` is readable: true when it is, false on timeout; sets `err` on a poll failure.
bool wait_readable(int fd, int timeout_ms, int& err) {
  using clock = std::chrono::steady_clock;
  const auto deadline = clock::now() + std::chrono::milliseconds(timeout_ms < 0 ? 0 : timeout_ms);
  for (;;) {
    int wait = -1;
    if (timeout_ms >= 0) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - clock::now()).count();
      wait = left > 0 ? static_cast<int>(left) : 0;
    }
    pollfd p{fd, POLLIN, 0};
    const int r = poll(&p, 1, wait);
    if (r > 0) return true;  // readable, or an error/hang-up that the next recv reports
    if (r == 0) return false;
    if (errno != EINTR) {
      err = errno;
      return false;
    }
  }
}

// Fills out[0, n) from the socket alone.
RecvResult recv_all(int fd, char* out, size_t n, int timeout_ms) {
  RecvResult res;
  size_t pos = 0;
  while (pos < n) {
    const ssize_t got = recv(fd, out + pos, n - pos, MSG_DONTWAIT);
    if (got > 0) {
      pos += static_cast<size_t>(got);
      continue;
    }
    if (got == 0) {
      res.status = RecvStatus::kClosed;
      return res;
    }
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) {
      res.status = RecvStatus::kError;
      res.error = errno;
      return res;
    }
    int err = 0;
    if (!wait_readable(fd, timeout_ms, err)) {
      res.status = err ? RecvStatus::kError : RecvStatus::kTimeout;
      res.error = err;
      return res;
    }
  }
  return res;
}

// Fills out[0, n) from rx, then the socket; once rx ran dry, spills what already arrived into it.
RecvResult take(int fd, RxBuffer& rx, char* out, size_t n, size_t spill, int timeout_ms) {
  const size_t k = std::min(rx.w - rx.r, n);
  std::memcpy(out, rx.buf + rx.r, k);
  rx.r += k;
  if (k == n) return {};
  rx.r = rx.w = 0;  // empty: what arrives after `out` lands at its start
  RecvResult res = recv_all(fd, out + k, n - k, timeout_ms);
  spill = std::min(spill, rx.cap);
  while (res.status == RecvStatus::kOk && spill > 0) {
    const ssize_t got = recv(fd, rx.buf, spill, MSG_DONTWAIT);
    if (got > 0) rx.w = static_cast<size_t>(got);
    if (got >= 0 || errno != EINTR) break;  // nothing there yet, or closed: the next read says so
  }
  return res;
}

}  // namespace

RecvResult recv_exact(int fd, RxBuffer& rx, char* dest, size_t n, size_t spill, int timeout_ms, bool checksum) {
  RecvResult res = take(fd, rx, dest, n, spill, timeout_ms);
  if (res.status == RecvStatus::kOk && checksum) res.checksum = block_checksum(dest, n);
  return res;
}

RecvResult recv_bulk(int fd, RxBuffer& rx, char* header, size_t header_len, char* dest, size_t n, size_t spill,
                     int timeout_ms) {
  char line[32];
  const int len = std::snprintf(line, sizeof line, "$%zu\r\n", header_len + n);
  if (rx.w - rx.r < static_cast<size_t>(len) || std::memcmp(rx.buf + rx.r, line, len) != 0) {
    return {RecvStatus::kOther, 0, 0};
  }
  rx.r += static_cast<size_t>(len);
  RecvResult res = take(fd, rx, header, header_len, spill, timeout_ms);
  if (res.status == RecvStatus::kOk) res = recv_exact(fd, rx, dest, n, spill, timeout_ms, true);
  if (res.status != RecvStatus::kOk) return res;
  char crlf[2];
  const uint64_t sum = res.checksum;
  res = take(fd, rx, crlf, 2, spill, timeout_ms);
  if (res.status == RecvStatus::kOk && (crlf[0] != '\r' || crlf[1] != '\n')) res.status = RecvStatus::kBadEnd;
  res.checksum = sum;
  return res;
}

}  // namespace dfkv
