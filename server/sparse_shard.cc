#include "server/sparse_shard.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <new>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "server/dense_chunk.h"

namespace pstrain::server {
namespace {

using Config = SparseTableConfig;

// The hot-key share is computed every kHotShareEvery versions, over the
// versions since the last multiple of kHotWindow, from the keys of every
// kHotSampleEvery-th (a sample of the steps: a quarter of the sketch's
// cost, a few percent of a large table's step otherwise).
constexpr int64_t kHotShareEvery = 10;
constexpr int64_t kHotWindow = 100;
constexpr int64_t kHotSampleEvery = 4;

// Table t's gauges after a step, and its hot-key share when due.
void UpdateTableGauges(SparseShard& shard, uint32_t t) ABSL_EXCLUSIVE_LOCKS_REQUIRED(shard.mu) {
  const ServerMetrics::Table& m = shard.metrics[t];
  const SparseTable& table = *shard.tables[t];
  m.rows->Set(static_cast<double>(table.rows()));
  m.bytes->Set(static_cast<double>(table.bytes()));
  const int64_t version = shard.version + 1;  // the step being applied, done
  if (version % kHotShareEvery == 0) {
    m.hot_key_share->Set(shard.hot_keys[t].HotShare());
    if (version % kHotWindow == 0) shard.hot_keys[t].Reset();
  }
}

float MaxAbsOfSections(const std::vector<SparseSection>& sections) {
  float max_abs = 0;
  for (const SparseSection& s : sections) {
    for (float g : s.grads) {
      if (!std::isfinite(g)) return std::numeric_limits<float>::infinity();
      max_abs = std::max(max_abs, std::abs(g));
    }
  }
  return max_abs;
}

// Why step `step`'s update must be skipped (the step ends' bounds, which
// every server sees alike, or a push beyond its worker's bound), or empty.
std::string SkipReason(const ShardJob& job, const SparseShard& shard, int64_t step,
                       absl::Span<const uint32_t> workers)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(shard.mu, job.step_end_mu) {
  double bound = 0;
  for (uint32_t w : workers) {
    if (!(job.ended_max_abs[w] < kMaxGradientBound)) {
      return absl::StrCat("worker ", w, "'s gradient of step ", step, " had a NaN or an infinity");
    }
    if (!(shard.pushed[w]->max_abs <= job.ended_max_abs[w])) {
      return absl::StrCat("worker ", w, "'s sparse push of step ", step,
                          " exceeds its step end's bound");
    }
    bound += job.ended_max_abs[w];
  }
  if (!(bound < kMaxGradientBound)) {
    return absl::StrCat("the workers' gradients of step ", step, " could overflow fp32");
  }
  return "";
}

// Applies the pushes of `workers` (in that order) as step `step` of every
// table, or skips it; then the pushes are gone.
absl::Status Apply(ShardJob& job, SparseShard& shard, int64_t step,
                   absl::Span<const uint32_t> workers) ABSL_EXCLUSIVE_LOCKS_REQUIRED(shard.mu) {
  std::string skip;
  {
    absl::MutexLock lock(&job.step_end_mu);
    skip = SkipReason(job, shard, step, workers);
  }
  if (!skip.empty()) {
    ++shard.skipped;
    LOG(WARNING) << "job " << job.id << ": tables skip step " << step << ": " << skip;
    return absl::OkStatus();
  }
  // Each worker's sections in table order: walk them table by table.
  const uint32_t num_tables = static_cast<uint32_t>(shard.tables.size());
  std::vector<std::vector<SparsePush>> pushes_of(num_tables);
  std::vector<size_t> next(workers.size(), 0);
  for (uint32_t t = 0; t < num_tables; ++t) {
    for (size_t i = 0; i < workers.size(); ++i) {
      const std::vector<SparseSection>& sections = shard.pushed[workers[i]]->sections;
      if (next[i] < sections.size() && sections[next[i]].table == t) {
        const SparseSection& s = sections[next[i]++];
        pushes_of[t].push_back({s.keys, s.counts, s.grads});
      }
    }
  }
  // The tables step on the server's apply threads, each table on one
  // (a table's step is a function of its pushes alone: the order in which
  // the tables take theirs changes nothing). Every table steps; the first
  // error, in table order, fails the job.
  std::vector<SparseTable*> tables(num_tables);
  for (uint32_t t = 0; t < num_tables; ++t) tables[t] = shard.tables[t].get();
  std::vector<absl::StatusOr<SparseStepStats>> results(num_tables);
  std::atomic<uint32_t> next_table{0};
  auto apply_tables = [&](int) {
    for (uint32_t t; (t = next_table.fetch_add(1)) < num_tables;) {
      // A table that cannot grow fails the job (below), on whichever
      // thread it steps: never the process.
      try {
        results[t] = tables[t]->ApplyStep(step, pushes_of[t]);
      } catch (const std::bad_alloc&) {
        results[t] = absl::ResourceExhaustedError(
            absl::StrCat("table ", tables[t]->config().name, ": step ", step,
                         ": out of memory for its rows"));
      }
    }
  };
  if (shard.pool != nullptr && num_tables > 1) {
    shard.pool->Run(std::min<int>(shard.pool->threads(), static_cast<int>(num_tables)),
                    apply_tables);
  } else {
    apply_tables(0);
  }
  for (uint32_t t = 0; t < num_tables; ++t) {
    const std::vector<SparsePush>& pushes = pushes_of[t];
    const absl::StatusOr<SparseStepStats>& stats = results[t];
    if (!stats.ok()) return stats.status();
    if (!shard.metrics.empty()) {
      const ServerMetrics::Table& m = shard.metrics[t];
      m.admitted->Increment(static_cast<double>(stats->admitted));
      m.evicted->Increment(static_cast<double>(stats->evicted));
      m.dropped_gradients->Increment(static_cast<double>(stats->gradients_dropped));
      if (shard.version % kHotSampleEvery == 0) {
        for (const SparsePush& push : pushes) {
          for (size_t i = 0; i < push.keys.size(); ++i) {
            shard.hot_keys[t].Add(push.keys[i], push.counts[i]);
          }
        }
      }
      UpdateTableGauges(shard, t);
    }
    shard.totals.rows_updated += stats->rows_updated;
    shard.totals.gradients_dropped += stats->gradients_dropped;
    shard.totals.admitted += stats->admitted;
    shard.totals.evicted += stats->evicted;
  }
  return absl::OkStatus();
}

// A table that could not take a step ends the job: its error, and the
// shard's waits ended with it.
absl::Status FailJob(ShardJob& job, SparseShard& shard, const absl::Status& why)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(shard.mu) {
  {
    absl::MutexLock lock(&job.error_mu);
    if (job.error.empty()) job.error = std::string(why.message());
  }
  const absl::Status failed = absl::FailedPreconditionError(why.message());
  AbortSparseWaits(shard, failed);
  shard.closed = failed;
  return failed;
}

}  // namespace

SparseTableConfig SparseTableConfigOf(const v1::JobSpec& spec, int t) {
  const v1::EmbeddingTableSpec& ts = spec.tables(t);
  Config c;
  c.name = ts.name();
  c.index = static_cast<uint32_t>(t);
  c.dim = ts.dim();
  c.seed = spec.seed();
  switch (ts.initializer().type()) {
    case v1::TABLE_INITIALIZER_TYPE_NORMAL:
      c.initializer = Config::Initializer::kNormal;
      break;
    case v1::TABLE_INITIALIZER_TYPE_ZEROS:
      c.initializer = Config::Initializer::kZeros;
      break;
    default:
      c.initializer = Config::Initializer::kUniform;
  }
  c.init_scale = ts.initializer().scale();
  c.values = ts.value_dtype() == v1::DTYPE_BF16 ? Config::Values::kBf16 : Config::Values::kFp32;
  const v1::TableOptimizer& o = ts.optimizer();
  switch (o.type()) {
    case v1::TABLE_OPTIMIZER_TYPE_SGD:
      c.optimizer = Config::Optimizer::kSgd;
      break;
    case v1::TABLE_OPTIMIZER_TYPE_ADAM:
      c.optimizer = Config::Optimizer::kAdam;
      break;
    case v1::TABLE_OPTIMIZER_TYPE_FTRL:
      c.optimizer = Config::Optimizer::kFtrl;
      break;
    case v1::TABLE_OPTIMIZER_TYPE_ROWWISE_ADAGRAD:
      c.optimizer = Config::Optimizer::kRowwiseAdagrad;
      break;
    default:
      c.optimizer = Config::Optimizer::kAdagrad;
  }
  c.learning_rate = o.learning_rate();
  if (o.has_initial_accumulator()) c.initial_accumulator = o.initial_accumulator();
  if (o.has_beta1()) c.beta1 = o.beta1();
  if (o.has_beta2()) c.beta2 = o.beta2();
  if (o.has_epsilon()) c.epsilon = o.epsilon();
  c.l1 = o.l1();
  c.l2 = o.l2();
  if (o.has_beta()) c.beta = o.beta();
  c.min_count = std::max<int64_t>(1, ts.admission().min_count());
  c.probability = ts.admission().has_probability() ? ts.admission().probability() : 1.0;
  if (ts.admission().filter_counters() > 0) c.filter_counters = ts.admission().filter_counters();
  if (ts.admission().has_max_false_admission()) {
    c.max_false_admission = ts.admission().max_false_admission();
  }
  c.ttl_steps = ts.eviction().ttl_steps();
  c.eviction = ts.eviction().policy() == v1::TABLE_EVICTION_POLICY_LFU ? Config::Eviction::kLfu
                                                                       : Config::Eviction::kLru;
  c.max_memory_bytes = ts.max_memory_bytes();
  c.record_evictions = !spec.checkpoint().dir().empty();  // incremental checkpoints
  return c;
}

absl::StatusOr<std::unique_ptr<SparseShard>> NewSparseShard(const v1::JobSpec& spec,
                                                            uint32_t num_workers) {
  auto shard = std::make_unique<SparseShard>();
  absl::MutexLock lock(&shard->mu);
  for (int t = 0; t < spec.tables_size(); ++t) {
    absl::StatusOr<std::unique_ptr<SparseTable>> table =
        SparseTable::Create(SparseTableConfigOf(spec, t));
    if (!table.ok()) return table.status();
    shard->dims.push_back(spec.tables(t).dim());
    shard->initial_rows.push_back(spec.tables(t).initial_rows());
    shard->tables.push_back(std::move(*table));
  }
  shard->clock.assign(num_workers, 0);
  shard->pushed.resize(num_workers);
  return shard;
}

int64_t InitialRowsHeld(const v1::JobSpec& spec, uint32_t server, uint32_t num_servers) {
  int64_t held = 0;
  for (int t = 0; t < spec.tables_size(); ++t) {
    for (int64_t key = 0; key < spec.tables(t).initial_rows(); ++key) {
      held += RowServer(t, static_cast<uint64_t>(key), num_servers) == server ? 1 : 0;
    }
  }
  return held;
}

absl::StatusOr<int64_t> AddInitialRows(SparseShard& shard,
                                       const std::vector<SparseSection>& sections) {
  for (const SparseSection& s : sections) {
    const int64_t rows = shard.initial_rows[s.table];
    if (rows == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("table ", shard.tables[s.table]->config().name, " has no initial_rows"));
    }
    for (const uint64_t key : s.keys) {
      if (key >= static_cast<uint64_t>(rows)) {
        return absl::InvalidArgumentError(absl::StrCat("initial row ", key, " of table ",
                                                       shard.tables[s.table]->config().name,
                                                       " outside [0, ", rows, ")"));
      }
    }
    for (const float v : s.grads) {
      if (!std::isfinite(v)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "the initial rows of table ", shard.tables[s.table]->config().name,
            " are not all finite"));
      }
    }
  }
  int64_t added = 0;
  for (const SparseSection& s : sections) {
    SparseTable& table = *shard.tables[s.table];
    const int dim = shard.dims[s.table];
    for (size_t i = 0; i < s.keys.size(); ++i) {
      added += table.AddRow(s.keys[i], absl::MakeConstSpan(s.grads).subspan(i * dim, dim)) ? 1 : 0;
    }
  }
  return added;
}

void MeasureTables(SparseShard& shard, ServerMetrics& metrics, const std::string& job_id) {
  shard.metrics.clear();
  for (const auto& table : shard.tables) {
    ServerMetrics::Table& m =
        shard.metrics.emplace_back(metrics.BindTable(job_id, table->config().name));
    m.rows->Set(static_cast<double>(table->rows()));
    m.bytes->Set(static_cast<double>(table->bytes()));
    m.max_bytes->Set(static_cast<double>(table->config().max_memory_bytes));
  }
  shard.hot_keys.assign(shard.tables.size(), HotKeys());
}

absl::Status AddSparsePush(ShardJob& job, SparseShard& shard, const v1::ChunkHeader& h,
                           std::vector<SparseSection> sections,
                           const std::function<void()>& stepped) {
  if (!shard.closed.ok()) return shard.closed;
  std::optional<SparseShard::Held>& held = shard.pushed[h.worker()];
  const int64_t step = h.step();
  if (job.mode == v1::MODE_SYNC) {
    if (step < shard.version || held.has_value()) return absl::OkStatus();  // applied, or a repeat
    if (step > shard.version) {
      return absl::InvalidArgumentError(absl::StrCat(
          "sparse push of step ", step, " is ahead of the tables at step ", shard.version));
    }
  } else {
    if (step < shard.clock[h.worker()]) return absl::OkStatus();  // applied
    if (held.has_value()) {
      if (held->step == step) return absl::OkStatus();  // a repeat
      return absl::InvalidArgumentError(absl::StrCat("sparse push of step ", step, " while step ",
                                                     held->step, " waits for its step end"));
    }
  }
  const float max_abs = MaxAbsOfSections(sections);
  if (!shard.metrics.empty()) {
    for (const SparseSection& s : sections) {
      shard.metrics[s.table].rows_pushed->Increment(static_cast<double>(s.keys.size()));
    }
  }
  held = SparseShard::Held{step, std::move(sections), max_abs};
  ++shard.received_count;
  return CompleteSparseStep(job, shard, h.worker(), stepped);
}

absl::Status CompleteSparseStep(ShardJob& job, SparseShard& shard, uint32_t worker,
                                const std::function<void()>& stepped) {
  if (!shard.closed.ok()) return shard.closed;
  if (job.mode == v1::MODE_SYNC) {
    if (shard.received_count < static_cast<int>(job.num_workers)) return absl::OkStatus();
    {
      absl::MutexLock lock(&job.step_end_mu);
      for (int64_t e : job.ended_step) {
        if (e < shard.version) return absl::OkStatus();
      }
    }
    std::vector<uint32_t> workers(job.num_workers);
    for (uint32_t w = 0; w < job.num_workers; ++w) workers[w] = w;
    if (absl::Status s = Apply(job, shard, shard.version, workers); !s.ok()) {
      return FailJob(job, shard, s);
    }
    ++shard.version;
    std::fill(shard.clock.begin(), shard.clock.end(), shard.version);
    for (auto& held : shard.pushed) held.reset();
    shard.received_count = 0;
    if (stepped) stepped();
    return absl::OkStatus();
  }
  std::optional<SparseShard::Held>& held = shard.pushed[worker];
  if (!held.has_value()) return absl::OkStatus();
  {
    absl::MutexLock lock(&job.step_end_mu);
    if (job.ended_step[worker] < held->step) return absl::OkStatus();  // its step end is to come
  }
  const uint32_t only[] = {worker};
  if (absl::Status s = Apply(job, shard, shard.version, only); !s.ok()) {
    return FailJob(job, shard, s);
  }
  ++shard.version;
  shard.clock[worker] = held->step + 1;
  held.reset();
  --shard.received_count;
  if (stepped) stepped();
  return absl::OkStatus();
}

void WaitAndAnswerSparse(SparseShard& shard, std::optional<SparseShard::Wait> wait) {
  if (wait.has_value()) shard.waiting.push_back(*std::move(wait));
  if (shard.waiting.empty()) return;
  const int64_t slowest = *std::min_element(shard.clock.begin(), shard.clock.end());
  std::vector<SparseShard::Wait> still;
  for (SparseShard::Wait& w : shard.waiting) {
    if (w.wait.waiter->Abandoned()) continue;
    const v1::ChunkHeader& request = w.wait.request;
    if (StateOf(w.wait, shard.version, shard.clock[request.worker()], slowest) !=
        WaitState::kAnswerable) {
      still.push_back(std::move(w));
      continue;
    }
    int64_t floats = 0;
    for (const SparseSection& s : w.sections) {
      floats += static_cast<int64_t>(s.keys.size()) * shard.dims[s.table];
    }
    auto rows = std::make_shared<std::vector<float>>(floats);
    float* out = rows->data();
    for (const SparseSection& s : w.sections) {
      shard.tables[s.table]->Read(s.keys, out);
      out += static_cast<int64_t>(s.keys.size()) * shard.dims[s.table];
      if (!shard.metrics.empty()) {
        shard.metrics[s.table].rows_pulled->Increment(static_cast<double>(s.keys.size()));
      }
    }
    w.wait.waiter->OnValues(request,
                            ChunkValues{shard.version, v1::DTYPE_FP32, rows->data(), floats, rows});
  }
  shard.waiting = std::move(still);
}

void AbortSparseWaits(SparseShard& shard, const absl::Status& status) {
  for (SparseShard::Wait& w : shard.waiting) w.wait.waiter->OnAbort(status);
  shard.waiting.clear();
}

void Close(SparseShard& shard, const absl::Status& status) {
  absl::MutexLock lock(&shard.mu);
  AbortSparseWaits(shard, status);
  if (shard.closed.ok()) shard.closed = status;
}

}  // namespace pstrain::server
