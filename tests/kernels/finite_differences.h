// The gradient check shared by the CPU kernels' tests: a kernel's analytic
// gradient against central finite differences of a reference loss in double.
#ifndef PSTRAIN_TESTS_KERNELS_FINITE_DIFFERENCES_H_
#define PSTRAIN_TESTS_KERNELS_FINITE_DIFFERENCES_H_

#include <algorithm>
#include <cmath>
#include <functional>
#include <vector>

#include "gtest/gtest.h"

namespace pstrain::kernels {

// Every grad[i] within 1e-3 (relative, or absolute below 1) of
// (loss(p + eps e_i) - loss(p - eps e_i)) / 2 eps at p = params; returns the
// worst error.
inline double ExpectGradientMatchesFiniteDifferences(
    const std::vector<float>& params, const std::vector<float>& grad,
    const std::function<double(const std::vector<double>&)>& loss) {
  std::vector<double> p(params.begin(), params.end());
  const double eps = 1e-5;
  double worst = 0;
  for (size_t i = 0; i < p.size(); ++i) {
    const double saved = p[i];
    p[i] = saved + eps;
    const double up = loss(p);
    p[i] = saved - eps;
    const double down = loss(p);
    p[i] = saved;
    const double numeric = (up - down) / (2 * eps);
    const double err = std::abs(numeric - grad[i]) / std::max(1.0, std::abs(numeric));
    worst = std::max(worst, err);
    EXPECT_LT(err, 1e-3) << "param " << i << ": analytic " << grad[i] << " numeric " << numeric;
  }
  return worst;
}

}  // namespace pstrain::kernels

#endif  // PSTRAIN_TESTS_KERNELS_FINITE_DIFFERENCES_H_
