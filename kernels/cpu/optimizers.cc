// Element-wise optimizer updates on the CPU.
//
// Each loop is compiled twice on x86-64 — for AVX2 with FMA and for the
// baseline — and the dynamic loader picks the one the CPU runs (GCC
// target_clones). Each has an in-place and an out-of-place entry point: the
// in-place one passes the same array twice, so the compiler knows the
// read and the write of an element are the same and vectorises without a
// run-time overlap check (which an equal pair of arrays would fail).
// Multiply-adds are fused where the CPU has FMA (-ffp-contract=fast for
// this file): a machine's processes all run the same clone, so results stay
// reproducible on one kind of CPU, and may differ in the last bit between
// an AVX2 machine and an older one.
#include <cmath>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/simd.h"

namespace pstrain::kernels {
namespace {

// std::sqrt is an ordinary inline function, which GCC does not inline into
// the AVX2 clones (see simd.h); the builtin is one instruction in both.
PSTRAIN_INLINE_LOOP float Sqrt(float x) { return __builtin_sqrtf(x); }

struct SgdArgs {
  float lr, wd, mu;
};

PSTRAIN_INLINE_LOOP void SgdLoop(const float* p, float* out, const float* g, float* v,
                                 int64_t n, SgdArgs a) {
  if (a.mu > 0) {
    for (int64_t i = 0; i < n; ++i) {
      v[i] = a.mu * v[i] + (g[i] + a.wd * p[i]);
      out[i] = p[i] - a.lr * v[i];
    }
  } else {
    for (int64_t i = 0; i < n; ++i) out[i] = p[i] - a.lr * (g[i] + a.wd * p[i]);
  }
}
PSTRAIN_SIMD_CLONES void SgdInPlace(float* p, const float* g, float* v, int64_t n, SgdArgs a) {
  SgdLoop(p, p, g, v, n, a);
}
PSTRAIN_SIMD_CLONES void SgdOutOfPlace(const float* __restrict p, float* __restrict out,
                                       const float* g, float* v, int64_t n, SgdArgs a) {
  SgdLoop(p, out, g, v, n, a);
}

struct AdamArgs {
  float b1, b2, wd, step, eps_hat;
};

PSTRAIN_INLINE_LOOP void AdamLoop(const float* p, float* out, const float* g, float* m,
                                  float* v, int64_t n, AdamArgs a) {
  for (int64_t i = 0; i < n; ++i) {
    const float gi = g[i] + a.wd * p[i];
    m[i] = a.b1 * m[i] + (1.0f - a.b1) * gi;
    v[i] = a.b2 * v[i] + (1.0f - a.b2) * gi * gi;
    out[i] = p[i] - a.step * m[i] / (Sqrt(v[i]) + a.eps_hat);
  }
}
PSTRAIN_SIMD_CLONES void AdamInPlace(float* p, const float* g, float* m, float* v, int64_t n,
                                     AdamArgs a) {
  AdamLoop(p, p, g, m, v, n, a);
}
PSTRAIN_SIMD_CLONES void AdamOutOfPlace(const float* __restrict p, float* __restrict out,
                                        const float* g, float* m, float* v, int64_t n,
                                        AdamArgs a) {
  AdamLoop(p, out, g, m, v, n, a);
}

struct AdagradArgs {
  float lr, wd, eps;
};

PSTRAIN_INLINE_LOOP void AdagradLoop(const float* p, float* out, const float* g, float* s,
                                     int64_t n, AdagradArgs a) {
  for (int64_t i = 0; i < n; ++i) {
    const float gi = g[i] + a.wd * p[i];
    s[i] += gi * gi;
    out[i] = p[i] - a.lr * gi / (Sqrt(s[i]) + a.eps);
  }
}
PSTRAIN_SIMD_CLONES void AdagradInPlace(float* p, const float* g, float* s, int64_t n,
                                        AdagradArgs a) {
  AdagradLoop(p, p, g, s, n, a);
}
PSTRAIN_SIMD_CLONES void AdagradOutOfPlace(const float* __restrict p, float* __restrict out,
                                           const float* g, float* s, int64_t n, AdagradArgs a) {
  AdagradLoop(p, out, g, s, n, a);
}

class Sgd final : public Optimizer {
 public:
  explicit Sgd(const OptimizerConfig& c) : c_(c) {}
  int StateFloatsPerParam() const override { return c_.momentum > 0 ? 1 : 0; }
  absl::Status Apply(const OptimizerSpan& s, int64_t) const override {
    const SgdArgs a{RateOf(c_, s), c_.weight_decay, c_.momentum};
    if (s.new_params == s.params) {
      SgdInPlace(s.new_params, s.grad, s.state, s.n, a);
    } else {
      SgdOutOfPlace(s.params, s.new_params, s.grad, s.state, s.n, a);
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
  absl::Status Apply(const OptimizerSpan& s, int64_t update_count) const override {
    const double t = static_cast<double>(update_count);
    // Bias corrections folded into the step size, in double for large t.
    AdamArgs a;
    a.b1 = c_.beta1;
    a.b2 = c_.beta2;
    a.wd = c_.weight_decay;
    a.step = static_cast<float>(RateOf(c_, s) * std::sqrt(1.0 - std::pow(c_.beta2, t)) /
                                (1.0 - std::pow(c_.beta1, t)));
    a.eps_hat = static_cast<float>(c_.epsilon * std::sqrt(1.0 - std::pow(c_.beta2, t)));
    float* m = s.state;
    float* v = s.state + s.state_stride;
    if (s.new_params == s.params) {
      AdamInPlace(s.new_params, s.grad, m, v, s.n, a);
    } else {
      AdamOutOfPlace(s.params, s.new_params, s.grad, m, v, s.n, a);
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
  absl::Status Apply(const OptimizerSpan& s, int64_t) const override {
    const AdagradArgs a{RateOf(c_, s), c_.weight_decay, c_.epsilon};
    if (s.new_params == s.params) {
      AdagradInPlace(s.new_params, s.grad, s.state, s.n, a);
    } else {
      AdagradOutOfPlace(s.params, s.new_params, s.grad, s.state, s.n, a);
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
