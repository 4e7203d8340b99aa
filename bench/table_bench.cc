// pstrain-bench tables: the time a table's step spends on admission,
// eviction and TTL, with the cap binding, at a server's table sizes.
//
// For each size N, one table of dim 16 with Adagrad (ttl_steps set, LRU or
// LFU) capped at exactly N rows is filled to its cap (all sizes held at
// once); then each timed step pushes `keys` distinct keys drawn from a flat
// Zipf (0.5) over 10^8 ids, so that most are new: the step admits nearly
// every key and evicts as many rows. The sizes take their steps in turn,
// the same keys each. The same keys are then pushed again as the next step, which finds
// every key a row and admits and evicts nothing: its time is the step's
// row updates alone (their rows already in cache: the difference, counted
// as bookkeeping, is if anything overstated). Prints, per size, the median
// step, the median of the updates alone, their median difference, and the
// rows admitted and evicted a step.
#include <algorithm>
#include <cmath>
#include <iostream>
#include <vector>

#include "absl/strings/str_cat.h"
#include "bench/bench.h"
#include "bench/bench_util.h"
#include "common/random.h"
#include "server/sparse_table.h"

namespace pstrain::bench {
namespace {

using server::SparseTable;
using server::SparseTableConfig;

constexpr uint64_t kIds = 100'000'000;
constexpr int kFillKeysPerStep = 1 << 16;
constexpr int kDim = 16;

double Median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values.empty() ? 0 : values[values.size() / 2];
}

// `n` distinct keys of a flat Zipf (0.5) over kIds ids: rank kIds * u^2
// (the inverse of the rank's CDF, sqrt), each id's key a mix of its rank.
std::vector<uint64_t> ZipfKeys(int n, uint64_t& state) {
  std::vector<uint64_t> keys;
  keys.reserve(n);
  while (static_cast<int>(keys.size()) < n) {
    const double u = UnitDouble(Mix64(++state));
    keys.push_back(Mix64(static_cast<uint64_t>(kIds * u * u) + 1));
    if (static_cast<int>(keys.size()) == n) {
      std::sort(keys.begin(), keys.end());
      keys.erase(std::unique(keys.begin(), keys.end()), keys.end());
    }
  }
  return keys;
}

struct StepTimes {
  double seconds = 0;
  server::SparseStepStats stats;
};

StepTimes TimedStep(SparseTable& table, int64_t step, const std::vector<uint64_t>& keys,
                    const std::vector<float>& grads) {
  const std::vector<uint32_t> counts(keys.size(), 1);
  const server::SparsePush push{keys, counts,
                                absl::MakeConstSpan(grads).first(keys.size() * kDim)};
  const absl::Time start = absl::Now();
  absl::StatusOr<server::SparseStepStats> stats = table.ApplyStep(step, {&push, 1});
  StepTimes out{.seconds = SecondsSince(start), .stats = {}};
  if (!stats.ok()) {
    std::cerr << "pstrain-bench tables: " << stats.status().message() << "\n";
    std::exit(1);
  }
  out.stats = *stats;
  return out;
}

}  // namespace

int RunTableBench(const TableBenchOptions& options) {
  const bool lfu = options.policy == "lfu";
  std::vector<float> grads(std::max(kFillKeysPerStep, options.keys) * kDim);
  for (size_t i = 0; i < grads.size(); ++i) {
    grads[i] = static_cast<float>(UnitDouble(Mix64(i)) - 0.5) * 1e-3f;
  }
  // Every size's table, filled to its cap.
  struct Sized {
    std::unique_ptr<SparseTable> table;
    int64_t step = 0;
    double fill_seconds = 0;
    std::vector<double> full, updates, bookkeeping;
    int64_t admitted = 0, evicted = 0;
  };
  std::vector<Sized> sized;
  for (const int64_t rows : options.rows) {
    SparseTableConfig c;
    c.name = "bench";
    c.dim = kDim;
    c.seed = 1;
    c.optimizer = SparseTableConfig::Optimizer::kAdagrad;
    c.eviction = lfu ? SparseTableConfig::Eviction::kLfu : SparseTableConfig::Eviction::kLru;
    c.max_memory_bytes = rows * server::BytesPerRow(c);
    // Configured, so that every step looks for expired rows; longer than
    // the run, so that the cap is what evicts.
    c.ttl_steps = int64_t{1} << 40;
    absl::StatusOr<std::unique_ptr<SparseTable>> made = SparseTable::Create(c);
    if (!made.ok()) {
      std::cerr << "pstrain-bench tables: " << made.status().message() << "\n";
      return 1;
    }
    Sized s;
    s.table = *std::move(made);
    // The fill: rows keys that no timed step draws (its keys are mixes of
    // ranks 1..kIds; these of numbers past them).
    const absl::Time fill_start = absl::Now();
    for (int64_t at = 0; at < rows; at += kFillKeysPerStep) {
      std::vector<uint64_t> keys;
      for (int64_t k = at; k < std::min(rows, at + kFillKeysPerStep); ++k) {
        keys.push_back(Mix64(kIds + 1 + static_cast<uint64_t>(k)));
      }
      std::sort(keys.begin(), keys.end());
      TimedStep(*s.table, s.step++, keys, grads);
    }
    s.fill_seconds = SecondsSince(fill_start);
    sized.push_back(std::move(s));
  }

  // The sizes' steps in turn, each size the same keys, so that the
  // machine's noise falls on every size alike.
  uint64_t state = 7;
  for (int i = 0; i < options.warmup_steps + options.steps; ++i) {
    const std::vector<uint64_t> keys = ZipfKeys(options.keys, state);
    for (Sized& s : sized) {
      const StepTimes first = TimedStep(*s.table, s.step++, keys, grads);
      const StepTimes again = TimedStep(*s.table, s.step++, keys, grads);
      if (i < options.warmup_steps) continue;
      s.full.push_back(first.seconds * 1e3);
      s.updates.push_back(again.seconds * 1e3);
      s.bookkeeping.push_back((first.seconds - again.seconds) * 1e3);
      s.admitted += first.stats.admitted;
      s.evicted += first.stats.evicted + again.stats.evicted;
    }
  }
  Table table("tables", {"rows", "policy", "keys/step", "step ms", "updates ms",
                         "bookkeeping ms", "admitted/step", "evicted/step", "fill s"});
  for (size_t k = 0; k < sized.size(); ++k) {
    const Sized& s = sized[k];
    table.Add(Table::Row()
                  .Int(options.rows[k])
                  .Text(options.policy)
                  .Int(options.keys)
                  .Number(Median(s.full), 3)
                  .Number(Median(s.updates), 3)
                  .Number(Median(s.bookkeeping), 3)
                  .Number(static_cast<double>(s.admitted) / options.steps, 0)
                  .Number(static_cast<double>(s.evicted) / options.steps, 0)
                  .Number(s.fill_seconds, 1));
  }
  table.Finish();
  return 0;
}

}  // namespace pstrain::bench
