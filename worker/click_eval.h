// What the click model's training and its evaluations share: a batch's
// keys by table (each field's tokens in the table the job gives it, bags
// over the batch's distinct keys), the job's test set, and the test set's
// AUC and log loss with the rows from wherever they are — the servers
// (ClickTrainer) or an export (pstrain-local --eval).
#ifndef PSTRAIN_WORKER_CLICK_EVAL_H_
#define PSTRAIN_WORKER_CLICK_EVAL_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "common/click_data.h"
#include "kernels/click_model.h"
#include "pstrain/v1/job.pb.h"
#include "worker/sparse_client.h"

namespace pstrain::worker {

// The key a field's token has in its table: the token itself, or, in a
// table several fields share, a mix of the token and the field (one row
// per field and token).
uint64_t TableKey(uint64_t token, int field, bool shared_table);

// A batch's keys by table, its bags over them, and their rows.
struct ClickRows {
  std::vector<SparseClient::TableKeys> tables;
  std::vector<absl::flat_hash_map<uint64_t, int32_t>> index;  // by table: key -> place
  std::vector<std::vector<float>> rows_by_table;
  std::vector<float> rows;  // every table's, in table order
  std::vector<int64_t> table_first_row;
  kernels::BagIndex bags;

  // rows_by_table, concatenated into rows.
  void JoinRows();
};

// Maps a batch's samples to each table's distinct keys.
class ClickKeys {
 public:
  // `spec` normalized, of a click model.
  explicit ClickKeys(const v1::JobSpec& spec);
  // Fills batch.tables (keys and counts), index, table_first_row and bags.
  absl::Status Prepare(const ClickBatch& samples, ClickRows& batch) const;

 private:
  int tables_ = 0;
  // Each field's table and whether it shares the table with other fields.
  std::vector<int> table_of_field_;
  std::vector<bool> shared_table_;
};

// A job's test set (generated, or data.clicks.test_files; at most
// test_samples), and, for generated data, the oracle's AUC on it.
absl::StatusOr<ClickBatch> ClickTestSet(const v1::JobSpec& spec, std::optional<double>* oracle_auc);

// What the evaluation of a model gives.
struct ClickEvaluation {
  double auc = 0;
  double log_loss = 0;
  double accuracy = 0;  // at a threshold of 1/2
};

// The test set's evaluation with dense values `params`; `fill_rows` puts
// the rows of a batch's keys into its rows_by_table. `model` takes batches
// of kClickEvalBatch samples.
inline constexpr int kClickEvalBatch = 4096;
absl::StatusOr<ClickEvaluation> EvaluateClickModel(
    const ClickKeys& keys, kernels::ClickModelKernels& model, const std::vector<float>& params,
    const ClickBatch& test, const std::function<absl::Status(ClickRows&)>& fill_rows);

}  // namespace pstrain::worker

#endif  // PSTRAIN_WORKER_CLICK_EVAL_H_
