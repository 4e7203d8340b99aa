// The node reducer for GPUs: one NCCL communicator over the local GPUs,
// each rank driven by its own thread on its own stream.
#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "kernels/cuda/cuda_api.h"
#include "kernels/cuda/cuda_check.h"

#define NCCL_RETURN_IF_ERROR(call)                                                    \
  do {                                                                                \
    const ncclResult_t pstrain_nccl_result_ = (call);                                 \
    if (pstrain_nccl_result_ != ncclSuccess) {                                        \
      return absl::InternalError(std::string(__FILE__) + ":" + std::to_string(__LINE__) + \
                                 ": " #call ": " + ncclGetErrorString(pstrain_nccl_result_) + \
                                 " (" + ncclGetLastError(nullptr) + ")");             \
    }                                                                                 \
  } while (0)

namespace pstrain::kernels {
namespace {

class NcclReducer final : public Reducer {
 public:
  NcclReducer(std::vector<int> ordinals, std::chrono::milliseconds timeout)
      : ordinals_(std::move(ordinals)),
        timeout_(timeout),
        comms_(ordinals_.size(), nullptr),
        streams_(ordinals_.size(), nullptr) {}

  ~NcclReducer() override {
    for (size_t r = 0; r < comms_.size(); ++r) {
      cudaSetDevice(ordinals_[r]);
      if (comms_[r] != nullptr) {
        if (aborted_) {
          ncclCommAbort(comms_[r]);
        } else {
          ncclCommDestroy(comms_[r]);
        }
      }
      if (streams_[r] != nullptr) cudaStreamDestroy(streams_[r]);
    }
  }

  absl::Status Init() {
    NCCL_RETURN_IF_ERROR(
        ncclCommInitAll(comms_.data(), static_cast<int>(ordinals_.size()), ordinals_.data()));
    for (size_t r = 0; r < ordinals_.size(); ++r) {
      CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinals_[r]));
      CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&streams_[r], cudaStreamNonBlocking));
    }
    return absl::OkStatus();
  }

  int ranks() const override { return static_cast<int>(ordinals_.size()); }

  absl::Status ReduceScatter(int rank, const float* send, float* recv, int64_t count) override {
    if (absl::Status s = Enter(rank); !s.ok()) return s;
    NCCL_RETURN_IF_ERROR(ncclReduceScatter(send, recv, static_cast<size_t>(count), ncclFloat32,
                                           ncclSum, comms_[rank], streams_[rank]));
    return Wait(rank);
  }

  absl::Status AllGather(int rank, const float* send, float* recv, int64_t count) override {
    if (absl::Status s = Enter(rank); !s.ok()) return s;
    NCCL_RETURN_IF_ERROR(ncclAllGather(send, recv, static_cast<size_t>(count), ncclFloat32,
                                       comms_[rank], streams_[rank]));
    return Wait(rank);
  }

  void Abort() override { aborted_ = true; }

 private:
  absl::Status Enter(int rank) {
    if (rank < 0 || rank >= ranks()) {
      return absl::InvalidArgumentError("rank " + std::to_string(rank) + " out of range");
    }
    if (aborted_) return absl::CancelledError("node reduction aborted");
    CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinals_[rank]));
    return absl::OkStatus();
  }

  // Polls the stream, watching for NCCL's asynchronous errors, an abort and
  // the deadline (a peer that never joins would block forever).
  absl::Status Wait(int rank) {
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    while (true) {
      const cudaError_t e = cudaStreamQuery(streams_[rank]);
      if (e == cudaSuccess) return absl::OkStatus();
      if (e != cudaErrorNotReady) CUDA_RETURN_IF_ERROR(e);
      ncclResult_t async = ncclSuccess;
      NCCL_RETURN_IF_ERROR(ncclCommGetAsyncError(comms_[rank], &async));
      if (async != ncclSuccess) {
        aborted_ = true;
        return absl::InternalError(std::string("NCCL: ") + ncclGetErrorString(async));
      }
      if (aborted_) return absl::CancelledError("node reduction aborted");
      if (std::chrono::steady_clock::now() > deadline) {
        aborted_ = true;
        return absl::DeadlineExceededError("NCCL collective did not complete in time");
      }
      std::this_thread::yield();
    }
  }

  const std::vector<int> ordinals_;
  const std::chrono::milliseconds timeout_;
  std::vector<ncclComm_t> comms_;
  std::vector<cudaStream_t> streams_;
  std::atomic<bool> aborted_{false};
};

}  // namespace

absl::StatusOr<std::unique_ptr<Reducer>> CreateNcclReducer(const std::vector<int>& ordinals) {
  if (ordinals.empty()) return absl::InvalidArgumentError("a reducer needs at least one GPU");
  absl::StatusOr<int> count = CudaDeviceCount();
  if (!count.ok()) return count.status();
  auto reducer = std::make_unique<NcclReducer>(ordinals, std::chrono::minutes(10));
  if (absl::Status s = reducer->Init(); !s.ok()) return s;
  return reducer;
}

}  // namespace pstrain::kernels
