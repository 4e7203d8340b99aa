// The order in which an embedding table's rows leave it, kept up to date as
// steps touch rows, so that the rows a step expires (TTL) or evicts (at the
// cap) are found in time proportional to the rows it touches and removes,
// never to the table's size.
//
// Rows are a table's slots; each slot's RowMeta (the table's) says its key,
// its last step and its touches. An order is a doubly linked list of slots
// through 8 bytes a slot, sorted by
//   kLastTouch:           (last_step, key) — LRU, and TTL's oldest first;
//   kTouchesThenLastTouch: (touches, last_step, key) — LFU: one such list
//                          for each count of touches, fewest first.
// A row is erased before its meta changes and inserted after; rows a step
// touched are inserted in key order after the rows of earlier steps, so an
// insertion walks back no row (one that does, as after a step repeated, is
// still put in its exact place).
#ifndef PSTRAIN_SERVER_ROW_ORDER_H_
#define PSTRAIN_SERVER_ROW_ORDER_H_

#include <cstdint>
#include <vector>

#include "absl/container/btree_map.h"
#include "absl/types/span.h"
#include "server/huge_pages.h"

namespace pstrain::server {

// A row's bookkeeping: 32 bytes a slot.
struct RowMeta {
  uint64_t key = 0;
  int64_t last_step = 0;
  int64_t updates = 0;   // Adam's bias correction counts the row's own updates
  uint32_t touches = 0;  // steps that touched it, saturating
  uint32_t epoch = 0;    // the table's snapshot epoch when the row was made
};
using RowMetas = std::vector<RowMeta, HugePageAllocator<RowMeta>>;

class RowOrder {
 public:
  static constexpr uint32_t kEnd = 0xffffffff;
  static constexpr int64_t kBytesPerSlot = 8;
  enum class By { kLastTouch, kTouchesThenLastTouch };

  // `meta` is the table's, by slot; it outlives the order.
  RowOrder(By by, const RowMetas& meta) : by_(by), meta_(meta) {}

  // Room for `slots` slots (a capped table's arrays never grow past it).
  void Reserve(size_t slots) { links_.reserve(slots); }
  // The row in `slot` into its place, by its meta now.
  void Insert(uint32_t slot);
  // The row in `slot` out of the order, its meta as when it was inserted.
  void Erase(uint32_t slot);
  // The rows of `slots`, and only they, in order.
  void Rebuild(absl::Span<const uint32_t> slots);

  // Asks for the slot's link ahead of its use, and, once it is in, for its
  // neighbours' links (which Erase writes).
  void Prefetch(uint32_t slot) const { __builtin_prefetch(links_.data() + slot, 1); }
  void PrefetchNeighbours(uint32_t slot) const {
    const Link& link = links_[slot];
    if (link.prev != kEnd) __builtin_prefetch(links_.data() + link.prev, 1);
    if (link.next != kEnd) __builtin_prefetch(links_.data() + link.next, 1);
  }

  // The first row of the order and the one after `slot`; kEnd past the last.
  uint32_t First() const;
  uint32_t Next(uint32_t slot) const;
  // kLastTouch: the last row and the one before `slot`; kEnd before the first.
  uint32_t Last() const;
  uint32_t Prev(uint32_t slot) const { return links_[slot].prev; }

 private:
  struct Link {
    uint32_t prev = kEnd;
    uint32_t next = kEnd;
  };
  struct List {
    uint32_t head = kEnd;
    uint32_t tail = kEnd;
  };
  // Whether slot a's row leaves before slot b's within one list.
  bool Before(uint32_t a, uint32_t b) const;
  List& ListOf(uint32_t slot);
  uint32_t ClassOf(uint32_t slot) const;

  const By by_;
  const RowMetas& meta_;
  std::vector<Link, HugePageAllocator<Link>> links_;  // by slot
  // kLastTouch: one list (class 0); LFU: a list for each count of touches.
  absl::btree_map<uint32_t, List> lists_;
};

}  // namespace pstrain::server

#endif  // PSTRAIN_SERVER_ROW_ORDER_H_
