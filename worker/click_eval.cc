#include "worker/click_eval.h"

#include <algorithm>

#include "common/click_generator.h"
#include "common/job_spec.h"
#include "common/random.h"
#include "common/roc_auc.h"
#include "common/status.h"

namespace pstrain::worker {

uint64_t TableKey(uint64_t token, int field, bool shared_table) {
  return shared_table ? Mix64(token ^ Mix64(0xf1e1dULL + static_cast<uint64_t>(field))) : token;
}

void ClickRows::JoinRows() {
  rows.clear();
  for (const std::vector<float>& table_rows : rows_by_table) {
    rows.insert(rows.end(), table_rows.begin(), table_rows.end());
  }
}

ClickKeys::ClickKeys(const v1::JobSpec& spec) : tables_(spec.tables_size()) {
  const int fields = spec.data().clicks().fields();
  table_of_field_.assign(fields, -1);
  shared_table_.assign(fields, false);
  for (int table = 0; table < spec.tables_size(); ++table) {
    for (int field : spec.tables(table).fields()) {
      table_of_field_[field - 1] = table;
      shared_table_[field - 1] = spec.tables(table).fields_size() > 1;
    }
  }
}

absl::Status ClickKeys::Prepare(const ClickBatch& samples, ClickRows& batch) const {
  const int tables = tables_;
  batch.tables.assign(tables, {});
  batch.index.resize(tables);
  for (auto& index : batch.index) index.clear();
  const int fields = static_cast<int>(table_of_field_.size());
  std::vector<std::pair<int, int32_t>> entries;  // (table, place) of each bag entry
  entries.reserve(samples.keys.size());
  for (int64_t s = 0; s < samples.size(); ++s) {
    for (int f = 0; f < fields; ++f) {
      const int64_t bag = s * fields + f;
      const int t = table_of_field_[f];
      SparseClient::TableKeys& table = batch.tables[t];
      for (int64_t e = samples.bag_starts[bag]; e < samples.bag_starts[bag + 1]; ++e) {
        const uint64_t key = TableKey(samples.keys[e], f, shared_table_[f]);
        const auto [it, added] =
            batch.index[t].try_emplace(key, static_cast<int32_t>(table.keys.size()));
        if (added) {
          table.keys.push_back(key);
          table.counts.push_back(0);
        }
        ++table.counts[it->second];
        entries.emplace_back(t, it->second);
      }
    }
  }
  batch.table_first_row.assign(tables + 1, 0);
  for (int t = 0; t < tables; ++t) {
    batch.table_first_row[t + 1] =
        batch.table_first_row[t] + static_cast<int64_t>(batch.tables[t].keys.size());
  }
  kernels::BagIndex& bags = batch.bags;
  bags.rows = batch.table_first_row[tables];
  bags.bag_starts = samples.bag_starts;
  bags.entry_rows.resize(entries.size());
  for (size_t e = 0; e < entries.size(); ++e) {
    bags.entry_rows[e] =
        static_cast<int32_t>(batch.table_first_row[entries[e].first] + entries[e].second);
  }
  return kernels::TransposeBags(bags);
}

absl::StatusOr<ClickBatch> ClickTestSet(const v1::JobSpec& spec, std::optional<double>* oracle_auc) {
  const v1::ClickDataSpec& clicks = spec.data().clicks();
  const ClickLayout layout{.dense = clicks.dense(), .fields = clicks.fields()};
  if (clicks.has_generate()) {
    const ClickDataSpec data = ClickDataSpecOf(spec.data());
    const ClickGenerator generator(data);
    ClickBatch test;
    test.layout = layout;
    const int64_t n =
        clicks.test_samples() > 0 ? std::min(clicks.test_samples(), data.test_rows) : data.test_rows;
    for (int64_t i = 0; i < n; ++i) generator.Generate(ClickSplit::kTest, i, test);
    ClickDataSpec measured = data;
    measured.test_rows = n;
    if (oracle_auc != nullptr) *oracle_auc = MeasureClickOracle(measured).auc;
    return test;
  }
  PSTRAIN_ASSIGN_OR_RETURN(
      ClickBatch test, ReadClickFiles({clicks.test_files().begin(), clicks.test_files().end()},
                                      layout, clicks.test_samples()));
  if (test.size() == 0) return absl::InvalidArgumentError("data.clicks.test_files are empty");
  return test;
}

absl::StatusOr<ClickEvaluation> EvaluateClickModel(
    const ClickKeys& keys, kernels::ClickModelKernels& model, const std::vector<float>& params,
    const ClickBatch& test, const std::function<absl::Status(ClickRows&)>& fill_rows) {
  std::vector<double> logits;
  std::vector<float> labels;
  ClickBatch part;
  part.layout = test.layout;
  ClickRows batch;
  std::vector<float> out;
  for (int64_t first = 0; first < test.size(); first += kClickEvalBatch) {
    const int n = static_cast<int>(std::min<int64_t>(kClickEvalBatch, test.size() - first));
    part.Clear();
    for (int64_t s = first; s < first + n; ++s) part.AppendSample(test, s);
    PSTRAIN_RETURN_IF_ERROR(keys.Prepare(part, batch));
    PSTRAIN_RETURN_IF_ERROR(fill_rows(batch));
    batch.JoinRows();
    out.resize(n);
    const kernels::ClickInputs inputs{n, part.dense.data(), part.labels.data(), &batch.bags};
    PSTRAIN_RETURN_IF_ERROR(model.Forward(params.data(), batch.rows.data(), inputs, out.data()));
    logits.insert(logits.end(), out.begin(), out.end());
    labels.insert(labels.end(), part.labels.begin(), part.labels.end());
  }
  ClickEvaluation eval;
  eval.auc = RocAuc(logits, labels);
  eval.log_loss = MeanLogLoss(logits, labels);
  int64_t right = 0;
  for (size_t i = 0; i < logits.size(); ++i) right += (logits[i] > 0) == (labels[i] > 0.5f);
  eval.accuracy = static_cast<double>(right) / static_cast<double>(logits.size());
  return eval;
}

}  // namespace pstrain::worker
