// Collectives between threads: each rank posts its buffers, all meet, each
// computes its own output from the others' buffers, and all meet again
// before anyone returns (so that no buffer is reused while being read).
#include <string>
#include <vector>

#include <condition_variable>
#include <mutex>

#include "kernels/reducer.h"

namespace pstrain::kernels {
namespace {

class CpuReducer final : public Reducer {
 public:
  CpuReducer(int ranks, std::chrono::milliseconds timeout)
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
    std::lock_guard<std::mutex> lock(mu_);
    aborted_ = true;
    changed_.notify_all();
  }

 private:
  // Runs `work` once every rank has posted its send buffer; returns once
  // every rank has done its work.
  template <typename Work>
  absl::Status Collective(int rank, const float* send, const Work& work) {
    if (rank < 0 || rank >= ranks_) {
      return absl::InvalidArgumentError("rank " + std::to_string(rank) + " out of range");
    }
    std::unique_lock<std::mutex> lock(mu_);
    const int64_t generation = generation_;
    send_[rank] = send;
    if (++arrived_ == ranks_) changed_.notify_all();
    if (!changed_.wait_for(lock, timeout_, [&] {
          return aborted_ || arrived_ == ranks_ || generation_ != generation;
        })) {
      return absl::DeadlineExceededError("node reduction: other devices did not arrive");
    }
    if (aborted_) return absl::CancelledError("node reduction aborted");
    lock.unlock();
    work();
    lock.lock();
    // Everyone has read the send buffers once all are done.
    if (++done_ == ranks_) {
      arrived_ = 0;
      done_ = 0;
      ++generation_;
      changed_.notify_all();
    }
    if (!changed_.wait_for(lock, timeout_,
                           [&] { return aborted_ || generation_ != generation; })) {
      return absl::DeadlineExceededError("node reduction: other devices did not finish");
    }
    if (aborted_) return absl::CancelledError("node reduction aborted");
    return absl::OkStatus();
  }

  const int ranks_;
  const std::chrono::milliseconds timeout_;
  std::mutex mu_;
  std::condition_variable changed_;
  // All guarded by mu_.
  std::vector<const float*> send_;
  int arrived_ = 0;
  int done_ = 0;
  int64_t generation_ = 0;
  bool aborted_ = false;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Reducer>> CreateCpuReducer(int ranks,
                                                          std::chrono::milliseconds timeout) {
  if (ranks < 1) return absl::InvalidArgumentError("a reducer needs at least one rank");
  return std::make_unique<CpuReducer>(ranks, timeout);
}

}  // namespace pstrain::kernels
