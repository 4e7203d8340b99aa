// Client::Impl: the rows of the embedding tables (worker/client_impl.h).
#include <algorithm>
#include <cmath>
#include <future>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/job_spec.h"
#include "common/status.h"
#include "worker/client_impl.h"

namespace pstrain {
namespace {

using worker::ParameterClient;

}  // namespace

absl::Status Client::Impl::BindTableRows(int table, const float* rows, int64_t count) {
  if (table < 0 || table >= static_cast<int>(tables_.size())) {
    return absl::InvalidArgumentError(absl::StrCat("table ", table, " outside [0, ",
                                                   tables_.size(), ")"));
  }
  const TableInfo& info = tables_[table];
  if (rows == nullptr || count != info.initial_rows || count == 0) {
    return absl::InvalidArgumentError(absl::StrCat("table '", info.name, "' starts from ",
                                                   info.initial_rows, " given rows, not ",
                                                   count));
  }
  std::erase_if(initial_rows_, [&](const auto& r) { return r.table == uint32_t(table); });
  initial_rows_.push_back({static_cast<uint32_t>(table), rows, count});
  return absl::OkStatus();
}

absl::Status Client::Impl::PullRows(const std::vector<RowPull>& pulls) {
  PSTRAIN_RETURN_IF_ERROR(CheckStarted());
  std::vector<worker::SparseClient::TableKeys> keys(tables_.size());
  for (const RowPull& pull : pulls) {
    PSTRAIN_RETURN_IF_ERROR(CheckRows(pull.table, pull.keys, pull.n, pull.rows));
    keys[pull.table].keys.insert(keys[pull.table].keys.end(), pull.keys, pull.keys + pull.n);
  }
  for (size_t t = 0; t < keys.size(); ++t) {
    PSTRAIN_RETURN_IF_ERROR(CheckDistinct(static_cast<int>(t), keys[t].keys));
  }
  PSTRAIN_RETURN_IF_ERROR(FinishDeferred());
  std::vector<std::vector<float>> rows;
  absl::Status status = step_discarded_ ? absl::OkStatus() : PullTableRows(keys, rows);
  if (!status.ok()) {
    PSTRAIN_RETURN_IF_ERROR(Recover(status));
    step_discarded_ = true;  // the rows of a step that will not be applied
  }
  std::vector<int64_t> taken(tables_.size(), 0);
  for (const RowPull& pull : pulls) {
    const int64_t floats = pull.n * tables_[pull.table].dim;
    if (step_discarded_) {
      std::fill_n(pull.rows, floats, 0.0f);
    } else {
      std::copy_n(rows[pull.table].data() + taken[pull.table], floats, pull.rows);
    }
    taken[pull.table] += floats;
  }
  return absl::OkStatus();
}

absl::Status Client::Impl::PushRowGradients(int table, const uint64_t* keys, const uint32_t* counts,
                              const float* grads, int64_t n) {
  PSTRAIN_RETURN_IF_ERROR(CheckStarted());
  PSTRAIN_RETURN_IF_ERROR(CheckRows(table, keys, n, grads));
  if (n > 0 && counts == nullptr) return absl::InvalidArgumentError("null counts");
  PSTRAIN_RETURN_IF_ERROR(FinishDeferred());
  if (step_discarded_) return absl::OkStatus();
  if (row_pushed_[table]) {
    return absl::InvalidArgumentError(absl::StrCat(
        "table '", tables_[table].name, "' was already pushed in step ", step_));
  }
  PSTRAIN_RETURN_IF_ERROR(CheckDistinct(table, absl::MakeConstSpan(keys, n)));
  worker::SparseClient::TableKeys& rows = row_push_[table];
  rows.keys.assign(keys, keys + n);
  rows.counts.assign(counts, counts + n);
  rows.grads.assign(grads, grads + n * tables_[table].dim);
  for (float g : rows.grads) {
    row_max_abs_ = std::max(row_max_abs_, std::isfinite(g) ? std::abs(g) : INFINITY);
  }
  row_pushed_[table] = true;
  if (std::all_of(row_pushed_.begin(), row_pushed_.end(), [](bool b) { return b; })) {
    StartRowPush();
  }
  return absl::OkStatus();
}

absl::Status Client::Impl::CheckRows(int table, const uint64_t* keys, int64_t n, const float* rows) const {
  if (table < 0 || table >= static_cast<int>(tables_.size())) {
    return absl::InvalidArgumentError(absl::StrCat("table ", table, " outside [0, ",
                                                   tables_.size(), ")"));
  }
  if (n < 0) return absl::InvalidArgumentError("a negative number of keys");
  if (n > 0 && (keys == nullptr || rows == nullptr)) {
    return absl::InvalidArgumentError("null keys or rows");
  }
  return absl::OkStatus();
}

absl::Status Client::Impl::CheckDistinct(int table, absl::Span<const uint64_t> keys) const {
  absl::flat_hash_set<uint64_t> seen;
  seen.reserve(keys.size());
  for (uint64_t key : keys) {
    if (!seen.insert(key).second) {
      return absl::InvalidArgumentError(absl::StrCat("table '", tables_[table].name,
                                                     "': key ", key, " twice in one step's "
                                                     "pulls or push (keys must be distinct)"));
    }
  }
  return absl::OkStatus();
}

std::pair<int64_t, int64_t> Client::Impl::RowsWaitFor() const {
  return {spec_.mode() == v1::MODE_SYNC ? step_ : 0,
          StepsAppliedBefore(step_, StalenessOf(spec_))};
}

absl::Status Client::Impl::PullTableRows(const std::vector<worker::SparseClient::TableKeys>& keys,
                           std::vector<std::vector<float>>& rows) {
  const auto [version, pushed_steps] = RowsWaitFor();
  PSTRAIN_RETURN_IF_ERROR(sparse_->Pull(step_, version, pushed_steps, keys, rows));
  pulled_step_ = step_;
  return absl::OkStatus();
}

void Client::Impl::StartRowPush() {
  if (row_push_done_.valid()) return;
  const bool pull_first = pulled_step_ != step_;
  row_push_done_ = std::async(
      std::launch::async, [sparse = sparse_.get(), step = step_, wait = RowsWaitFor(),
                           pull_first, rows = std::exchange(row_push_, {})]() -> absl::Status {
        if (pull_first) {
          std::vector<std::vector<float>> none;
          PSTRAIN_RETURN_IF_ERROR(sparse->Pull(
              step, wait.first, wait.second,
              std::vector<worker::SparseClient::TableKeys>(rows.size()), none));
        }
        return sparse->Push(step, rows);
      });
}

absl::Status Client::Impl::WaitForRowPush() {
  absl::Status status;
  if (row_push_done_.valid()) status = row_push_done_.get();
  ResetRowPush();
  return status;
}

void Client::Impl::ResetRowPush() {
  row_push_.assign(tables_.size(), {});
  row_pushed_.assign(tables_.size(), false);
  row_max_abs_ = 0;
}

}  // namespace pstrain
