#include "server/sparse_table.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <numeric>
#include <optional>
#include <random>
#include <set>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "tests/test_util.h"

namespace pstrain::server {
namespace {

using Config = SparseTableConfig;

Config SmallConfig(Config::Optimizer optimizer = Config::Optimizer::kSgd) {
  Config c;
  c.name = "ads";
  c.index = 1;
  c.dim = 4;
  c.seed = 7;
  c.optimizer = optimizer;
  c.learning_rate = 0.5f;
  c.init_scale = 0.1f;
  return c;
}

// A push whose keys, counts and gradients stay alive with it.
struct OwnedPush {
  std::vector<uint64_t> keys;
  std::vector<uint32_t> counts;
  std::vector<float> grads;
  SparsePush view() const { return {keys, counts, grads}; }
};

// Keys with count 1 and gradient `g` in every float.
OwnedPush Push(std::vector<uint64_t> keys, float g, int dim = 4) {
  OwnedPush p;
  p.keys = std::move(keys);
  p.counts.assign(p.keys.size(), 1);
  p.grads.assign(p.keys.size() * dim, g);
  return p;
}

absl::StatusOr<SparseStepStats> Step(SparseTable& table, int64_t step,
                                     const std::vector<OwnedPush>& pushes) {
  std::vector<SparsePush> views;
  for (const OwnedPush& p : pushes) views.push_back(p.view());
  return table.ApplyStep(step, views);
}

std::vector<float> Read(const SparseTable& table, std::vector<uint64_t> keys) {
  std::vector<float> out(keys.size() * table.config().dim);
  table.Read(keys, out.data());
  return out;
}

std::unique_ptr<SparseTable> Make(const Config& c) {
  absl::StatusOr<std::unique_ptr<SparseTable>> table = SparseTable::Create(c);
  EXPECT_TRUE(table.ok()) << table.status();
  return std::move(*table);
}

TEST(SparseTableTest, ARowsInitialValuesComeFromSeedTableAndKeyAlone) {
  auto a = Make(SmallConfig());
  auto b = Make(SmallConfig());
  EXPECT_EQ(Read(*a, {5}), std::vector<float>(4, 0.0f));  // no row yet: zeros
  ASSERT_TRUE(Step(*a, 0, {Push({1, 2, 3}, 0)}).ok());
  ASSERT_TRUE(Step(*b, 0, {Push({3}, 0)}).ok());
  ASSERT_TRUE(Step(*b, 1, {Push({2, 1}, 0)}).ok());
  // A zero gradient leaves SGD's rows at their initial values, whenever admitted.
  EXPECT_EQ(Read(*a, {3, 2, 1}), Read(*b, {3, 2, 1}));
  for (float v : Read(*a, {1, 2, 3})) {
    EXPECT_LE(std::abs(v), 0.1f);
    EXPECT_NE(v, 0.0f);
  }
  EXPECT_NE(Read(*a, {1}), Read(*a, {2}));
  Config other = SmallConfig();
  other.index = 2;
  auto c = Make(other);
  ASSERT_TRUE(Step(*c, 0, {Push({1}, 0)}).ok());
  EXPECT_NE(Read(*c, {1}), Read(*a, {1}));
  other.seed = 8;
  other.index = 1;
  auto d = Make(other);
  ASSERT_TRUE(Step(*d, 0, {Push({1}, 0)}).ok());
  EXPECT_NE(Read(*d, {1}), Read(*a, {1}));
}

TEST(SparseTableTest, WorkersPushesAreSummedInWorkerOrderWhateverTheKeyOrder) {
  auto a = Make(SmallConfig());
  auto b = Make(SmallConfig());
  ASSERT_TRUE(Step(*a, 0, {Push({1, 2}, 0)}).ok());
  ASSERT_TRUE(Step(*b, 0, {Push({2, 1}, 0)}).ok());
  OwnedPush w0 = Push({1, 2}, 0.25f), w1 = Push({2, 1}, 1.5f);
  w1.grads[0] = 0.125f;  // key 2's first float
  ASSERT_TRUE(Step(*a, 1, {w0, w1}).ok());
  // The same sums as one push: key 1 gets 0.25 + 1.5, key 2 0.25 + (0.125, 1.5, ...).
  OwnedPush one = Push({2, 1}, 1.75f);
  one.grads[0] = 0.25f + 0.125f;
  ASSERT_TRUE(Step(*b, 1, {one}).ok());
  EXPECT_EQ(Read(*a, {1, 2}), Read(*b, {1, 2}));
  auto c = Make(SmallConfig());
  ASSERT_TRUE(Step(*c, 0, {Push({1}, 0)}).ok());
  const std::vector<float> fresh = Read(*c, {1});
  for (int j = 0; j < 4; ++j) EXPECT_EQ(Read(*a, {1})[j], fresh[j] - 0.5f * 1.75f);
  EXPECT_EQ(a->Rows().size(), 2u);
  EXPECT_EQ(a->Rows()[0].touches, 2);  // the admitting step and step 1
  EXPECT_EQ(a->Rows()[0].last_step, 1);
}

// One touched row against the optimizer's textbook formula, twice with a
// step between that leaves it alone.
void ExpectRowFollows(
    Config::Optimizer optimizer,
    const std::function<void(float& w, std::vector<float>& state, float g, int update)>& formula) {
  Config c = SmallConfig(optimizer);
  c.learning_rate = 0.1f;
  auto table = Make(c);
  // Admitted, and its zero gradient applied (which changes no value or
  // state, but counts as an update).
  ASSERT_TRUE(Step(*table, 0, {Push({9, 10}, 0)}).ok());
  std::vector<float> w = Read(*table, {9});
  const std::vector<float> untouched = Read(*table, {10});
  std::vector<std::vector<float>> state(4);
  for (int j = 0; j < 4; ++j) {
    state[j] = {0.0f, 0.0f};
    if (optimizer == Config::Optimizer::kAdagrad) state[j] = {c.initial_accumulator};
    if (optimizer == Config::Optimizer::kFtrl) state[j] = {0.0f, c.initial_accumulator};
  }
  int update = 1;
  for (int64_t step : {1, 2, 3}) {
    const float g = step == 1 ? 0.5f : -0.25f;
    if (step == 2) {
      ASSERT_TRUE(Step(*table, step, {Push({10}, 1.0f)}).ok());  // row 9 left alone
      continue;
    }
    ASSERT_TRUE(Step(*table, step, {Push({9}, g)}).ok());
    ++update;
    for (int j = 0; j < 4; ++j) formula(w[j], state[j], g, update);
    const std::vector<float> got = Read(*table, {9});
    for (int j = 0; j < 4; ++j) EXPECT_NEAR(got[j], w[j], 1e-6) << "step " << step;
  }
  EXPECT_NE(Read(*table, {10}), untouched);
  EXPECT_EQ(table->Rows()[0].updates, 3);
}

TEST(SparseTableTest, RowwiseAdagradKeepsOneAccumulatorARow) {
  Config c = SmallConfig(Config::Optimizer::kRowwiseAdagrad);
  c.learning_rate = 0.1f;
  EXPECT_EQ(StateFloatsPerRow(c), 1);
  auto table = Make(c);
  ASSERT_TRUE(Step(*table, 0, {Push({9}, 0)}).ok());
  std::vector<float> w = Read(*table, {9});
  float n = c.initial_accumulator;
  for (int64_t step = 1; step <= 3; ++step) {
    OwnedPush push = Push({9}, 0);
    for (int j = 0; j < 4; ++j) push.grads[j] = 0.1f * static_cast<float>((j + 1) * step);
    ASSERT_TRUE(Step(*table, step, {push}).ok());
    float sum_squares = 0;
    for (float g : push.grads) sum_squares += g * g;
    n += sum_squares / 4;  // the mean of the row's g²
    for (int j = 0; j < 4; ++j) w[j] -= 0.1f / (std::sqrt(n) + 1e-8f) * push.grads[j];
    const std::vector<float> got = Read(*table, {9});
    for (int j = 0; j < 4; ++j) EXPECT_NEAR(got[j], w[j], 1e-6) << "step " << step;
  }
  ASSERT_EQ(table->Rows()[0].state.size(), 1u);
  EXPECT_NEAR(table->Rows()[0].state[0], n, 1e-6);
}

TEST(SparseTableTest, Bf16RowsRoundEachUpdateStochasticallyAndReproducibly) {
  Config c = SmallConfig();  // sgd, dim 4
  c.values = Config::Values::kBf16;
  c.learning_rate = 1.0f;
  EXPECT_EQ(ValueWordsPerRow(c), 2);
  Config rowwise = c;
  rowwise.dim = 16;
  rowwise.optimizer = Config::Optimizer::kRowwiseAdagrad;
  EXPECT_EQ(BytesPerRow(rowwise), (8 + 1) * 4 + 32 + 40 + 8);  // 116: 208 in fp32 Adagrad
  auto a = Make(c);
  auto b = Make(c);
  std::vector<uint64_t> keys(1000);
  std::iota(keys.begin(), keys.end(), 1);
  for (uint64_t key : keys) {
    ASSERT_TRUE(a->AddRow(key, std::vector<float>(4, 1.0f)));
    ASSERT_TRUE(b->AddRow(key, std::vector<float>(4, 1.0f)));
  }
  // Each step moves every value by 1/8 of bf16's spacing at 1 (2^-7):
  // rounded to the nearest, no value would ever move.
  for (int64_t step = 0; step < 16; ++step) {
    ASSERT_TRUE(Step(*a, step, {Push(keys, 0x1p-10f)}).ok());
    ASSERT_TRUE(Step(*b, step, {Push(keys, 0x1p-10f)}).ok());
  }
  const std::vector<float> values = Read(*a, keys);
  EXPECT_EQ(values, Read(*b, keys));  // the draws are (seed, table, key, step)'s
  double sum = 0;
  for (float v : values) {
    // bf16 values: the low 16 bits of each float are zero.
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    EXPECT_EQ(bits & 0xffff, 0u);
    sum += v;
  }
  EXPECT_NEAR(sum / values.size(), 1.0 - 16 * 0x1p-10, 0.001);  // unbiased on average
  // A checkpoint's rows (floats) load back exactly.
  auto reloaded = Make(c);
  PSTRAIN_ASSERT_OK(reloaded->Load(a->Rows(), a->filter()));
  EXPECT_EQ(Read(*reloaded, keys), values);
}

TEST(SparseTableTest, RowWiseOptimizersUpdateOnlyTheRowsAStepTouches) {
  ExpectRowFollows(Config::Optimizer::kSgd,
                   [](float& w, std::vector<float>&, float g, int) { w -= 0.1f * g; });
  ExpectRowFollows(Config::Optimizer::kAdagrad, [](float& w, std::vector<float>& s, float g, int) {
    s[0] += g * g;
    w -= 0.1f * g / (std::sqrt(s[0]) + 1e-8f);
  });
  ExpectRowFollows(Config::Optimizer::kAdam, [](float& w, std::vector<float>& s, float g, int t) {
    s[0] = 0.9f * s[0] + 0.1f * g;
    s[1] = 0.999f * s[1] + 0.001f * g * g;
    const double m = s[0] / (1 - std::pow(0.9, t)), v = s[1] / (1 - std::pow(0.999, t));
    w -= static_cast<float>(0.1 * m / (std::sqrt(v) + 1e-8));  // t: the row's own updates
  });
  ExpectRowFollows(Config::Optimizer::kFtrl, [](float& w, std::vector<float>& s, float g, int) {
    float& z = s[0];
    float& n = s[1];
    const float sigma = (std::sqrt(n + g * g) - std::sqrt(n)) / 0.1f;
    z += g - sigma * w;
    n += g * g;
    w = -z / ((1.0f + std::sqrt(n)) / 0.1f);  // l1 = l2 = 0, beta 1
  });
}

TEST(SparseTableTest, AKeyBecomesARowOnceSeenMinCountTimes) {
  Config c = SmallConfig();
  c.min_count = 3;
  c.filter_counters = 1024;
  auto table = Make(c);
  for (int64_t step = 0; step < 2; ++step) {
    absl::StatusOr<SparseStepStats> stats = Step(*table, step, {Push({42}, 1.0f)});
    ASSERT_TRUE(stats.ok());
    EXPECT_EQ(stats->gradients_dropped, 1);
    EXPECT_EQ(stats->admitted, 0);
    EXPECT_EQ(table->rows(), 0);
    EXPECT_EQ(Read(*table, {42}), std::vector<float>(4, 0.0f));
  }
  // The third sighting admits it at the step boundary: the new row takes
  // the step's gradient.
  absl::StatusOr<SparseStepStats> third = Step(*table, 2, {Push({42}, 1.0f)});
  ASSERT_TRUE(third.ok());
  EXPECT_EQ(third->admitted, 1);
  EXPECT_EQ(third->gradients_dropped, 0);
  EXPECT_EQ(third->rows_updated, 1);
  EXPECT_EQ(table->rows(), 1);
  auto fresh = Make(SmallConfig());
  ASSERT_TRUE(Step(*fresh, 0, {Push({42}, 1.0f)}).ok());
  EXPECT_EQ(Read(*table, {42}), Read(*fresh, {42}));
  // Counts add up over workers and within a batch: 2 + 1 in one step.
  OwnedPush twice = Push({7}, 1.0f);
  twice.counts[0] = 2;
  ASSERT_TRUE(Step(*table, 3, {twice, Push({7}, 1.0f)}).ok());
  EXPECT_EQ(table->rows(), 2);
}

// A table with min_count 2 and a filter of 2^12 counters a row (2,048 a
// generation): its window is what keeps a once-seen key's false admission
// to 1%.
Config AgingFilterConfig() {
  Config c = SmallConfig();
  c.min_count = 2;
  c.filter_counters = 1 << 12;
  c.max_false_admission = 0.01;
  return c;
}

// Keys from `next` on, `n` of them; `next` moves past them.
std::vector<uint64_t> NewKeys(uint64_t& next, int n) {
  std::vector<uint64_t> keys(n);
  std::iota(keys.begin(), keys.end(), next);
  next += n;
  return keys;
}

TEST(SparseTableTest, TheAdmissionFilterForgetsSoThatOnceSeenKeysStayWithinTheBound) {
  const Config c = AgingFilterConfig();
  const int64_t window = AdmissionWindow(c);
  // (1 - e^(-2 window / 2048))^4 <= 0.01: about 0.19 x 2048 sightings.
  EXPECT_GE(window, 350);
  EXPECT_LE(window, 400);
  auto table = Make(c);
  // Ten times the filter's counters of keys seen once (a filter that never
  // forgot would be saturated after a fraction of them and admit nearly
  // every one): a key admitted is a false admission.
  uint64_t next = 1;
  int64_t admitted = 0, admitted_last_tenth = 0;
  const int steps = 10 * c.filter_counters / 256;
  for (int64_t step = 0; step < steps; ++step) {
    absl::StatusOr<SparseStepStats> stats = Step(*table, step, {Push(NewKeys(next, 256), 1.0f)});
    ASSERT_TRUE(stats.ok()) << stats.status();
    admitted += stats->admitted;
    if (step >= steps * 9 / 10) admitted_last_tenth += stats->admitted;
  }
  const double keys = static_cast<double>(next - 1);
  EXPECT_LE(admitted / keys, c.max_false_admission);
  EXPECT_LE(admitted_last_tenth / (keys / 10), c.max_false_admission);  // it does not grow
  EXPECT_EQ(table->rows(), admitted);
}

TEST(SparseTableTest, KeysSeenMinCountTimesWithinTheWindowAreAdmittedAndOlderSightingsForgotten) {
  const Config c = AgingFilterConfig();
  const int64_t window = AdmissionWindow(c);
  auto table = Make(c);
  auto reloaded = Make(c);  // the same from a checkpoint's rows and filter, at step 50
  uint64_t next = 1;
  std::vector<uint64_t> recent;  // seen once, two steps ago: within the window
  std::vector<uint64_t> old;     // seen once, more than two windows ago
  std::set<uint64_t> seen_twice_within, seen_twice_apart;
  int64_t step = 0;
  auto step_both = [&](const std::vector<uint64_t>& keys) {
    ASSERT_TRUE(Step(*table, step, {Push(keys, 1.0f)}).ok());
    ASSERT_TRUE(Step(*reloaded, step, {Push(keys, 1.0f)}).ok());
    ++step;
  };
  for (int round = 0; round < 100; ++round) {
    // 20 new keys, seen again in the step after next; noise seen once.
    std::vector<uint64_t> keys = NewKeys(next, 100);
    const std::vector<uint64_t> first = NewKeys(next, 20);
    keys.insert(keys.end(), first.begin(), first.end());
    if (round >= 2) {
      keys.insert(keys.end(), recent.begin(), recent.end());
      seen_twice_within.insert(recent.begin(), recent.end());
      recent.erase(recent.begin(), recent.begin() + 20);
    }
    recent.insert(recent.end(), first.begin(), first.end());
    // Every tenth round, 20 keys seen a first time, and again once more
    // than two windows' sightings have gone by (the rounds add 140 each).
    if (round % 10 == 0) {
      const std::vector<uint64_t> apart = NewKeys(next, 20);
      keys.insert(keys.end(), apart.begin(), apart.end());
      old.insert(old.end(), apart.begin(), apart.end());
    }
    const int rounds_apart = static_cast<int>(2 * window / 140 + 2);
    if (round % 10 == rounds_apart % 10 && round >= rounds_apart && old.size() >= 20) {
      keys.insert(keys.end(), old.begin(), old.begin() + 20);
      seen_twice_apart.insert(old.begin(), old.begin() + 20);
      old.erase(old.begin(), old.begin() + 20);
    }
    if (step == 50) {
      PSTRAIN_ASSERT_OK(reloaded->Load(table->Rows(), table->filter()));
      EXPECT_EQ(reloaded->filter(), table->filter());
    }
    step_both(keys);
  }
  std::set<uint64_t> rows;
  for (const SparseTable::Row& row : table->Rows()) rows.insert(row.key);
  auto admitted_share = [&](const std::set<uint64_t>& keys) {
    int64_t n = 0;
    for (uint64_t key : keys) n += rows.contains(key);
    return static_cast<double>(n) / static_cast<double>(keys.size());
  };
  ASSERT_GE(seen_twice_within.size(), 1900u);
  EXPECT_GE(admitted_share(seen_twice_within), 0.99);
  ASSERT_GE(seen_twice_apart.size(), 60u);
  EXPECT_LE(admitted_share(seen_twice_apart), 0.05);
  // The reloaded table went on exactly.
  EXPECT_EQ(reloaded->filter(), table->filter());
  EXPECT_EQ(reloaded->Rows().size(), table->Rows().size());
  std::vector<uint64_t> keys(rows.begin(), rows.end());
  EXPECT_EQ(Read(*reloaded, keys), Read(*table, keys));
}

TEST(SparseTableTest, AdmissionByProbabilityIsADrawOfSeedTableKeyAndSighting) {
  Config c = SmallConfig();
  c.probability = 0.25;
  auto a = Make(c);
  auto b = Make(c);
  std::vector<uint64_t> keys(20000);
  std::iota(keys.begin(), keys.end(), 1000);
  ASSERT_TRUE(Step(*a, 0, {Push(keys, 0)}).ok());
  std::reverse(keys.begin(), keys.end());
  ASSERT_TRUE(Step(*b, 0, {Push(keys, 0)}).ok());
  EXPECT_NEAR(a->rows() / 20000.0, 0.25, 0.02);
  std::vector<uint64_t> admitted_a, admitted_b;
  for (const auto& row : a->Rows()) admitted_a.push_back(row.key);
  for (const auto& row : b->Rows()) admitted_b.push_back(row.key);
  EXPECT_EQ(admitted_a, admitted_b);
  // A second sighting of each gives each the chance again: 1 - 0.75^2.
  ASSERT_TRUE(Step(*a, 1, {Push(keys, 0)}).ok());
  EXPECT_NEAR(a->rows() / 20000.0, 1 - 0.75 * 0.75, 0.02);
}

// The filter forgets, and a key's count with it: each step's sightings
// still draw afresh, so a key seen again and again is admitted at last.
TEST(SparseTableTest, AdmissionByProbabilityDrawsAfreshAfterTheFilterForgets) {
  Config c = SmallConfig();
  c.probability = 0.2;
  c.filter_counters = 64;  // a window of 6 sightings
  ASSERT_LE(AdmissionWindow(c), 8);
  auto table = Make(c);
  std::vector<uint64_t> returning(50);
  std::iota(returning.begin(), returning.end(), 1);
  uint64_t next = 1000;
  for (int64_t step = 0; step < 100; ++step) {
    // Each returning key once a step, among as many new ones.
    std::vector<uint64_t> keys = returning;
    const std::vector<uint64_t> fresh = NewKeys(next, 50);
    keys.insert(keys.end(), fresh.begin(), fresh.end());
    ASSERT_TRUE(Step(*table, step, {Push(keys, 0)}).ok());
  }
  int admitted = 0;
  for (const SparseTable::Row& row : table->Rows()) admitted += row.key <= 50;
  EXPECT_EQ(admitted, 50);  // each had 100 draws of 0.2
}

TEST(SparseTableTest, RowsUntouchedForTtlStepsAreEvicted) {
  Config c = SmallConfig();
  c.ttl_steps = 3;
  auto table = Make(c);
  ASSERT_TRUE(Step(*table, 0, {Push({1, 2}, 0)}).ok());
  for (int64_t step = 1; step <= 4; ++step) {
    absl::StatusOr<SparseStepStats> stats = Step(*table, step, {Push({1}, 0.1f)});
    ASSERT_TRUE(stats.ok());
    EXPECT_EQ(stats->evicted, step == 3 ? 1 : 0) << step;
  }
  ASSERT_EQ(table->rows(), 1);
  EXPECT_EQ(table->Rows()[0].key, 1u);
  EXPECT_EQ(Read(*table, {2}), std::vector<float>(4, 0.0f));
}

TEST(SparseTableTest, TheCapEvictsTheLeastRecentlyOrFrequentlyUsedAndIsNeverExceeded) {
  for (Config::Eviction eviction : {Config::Eviction::kLru, Config::Eviction::kLfu}) {
    Config c = SmallConfig();
    c.eviction = eviction;
    c.max_memory_bytes = 10 * BytesPerRow(c);
    auto table = Make(c);
    std::vector<uint64_t> ten(10);
    std::iota(ten.begin(), ten.end(), 100);
    ASSERT_TRUE(Step(*table, 0, {Push(ten, 0)}).ok());
    // Keys 100..104 touched at steps 1 and 2; 105..109 at step 3 only.
    ASSERT_TRUE(Step(*table, 1, {Push({100, 101, 102, 103, 104}, 0.1f)}).ok());
    ASSERT_TRUE(Step(*table, 2, {Push({100, 101, 102, 103, 104}, 0.1f)}).ok());
    ASSERT_TRUE(Step(*table, 3, {Push({105, 106, 107, 108, 109}, 0.1f)}).ok());
    absl::StatusOr<SparseStepStats> stats = Step(*table, 4, {Push({1, 2, 3}, 0)});
    ASSERT_TRUE(stats.ok()) << stats.status();
    EXPECT_EQ(stats->admitted, 3);
    EXPECT_EQ(stats->evicted, 3);
    EXPECT_EQ(table->rows(), 10);
    EXPECT_LE(table->bytes(), c.max_memory_bytes);
    std::set<uint64_t> left;
    for (const auto& row : table->Rows()) left.insert(row.key);
    // LRU: the oldest touches (100..104 at step 2) go, lowest keys first;
    // LFU: the fewest touches (105..109, once each) go, lowest keys first.
    const std::set<uint64_t> gone = eviction == Config::Eviction::kLru
                                        ? std::set<uint64_t>{100, 101, 102}
                                        : std::set<uint64_t>{105, 106, 107};
    for (uint64_t key : gone) EXPECT_FALSE(left.contains(key)) << key;
    EXPECT_TRUE(left.contains(1) && left.contains(2) && left.contains(3));
  }
}

// The documented policy, by brute force: every row's last step and
// touches; at a step's end the untouched rows of ttl_steps go, then, past
// the cap, the untouched rows first in (touches for LFU, last step, key).
class PolicyModel {
 public:
  explicit PolicyModel(const Config& c) : c_(c) {}

  // The keys a step evicts, the step's keys all admitted (min_count 1).
  std::set<uint64_t> Step(int64_t step, const std::set<uint64_t>& keys) {
    std::set<uint64_t> gone;
    for (const auto& [key, row] : rows_) {
      if (c_.ttl_steps > 0 && step - row.last_step >= c_.ttl_steps && !keys.contains(key)) {
        gone.insert(key);
      }
    }
    for (const uint64_t key : gone) rows_.erase(key);
    std::vector<uint64_t> candidates;
    for (const auto& [key, row] : rows_) {
      if (!keys.contains(key)) candidates.push_back(key);
    }
    for (const uint64_t key : keys) {
      Row& row = rows_[key];
      row.last_step = step;
      ++row.touches;
    }
    const int64_t room = c_.max_memory_bytes / BytesPerRow(c_);
    const int64_t over = static_cast<int64_t>(rows_.size()) - room;
    if (c_.max_memory_bytes > 0 && over > 0) {
      const bool lfu = c_.eviction == Config::Eviction::kLfu;
      std::sort(candidates.begin(), candidates.end(), [&](uint64_t a, uint64_t b) {
        const Row &x = rows_.at(a), &y = rows_.at(b);
        if (lfu && x.touches != y.touches) return x.touches < y.touches;
        if (x.last_step != y.last_step) return x.last_step < y.last_step;
        return a < b;
      });
      for (int64_t i = 0; i < over; ++i) {
        gone.insert(candidates[i]);
        rows_.erase(candidates[i]);
      }
    }
    return gone;
  }

  std::set<uint64_t> keys() const {
    std::set<uint64_t> out;
    for (const auto& [key, row] : rows_) out.insert(key);
    return out;
  }

 private:
  struct Row {
    int64_t last_step = 0;
    int64_t touches = 0;
  };
  const Config c_;
  std::map<uint64_t, Row> rows_;
};

// The orders kept as rows are touched evict and expire exactly the rows
// the documented policy names, through random steps (a step now and then
// given twice, as a table reloaded from its rows mid-way).
TEST(SparseTableTest, EvictionAndTtlFollowTheDocumentedPolicyExactly) {
  for (Config::Eviction eviction : {Config::Eviction::kLru, Config::Eviction::kLfu}) {
    for (int64_t ttl : {0, 6}) {
      Config c = SmallConfig();
      c.eviction = eviction;
      c.ttl_steps = ttl;
      c.max_memory_bytes = 120 * BytesPerRow(c);
      auto table = Make(c);
      PolicyModel model(c);
      std::mt19937_64 random(ttl * 2 + static_cast<int>(eviction));
      int64_t step = 0;
      for (int i = 0; i < 400; ++i) {
        if (random() % 9 != 0) ++step;  // else the last step again
        if (i == 200) {  // a reload: the orders rebuilt from the rows
          auto reloaded = Make(c);
          ASSERT_TRUE(reloaded->Load(table->Rows(), table->filter()).ok());
          table = std::move(reloaded);
        }
        std::set<uint64_t> keys;
        std::vector<OwnedPush> pushes;
        for (int w = 0; w < 2; ++w) {
          std::set<uint64_t> push_keys;
          const int n = static_cast<int>(random() % 25);
          for (int k = 0; k < n; ++k) {
            // Skewed: low keys often, the range up to 600 now and then.
            const uint64_t range = random() % 3 == 0 ? 600 : 60;
            push_keys.insert(random() % range);
          }
          keys.insert(push_keys.begin(), push_keys.end());
          pushes.push_back(Push({push_keys.begin(), push_keys.end()}, 0.01f));
        }
        const std::set<uint64_t> gone = model.Step(step, keys);
        absl::StatusOr<SparseStepStats> stats = Step(*table, step, pushes);
        ASSERT_TRUE(stats.ok()) << stats.status();
        EXPECT_EQ(stats->evicted, static_cast<int64_t>(gone.size())) << "step " << step;
        std::set<uint64_t> held;
        for (const auto& row : table->Rows()) held.insert(row.key);
        ASSERT_EQ(held, model.keys()) << "step " << step << " i " << i;
        EXPECT_LE(table->bytes(), c.max_memory_bytes);
      }
    }
  }
}

TEST(SparseTableTest, AStepThatCannotFitFailsNamingTheTableAndChangesNothing) {
  Config c = SmallConfig();
  c.max_memory_bytes = 10 * BytesPerRow(c);
  auto table = Make(c);
  ASSERT_TRUE(Step(*table, 0, {Push({1, 2, 3}, 0)}).ok());
  const auto rows = table->Rows();
  std::vector<uint64_t> many(12);
  std::iota(many.begin(), many.end(), 50);
  absl::StatusOr<SparseStepStats> stats = Step(*table, 1, {Push(many, 0.5f), Push({1}, 0.5f)});
  EXPECT_EQ(stats.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(absl::StrContains(stats.status().message(), "table ads")) << stats.status();
  EXPECT_EQ(table->rows(), 3);
  const auto after = table->Rows();
  ASSERT_EQ(after.size(), rows.size());
  for (size_t i = 0; i < rows.size(); ++i) EXPECT_EQ(after[i].values, rows[i].values);
}

// Every row a snapshot holds, read in key order in batches.
absl::StatusOr<std::vector<SparseTable::Row>> ReadAll(SparseTable& table,
                                                      SparseTable::Snapshot& snapshot,
                                                      size_t batch) {
  std::sort(snapshot.keys.begin(), snapshot.keys.end());
  std::vector<SparseTable::Row> all, rows;
  for (size_t at = 0; at < snapshot.keys.size(); at += batch) {
    PSTRAIN_RETURN_IF_ERROR(table.ReadSnapshot(
        snapshot.token, absl::MakeConstSpan(snapshot.keys).subspan(at, batch), rows));
    all.insert(all.end(), rows.begin(), rows.end());
  }
  return all;
}

void ExpectSameRows(const std::vector<SparseTable::Row>& a, const std::vector<SparseTable::Row>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].key, b[i].key);
    EXPECT_EQ(a[i].values, b[i].values) << a[i].key;
    EXPECT_EQ(a[i].state, b[i].state) << a[i].key;
    EXPECT_EQ(a[i].last_step, b[i].last_step) << a[i].key;
    EXPECT_EQ(a[i].touches, b[i].touches) << a[i].key;
  }
}

// A snapshot reads the rows as they were when it began, whatever the steps
// after it update, admit or evict, before or after it reads a batch.
TEST(SparseTableTest, ASnapshotReadsTheRowsAsTheyWereWhileStepsGoOn) {
  for (const int64_t since : {std::numeric_limits<int64_t>::min(), int64_t{1}}) {
    Config c = SmallConfig(Config::Optimizer::kAdagrad);
    c.ttl_steps = 2;
    auto table = Make(c);
    std::vector<uint64_t> keys(40);
    std::iota(keys.begin(), keys.end(), 100);
    ASSERT_TRUE(Step(*table, 0, {Push(keys, 0.5f)}).ok());
    ASSERT_TRUE(Step(*table, 1, {Push({100, 101, 102, 130, 131}, 0.25f)}).ok());
    const std::vector<SparseTable::Row> expected = table->Rows(since);
    std::optional<SparseTable::Snapshot> snapshot = table->BeginSnapshot(since);
    ASSERT_TRUE(snapshot.has_value());
    EXPECT_EQ(snapshot->keys.size(), expected.size());
    EXPECT_FALSE(table->BeginSnapshot().has_value());  // one at a time
    std::sort(snapshot->keys.begin(), snapshot->keys.end());
    std::vector<SparseTable::Row> got, rows;
    // Steps 2 and 3 update some rows, admit others and (ttl 2) evict
    // those untouched since step 0, between reads of 4 rows at a time.
    for (size_t at = 0; at < snapshot->keys.size(); at += 4) {
      const int64_t step = 2 + static_cast<int64_t>(at / 4);
      ASSERT_TRUE(Step(*table, step, {Push({100, 131, 139, 500 + static_cast<uint64_t>(at)}, 1.0f)})
                      .ok());
      PSTRAIN_ASSERT_OK(table->ReadSnapshot(
          snapshot->token, absl::MakeConstSpan(snapshot->keys).subspan(at, 4), rows));
      got.insert(got.end(), rows.begin(), rows.end());
    }
    ExpectSameRows(got, expected);
    EXPECT_NE(Read(*table, {100}), expected[0].values);  // the table did move on
    // The next snapshot begins once the first's token is gone.
    std::shared_ptr<const void> token = snapshot->token;
    snapshot.reset();
    EXPECT_FALSE(table->BeginSnapshot(since).has_value());  // `token` keeps it open
    token.reset();
    EXPECT_TRUE(table->BeginSnapshot(since).has_value());
  }
}

TEST(SparseTableTest, ASnapshotEndsWithItsTokenAndAReloadAbortsIt) {
  auto table = Make(SmallConfig());
  ASSERT_TRUE(Step(*table, 0, {Push({1, 2, 3}, 0.5f)}).ok());
  {
    std::optional<SparseTable::Snapshot> dropped = table->BeginSnapshot();
    ASSERT_TRUE(dropped.has_value());
  }
  // Its reader gone, the snapshot copies nothing and another can begin.
  ASSERT_TRUE(Step(*table, 1, {Push({1}, 0.5f)}).ok());
  std::optional<SparseTable::Snapshot> snapshot = table->BeginSnapshot();
  ASSERT_TRUE(snapshot.has_value());
  const std::vector<SparseTable::Row> before = table->Rows();
  PSTRAIN_ASSERT_OK(table->Load(before, table->filter()));
  absl::StatusOr<std::vector<SparseTable::Row>> read = ReadAll(*table, *snapshot, 2);
  EXPECT_EQ(read.status().code(), absl::StatusCode::kAborted) << read.status();
}

TEST(SparseTableTest, BadPushesAreRefusedWithNothingChanged) {
  auto table = Make(SmallConfig());
  ASSERT_TRUE(Step(*table, 0, {Push({1}, 0)}).ok());
  const std::vector<float> before = Read(*table, {1});
  OwnedPush short_grads = Push({1, 2}, 0.5f);
  short_grads.grads.pop_back();
  OwnedPush few_counts = Push({1, 2}, 0.5f);
  few_counts.counts.pop_back();
  for (const OwnedPush& bad : {short_grads, few_counts, Push({1, 3, 1}, 0.5f)}) {
    absl::StatusOr<SparseStepStats> stats = Step(*table, 1, {Push({1}, 0.5f), bad});
    EXPECT_EQ(stats.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StrContains(stats.status().message(), "table ads")) << stats.status();
  }
  EXPECT_EQ(Read(*table, {1}), before);
  EXPECT_EQ(table->rows(), 1);
  // The same key from two workers is no repeat.
  EXPECT_TRUE(Step(*table, 1, {Push({1}, 0.5f), Push({1}, 0.5f)}).ok());
}

TEST(SparseTableTest, ACheckpointsRowsAndFilterLoadIntoATableThatGoesOnTheSame) {
  for (Config::Optimizer optimizer : {Config::Optimizer::kAdam, Config::Optimizer::kFtrl}) {
    Config c = SmallConfig(optimizer);
    c.min_count = 2;
    c.filter_counters = 64;
    c.ttl_steps = 3;
    c.record_evictions = true;
    auto a = Make(c);
    auto steps = [&](SparseTable& t, int64_t from, int64_t to) {
      for (int64_t step = from; step < to; ++step) {
        const uint64_t k = static_cast<uint64_t>(step % 5);
        ASSERT_TRUE(
            Step(t, step, {Push({k, k + 10, 20}, 0.1f * step), Push({k + 1, 20}, 0.2f)}).ok());
      }
    };
    steps(*a, 0, 6);
    auto b = Make(c);
    ASSERT_TRUE(b->Load(a->Rows(), a->filter()).ok());
    steps(*a, 6, 12);
    steps(*b, 6, 12);
    const auto rows_a = a->Rows(), rows_b = b->Rows();
    ASSERT_EQ(rows_a.size(), rows_b.size());
    for (size_t i = 0; i < rows_a.size(); ++i) {
      EXPECT_EQ(rows_a[i].key, rows_b[i].key);
      EXPECT_EQ(rows_a[i].values, rows_b[i].values);
      EXPECT_EQ(rows_a[i].state, rows_b[i].state);
      EXPECT_EQ(rows_a[i].updates, rows_b[i].updates);
    }
    // Incremental: the rows steps >= 10 touched or admitted, and the keys evicted.
    for (const auto& row : a->Rows(10)) EXPECT_GE(row.last_step, 10);
    EXPECT_LT(a->Rows(10).size(), rows_a.size());
    EXPECT_FALSE(a->TakeEvicted().empty());
    EXPECT_TRUE(a->TakeEvicted().empty());
  }
  auto table = Make(SmallConfig());
  SparseTable::Row row{.key = 1, .values = {1, 2, 3}, .state = {}};
  EXPECT_EQ(table->Load({row}, {}).code(), absl::StatusCode::kInvalidArgument);
  row.values.push_back(4);
  EXPECT_EQ(table->Load({row, row}, {}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(table->Load({row}, {.counters = {1, 2}}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(table->rows(), 0);
  EXPECT_TRUE(table->Load({row}, {}).ok());
  EXPECT_EQ(Read(*table, {1}), (std::vector<float>{1, 2, 3, 4}));
}

TEST(SparseTableTest, BadConfigsAreRefusedNamingTheTable) {
  std::vector<std::function<void(Config&)>> changes = {
      [](Config& c) { c.dim = 0; },       [](Config& c) { c.learning_rate = 0; },
      [](Config& c) { c.min_count = 0; }, [](Config& c) { c.probability = 0; },
      [](Config& c) { c.beta1 = 1; },     [](Config& c) { c.ttl_steps = -1; },
  };
  for (const auto& change : changes) {
    Config c = SmallConfig();
    change(c);
    absl::StatusOr<std::unique_ptr<SparseTable>> table = SparseTable::Create(c);
    EXPECT_EQ(table.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StrContains(table.status().message(), "table ads")) << table.status();
  }
  Config c = SmallConfig();
  c.min_count = 2;
  c.max_memory_bytes = 1000;
  EXPECT_EQ(SparseTable::Create(c).status().code(), absl::StatusCode::kResourceExhausted);
}

}  // namespace
}  // namespace pstrain::server
