#include "server/apply.h"

#include <algorithm>
#include <memory>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/blocking_counter.h"
#include "kernels/cpu/cpu_kernels.h"

namespace pstrain::server {
namespace {

// Floats summed and applied at a time: 16 KiB, which stays in the L1/L2
// cache between the sum and the update.
constexpr int64_t kTileFloats = 4096;

// The bits of a float's magnitude from which on it is an infinity or a NaN.
constexpr uint32_t kFloatInfinityBits = 0x7f800000u;

// Values [begin, end) of the chunk.
absl::Status ApplyRange(const kernels::Optimizer& optimizer, absl::Span<const Frame* const> grads,
                        const kernels::OptimizerSpan& span, int64_t update_count, bool check_sum,
                        int64_t begin, int64_t end) {
  // Each thread's tile, allocated once.
  thread_local std::unique_ptr<float[]> tile(new float[kTileFloats]);
  for (int64_t at = begin; at < end; at += kTileFloats) {
    const int64_t n = std::min(kTileFloats, end - at);
    if (grads.empty()) {
      std::fill(tile.get(), tile.get() + n, 0.0f);
    } else {
      grads[0]->ReadValues(at, n, tile.get());
      for (size_t w = 1; w < grads.size(); ++w) grads[w]->AddValues(at, n, tile.get());
    }
    if (check_sum && kernels::MaxMagnitudeBits(tile.get(), 4, n) >= kFloatInfinityBits) {
      return absl::OutOfRangeError(absl::StrCat("the sum of the gradients of values [", at, ", ",
                                                at + n, ") has a NaN or an infinity"));
    }
    kernels::OptimizerSpan part = span;
    part.params += at;
    part.new_params += at;
    part.grad = tile.get();
    if (part.state != nullptr) part.state += at;  // plain SGD has none
    part.n = n;
    if (absl::Status s = optimizer.Apply(part, update_count); !s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace

ApplyPool::ApplyPool(int threads) {
  for (int i = 1; i < threads; ++i) helpers_.emplace_back([this] { HelperLoop(); });
}

ApplyPool::~ApplyPool() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  for (std::thread& t : helpers_) t.join();
}

void ApplyPool::HelperLoop() {
  while (true) {
    std::function<void()> task;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](ApplyPool* p) ABSL_NO_THREAD_SAFETY_ANALYSIS {
            return p->stopping_ || !p->queue_.empty();
          },
          this));
      if (queue_.empty()) return;  // stopping
      task = std::move(queue_.front());  // oldest first: no caller waits on others
      queue_.pop_front();
    }
    task();
  }
}

void ApplyPool::Run(int parts, const std::function<void(int)>& fn) {
  if (parts <= 1 || helpers_.empty()) {
    for (int p = 0; p < parts; ++p) fn(p);
    return;
  }
  absl::BlockingCounter done(parts - 1);
  {
    absl::MutexLock lock(&mu_);
    for (int p = 1; p < parts; ++p) {
      queue_.push_back([&fn, &done, p] {
        fn(p);
        done.DecrementCount();
      });
    }
  }
  fn(0);
  done.Wait();
}

absl::Status SumAndApply(const kernels::Optimizer& optimizer, absl::Span<const Frame* const> grads,
                         const kernels::OptimizerSpan& span, int64_t update_count,
                         ApplyPool* pool, bool check_sum) {
  int parts = 1;
  if (pool != nullptr) {
    parts = static_cast<int>(std::clamp<int64_t>(span.n / ApplyPool::kMinFloatsPerThread, 1,
                                                 pool->threads()));
  }
  if (parts == 1) return ApplyRange(optimizer, grads, span, update_count, check_sum, 0, span.n);
  // Whole tiles per part.
  const int64_t tiles = (span.n + kTileFloats - 1) / kTileFloats;
  std::vector<absl::Status> status(parts);
  pool->Run(parts, [&](int p) {
    const int64_t begin = std::min(span.n, tiles * p / parts * kTileFloats);
    const int64_t end = std::min(span.n, tiles * (p + 1) / parts * kTileFloats);
    status[p] = ApplyRange(optimizer, grads, span, update_count, check_sum, begin, end);
  });
  for (const absl::Status& s : status) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace pstrain::server
