#include "common/click_generator.h"

#include <zlib.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <numbers>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/files.h"
#include "common/random.h"
#include "common/roc_auc.h"

namespace pstrain {
namespace {

constexpr double kDenseCenter = 3.0;
constexpr double kDenseSpread = 6.0;  // v = log(1 + x) is spread over [0, 6)

// murmur3's 32-bit finalizer: a bijection of 32-bit words.
uint32_t Scramble32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x85ebca6bU;
  x ^= x >> 13;
  x *= 0xc2b2ae35U;
  return x ^ (x >> 16);
}

// A standard normal drawn from a hash word (Box-Muller).
double NormalFromHash(uint64_t hash) {
  const double u1 = UnitDouble(Mix64(hash));
  const double u2 = UnitDouble(Mix64(hash ^ 0x5851f42d4c957f2dULL));
  return std::sqrt(-2.0 * std::log1p(-u1)) * std::cos(2.0 * std::numbers::pi * u2);
}

// log1p(x) / x and expm1(x) / x, 1 at 0.
double Log1pOverX(double x) { return std::abs(x) > 1e-8 ? std::log1p(x) / x : 1.0 - x / 2; }
double Expm1OverX(double x) { return std::abs(x) > 1e-8 ? std::expm1(x) / x : 1.0 + x / 2; }

double Sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

absl::Status OutOfRange(absl::string_view name, double value, absl::string_view range) {
  return absl::InvalidArgumentError(absl::StrCat(name, " ", value, " is outside ", range));
}

// Writes lines to a plain or gzip file under a temporary name, renamed to
// its own when closed without an error.
class LineWriter {
 public:
  static absl::StatusOr<std::unique_ptr<LineWriter>> Open(const std::string& path, bool gzip) {
    const std::string temporary = path + ".partial";
    if (gzip) {
      gzFile file = gzopen(temporary.c_str(), "wb1");
      if (file == nullptr) return Error(temporary);
      return std::unique_ptr<LineWriter>(new LineWriter(path, file, nullptr));
    }
    FILE* file = std::fopen(temporary.c_str(), "wb");
    if (file == nullptr) return Error(temporary);
    return std::unique_ptr<LineWriter>(new LineWriter(path, nullptr, file));
  }
  ~LineWriter() {
    if (gz_ != nullptr) gzclose(gz_);
    if (plain_ != nullptr) std::fclose(plain_);
  }

  absl::Status Write(const std::string& text) {
    const bool ok = gz_ != nullptr
                        ? gzwrite(gz_, text.data(), text.size()) == static_cast<int>(text.size())
                        : std::fwrite(text.data(), 1, text.size(), plain_) == text.size();
    return ok ? absl::OkStatus() : Error(path_ + ".partial");
  }

  absl::Status Close() {
    const bool ok = gz_ != nullptr ? gzclose(gz_) == Z_OK : std::fclose(plain_) == 0;
    gz_ = nullptr;
    plain_ = nullptr;
    if (!ok) return Error(path_ + ".partial");
    std::error_code error;
    std::filesystem::rename(path_ + ".partial", path_, error);
    if (error) return absl::InternalError(absl::StrCat(path_, ": ", error.message()));
    return absl::OkStatus();
  }

 private:
  LineWriter(std::string path, gzFile gz, FILE* plain)
      : path_(std::move(path)), gz_(gz), plain_(plain) {}
  static absl::Status Error(const std::string& path) {
    return absl::InternalError(absl::StrCat(path, ": ", std::strerror(errno)));
  }

  const std::string path_;
  gzFile gz_;
  FILE* plain_;
};

absl::Status WriteSplit(const ClickGenerator& generator, ClickSplit split, int64_t rows,
                        const std::string& path, bool gzip, const ClickLayout& layout) {
  absl::StatusOr<std::unique_ptr<LineWriter>> writer = LineWriter::Open(path, gzip);
  if (!writer.ok()) return writer.status();
  ClickBatch batch;
  batch.layout = layout;
  std::string text;
  for (int64_t i = 0; i < rows; ++i) {
    generator.Generate(split, i, batch, &text);
    if (text.size() >= (size_t{1} << 20) || i + 1 == rows) {
      absl::Status written = (*writer)->Write(text);
      if (!written.ok()) return written;
      text.clear();
      batch.Clear();
    }
  }
  return (*writer)->Close();
}

}  // namespace

absl::Status CheckClickDataSpec(const ClickDataSpec& spec) {
  if (spec.train_rows < 1) return OutOfRange("train_rows", spec.train_rows, "[1, 2^63)");
  if (spec.test_rows < 1) return OutOfRange("test_rows", spec.test_rows, "[1, 2^63)");
  if (spec.layout.dense < 0 || spec.layout.dense > 1000) {
    return OutOfRange("dense", spec.layout.dense, "[0, 1000]");
  }
  if (spec.layout.fields < 1 || spec.layout.fields > 1000) {
    return OutOfRange("fields", spec.layout.fields, "[1, 1000]");
  }
  if (spec.vocabulary < 1 || spec.vocabulary > (int64_t{1} << 32)) {
    return OutOfRange("vocabulary", spec.vocabulary, "[1, 2^32]");
  }
  if (!(spec.zipf > 0 && spec.zipf <= 10)) return OutOfRange("zipf", spec.zipf, "(0, 10]");
  if (spec.max_values < 1 || spec.max_values > 1000) {
    return OutOfRange("max_values", spec.max_values, "[1, 1000]");
  }
  if (!(spec.missing >= 0 && spec.missing < 1))
    return OutOfRange("missing", spec.missing, "[0, 1)");
  if (!(spec.token_weight >= 0 && spec.token_weight <= 100)) {
    return OutOfRange("token_weight", spec.token_weight, "[0, 100]");
  }
  if (!(spec.dense_weight >= 0 && spec.dense_weight <= 100)) {
    return OutOfRange("dense_weight", spec.dense_weight, "[0, 100]");
  }
  if (!(std::abs(spec.bias) <= 100)) return OutOfRange("bias", spec.bias, "[-100, 100]");
  return absl::OkStatus();
}

ClickGenerator::ClickGenerator(const ClickDataSpec& spec) : spec_(spec) {
  for (int i = 0; i < spec.layout.dense; ++i) {
    dense_weights_.push_back(spec.dense_weight *
                             NormalFromHash(Mix64(spec.seed) ^ Mix64(0xdea5e000ULL + i)));
  }
  for (int f = 0; f < spec.layout.fields; ++f) {
    field_salts_.push_back(static_cast<uint32_t>(Mix64(Mix64(spec.seed) + 0xf1e1d000ULL + f)));
  }
  const double n = static_cast<double>(spec.vocabulary);
  h_of_first_ = H(1.5) - 1.0;
  h_of_last_ = H(n + 0.5);
  accept_width_ = 2.0 - HInverse(H(2.5) - std::pow(2.0, -spec.zipf));
}

// H(x) = integral of t^-zipf from 1 to x (log x at zipf 1).
double ClickGenerator::H(double x) const {
  const double log_x = std::log(x);
  return Expm1OverX((1.0 - spec_.zipf) * log_x) * log_x;
}

double ClickGenerator::HInverse(double x) const {
  const double t = std::max((1.0 - spec_.zipf) * x, -1.0);
  return std::exp(Log1pOverX(t) * x);
}

uint64_t ClickGenerator::ZipfRank(uint64_t& state) const {
  const double last = static_cast<double>(spec_.vocabulary);
  while (true) {
    const double u = h_of_last_ + UnitDouble(SplitMix64(state)) * (h_of_first_ - h_of_last_);
    const double x = HInverse(u);
    const double k = std::clamp(std::floor(x + 0.5), 1.0, last);
    if (k - x <= accept_width_ || u >= H(k + 0.5) - std::pow(k, -spec_.zipf)) {
      return static_cast<uint64_t>(k);
    }
  }
}

uint64_t ClickGenerator::TokenKey(int field, uint64_t rank) const {
  return Scramble32(static_cast<uint32_t>(rank - 1) + field_salts_[field]);
}

double ClickGenerator::TokenWeight(int field, uint64_t rank) const {
  return spec_.token_weight * NormalFromHash(Mix64(spec_.seed ^ 0x70ce4000ULL) ^
                                             Mix64((uint64_t{1} << 40) * field + rank));
}

ClickGenerator::Planted ClickGenerator::Generate(ClickSplit split, int64_t index, ClickBatch& batch,
                                                 std::string* line) const {
  uint64_t state = Mix64(Mix64(spec_.seed) + (static_cast<uint64_t>(split) << 62) +
                         static_cast<uint64_t>(index));
  Planted planted;
  planted.dense_logit = spec_.bias;
  std::string dense_text;
  for (int i = 0; i < spec_.layout.dense; ++i) {
    const bool missing = UnitDouble(SplitMix64(state)) < spec_.missing;
    const int64_t x =
        static_cast<int64_t>(std::floor(std::expm1(kDenseSpread * UnitDouble(SplitMix64(state)))));
    const float value = missing ? 0.0f : DenseFeatureValue(x);
    batch.dense.push_back(value);
    if (!missing) planted.dense_logit += dense_weights_[i] * (value - kDenseCenter);
    if (line != nullptr) {
      dense_text.push_back('\t');
      if (!missing) absl::StrAppend(&dense_text, x);
    }
  }
  planted.logit = planted.dense_logit;
  std::string fields_text;
  for (int f = 0; f < spec_.layout.fields; ++f) {
    const bool missing = UnitDouble(SplitMix64(state)) < spec_.missing;
    const int count = missing
                          ? 0
                          : 1 + static_cast<int>(BelowN(SplitMix64(state),
                                                        static_cast<uint64_t>(spec_.max_values)));
    if (line != nullptr) fields_text.push_back('\t');
    double weights = 0;
    for (int v = 0; v < count; ++v) {
      const uint64_t rank = ZipfRank(state);
      const uint64_t key = TokenKey(f, rank);
      batch.keys.push_back(key);
      weights += TokenWeight(f, rank);
      if (line != nullptr) {
        if (v > 0) fields_text.push_back(',');
        absl::StrAppend(&fields_text, absl::Hex(key, absl::kZeroPad8));
      }
    }
    batch.bag_starts.push_back(static_cast<int64_t>(batch.keys.size()));
    if (count > 0) planted.logit += weights / count;
  }
  const bool clicked = UnitDouble(SplitMix64(state)) < Sigmoid(planted.logit);
  batch.labels.push_back(clicked ? 1.0f : 0.0f);
  if (line != nullptr) absl::StrAppend(line, clicked ? "1" : "0", dense_text, fields_text, "\n");
  return planted;
}

ClickOracle MeasureClickOracle(const ClickDataSpec& spec) {
  const ClickGenerator generator(spec);
  ClickBatch batch;
  batch.layout = spec.layout;
  std::vector<double> logits;
  std::vector<double> dense_logits;
  std::vector<float> labels;
  for (int64_t i = 0; i < spec.test_rows; ++i) {
    const ClickGenerator::Planted planted = generator.Generate(ClickSplit::kTest, i, batch);
    logits.push_back(planted.logit);
    dense_logits.push_back(planted.dense_logit);
    labels.push_back(batch.labels.back());
    batch.Clear();
  }
  ClickOracle oracle;
  oracle.auc = RocAuc(logits, labels);
  oracle.dense_only_auc = RocAuc(dense_logits, labels);
  oracle.log_loss = MeanLogLoss(logits, labels);
  double positives = 0;
  for (float label : labels) positives += label;
  oracle.positive_rate = positives / static_cast<double>(labels.size());
  return oracle;
}

std::string ClickDataJson(const ClickDataSpec& spec, const ClickOracle& oracle) {
  return absl::StrFormat(
      "{\"seed\": %d, \"train_rows\": %d, \"test_rows\": %d, \"dense\": %d, \"fields\": %d, "
      "\"vocabulary\": %d, \"zipf\": %.17g, \"max_values\": %d, \"missing\": %.17g, "
      "\"token_weight\": %.17g, \"dense_weight\": %.17g, \"bias\": %.17g, "
      "\"oracle_auc\": %.6f, \"dense_only_oracle_auc\": %.6f, \"oracle_log_loss\": %.6f, "
      "\"positive_rate\": %.6f}",
      spec.seed, spec.train_rows, spec.test_rows, spec.layout.dense, spec.layout.fields,
      spec.vocabulary, spec.zipf, spec.max_values, spec.missing, spec.token_weight,
      spec.dense_weight, spec.bias, oracle.auc, oracle.dense_only_auc, oracle.log_loss,
      oracle.positive_rate);
}

absl::StatusOr<ClickOracle> WriteClickData(const ClickDataSpec& spec, const std::string& dir,
                                           bool gzip) {
  if (absl::Status valid = CheckClickDataSpec(spec); !valid.ok()) return valid;
  std::error_code error;
  std::filesystem::create_directories(dir, error);
  if (error) return absl::InternalError(absl::StrCat(dir, ": ", error.message()));
  const ClickGenerator generator(spec);
  const std::string suffix = gzip ? ".txt.gz" : ".txt";
  for (const auto& [split, rows, name] : {std::tuple{ClickSplit::kTrain, spec.train_rows, "train"},
                                          std::tuple{ClickSplit::kTest, spec.test_rows, "test"}}) {
    absl::Status written =
        WriteSplit(generator, split, rows, absl::StrCat(dir, "/", name, suffix), gzip, spec.layout);
    if (!written.ok()) return written;
  }
  const ClickOracle oracle = MeasureClickOracle(spec);
  absl::Status written =
      WriteFileAtomically(dir + "/clicks.json", ClickDataJson(spec, oracle) + "\n");
  if (!written.ok()) return written;
  return oracle;
}

}  // namespace pstrain
