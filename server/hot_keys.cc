#include "server/hot_keys.h"

#include <algorithm>
#include <cmath>
#include <functional>

#include "common/random.h"

namespace pstrain::server {

HotKeys::HotKeys(int capacity) : capacity_(static_cast<size_t>(std::max(capacity, 1))) {}

void HotKeys::Add(uint64_t key, uint64_t count) {
  if (count == 0) return;
  total_ += count;
  AddDistinct(key);
  counts_[key] += count;
  if (counts_.size() >= 2 * capacity_) Compact();
}

void HotKeys::Compact() {
  std::vector<uint64_t> counts;
  counts.reserve(counts_.size());
  for (const auto& [key, count] : counts_) counts.push_back(count);
  std::nth_element(counts.begin(), counts.begin() + static_cast<ptrdiff_t>(capacity_),
                   counts.end(), std::greater<>());
  const uint64_t cut = counts[capacity_];
  absl::erase_if(counts_, [cut](const auto& entry) { return entry.second <= cut; });
  for (auto& [key, count] : counts_) count -= cut;
}

void HotKeys::AddDistinct(uint64_t key) {
  const uint64_t h = Mix64(key);
  if (smallest_.size() == capacity_ && h >= smallest_.front()) return;  // most keys, at once
  if (smallest_set_.contains(h)) return;
  if (smallest_.size() < capacity_) {
    smallest_.push_back(h);
    std::push_heap(smallest_.begin(), smallest_.end());
    smallest_set_.insert(h);
    return;
  }
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
  const size_t hottest = std::min(
      counts_.size(), static_cast<size_t>(std::max(1.0, std::ceil(DistinctKeys() / 100))));
  std::vector<uint64_t> counts;
  counts.reserve(counts_.size());
  for (const auto& [key, count] : counts_) counts.push_back(count);
  std::nth_element(counts.begin(), counts.begin() + static_cast<ptrdiff_t>(hottest) - 1,
                   counts.end(), std::greater<>());
  uint64_t hot = 0;
  for (size_t i = 0; i < hottest; ++i) hot += counts[i];
  return static_cast<double>(hot) / static_cast<double>(total_);
}

void HotKeys::Reset() {
  total_ = 0;
  counts_.clear();
  smallest_.clear();
  smallest_set_.clear();
}

}  // namespace pstrain::server
