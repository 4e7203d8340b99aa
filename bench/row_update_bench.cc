// pstrain-bench rows: a table's row updates against the machine's memory
// bandwidth, for each compact-row option.
//
// For each variant (dim 16: fp32 Adagrad; fp32 rowwise_adagrad; bf16
// rowwise_adagrad), one table whose rows' values and state alone take ten
// times the last-level cache is filled; then each timed step pushes 4,096
// distinct keys drawn uniformly from its rows (every key a row, each out of
// cache): the table's whole step (summing, index, orders, the updates).
// A row update reads and writes the row's values and state; their bytes a
// second are set against memcpy's (bytes read and written a second,
// copying a buffer of twice the cache, best of five) measured in the same
// run.
#include <algorithm>
#include <cstring>
#include <iostream>
#include <unistd.h>
#include <vector>

#include "bench/bench.h"
#include "bench/bench_util.h"
#include "common/random.h"
#include "server/sparse_table.h"

namespace pstrain::bench {
namespace {

using server::SparseTable;
using server::SparseTableConfig;

constexpr int kDim = 16;
constexpr int kKeysPerStep = 4096;

int64_t LastLevelCacheBytes() {
  const long bytes = sysconf(_SC_LEVEL3_CACHE_SIZE);
  return bytes > 0 ? bytes : int64_t{32} << 20;
}

// Bytes read and written a second by memcpy of `bytes`, best of five.
double MemcpyBytesPerSecond(int64_t bytes) {
  std::vector<char> from(bytes, 1), to(bytes, 0);
  double best = 0;
  for (int i = 0; i < 5; ++i) {
    const absl::Time start = absl::Now();
    std::memcpy(to.data(), from.data(), bytes);
    best = std::max(best, 2.0 * static_cast<double>(bytes) / SecondsSince(start));
    from[i] = to[bytes - 1 - i];  // the copies are used
  }
  return best;
}

struct Variant {
  const char* name;
  SparseTableConfig::Optimizer optimizer;
  SparseTableConfig::Values values;
};

}  // namespace

int RunRowUpdateBench(const RowUpdateBenchOptions& options) {
  const int64_t cache = LastLevelCacheBytes();
  const double memcpy_rate = MemcpyBytesPerSecond(2 * cache);
  Table table("rows", {"variant", "row bytes", "rows", "table MiB", "updates/s",
                       "update GB/s", "memcpy GB/s", "share"});
  const Variant variants[] = {
      {"adagrad fp32", SparseTableConfig::Optimizer::kAdagrad, SparseTableConfig::Values::kFp32},
      {"rowwise fp32", SparseTableConfig::Optimizer::kRowwiseAdagrad,
       SparseTableConfig::Values::kFp32},
      {"rowwise bf16", SparseTableConfig::Optimizer::kRowwiseAdagrad,
       SparseTableConfig::Values::kBf16},
  };
  for (const Variant& v : variants) {
    SparseTableConfig c;
    c.name = v.name;
    c.dim = kDim;
    c.optimizer = v.optimizer;
    c.values = v.values;
    const int64_t data_bytes = (server::ValueWordsPerRow(c) + server::StateFloatsPerRow(c)) * 4;
    const int64_t rows = options.rows > 0 ? options.rows : (10 * cache + data_bytes - 1) / data_bytes;
    absl::StatusOr<std::unique_ptr<SparseTable>> made = SparseTable::Create(c);
    if (!made.ok()) {
      std::cerr << "pstrain-bench rows: " << made.status().message() << "\n";
      return 1;
    }
    SparseTable& t = **made;
    std::vector<float> grads(size_t{1 << 16} * kDim, 0.001f);
    auto step = [&, next_step = int64_t{0}](const std::vector<uint64_t>& keys) mutable {
      const std::vector<uint32_t> counts(keys.size(), 1);
      const server::SparsePush push{keys, counts,
                                    absl::MakeConstSpan(grads).first(keys.size() * kDim)};
      absl::StatusOr<server::SparseStepStats> stats = t.ApplyStep(next_step++, {&push, 1});
      if (!stats.ok()) {
        std::cerr << "pstrain-bench rows: " << stats.status().message() << "\n";
        std::exit(1);
      }
    };
    // Keys 1..rows, mixed (the index sees them as a job's keys).
    for (int64_t at = 0; at < rows; at += 1 << 16) {
      std::vector<uint64_t> keys;
      for (int64_t k = at; k < std::min(rows, at + (int64_t{1} << 16)); ++k) {
        keys.push_back(Mix64(static_cast<uint64_t>(k)));
      }
      step(keys);
    }
    uint64_t state = 11;
    double seconds = 0;
    for (int i = 0; i < options.warmup_steps + options.steps; ++i) {
      std::vector<uint64_t> keys;
      while (static_cast<int>(keys.size()) < kKeysPerStep) {
        keys.push_back(Mix64(BelowN(Mix64(++state), rows)));
        if (static_cast<int>(keys.size()) == kKeysPerStep) {
          std::sort(keys.begin(), keys.end());
          keys.erase(std::unique(keys.begin(), keys.end()), keys.end());
        }
      }
      const absl::Time start = absl::Now();
      step(keys);
      if (i >= options.warmup_steps) seconds += SecondsSince(start);
    }
    const double updates = static_cast<double>(kKeysPerStep) * options.steps / seconds;
    const double update_rate = updates * 2.0 * static_cast<double>(data_bytes);
    table.Add(Table::Row()
                  .Text(v.name)
                  .Int(server::BytesPerRow(c))
                  .Int(rows)
                  .Number(static_cast<double>(rows * server::BytesPerRow(c)) / (1 << 20), 0)
                  .Number(updates, 0)
                  .Number(update_rate / 1e9, 2)
                  .Number(memcpy_rate / 1e9, 2)
                  .Number(update_rate / memcpy_rate, 3));
  }
  table.Finish();
  return 0;
}

}  // namespace pstrain::bench
