// Dynamic loss scaling for precision fp16.
#ifndef PSTRAIN_WORKER_LOSS_SCALE_H_
#define PSTRAIN_WORKER_LOSS_SCALE_H_

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace pstrain::worker {

// The factor a worker multiplies its loss by before the backward pass (so
// that small gradients survive fp16) and divides its gradient by before it
// pushes: halved after a step whose gradient overflowed (the servers skip
// that step), doubled after growth_steps steps in a row without an
// overflow; always a power of two in [1, 2^24], so both are exact.
class DynamicLossScale {
 public:
  static constexpr double kMin = 1, kMax = 1 << 24;

  // A scale that is not a power of two in [kMin, kMax] (a resume state's)
  // becomes the nearest one below it, or kMin.
  DynamicLossScale(double scale, int32_t growth_steps, int32_t good_steps = 0)
      : scale_(PowerOfTwoAtMost(scale)),
        growth_steps_(std::max(growth_steps, 1)),
        good_steps_(std::clamp(good_steps, 0, growth_steps_ - 1)) {}

  double scale() const { return scale_; }
  // Steps in a row without an overflow since the scale last changed.
  int32_t good_steps() const { return good_steps_; }

  // After a step: whether its gradient overflowed.
  void Update(bool overflowed) {
    if (overflowed) {
      scale_ = std::max(scale_ / 2, kMin);
      good_steps_ = 0;
    } else if (++good_steps_ >= growth_steps_) {
      scale_ = std::min(scale_ * 2, kMax);
      good_steps_ = 0;
    }
  }

 private:
  static double PowerOfTwoAtMost(double scale) {
    if (!(scale >= kMin)) return kMin;  // NaN too
    if (scale >= kMax) return kMax;
    int exponent = 0;
    std::frexp(scale, &exponent);  // scale = m 2^exponent, m in [0.5, 1)
    return std::ldexp(1.0, exponent - 1);
  }

  double scale_;
  int32_t growth_steps_;
  int32_t good_steps_;
};

// Divides the gradient in [begin, end), computed under loss scale `scale`,
// by it, in place: exact for the powers of two DynamicLossScale keeps.
inline void Unscale(float* begin, float* end, double scale) {
  if (scale == 1.0) return;
  const float unscale = static_cast<float>(1.0 / scale);
  for (float* g = begin; g < end; ++g) *g *= unscale;
}

}  // namespace pstrain::worker

#endif  // PSTRAIN_WORKER_LOSS_SCALE_H_
