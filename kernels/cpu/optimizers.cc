// Element-wise optimizer updates on the CPU.
#include <cmath>

#include "kernels/cpu/cpu_kernels.h"

namespace pstrain::kernels {
namespace {

class Sgd final : public Optimizer {
 public:
  explicit Sgd(const OptimizerConfig& c) : c_(c) {}
  int StateFloatsPerParam() const override { return c_.momentum > 0 ? 1 : 0; }
  absl::Status Apply(float* p, const float* g, float* state, int64_t n, int64_t) const override {
    const float lr = c_.learning_rate, wd = c_.weight_decay, mu = c_.momentum;
    if (mu > 0) {
      float* v = state;
      for (int64_t i = 0; i < n; ++i) {
        v[i] = mu * v[i] + (g[i] + wd * p[i]);
        p[i] -= lr * v[i];
      }
    } else {
      for (int64_t i = 0; i < n; ++i) p[i] -= lr * (g[i] + wd * p[i]);
    }
    return absl::OkStatus();
  }

 private:
  const OptimizerConfig c_;
};

class Adam final : public Optimizer {
 public:
  explicit Adam(const OptimizerConfig& c) : c_(c) {}
  int StateFloatsPerParam() const override { return 2; }
  absl::Status Apply(float* p, const float* g, float* state, int64_t n,
                     int64_t update_count) const override {
    float* m = state;
    float* v = state + n;
    const float b1 = c_.beta1, b2 = c_.beta2, wd = c_.weight_decay, eps = c_.epsilon;
    const double t = static_cast<double>(update_count);
    // Bias corrections folded into the step size, in double for large t.
    const float step = static_cast<float>(c_.learning_rate * std::sqrt(1.0 - std::pow(b2, t)) /
                                          (1.0 - std::pow(b1, t)));
    const float eps_hat = static_cast<float>(eps * std::sqrt(1.0 - std::pow(b2, t)));
    for (int64_t i = 0; i < n; ++i) {
      const float gi = g[i] + wd * p[i];
      m[i] = b1 * m[i] + (1.0f - b1) * gi;
      v[i] = b2 * v[i] + (1.0f - b2) * gi * gi;
      p[i] -= step * m[i] / (std::sqrt(v[i]) + eps_hat);
    }
    return absl::OkStatus();
  }

 private:
  const OptimizerConfig c_;
};

class Adagrad final : public Optimizer {
 public:
  explicit Adagrad(const OptimizerConfig& c) : c_(c) {}
  int StateFloatsPerParam() const override { return 1; }
  absl::Status Apply(float* p, const float* g, float* state, int64_t n, int64_t) const override {
    float* s = state;
    const float lr = c_.learning_rate, wd = c_.weight_decay, eps = c_.epsilon;
    for (int64_t i = 0; i < n; ++i) {
      const float gi = g[i] + wd * p[i];
      s[i] += gi * gi;
      p[i] -= lr * gi / (std::sqrt(s[i]) + eps);
    }
    return absl::OkStatus();
  }

 private:
  const OptimizerConfig c_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Optimizer>> CreateCpuOptimizer(const OptimizerConfig& c) {
  if (!(c.learning_rate > 0) || !std::isfinite(c.learning_rate)) {
    return absl::InvalidArgumentError("learning_rate must be > 0");
  }
  if (!(c.momentum >= 0 && c.momentum < 1)) {
    return absl::InvalidArgumentError("momentum must be in [0, 1)");
  }
  if (!(c.weight_decay >= 0)) return absl::InvalidArgumentError("weight_decay must be >= 0");
  switch (c.type) {
    case OptimizerConfig::Type::kSgd:
      return std::make_unique<Sgd>(c);
    case OptimizerConfig::Type::kAdam:
      if (!(c.beta1 >= 0 && c.beta1 < 1) || !(c.beta2 >= 0 && c.beta2 < 1)) {
        return absl::InvalidArgumentError("beta1 and beta2 must be in [0, 1)");
      }
      if (!(c.epsilon > 0)) return absl::InvalidArgumentError("epsilon must be > 0");
      return std::make_unique<Adam>(c);
    case OptimizerConfig::Type::kAdagrad:
      if (!(c.epsilon > 0)) return absl::InvalidArgumentError("epsilon must be > 0");
      return std::make_unique<Adagrad>(c);
  }
  return absl::InvalidArgumentError("unknown optimizer type");
}

}  // namespace pstrain::kernels
