#include "worker/gradient_pusher.h"

#include <utility>

#include "worker/loss_scale.h"

namespace pstrain::worker {

GradientPusher::GradientPusher(ParameterClient* client, StepExchanges* exchanges,
                               Options options)
    : client_(client),
      exchanges_(exchanges),
      first_unpushed_(std::move(options.first_chunks)),
      options_(std::move(options)) {}

void GradientPusher::PushUpTo(int layer, int last_chunk) {
  const int first_chunk = first_unpushed_[layer];
  if (first_chunk >= last_chunk) return;
  const v1::PartitionPlan& plan = client_->plan();
  for (int c = first_chunk; c < last_chunk; ++c) {
    queued_.push_back(static_cast<uint32_t>(c));
    queued_bytes_ += plan.chunks(c).size() * int64_t{sizeof(float)};
  }
  if (queued_layers_.empty() || queued_layers_.back() != layer) queued_layers_.push_back(layer);
  const v1::ChunkInfo& last = plan.chunks(last_chunk - 1);
  float* grad = options_.grad->data();
  Unscale(grad + plan.chunks(first_chunk).offset(), grad + last.offset() + last.size(),
          options_.loss_scale);
  first_unpushed_[layer] = last_chunk;
  if (queued_bytes_ >= options_.min_push_bytes) Flush();
}

void GradientPusher::Flush() {
  if (queued_.empty()) return;
  std::vector<uint32_t> chunks = std::move(queued_);
  queued_.clear();
  queued_bytes_ = 0;
  exchanges_->Add(client_->StartPushPull(options_.step, options_.grad, options_.params, chunks),
                  chunks);
  if (options_.on_started) {
    for (int layer : queued_layers_) options_.on_started(layer);
  }
  queued_layers_.clear();
}

}  // namespace pstrain::worker
