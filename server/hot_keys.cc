#include "server/hot_keys.h"

#include <algorithm>
#include <cmath>
#include <functional>

#include "common/random.h"

namespace pstrain::server {

HotKeys::HotKeys(int capacity) : capacity_(static_cast<size_t>(std::max(capacity, 1))) {}

void HotKeys::Swap(size_t a, size_t b) {
  std::swap(heap_[a], heap_[b]);
  slot_[heap_[a].key] = a;
  slot_[heap_[b].key] = b;
}

void HotKeys::SiftDown(size_t i) {
  for (;;) {
    size_t least = i;
    for (size_t child : {2 * i + 1, 2 * i + 2}) {
      if (child < heap_.size() && heap_[child].count < heap_[least].count) least = child;
    }
    if (least == i) return;
    Swap(i, least);
    i = least;
  }
}

void HotKeys::Add(uint64_t key, uint64_t count) {
  if (count == 0) return;
  total_ += count;
  AddDistinct(key);
  if (auto it = slot_.find(key); it != slot_.end()) {
    heap_[it->second].count += count;
    SiftDown(it->second);
    return;
  }
  if (heap_.size() < capacity_) {
    heap_.push_back({key, count, 0});
    size_t i = heap_.size() - 1;
    slot_[key] = i;
    while (i > 0 && heap_[(i - 1) / 2].count > heap_[i].count) {
      Swap(i, (i - 1) / 2);
      i = (i - 1) / 2;
    }
    return;
  }
  // The lightest entry makes way; the newcomer may have been it all along.
  Entry& root = heap_[0];
  slot_.erase(root.key);
  root = {key, root.count + count, root.count};
  slot_[key] = 0;
  SiftDown(0);
}

void HotKeys::AddDistinct(uint64_t key) {
  const uint64_t h = Mix64(key);
  if (smallest_set_.contains(h)) return;
  if (smallest_.size() < capacity_) {
    smallest_.push_back(h);
    std::push_heap(smallest_.begin(), smallest_.end());
    smallest_set_.insert(h);
    return;
  }
  if (h >= smallest_.front()) return;
  std::pop_heap(smallest_.begin(), smallest_.end());
  smallest_set_.erase(smallest_.back());
  smallest_.back() = h;
  std::push_heap(smallest_.begin(), smallest_.end());
  smallest_set_.insert(h);
}

double HotKeys::DistinctKeys() const {
  if (smallest_.size() < capacity_) return static_cast<double>(smallest_.size());
  // The k-th smallest of n uniform hashes sits near k/n of the range.
  const double kth = (static_cast<double>(smallest_.front()) + 1) / 0x1.0p64;
  return static_cast<double>(capacity_ - 1) / kth;
}

double HotKeys::HotShare() const {
  if (total_ == 0) return 0;
  const size_t hottest =
      std::min(heap_.size(), static_cast<size_t>(std::max(1.0, std::ceil(DistinctKeys() / 100))));
  std::vector<uint64_t> guaranteed;
  guaranteed.reserve(heap_.size());
  for (const Entry& e : heap_) guaranteed.push_back(e.count - e.error);
  std::nth_element(guaranteed.begin(), guaranteed.begin() + static_cast<ptrdiff_t>(hottest) - 1,
                   guaranteed.end(), std::greater<>());
  uint64_t hot = 0;
  for (size_t i = 0; i < hottest; ++i) hot += guaranteed[i];
  return static_cast<double>(hot) / static_cast<double>(total_);
}

void HotKeys::Reset() {
  total_ = 0;
  heap_.clear();
  slot_.clear();
  smallest_.clear();
  smallest_set_.clear();
}

}  // namespace pstrain::server
