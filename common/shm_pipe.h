// The shared-memory carrier of direct connections (direct_connection.h):
// a region made with memfd_create, sealed against resizing, that holds a
// header page and two byte pipes, one each way. The connecting side makes
// the region and hands its descriptor to the listening side, which checks
// it before it maps it (direct_listener.cc).
#ifndef PSTRAIN_COMMON_SHM_PIPE_H_
#define PSTRAIN_COMMON_SHM_PIPE_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <utility>

#include "absl/status/statusor.h"
#include "grpcpp/support/slice.h"

namespace pstrain {

inline constexpr uint64_t kRegionMagic = 0x314d485352545350;  // "PSTRSHM1", little-endian
inline constexpr size_t kControlBytes = 4096;  // the region's first page: its header
inline constexpr int64_t kMinPipeBytes = 64 << 10;
inline constexpr int64_t kMaxPipeBytes = int64_t{1} << 30;

// One direction's indices, each written by one side only, on cache lines
// of their own.
struct PipeControl {
  alignas(64) std::atomic<uint64_t> head;  // bytes written ever (the writer's)
  alignas(64) std::atomic<uint64_t> tail;  // bytes read ever (the reader's)
  // The reader is about to sleep: a writer that sees it rings.
  alignas(64) std::atomic<uint32_t> reader_sleeping;
  // The writer waits for room: a reader that sees it rings.
  alignas(64) std::atomic<uint32_t> writer_waiting;
};
static_assert(std::atomic<uint64_t>::is_always_lock_free);

struct RegionHeader {
  uint64_t magic;
  uint64_t pipe_bytes;
  PipeControl pipes[2];  // [0]: connecting side -> listening side, [1]: back
};
static_assert(sizeof(RegionHeader) <= kControlBytes);

// A region of pipes of `pipe_bytes` each: its size.
inline size_t RegionBytes(uint64_t pipe_bytes) { return kControlBytes + 2 * pipe_bytes; }

// One end of one direction of a region: a ring of `capacity` bytes, one
// side writing, the other reading. The peer's index is read, never trusted:
// a value that the protocol cannot produce makes the pipe broken(). Not
// thread-safe: each end is used by one thread at a time.
class ShmPipe {
 public:
  ShmPipe(PipeControl* control, unsigned char* data, uint64_t capacity)
      : control_(control), data_(data), capacity_(capacity) {}

  bool broken() const { return broken_; }

  // Writer: copies up to n bytes in; returns how many. *ring: the reader
  // sleeps and must be woken.
  size_t Write(const unsigned char* src, size_t n, bool* ring) {
    const size_t room = Writable();
    n = std::min(n, room);
    if (n == 0) return 0;
    const size_t at = static_cast<size_t>(head_ & (capacity_ - 1));
    const size_t first = std::min<size_t>(n, capacity_ - at);
    std::memcpy(data_ + at, src, first);
    std::memcpy(data_, src + first, n - first);
    head_ += n;
    control_->head.store(head_, std::memory_order_release);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (control_->reader_sleeping.load(std::memory_order_relaxed) != 0 &&
        control_->reader_sleeping.exchange(0) != 0) {
      *ring = true;
    }
    return n;
  }
  size_t Writable() {
    const uint64_t used = head_ - control_->tail.load(std::memory_order_acquire);
    if (used > capacity_) {
      broken_ = true;
      return 0;
    }
    return static_cast<size_t>(capacity_ - used);
  }

  // Reader: copies up to n bytes out; returns how many. *ring: the writer
  // waits for room and must be woken.
  size_t Read(unsigned char* dst, size_t n, bool* ring) {
    n = std::min(n, Readable());
    if (n == 0) return 0;
    const size_t at = static_cast<size_t>(tail_ & (capacity_ - 1));
    const size_t first = std::min<size_t>(n, capacity_ - at);
    std::memcpy(dst, data_ + at, first);
    std::memcpy(dst + first, data_, n - first);
    Skip(n, ring);
    return n;
  }
  // Reader: the next n bytes where they lie, if they are all written (else
  // false): *first up to the pipe's end, *rest (empty unless they wrap
  // around it) from its start. Skip(n) releases them.
  bool Peek(size_t n, grpc::Slice* first, grpc::Slice* rest) {
    if (Readable() < n) return false;
    const size_t at = static_cast<size_t>(tail_ & (capacity_ - 1));
    const size_t first_bytes = std::min<size_t>(n, capacity_ - at);
    *first = grpc::Slice(data_ + at, first_bytes, grpc::Slice::STATIC_SLICE);
    *rest = grpc::Slice(data_, n - first_bytes, grpc::Slice::STATIC_SLICE);
    return true;
  }
  uint64_t capacity() const { return capacity_; }
  void Skip(size_t n, bool* ring) {
    tail_ += n;
    control_->tail.store(tail_, std::memory_order_release);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (control_->writer_waiting.load(std::memory_order_relaxed) != 0 &&
        control_->writer_waiting.exchange(0) != 0) {
      *ring = true;
    }
  }

  size_t Readable() {
    const uint64_t ready = control_->head.load(std::memory_order_acquire) - tail_;
    if (ready > capacity_) {
      broken_ = true;
      return 0;
    }
    return static_cast<size_t>(ready);
  }

  // Before sleeping: the flags that make the peer ring, set (a seq_cst
  // fence follows in the caller, then a last look).
  void SetReaderSleeping(bool on) { control_->reader_sleeping.store(on ? 1 : 0); }
  void SetWriterWaiting(bool on) { control_->writer_waiting.store(on ? 1 : 0); }

 private:
  PipeControl* const control_;
  unsigned char* const data_;
  const uint64_t capacity_;
  uint64_t head_ = 0;  // the writer's own count
  uint64_t tail_ = 0;  // the reader's own count
  bool broken_ = false;
};

// A new region for pipes of `pipe_bytes`, mapped, with its header written;
// `memfd` is the caller's to hand over and close.
struct ShmRegion {
  void* base = nullptr;
  size_t bytes = 0;
  int memfd = -1;
};
absl::StatusOr<ShmRegion> CreateShmRegion(uint64_t pipe_bytes);

// Maps the region a peer made for pipes of `pipe_bytes`, if it is one: the
// size that makes, sealed against shrinking (the peer cannot truncate what
// is mapped here), with a good header. INVALID_ARGUMENT otherwise.
absl::StatusOr<void*> MapPeerRegion(int memfd, uint64_t pipe_bytes);

// The two pipes of a region: (out, in) for the connecting side (is_client)
// or the listening one.
std::pair<std::unique_ptr<ShmPipe>, std::unique_ptr<ShmPipe>> PipesOf(void* region,
                                                                     uint64_t pipe_bytes,
                                                                     bool is_client);

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_SHM_PIPE_H_
