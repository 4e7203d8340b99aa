// Collectives between threads: each rank posts its buffers, all meet, each
// computes its own output from the others' buffers, and all meet again
// before anyone returns (so that no buffer is reused while being read).
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "kernels/reducer.h"

namespace pstrain::kernels {
namespace {

class CpuReducer final : public Reducer {
 public:
  CpuReducer(int ranks, absl::Duration timeout)
      : ranks_(ranks), timeout_(timeout), send_(ranks, nullptr) {}

  int ranks() const override { return ranks_; }

  absl::Status ReduceScatter(int rank, const float* send, float* recv, int64_t count) override {
    return Collective(rank, send, [&] {
      for (int64_t i = 0; i < count; ++i) recv[i] = send_[0][rank * count + i];
      for (int r = 1; r < ranks_; ++r) {
        const float* from = send_[r] + rank * count;
        for (int64_t i = 0; i < count; ++i) recv[i] += from[i];
      }
    });
  }

  absl::Status AllGather(int rank, const float* send, float* recv, int64_t count) override {
    return Collective(rank, send, [&] {
      for (int r = 0; r < ranks_; ++r) {
        const float* from = send_[r];
        float* to = recv + r * count;
        if (from != to) std::copy(from, from + count, to);
      }
    });
  }

  void Abort() override {
    absl::MutexLock lock(&mu_);
    aborted_ = true;
  }

 private:
  // Runs `work` once every rank has posted its send buffer; returns once
  // every rank has done its work.
  template <typename Work>
  absl::Status Collective(int rank, const float* send, const Work& work) {
    if (rank < 0 || rank >= ranks_) {
      return absl::InvalidArgumentError("rank " + std::to_string(rank) + " out of range");
    }
    absl::MutexLock lock(&mu_);
    const int64_t generation = generation_;
    send_[rank] = send;
    ++arrived_;
    auto all_arrived = [&] { return aborted_ || arrived_ == ranks_ || generation_ != generation; };
    if (!mu_.AwaitWithTimeout(absl::Condition(&all_arrived), timeout_)) {
      return absl::DeadlineExceededError("node reduction: other devices did not arrive");
    }
    if (aborted_) return absl::CancelledError("node reduction aborted");
    mu_.Unlock();
    work();
    mu_.Lock();
    // Everyone has read the send buffers once all are done.
    if (++done_ == ranks_) {
      arrived_ = 0;
      done_ = 0;
      ++generation_;
    }
    auto all_done = [&] { return aborted_ || generation_ != generation; };
    if (!mu_.AwaitWithTimeout(absl::Condition(&all_done), timeout_)) {
      return absl::DeadlineExceededError("node reduction: other devices did not finish");
    }
    if (aborted_) return absl::CancelledError("node reduction aborted");
    return absl::OkStatus();
  }

  const int ranks_;
  const absl::Duration timeout_;
  absl::Mutex mu_;
  std::vector<const float*> send_ ABSL_GUARDED_BY(mu_);
  int arrived_ ABSL_GUARDED_BY(mu_) = 0;
  int done_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  bool aborted_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Reducer>> CreateCpuReducer(int ranks, absl::Duration timeout) {
  if (ranks < 1) return absl::InvalidArgumentError("a reducer needs at least one rank");
  return std::make_unique<CpuReducer>(ranks, timeout);
}

}  // namespace pstrain::kernels
