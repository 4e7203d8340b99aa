// One embedding table's rows on one parameter server: 64-bit keys with no
// fixed vocabulary, each row `dim` floats and its optimizer's state, with
// admission and eviction under a memory cap.
//
// Everything a table does is decided at step boundaries (ApplyStep), by
// functions of (seed, table, key, counts) alone — never by timing or the
// order in which rows arrived — so that a sync job gives bitwise the same
// rows on every run, and a recovery from a checkpoint goes on exactly:
//   - a row's initial values are drawn from (seed, table, key);
//   - a key becomes a row (admission) once it has been seen min_count
//     times within the filter's window, counted by a counting filter of
//     bounded memory that forgets (server/counting_filter.h), or by a draw
//     from (seed, table, key, step, sighting) below a probability; until
//     then it reads as zeros and its gradients are dropped (and counted);
//   - a row is evicted once it has not been touched for ttl_steps steps,
//     or, when admissions would take the table past its memory cap, the
//     least recently (LRU) or least frequently (LFU) used rows go first,
//     ties broken by key;
//   - row-wise optimizers update only the rows a step touched: a row no
//     push names keeps its values and state (Adam's and FTRL's too: lazy).
// Not thread-safe: the shard store serializes a table's calls.
#ifndef PSTRAIN_SERVER_SPARSE_TABLE_H_
#define PSTRAIN_SERVER_SPARSE_TABLE_H_

#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "server/counting_filter.h"
#include "server/row_order.h"

namespace pstrain::server {

struct SparseTableConfig {
  std::string name;
  uint32_t index = 0;  // the table's number in the job: part of every draw
  int dim = 16;
  uint64_t seed = 0;  // the job's

  // Initial values: uniform in [-scale, scale], normal of deviation
  // `scale`, or zeros.
  enum class Initializer { kUniform, kNormal, kZeros };
  Initializer initializer = Initializer::kUniform;
  float init_scale = 0.01f;

  // How a row's values are held: fp32, or bf16 (half the bytes), each
  // update rounded stochastically by a draw of (seed, table, key, step) so
  // that small updates are not lost and runs stay reproducible. The
  // optimizer's state is fp32 either way.
  enum class Values { kFp32, kBf16 };
  Values values = Values::kFp32;

  enum class Optimizer { kSgd, kAdagrad, kAdam, kFtrl, kRowwiseAdagrad };
  Optimizer optimizer = Optimizer::kAdagrad;
  float learning_rate = 0.01f;
  float initial_accumulator = 0.1f;  // Adagrad's (both) and FTRL's n at the start
  float beta1 = 0.9f;                // Adam
  float beta2 = 0.999f;              // Adam
  float epsilon = 1e-8f;             // Adagrad (both), Adam
  float l1 = 0;                      // FTRL
  float l2 = 0;                      // FTRL
  float beta = 1.0f;                 // FTRL's beta (the rate's offset)

  // Admission: a key is admitted once seen min_count times (1: at once),
  // and, below 1, each sighting admits it with this probability.
  int64_t min_count = 1;
  double probability = 1.0;
  // Counters of the counting filter a row (4 rows of 16-bit saturating
  // counts), half of them each generation's: its memory is 8 bytes a
  // counter, within the table's cap.
  int64_t filter_counters = int64_t{1} << 20;
  // The chance that a key seen fewer than min_count times is admitted by
  // the filter's collisions: it sets the window (AdmissionWindow) so that
  // the two generations together never hold more sightings than the
  // counters keep to this bound.
  double max_false_admission = 0.01;

  // Eviction: rows untouched for ttl_steps steps (0: never); the order in
  // which rows go when the cap is reached.
  int64_t ttl_steps = 0;
  enum class Eviction { kLru, kLfu };
  Eviction eviction = Eviction::kLru;
  // This server's bytes for the table: rows, state, index and filter. 0:
  // unlimited.
  int64_t max_memory_bytes = 0;
  // Keep the keys evicted for TakeEvicted (a job with checkpoints).
  bool record_evictions = false;
};

// INVALID_ARGUMENT naming the table and the field outside its range.
absl::Status CheckSparseTableConfig(const SparseTableConfig& config);

// Floats of optimizer state per row.
int StateFloatsPerRow(const SparseTableConfig& config);
// 4-byte words of a row's values: dim in fp32, half of it (rounded up) in
// bf16.
int ValueWordsPerRow(const SparseTableConfig& config);

// The sightings a generation of the table's admission filter takes before
// it becomes the previous one: a key seen min_count times within the last
// AdmissionWindow sightings is admitted; sightings older than twice it are
// forgotten. 0 for a table without a filter.
int64_t AdmissionWindow(const SparseTableConfig& config);

// Bytes one row takes: values, state, its key and bookkeeping, its share of
// the index, and its links in the orders TTL and the cap keep.
int64_t BytesPerRow(const SparseTableConfig& config);

// One worker's push to a table: its batch's distinct keys, how often each
// occurred in the batch, and each key's summed gradient (dim floats a key,
// in key order of `keys`).
struct SparsePush {
  absl::Span<const uint64_t> keys;
  absl::Span<const uint32_t> counts;
  absl::Span<const float> grads;
};

// What a step did.
struct SparseStepStats {
  int64_t rows_updated = 0;
  int64_t gradients_dropped = 0;  // of keys without a row
  int64_t admitted = 0;
  int64_t evicted = 0;
};

class SparseTable {
 public:
  // INVALID_ARGUMENT for a bad config; RESOURCE_EXHAUSTED naming the table
  // if the counting filter alone exceeds the cap.
  static absl::StatusOr<std::unique_ptr<SparseTable>> Create(const SparseTableConfig& config);

  const SparseTableConfig& config() const { return config_; }

  // The rows of `keys` (dim floats each) into out; zeros for a key that has
  // no row.
  void Read(absl::Span<const uint64_t> keys, float* out) const;

  // Step `step`'s pushes, summed key by key in the order given (the
  // workers' order), applied to the rows; then the step boundary: the keys'
  // counts, admissions, and evictions by age and by the cap. All or
  // nothing: INVALID_ARGUMENT naming the table for a push whose arrays
  // disagree or repeat a key; RESOURCE_EXHAUSTED naming the table when the
  // step's admissions cannot fit under the cap even after every row the
  // step did not touch is evicted. The table is unchanged after an error.
  absl::StatusOr<SparseStepStats> ApplyStep(int64_t step, absl::Span<const SparsePush> pushes);

  // A row of `key` with `values` (dim floats) and fresh optimizer state,
  // unless the key has one: false then, and nothing changes. Not held to
  // max_memory_bytes (a table with initial rows has no cap).
  bool AddRow(uint64_t key, absl::Span<const float> values);

  int64_t rows() const { return static_cast<int64_t>(index_.size()); }
  // Bytes held: rows (BytesPerRow each) and the filter.
  int64_t bytes() const;

  // One row as a checkpoint or an export holds it.
  struct Row {
    uint64_t key = 0;
    std::vector<float> values;
    std::vector<float> state;
    int64_t last_step = 0;  // the step that last touched it
    int64_t touches = 0;    // steps that touched it
    int64_t updates = 0;    // updates applied (Adam's bias correction)
  };
  // The rows (by key) that steps >= `since` touched or admitted: every
  // row by default; an incremental checkpoint's since its last.
  std::vector<Row> Rows(int64_t since = std::numeric_limits<int64_t>::min()) const;

  // A snapshot: the rows Rows(since) would give now, read later, a batch
  // at a time, while steps go on changing the table. Copy on write: a
  // snapshot row that a step updates or evicts before the snapshot has read
  // it is copied first; rows admitted after it are not in it. One at a
  // time: BeginSnapshot returns nullopt while another is open. It returns
  // the snapshot's keys (unordered) and a token: the snapshot stays open
  // while the token lives, and ends with it (or with Load).
  struct Snapshot {
    std::vector<uint64_t> keys;
    std::shared_ptr<const void> token;
  };
  std::optional<Snapshot> BeginSnapshot(int64_t since = std::numeric_limits<int64_t>::min());
  // The snapshot rows of `keys` (a batch of the snapshot's keys, each
  // batch's keys above the last batch's, ascending) into out, replacing its
  // contents. ABORTED if the snapshot of `token` is no longer open (a
  // recovery loaded the table); INVALID_ARGUMENT for keys out of order.
  absl::Status ReadSnapshot(const std::shared_ptr<const void>& token,
                            absl::Span<const uint64_t> keys, std::vector<Row>& out);

  // The keys evicted since the last call, by key: an incremental
  // checkpoint's deletions (with record_evictions; else none).
  std::vector<uint64_t> TakeEvicted();

  // The counting filter: a checkpoint holds it, so that admission goes on
  // exactly.
  const AdmissionFilter& filter() const { return filter_.state(); }

  // Replaces the table's contents with a checkpoint's rows and filter (a
  // filter without counters: an empty one). INVALID_ARGUMENT naming the
  // table for a row of the wrong size, a repeated key or a filter of the
  // wrong size or state; RESOURCE_EXHAUSTED past the cap. The table is
  // unchanged after an error.
  absl::Status Load(const std::vector<Row>& rows, const AdmissionFilter& filter);

 private:
  explicit SparseTable(const SparseTableConfig& config);

  // The rows max_memory_bytes holds beside the filter (a capped table's).
  int64_t RowsUnderCap() const;
  uint32_t NewSlot();
  void InitRow(uint64_t key, uint32_t slot);
  // The row's values updated by its optimizer with the step's gradient.
  void UpdateRow(uint32_t slot, const float* grad, int64_t step);
  // The row's values as floats, and set from floats: rounded to the nearest
  // bf16 value, or, with a step, stochastically by a draw of (seed, table,
  // key, step).
  void GetValues(uint32_t slot, float* out) const;
  void SetValues(uint32_t slot, const float* in, std::optional<int64_t> step = std::nullopt);
  bool Admits(uint64_t key, uint32_t seen_before, uint32_t seen_now, int64_t step) const;
  // Evicts the first `rows_to_free` rows of the eviction order.
  void Evict(int64_t rows_to_free, SparseStepStats& stats);
  void Remove(uint64_t key);
  void RemoveAll(absl::Span<const uint64_t> keys);
  // Asks for the row in `slot` (values, state and meta) ahead of writing it.
  void PrefetchRow(uint32_t slot) const;
  // The row in `slot` into / out of the orders kept (before its meta
  // changes, out; after, in).
  void Order(uint32_t slot);
  void Unorder(uint32_t slot);
  RowOrder& eviction_order();
  // Visits the slots of the rows with last_step >= since: in time
  // proportional to them (every row for the lowest `since`).
  void ForEachTouchedSince(int64_t since, const std::function<void(uint32_t)>& visit) const;
  // Before a step changes or frees the row in `slot`: its copy, if the open
  // snapshot holds the row and has not read it yet.
  void PreserveForSnapshot(uint32_t slot);
  Row RowAt(uint32_t slot) const;
  // A slot's row: its values' words (the floats themselves in fp32), then
  // its state.
  float* WordsOf(uint32_t slot) { return rows_.data() + int64_t{slot} * row_floats_; }
  const float* WordsOf(uint32_t slot) const { return rows_.data() + int64_t{slot} * row_floats_; }
  float* StateOf(uint32_t slot) { return WordsOf(slot) + value_words_; }
  const float* StateOf(uint32_t slot) const { return WordsOf(slot) + value_words_; }

  const SparseTableConfig config_;
  const int state_floats_;
  const int value_words_;  // ValueWordsPerRow
  const int row_floats_;   // value_words_ + state_floats_
  using KeyIndex = absl::flat_hash_map<uint64_t, uint32_t, absl::Hash<uint64_t>,
                                       std::equal_to<uint64_t>,
                                       HugePageAllocator<std::pair<const uint64_t, uint32_t>>>;
  KeyIndex index_;                                  // key -> slot
  // A slot's row: its values (value_words_ 4-byte words), then its
  // state_floats_ optimizer state, side by side (a row's update reaches one
  // place in memory).
  std::vector<float, HugePageAllocator<float>> rows_;
  RowMetas meta_;                                        // by slot
  // The orders rows leave in: by last touch (TTL's, LRU's at the cap, and
  // the rows touched since a step), by touches (LFU's at the cap).
  RowOrder by_last_touch_;
  std::optional<RowOrder> by_touches_;
  std::vector<uint32_t> free_slots_;
  std::vector<uint64_t> evicted_;  // since TakeEvicted
  CountingFilter filter_;
  // The open snapshot: rows made at epochs below `epoch` with last_step >=
  // `since`, those above key `read_up_to` (all before its first read) not
  // read yet; `saved` holds the copies of those that changed since.
  struct OpenSnapshot {
    std::weak_ptr<const void> token;
    uint32_t epoch = 0;
    int64_t since = 0;
    std::optional<uint64_t> read_up_to;
    absl::flat_hash_map<uint64_t, Row> saved;
  };
  std::optional<OpenSnapshot> snapshot_;  // reset lazily once its token is gone
  uint32_t snapshot_epoch_ = 0;
};

}  // namespace pstrain::server

#endif  // PSTRAIN_SERVER_SPARSE_TABLE_H_
