// One device's pushes of one step (trainer.h): as backward makes a layer's
// gradient final, the chunks of the device's slice of it are queued, and
// once at least min_push_bytes are queued (or the pass is over: Flush)
// they go out in one exchange, which joins the step's exchanges. A
// gradient computed under a loss scale is divided by it first, in place.
#ifndef PSTRAIN_WORKER_GRADIENT_PUSHER_H_
#define PSTRAIN_WORKER_GRADIENT_PUSHER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "worker/parameter_client.h"

namespace pstrain::worker {

// Not thread-safe: the device's thread.
class GradientPusher {
 public:
  struct Options {
    int64_t step = 0;
    // The gradient pushed (flat, host memory), and where the replies land.
    std::shared_ptr<std::vector<float>> grad;
    float* params = nullptr;
    // What the gradient was computed under (1: none).
    double loss_scale = 1;
    int64_t min_push_bytes = 0;
    // By layer: the first chunk of this device's slice of it.
    std::vector<int> first_chunks;
    // Called with the layers of each exchange as it starts; may be null.
    std::function<void(int layer)> on_started;
  };
  // `client` and `exchanges` must outlive the pusher.
  GradientPusher(ParameterClient* client, StepExchanges* exchanges, Options options);

  // The gradient of `layer` is final up to chunk `last_chunk` (exclusive):
  // the chunks from the first not pushed yet are unscaled and queued.
  void PushUpTo(int layer, int last_chunk);
  // The first chunk of `layer` not pushed yet.
  int first_unpushed(int layer) const { return first_unpushed_[layer]; }
  // Sends what is queued.
  void Flush();

 private:
  ParameterClient* const client_;
  StepExchanges* const exchanges_;
  // By layer, from options.first_chunks (moved, before options_).
  std::vector<int> first_unpushed_;
  const Options options_;
  // Final chunks not sent yet, their bytes, and their layers.
  std::vector<uint32_t> queued_;
  int64_t queued_bytes_ = 0;
  std::vector<int> queued_layers_;
};

}  // namespace pstrain::worker

#endif  // PSTRAIN_WORKER_GRADIENT_PUSHER_H_
