// Generated click logs whose best possible AUC is known: tokens drawn from
// a Zipf distribution per field, labels drawn from a planted logistic model
// over hidden per-token weights and the integer features.
//
// Row i of a split is a function of (spec, split, i) alone, so the same
// spec gives the same files everywhere, and a reader may also generate rows
// on the fly instead of reading them.
//
// The planted model: logit = bias + sum_i dense_weight_i * (v_i - 3)
//                          + sum_f mean of the weights of field f's tokens
// where v_i = log(1 + x_i) is what the model reads of integer feature i
// (x_i = floor(e^(6u) - 1), u uniform, so v_i is spread over [0, 6)), the
// dense weights are normal with deviation `dense_weight`, and each token of
// each field has a weight drawn from a normal of deviation `token_weight`
// by a hash of (seed, field, token). A missing field or feature adds 0.
// The label is 1 with probability sigmoid(logit).
//
// The oracle AUC is the AUC of the planted logit on the test split. The
// dense-only oracle is the AUC of the dense part of the logit: the tokens
// are drawn independently of the dense features, so P(label | dense
// features) rises with that part, and no model that reads only the dense
// features can rank the test split better.
#ifndef PSTRAIN_COMMON_CLICK_GENERATOR_H_
#define PSTRAIN_COMMON_CLICK_GENERATOR_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/click_data.h"

namespace pstrain {

struct ClickDataSpec {
  uint64_t seed = 1;
  int64_t train_rows = 1000000;
  int64_t test_rows = 100000;
  ClickLayout layout;
  // Distinct tokens per field (Zipf ranks 1..vocabulary), at most 2^32;
  // rank r of field f is written as the 8-hex-digit token of a bijection
  // of (seed, f, r), so distinct ranks are distinct keys.
  int64_t vocabulary = 1000000;
  double zipf = 1.1;    // the exponent: P(rank r) is proportional to r^-zipf
  int max_values = 1;   // a field holds 1..max_values tokens, uniformly
  double missing = 0;   // the chance that a field or integer feature is empty
  double token_weight = 0.3;
  double dense_weight = 0.25;
  double bias = -1.5;
};

// INVALID_ARGUMENT naming the first parameter outside its range.
absl::Status CheckClickDataSpec(const ClickDataSpec& spec);

enum class ClickSplit { kTrain = 0, kTest = 1 };

class ClickGenerator {
 public:
  // `spec` must pass CheckClickDataSpec.
  explicit ClickGenerator(const ClickDataSpec& spec);

  struct Planted {
    double logit = 0;        // the planted model's
    double dense_logit = 0;  // its bias and dense part
  };
  // Appends row `index` of `split` to `batch` (of the spec's layout) and
  // returns its planted logits. With `line`, also appends the row as a
  // line of text, which ParseClickLine reads back as the same sample.
  Planted Generate(ClickSplit split, int64_t index, ClickBatch& batch,
                   std::string* line = nullptr) const;

  // The token (key) of rank r (from 1) in field f, and its planted weight.
  uint64_t TokenKey(int field, uint64_t rank) const;
  double TokenWeight(int field, uint64_t rank) const;

 private:
  // Rejection-inversion sampling of Zipf ranks (Hörmann and Derflinger,
  // 1996): O(1) per draw for any vocabulary.
  uint64_t ZipfRank(uint64_t& state) const;
  double H(double x) const;
  double HInverse(double x) const;

  const ClickDataSpec spec_;
  std::vector<double> dense_weights_;
  std::vector<uint32_t> field_salts_;
  double h_of_first_ = 0;  // H(1.5) - 1
  double h_of_last_ = 0;   // H(vocabulary + 0.5)
  double accept_width_ = 0;
};

// The oracle's measures on the test split.
struct ClickOracle {
  double auc = 0;
  double dense_only_auc = 0;
  double log_loss = 0;
  double positive_rate = 0;
};

// Generates the spec's test split and measures the planted model on it.
ClickOracle MeasureClickOracle(const ClickDataSpec& spec);

// Writes dir/train.txt and dir/test.txt (gzip: .txt.gz) and dir/clicks.json
// (the spec and the oracle, written last: a directory with it is complete),
// creating dir. INVALID_ARGUMENT for a bad spec; the file system's error
// naming the file otherwise.
absl::StatusOr<ClickOracle> WriteClickData(const ClickDataSpec& spec, const std::string& dir,
                                           bool gzip);

// The spec and oracle as the JSON object clicks.json holds.
std::string ClickDataJson(const ClickDataSpec& spec, const ClickOracle& oracle);

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_CLICK_GENERATOR_H_
