#include "server/row_order.h"

#include <algorithm>

namespace pstrain::server {

uint32_t RowOrder::ClassOf(uint32_t slot) const {
  return by_ == By::kLastTouch ? 0 : meta_[slot].touches;
}

RowOrder::List& RowOrder::ListOf(uint32_t slot) { return lists_[ClassOf(slot)]; }

bool RowOrder::Before(uint32_t a, uint32_t b) const {
  const RowMeta& x = meta_[a];
  const RowMeta& y = meta_[b];
  if (x.last_step != y.last_step) return x.last_step < y.last_step;
  return x.key < y.key;
}

void RowOrder::Insert(uint32_t slot) {
  if (slot >= links_.size()) links_.resize(slot + 1);
  List& list = ListOf(slot);
  // After the last row that leaves before it: the tail, but for a row
  // touched at an earlier step than the tail's (a step repeated).
  uint32_t after = list.tail;
  while (after != kEnd && Before(slot, after)) after = links_[after].prev;
  Link& link = links_[slot];
  link.prev = after;
  link.next = after == kEnd ? list.head : links_[after].next;
  (link.prev == kEnd ? list.head : links_[link.prev].next) = slot;
  (link.next == kEnd ? list.tail : links_[link.next].prev) = slot;
}

void RowOrder::Erase(uint32_t slot) {
  const auto it = lists_.find(ClassOf(slot));
  List& list = it->second;
  const Link link = links_[slot];
  (link.prev == kEnd ? list.head : links_[link.prev].next) = link.next;
  (link.next == kEnd ? list.tail : links_[link.next].prev) = link.prev;
  links_[slot] = Link{};
  if (list.head == kEnd && by_ != By::kLastTouch) lists_.erase(it);
}

void RowOrder::Rebuild(absl::Span<const uint32_t> slots) {
  lists_.clear();
  links_.assign(links_.size(), Link{});
  std::vector<uint32_t> sorted(slots.begin(), slots.end());
  std::sort(sorted.begin(), sorted.end(), [this](uint32_t a, uint32_t b) {
    const uint32_t ca = ClassOf(a), cb = ClassOf(b);
    return ca != cb ? ca < cb : Before(a, b);
  });
  for (const uint32_t slot : sorted) Insert(slot);
}

uint32_t RowOrder::First() const {
  for (const auto& [touches, list] : lists_) {
    if (list.head != kEnd) return list.head;
  }
  return kEnd;
}

uint32_t RowOrder::Last() const {
  const auto it = lists_.find(0);
  return it == lists_.end() ? kEnd : it->second.tail;
}

uint32_t RowOrder::Next(uint32_t slot) const {
  if (links_[slot].next != kEnd || by_ == By::kLastTouch) return links_[slot].next;
  // The next class's first row.
  const auto it = lists_.upper_bound(ClassOf(slot));
  return it == lists_.end() ? kEnd : it->second.head;
}

}  // namespace pstrain::server
