#include "common/roc_auc.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>

namespace pstrain {
namespace {

// log(1 + e^x) for any x.
double Softplus(double x) { return std::max(x, 0.0) + std::log1p(std::exp(-std::abs(x))); }

}  // namespace

double RocAuc(const std::vector<double>& scores, const std::vector<float>& labels) {
  const size_t n = std::min(scores.size(), labels.size());
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return scores[a] < scores[b]; });
  double pairs_won = 0;  // positive above negative, ties one half
  int64_t negatives_below = 0;
  int64_t positives = 0;
  for (size_t begin = 0; begin < n;) {
    size_t end = begin;
    int64_t tie_positives = 0;
    int64_t tie_negatives = 0;
    for (; end < n && scores[order[end]] == scores[order[begin]]; ++end) {
      (labels[order[end]] > 0.5f ? tie_positives : tie_negatives) += 1;
    }
    pairs_won += static_cast<double>(tie_positives) *
                 (static_cast<double>(negatives_below) + 0.5 * static_cast<double>(tie_negatives));
    negatives_below += tie_negatives;
    positives += tie_positives;
    begin = end;
  }
  if (positives == 0 || negatives_below == 0) return std::numeric_limits<double>::quiet_NaN();
  return pairs_won / (static_cast<double>(positives) * static_cast<double>(negatives_below));
}

double MeanLogLoss(const std::vector<double>& logits, const std::vector<float>& labels) {
  const size_t n = std::min(logits.size(), labels.size());
  if (n == 0) return std::numeric_limits<double>::quiet_NaN();
  double sum = 0;
  for (size_t i = 0; i < n; ++i) sum += Softplus(labels[i] > 0.5f ? -logits[i] : logits[i]);
  return sum / static_cast<double>(n);
}

}  // namespace pstrain
