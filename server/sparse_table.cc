#include "server/sparse_table.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <numbers>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "common/random.h"
#include "kernels/cpu/cpu_kernels.h"

namespace pstrain::server {
namespace {

// A key's sightings past this many in one step draw no further admission
// chances (beyond it a probability below 1 has long admitted the key).
constexpr int kMaxDim = 1024;
constexpr uint32_t kMaxDrawsPerStep = 4096;
// The index's bytes per row at its emptiest, just after it doubled: a hash
// map of 16-byte slots (12 and padding) and a control byte, 7/16 full.
constexpr int64_t kIndexBytesPerRow = 40;
// How many keys ahead a loop over a step's keys asks for the memory it will
// reach (their index entries, rows and bookkeeping): rows are reached at
// random, each a cache miss, and a miss asked for early overlaps the others.
constexpr size_t kPrefetchAhead = 16;

// LFU keeps an order by touches beside the one by last touch every table
// keeps (TTL's, LRU's, and the rows touched since a step).
bool KeepsTouchesOrder(const SparseTableConfig& c) {
  return c.eviction == SparseTableConfig::Eviction::kLfu;
}

bool HasFilter(const SparseTableConfig& c) { return c.min_count > 1 || c.probability < 1; }

absl::Status Bad(const SparseTableConfig& c, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("table ", c.name, ": ", what));
}

}  // namespace

absl::Status CheckSparseTableConfig(const SparseTableConfig& c) {
  if (c.dim < 1 || c.dim > kMaxDim)
    return Bad(c, absl::StrCat("dim ", c.dim, " is outside [1, ", kMaxDim, "]"));
  if (!(c.init_scale >= 0 && c.init_scale <= 10)) {
    return Bad(c, absl::StrCat("init scale ", c.init_scale, " is outside [0, 10]"));
  }
  if (!(c.learning_rate > 0 && c.learning_rate <= 1e3)) {
    return Bad(c, absl::StrCat("learning_rate ", c.learning_rate, " is outside (0, 1000]"));
  }
  if (!(c.initial_accumulator >= 0 && c.initial_accumulator <= 1e6)) {
    return Bad(c, "initial_accumulator is outside [0, 1e6]");
  }
  if (!(c.beta1 >= 0 && c.beta1 < 1) || !(c.beta2 >= 0 && c.beta2 < 1)) {
    return Bad(c, "beta1 and beta2 must be in [0, 1)");
  }
  if (!(c.epsilon > 0 && c.epsilon <= 1)) return Bad(c, "epsilon must be in (0, 1]");
  if (!(c.l1 >= 0) || !(c.l2 >= 0) || !(c.beta >= 0)) return Bad(c, "l1, l2 and beta must be >= 0");
  if (c.min_count < 1 || c.min_count > kMaxSightings) {
    return Bad(c, absl::StrCat("min_count ", c.min_count, " is outside [1, ", kMaxSightings, "]"));
  }
  if (!(c.probability > 0 && c.probability <= 1)) {
    return Bad(c, absl::StrCat("probability ", c.probability, " is outside (0, 1]"));
  }
  if (c.filter_counters < 2 || c.filter_counters > (int64_t{1} << 32)) {
    return Bad(c, "filter_counters is outside [2, 2^32]");
  }
  if (!(c.max_false_admission > 0 && c.max_false_admission <= 0.5)) {
    return Bad(c, absl::StrCat("max_false_admission ", c.max_false_admission,
                               " is outside (0, 0.5]"));
  }
  if (c.ttl_steps < 0) return Bad(c, "ttl_steps must be >= 0");
  if (c.max_memory_bytes < 0) return Bad(c, "max_memory_bytes must be >= 0");
  return absl::OkStatus();
}

int64_t AdmissionWindow(const SparseTableConfig& c) {
  return HasFilter(c) ? AdmissionWindow(c.filter_counters, c.max_false_admission) : 0;
}

int StateFloatsPerRow(const SparseTableConfig& c) {
  switch (c.optimizer) {
    case SparseTableConfig::Optimizer::kSgd:
      return 0;
    case SparseTableConfig::Optimizer::kAdagrad:
      return c.dim;
    case SparseTableConfig::Optimizer::kRowwiseAdagrad:
      return 1;
    case SparseTableConfig::Optimizer::kAdam:
    case SparseTableConfig::Optimizer::kFtrl:
      return 2 * c.dim;
  }
  return 0;
}

int ValueWordsPerRow(const SparseTableConfig& c) {
  return c.values == SparseTableConfig::Values::kBf16 ? (c.dim + 1) / 2 : c.dim;
}

int64_t BytesPerRow(const SparseTableConfig& c) {
  // Values and state, the row's bookkeeping (RowMeta), its share of the
  // index and its links in the orders kept.
  const int orders = KeepsTouchesOrder(c) ? 2 : 1;
  return (int64_t{ValueWordsPerRow(c)} + StateFloatsPerRow(c)) * 4 + int64_t{sizeof(RowMeta)} +
         kIndexBytesPerRow + orders * RowOrder::kBytesPerSlot;
}

SparseTable::SparseTable(const SparseTableConfig& config)
    : config_(config),
      state_floats_(StateFloatsPerRow(config)),
      value_words_(ValueWordsPerRow(config)),
      row_floats_(value_words_ + state_floats_),
      by_last_touch_(RowOrder::By::kLastTouch, meta_),
      filter_(HasFilter(config) ? config.filter_counters : 0, config.max_false_admission,
              config.seed + config.index * 8) {
  if (KeepsTouchesOrder(config)) by_touches_.emplace(RowOrder::By::kTouchesThenLastTouch, meta_);
}

RowOrder& SparseTable::eviction_order() {
  return by_touches_.has_value() ? *by_touches_ : by_last_touch_;
}

absl::StatusOr<std::unique_ptr<SparseTable>> SparseTable::Create(const SparseTableConfig& config) {
  if (absl::Status s = CheckSparseTableConfig(config); !s.ok()) return s;
  auto table = std::unique_ptr<SparseTable>(new SparseTable(config));
  if (config.max_memory_bytes > 0 && table->filter_.bytes() > config.max_memory_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("table ", config.name, ": its counting filter (", config.filter_counters,
                     " counters, ", table->filter_.bytes(), " bytes) exceeds max_memory_bytes ",
                     config.max_memory_bytes));
  }
  return table;
}

int64_t SparseTable::bytes() const {
  return filter_.bytes() +
         static_cast<int64_t>(meta_.size()) * BytesPerRow(config_);
}

void SparseTable::Read(absl::Span<const uint64_t> keys, float* out) const {
  const int dim = config_.dim;
  for (size_t i = 0; i < keys.size(); ++i) {
    float* o = out + i * dim;
    const auto it = index_.find(keys[i]);
    if (it == index_.end()) {
      std::fill(o, o + dim, 0.0f);
    } else {
      GetValues(it->second, o);
    }
  }
}

int64_t SparseTable::RowsUnderCap() const {
  return (config_.max_memory_bytes - filter_.bytes()) / BytesPerRow(config_);
}

uint32_t SparseTable::NewSlot() {
  if (!free_slots_.empty()) {
    const uint32_t slot = free_slots_.back();
    free_slots_.pop_back();
    return slot;
  }
  const uint32_t slot = static_cast<uint32_t>(meta_.size());
  if (meta_.size() == meta_.capacity()) {
    // Grow by half, but under a cap never past the rows it holds: the
    // arrays' spare capacity is memory too.
    size_t rows = std::max<size_t>(1024, meta_.size() + meta_.size() / 2);
    if (config_.max_memory_bytes > 0) {
      rows = std::clamp<size_t>(rows, meta_.size() + 1, std::max<int64_t>(RowsUnderCap(), 1));
    }
    meta_.reserve(rows);
    by_last_touch_.Reserve(rows);
    if (by_touches_.has_value()) by_touches_->Reserve(rows);
    rows_.reserve(rows * row_floats_);
  }
  meta_.emplace_back();
  rows_.resize(rows_.size() + row_floats_);
  return slot;
}

void SparseTable::InitRow(uint64_t key, uint32_t slot) {
  const int dim = config_.dim;
  std::array<float, kMaxDim> drawn;
  float* v = drawn.data();
  const uint64_t stream = Mix64(Mix64(config_.seed ^ 0x7ab1e5eedULL) + config_.index) ^ Mix64(key);
  for (int j = 0; j < dim; ++j) {
    const uint64_t bits = Mix64(stream + static_cast<uint64_t>(j));
    switch (config_.initializer) {
      case SparseTableConfig::Initializer::kZeros:
        v[j] = 0.0f;
        break;
      case SparseTableConfig::Initializer::kUniform:
        v[j] = static_cast<float>((2.0 * UnitDouble(bits) - 1.0) * config_.init_scale);
        break;
      case SparseTableConfig::Initializer::kNormal: {
        const double u1 = UnitDouble(bits), u2 = UnitDouble(Mix64(bits));
        v[j] = static_cast<float>(config_.init_scale * std::sqrt(-2.0 * std::log1p(-u1)) *
                                  std::cos(2.0 * std::numbers::pi * u2));
        break;
      }
    }
  }
  meta_[slot] = RowMeta{.key = key, .epoch = snapshot_epoch_};
  SetValues(slot, v);
  float* s = StateOf(slot);
  std::fill(s, s + state_floats_, 0.0f);
  if (config_.optimizer == SparseTableConfig::Optimizer::kAdagrad ||
      config_.optimizer == SparseTableConfig::Optimizer::kRowwiseAdagrad) {
    std::fill(s, s + state_floats_, config_.initial_accumulator);
  } else if (config_.optimizer == SparseTableConfig::Optimizer::kFtrl) {
    std::fill(s + dim, s + 2 * dim, config_.initial_accumulator);  // n; z stays 0
  }
}

bool SparseTable::AddRow(uint64_t key, absl::Span<const float> values) {
  if (index_.contains(key)) return false;
  const uint32_t slot = NewSlot();
  InitRow(key, slot);
  SetValues(slot, values.data());
  index_.emplace(key, slot);
  Order(slot);
  return true;
}

void SparseTable::GetValues(uint32_t slot, float* out) const {
  if (config_.values == SparseTableConfig::Values::kFp32) {
    std::copy_n(WordsOf(slot), config_.dim, out);
    return;
  }
  std::array<uint16_t, kMaxDim + 1> halves;
  std::memcpy(halves.data(), WordsOf(slot), value_words_ * 4);
  kernels::CastFromBf16(halves.data(), out, config_.dim);
}

void SparseTable::SetValues(uint32_t slot, const float* in, std::optional<int64_t> step) {
  const int dim = config_.dim;
  if (config_.values == SparseTableConfig::Values::kFp32) {
    std::copy_n(in, dim, WordsOf(slot));
    return;
  }
  std::array<uint16_t, kMaxDim + 1> halves{};
  if (!step.has_value()) {
    kernels::CastToBf16(in, halves.data(), dim);
  } else {
    // Up or down to a neighbouring bf16 value, up with the chance of the
    // distance from the lower one: the low 16 bits of the float's bits and
    // 16 random bits added, the sum's carry deciding (a NaN stays one).
    const uint64_t stream = Mix64(Mix64(config_.seed ^ 0x5707c4a5ULL) + config_.index) ^
                            Mix64(meta_[slot].key) ^ Mix64(static_cast<uint64_t>(*step));
    uint64_t noise = 0;
    for (int j = 0; j < dim; ++j) {
      if (j % 4 == 0) noise = Mix64(stream + static_cast<uint64_t>(j / 4));
      uint32_t bits;
      std::memcpy(&bits, in + j, 4);
      halves[j] = std::isnan(in[j]) ? uint16_t{0x7fc0}
                                    : static_cast<uint16_t>((bits + (noise & 0xffff)) >> 16);
      noise >>= 16;
    }
  }
  std::memcpy(WordsOf(slot), halves.data(), value_words_ * 4);
}

void SparseTable::UpdateRow(uint32_t slot, const float* g, int64_t step) {
  const int dim = config_.dim;
  const float lr = config_.learning_rate;
  const bool fp32 = config_.values == SparseTableConfig::Values::kFp32;
  std::array<float, kMaxDim> decoded;
  float* w = fp32 ? WordsOf(slot) : decoded.data();
  if (!fp32) GetValues(slot, w);
  float* s = StateOf(slot);
  RowMeta& meta = meta_[slot];
  ++meta.updates;
  switch (config_.optimizer) {
    case SparseTableConfig::Optimizer::kSgd:
      for (int j = 0; j < dim; ++j) w[j] -= lr * g[j];
      break;
    case SparseTableConfig::Optimizer::kAdagrad:
      for (int j = 0; j < dim; ++j) {
        s[j] += g[j] * g[j];
        w[j] -= lr * g[j] / (std::sqrt(s[j]) + config_.epsilon);
      }
      break;
    case SparseTableConfig::Optimizer::kRowwiseAdagrad: {
      // One accumulator for the row: the mean of g² over its values.
      float sum_squares = 0;
      for (int j = 0; j < dim; ++j) sum_squares += g[j] * g[j];
      s[0] += sum_squares / static_cast<float>(dim);
      const float rate = lr / (std::sqrt(s[0]) + config_.epsilon);
      for (int j = 0; j < dim; ++j) w[j] -= rate * g[j];
      break;
    }
    case SparseTableConfig::Optimizer::kAdam: {
      const float b1 = config_.beta1, b2 = config_.beta2;
      const double t = static_cast<double>(meta.updates);
      const float correction1 = static_cast<float>(1.0 - std::pow(double{b1}, t));
      const float correction2 = static_cast<float>(1.0 - std::pow(double{b2}, t));
      float* m = s;
      float* v = s + dim;
      for (int j = 0; j < dim; ++j) {
        m[j] = b1 * m[j] + (1.0f - b1) * g[j];
        v[j] = b2 * v[j] + (1.0f - b2) * g[j] * g[j];
        w[j] -= lr * (m[j] / correction1) / (std::sqrt(v[j] / correction2) + config_.epsilon);
      }
      break;
    }
    case SparseTableConfig::Optimizer::kFtrl: {
      float* z = s;
      float* n = s + dim;
      for (int j = 0; j < dim; ++j) {
        const float n_new = n[j] + g[j] * g[j];
        const float sigma = (std::sqrt(n_new) - std::sqrt(n[j])) / lr;
        z[j] += g[j] - sigma * w[j];
        n[j] = n_new;
        w[j] = std::abs(z[j]) <= config_.l1
                   ? 0.0f
                   : -(z[j] - std::copysign(config_.l1, z[j])) /
                         ((config_.beta + std::sqrt(n_new)) / lr + config_.l2);
      }
      break;
    }
  }
  if (!fp32) SetValues(slot, w, step);
}

bool SparseTable::Admits(uint64_t key, uint32_t seen_before, uint32_t seen_now,
                         int64_t step) const {
  const uint64_t seen = uint64_t{seen_before} + seen_now;
  if (seen < static_cast<uint64_t>(config_.min_count)) return false;
  if (config_.probability >= 1) return true;
  // Sighting i (from 0) of the key, from the min_count-th on, admits it
  // with the probability, by a draw of (seed, table, key, step, i): the
  // step's part, because the filter forgets, and a key's count (so i)
  // may come back to numbers whose draws failed.
  const uint64_t first = std::max<uint64_t>(seen_before, config_.min_count - 1);
  const uint64_t last = std::min<uint64_t>(seen, first + kMaxDrawsPerStep);
  const uint64_t stream = Mix64(Mix64(config_.seed ^ 0xad317ULL) + config_.index) ^ Mix64(key) ^
                          Mix64(static_cast<uint64_t>(step) ^ 0x57e9ULL);
  for (uint64_t i = first; i < last; ++i) {
    if (UnitDouble(Mix64(stream + i)) < config_.probability) return true;
  }
  return false;
}

void SparseTable::Order(uint32_t slot) {
  by_last_touch_.Insert(slot);
  if (by_touches_.has_value()) by_touches_->Insert(slot);
}

void SparseTable::Unorder(uint32_t slot) {
  by_last_touch_.Erase(slot);
  if (by_touches_.has_value()) by_touches_->Erase(slot);
}

void SparseTable::RemoveAll(absl::Span<const uint64_t> keys) {
  for (size_t i = 0; i < keys.size(); ++i) {
    if (i + kPrefetchAhead < keys.size()) index_.prefetch(keys[i + kPrefetchAhead]);
    Remove(keys[i]);
  }
}

void SparseTable::PrefetchRow(uint32_t slot) const {
  // The row's first and last bytes: its values and state, side by side.
  __builtin_prefetch(WordsOf(slot), 1);
  __builtin_prefetch(WordsOf(slot) + row_floats_ - 1, 1);
  __builtin_prefetch(meta_.data() + slot, 1);
}

void SparseTable::Remove(uint64_t key) {
  if (config_.record_evictions) evicted_.push_back(key);
  const auto it = index_.find(key);
  PreserveForSnapshot(it->second);
  Unorder(it->second);
  free_slots_.push_back(it->second);
  index_.erase(it);
}

absl::StatusOr<SparseStepStats> SparseTable::ApplyStep(int64_t step,
                                                       absl::Span<const SparsePush> pushes) {
  const int dim = config_.dim;
  // The step's keys in order of first appearance, their summed gradients
  // and counts, and which push named each last (to catch a repeat).
  absl::flat_hash_map<uint64_t, uint32_t> merged;
  std::vector<uint64_t> keys;
  std::vector<float> sums;
  std::vector<uint32_t> counts;
  std::vector<uint32_t> named_by;
  size_t pushed_keys = 0;
  for (const SparsePush& push : pushes) pushed_keys += push.keys.size();
  merged.reserve(pushed_keys);
  keys.reserve(pushed_keys);
  sums.reserve(pushed_keys * dim);
  counts.reserve(pushed_keys);
  named_by.reserve(pushed_keys);
  for (uint32_t p = 0; p < pushes.size(); ++p) {
    const SparsePush& push = pushes[p];
    if (push.counts.size() != push.keys.size() || push.grads.size() != push.keys.size() * dim) {
      return absl::InvalidArgumentError(
          absl::StrCat("table ", config_.name, ": a push of ", push.keys.size(), " keys has ",
                       push.counts.size(), " counts and ", push.grads.size(),
                       " gradient floats (dim ", dim, ")"));
    }
    for (size_t i = 0; i < push.keys.size(); ++i) {
      const auto [it, inserted] = merged.try_emplace(push.keys[i], keys.size());
      const float* g = push.grads.data() + i * dim;
      if (inserted) {
        keys.push_back(push.keys[i]);
        sums.insert(sums.end(), g, g + dim);
        counts.push_back(push.counts[i]);
        named_by.push_back(p);
        continue;
      }
      const uint32_t at = it->second;
      if (named_by[at] == p) {
        return absl::InvalidArgumentError(absl::StrCat("table ", config_.name, ": key ",
                                                       push.keys[i], " appears twice in one push"));
      }
      named_by[at] = p;
      float* sum = sums.data() + int64_t{at} * dim;
      for (int j = 0; j < dim; ++j) sum[j] += g[j];
      counts[at] = static_cast<uint32_t>(
          std::min<uint64_t>(uint64_t{counts[at]} + push.counts[i], kMaxSightings));
    }
  }

  // The step boundary's decisions, made before anything changes: each
  // key's row (kEnd: none) and the keys admitted (by their place in keys).
  std::vector<uint32_t> slot_of(keys.size(), RowOrder::kEnd);
  std::vector<uint32_t> admitted;
  int64_t rows_touched = 0;
  for (size_t i = 0; i < keys.size(); ++i) {
    if (i + kPrefetchAhead < keys.size()) index_.prefetch(keys[i + kPrefetchAhead]);
    if (const auto it = index_.find(keys[i]); it != index_.end()) {
      slot_of[i] = it->second;
      ++rows_touched;
    } else if (Admits(keys[i], filter_.Sightings(keys[i]), counts[i], step)) {
      admitted.push_back(static_cast<uint32_t>(i));
    }
  }
  // Rows untouched for ttl_steps: the oldest of the last-touch order, but
  // for those this step touches.
  std::vector<uint64_t> expired;
  if (config_.ttl_steps > 0) {
    for (uint32_t slot = by_last_touch_.First();
         slot != RowOrder::kEnd && step - meta_[slot].last_step >= config_.ttl_steps;
         slot = by_last_touch_.Next(slot)) {
      if (!merged.contains(meta_[slot].key)) expired.push_back(meta_[slot].key);
    }
  }
  int64_t over_cap = 0;
  if (config_.max_memory_bytes > 0) {
    const int64_t room = RowsUnderCap();
    const int64_t after =
        rows() - static_cast<int64_t>(expired.size()) + static_cast<int64_t>(admitted.size());
    over_cap = std::max<int64_t>(0, after - room);
    const int64_t evictable = rows() - static_cast<int64_t>(expired.size()) - rows_touched;
    if (over_cap > evictable) {
      return absl::ResourceExhaustedError(
          absl::StrCat("table ", config_.name, ": step ", step, " needs ", after - evictable,
                       " rows (the rows it touched and admits), more than max_memory_bytes ",
                       config_.max_memory_bytes, " holds (", room, " rows of ",
                       BytesPerRow(config_), " bytes on this server)"));
    }
  }

  SparseStepStats stats;
  // The rows this step touches leave the orders until its end, when they
  // come back (by key) as its most recent.
  std::vector<std::pair<uint64_t, uint32_t>> touched;  // (key, slot)
  touched.reserve(keys.size());
  auto update = [&](uint32_t slot, size_t i) {
    UpdateRow(slot, sums.data() + i * dim, step);
    RowMeta& meta = meta_[slot];
    meta.last_step = step;
    if (meta.touches < std::numeric_limits<uint32_t>::max()) ++meta.touches;
    ++stats.rows_updated;
    touched.emplace_back(keys[i], slot);
  };
  for (size_t i = 0; i < keys.size(); ++i) {
    // Two stages ahead: the row, its meta and its link; one stage: its
    // neighbours' links, which taking it out of the order writes.
    if (i + 2 * kPrefetchAhead < keys.size() && slot_of[i + 2 * kPrefetchAhead] != RowOrder::kEnd) {
      PrefetchRow(slot_of[i + 2 * kPrefetchAhead]);
      by_last_touch_.Prefetch(slot_of[i + 2 * kPrefetchAhead]);
    }
    if (i + kPrefetchAhead < keys.size() && slot_of[i + kPrefetchAhead] != RowOrder::kEnd) {
      by_last_touch_.PrefetchNeighbours(slot_of[i + kPrefetchAhead]);
    }
    const uint32_t slot = slot_of[i];
    if (slot == RowOrder::kEnd) {
      filter_.Add(keys[i], counts[i]);
      continue;
    }
    PreserveForSnapshot(slot);
    Unorder(slot);
    update(slot, i);
  }
  std::sort(expired.begin(), expired.end());
  RemoveAll(expired);
  stats.evicted += static_cast<int64_t>(expired.size());
  if (over_cap > 0) Evict(over_cap, stats);
  // A new row: its initial values, then the admitting step's update.
  for (size_t n = 0; n < admitted.size(); ++n) {
    if (n + kPrefetchAhead < admitted.size()) {
      index_.prefetch(keys[admitted[n + kPrefetchAhead]]);
      if (kPrefetchAhead < free_slots_.size()) {
        PrefetchRow(free_slots_[free_slots_.size() - 1 - kPrefetchAhead]);
      }
    }
    const uint32_t i = admitted[n];
    const uint32_t slot = NewSlot();
    InitRow(keys[i], slot);
    index_.emplace(keys[i], slot);
    update(slot, i);
  }
  std::sort(touched.begin(), touched.end());
  for (const auto& [key, slot] : touched) Order(slot);
  stats.admitted = static_cast<int64_t>(admitted.size());
  stats.gradients_dropped = static_cast<int64_t>(keys.size()) - stats.rows_updated;
  return stats;
}

void SparseTable::Evict(int64_t rows_to_free, SparseStepStats& stats) {
  std::vector<uint64_t> out;
  const RowOrder& order = eviction_order();
  for (uint32_t slot = order.First();
       slot != RowOrder::kEnd && static_cast<int64_t>(out.size()) < rows_to_free;
       slot = order.Next(slot)) {
    out.push_back(meta_[slot].key);
  }
  RemoveAll(out);
  stats.evicted += static_cast<int64_t>(out.size());
}

std::vector<uint64_t> SparseTable::TakeEvicted() {
  std::vector<uint64_t> keys;
  keys.swap(evicted_);
  std::sort(keys.begin(), keys.end());
  keys.erase(std::unique(keys.begin(), keys.end()), keys.end());
  return keys;
}

absl::Status SparseTable::Load(const std::vector<Row>& rows, const AdmissionFilter& filter) {
  const int dim = config_.dim;
  if (absl::Status s = filter_.CheckLoadable(filter); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("table ", config_.name, ": ", s.message()));
  }
  KeyIndex index;
  for (size_t i = 0; i < rows.size(); ++i) {
    const Row& row = rows[i];
    if (static_cast<int>(row.values.size()) != dim ||
        static_cast<int>(row.state.size()) != state_floats_) {
      return absl::InvalidArgumentError(absl::StrCat("table ", config_.name, ": row ", row.key,
                                                     " has ", row.values.size(), " values and ",
                                                     row.state.size(), " state floats"));
    }
    if (!index.try_emplace(row.key, static_cast<uint32_t>(i)).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("table ", config_.name, ": row ", row.key, " twice"));
    }
  }
  if (config_.max_memory_bytes > 0 &&
      filter_.bytes() +
              static_cast<int64_t>(rows.size()) * BytesPerRow(config_) >
          config_.max_memory_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat("table ", config_.name, ": ", rows.size(),
                                                     " rows exceed max_memory_bytes ",
                                                     config_.max_memory_bytes));
  }
  snapshot_.reset();  // its reader gets ABORTED: the rows it was reading are gone
  index_ = std::move(index);
  filter_.Load(filter);
  meta_.assign(rows.size(), RowMeta{});
  rows_.assign(rows.size() * row_floats_, 0.0f);
  free_slots_.clear();
  evicted_.clear();
  for (size_t i = 0; i < rows.size(); ++i) {
    const Row& row = rows[i];
    SetValues(static_cast<uint32_t>(i), row.values.data());
    std::copy(row.state.begin(), row.state.end(), StateOf(static_cast<uint32_t>(i)));
    meta_[i] = RowMeta{.key = row.key,
                    .last_step = row.last_step,
                    .updates = row.updates,
                    .touches = static_cast<uint32_t>(std::clamp<int64_t>(
                        row.touches, 0, std::numeric_limits<uint32_t>::max())),
                    .epoch = snapshot_epoch_};
  }
  std::vector<uint32_t> slots(rows.size());
  std::iota(slots.begin(), slots.end(), 0);
  by_last_touch_.Rebuild(slots);
  if (by_touches_.has_value()) by_touches_->Rebuild(slots);
  return absl::OkStatus();
}

void SparseTable::ForEachTouchedSince(int64_t since,
                                      const std::function<void(uint32_t)>& visit) const {
  if (since == std::numeric_limits<int64_t>::min()) {
    for (const auto& [key, slot] : index_) visit(slot);
    return;
  }
  // The last-touch order's newest rows, from its end.
  for (uint32_t slot = by_last_touch_.Last();
       slot != RowOrder::kEnd && meta_[slot].last_step >= since; slot = by_last_touch_.Prev(slot)) {
    visit(slot);
  }
}

SparseTable::Row SparseTable::RowAt(uint32_t slot) const {
  const RowMeta& meta = meta_[slot];
  Row row{
      .key = meta.key,
      .values = std::vector<float>(config_.dim),
      .state = {StateOf(slot), StateOf(slot) + state_floats_},
      .last_step = meta.last_step,
      .touches = meta.touches,
      .updates = meta.updates,
  };
  GetValues(slot, row.values.data());
  return row;
}

std::optional<SparseTable::Snapshot> SparseTable::BeginSnapshot(int64_t since) {
  if (snapshot_.has_value() && !snapshot_->token.expired()) return std::nullopt;
  auto token = std::make_shared<int>(0);
  OpenSnapshot open;
  open.token = token;
  open.epoch = ++snapshot_epoch_;  // rows made from now on are not in it
  open.since = since;
  snapshot_.emplace(std::move(open));
  Snapshot out;
  out.token = std::move(token);
  ForEachTouchedSince(since, [&](uint32_t slot) { out.keys.push_back(meta_[slot].key); });
  return out;
}

void SparseTable::PreserveForSnapshot(uint32_t slot) {
  if (!snapshot_.has_value()) return;
  if (snapshot_->token.expired()) {  // its reader is gone
    snapshot_.reset();
    return;
  }
  const RowMeta& meta = meta_[slot];
  if (meta.epoch >= snapshot_->epoch || meta.last_step < snapshot_->since) return;
  if (snapshot_->read_up_to.has_value() && meta.key <= *snapshot_->read_up_to) return;
  snapshot_->saved.try_emplace(meta.key, RowAt(slot));  // the first change's
}

absl::Status SparseTable::ReadSnapshot(const std::shared_ptr<const void>& token,
                                       absl::Span<const uint64_t> keys, std::vector<Row>& out) {
  if (!snapshot_.has_value() || snapshot_->token.lock() != token) {
    return absl::AbortedError(
        absl::StrCat("table ", config_.name, ": its snapshot ended (the table was reloaded)"));
  }
  out.clear();
  out.reserve(keys.size());
  for (const uint64_t key : keys) {
    if (snapshot_->read_up_to.has_value() && key <= *snapshot_->read_up_to) {
      return absl::InvalidArgumentError("snapshot keys out of order");
    }
    snapshot_->read_up_to = key;
    if (auto saved = snapshot_->saved.extract(key); !saved.empty()) {
      out.push_back(std::move(saved.mapped()));
      continue;
    }
    const auto it = index_.find(key);
    if (it == index_.end()) {
      return absl::InternalError(absl::StrCat("table ", config_.name, ": snapshot row ", key,
                                              " is gone without its copy"));
    }
    out.push_back(RowAt(it->second));
  }
  return absl::OkStatus();
}

std::vector<SparseTable::Row> SparseTable::Rows(int64_t since) const {
  std::vector<Row> rows;
  ForEachTouchedSince(since, [&](uint32_t slot) { rows.push_back(RowAt(slot)); });
  std::sort(rows.begin(), rows.end(), [](const Row& a, const Row& b) { return a.key < b.key; });
  return rows;
}

}  // namespace pstrain::server
