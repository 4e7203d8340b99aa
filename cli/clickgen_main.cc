// pstrain-clickgen: writes generated click logs in Criteo's layout, with a
// planted model whose AUC it prints (see docs/click-data.md).
//
//   pstrain-clickgen --out DIR [--train_rows N --vocabulary V --zipf S ...]
//
// DIR gets train.txt and test.txt (.txt.gz with --gzip) and clicks.json,
// the parameters and the oracle; the same line is printed.
#include <cstdio>
#include <iostream>

#include "absl/flags/flag.h"
#include "common/click_generator.h"
#include "common/init.h"

namespace {
const pstrain::ClickDataSpec kDefaults;
}  // namespace

ABSL_FLAG(std::string, out, "", "directory to write (created if missing)");
ABSL_FLAG(bool, gzip, false, "write train.txt.gz and test.txt.gz");
ABSL_FLAG(uint64_t, seed, kDefaults.seed, "the data's seed: the same flags give the same files");
ABSL_FLAG(int64_t, train_rows, kDefaults.train_rows, "lines of train.txt");
ABSL_FLAG(int64_t, test_rows, kDefaults.test_rows, "lines of test.txt");
ABSL_FLAG(int, dense, kDefaults.layout.dense, "integer features per line");
ABSL_FLAG(int, fields, kDefaults.layout.fields, "categorical features (fields) per line");
ABSL_FLAG(int64_t, vocabulary, kDefaults.vocabulary, "distinct tokens per field, up to 2^32");
ABSL_FLAG(double, zipf, kDefaults.zipf, "Zipf exponent of the tokens' ranks");
ABSL_FLAG(int, max_values, kDefaults.max_values,
          "tokens per field, 1..max_values (more than 1: the multi-valued extension)");
ABSL_FLAG(double, missing, kDefaults.missing, "chance that a feature is empty");
ABSL_FLAG(double, token_weight, kDefaults.token_weight,
          "deviation of the planted per-token weights");
ABSL_FLAG(double, dense_weight, kDefaults.dense_weight,
          "deviation of the planted integer features' weights");
ABSL_FLAG(double, bias, kDefaults.bias, "the planted model's bias (sets the click rate)");

int main(int argc, char** argv) {
  pstrain::InitMain(argc, argv, "pstrain-clickgen --out DIR [flags]");
  if (absl::GetFlag(FLAGS_out).empty())
    pstrain::ExitForBadFlag("pstrain-clickgen", "--out is required");
  pstrain::ClickDataSpec spec;
  spec.seed = absl::GetFlag(FLAGS_seed);
  spec.train_rows = absl::GetFlag(FLAGS_train_rows);
  spec.test_rows = absl::GetFlag(FLAGS_test_rows);
  spec.layout = {.dense = absl::GetFlag(FLAGS_dense), .fields = absl::GetFlag(FLAGS_fields)};
  spec.vocabulary = absl::GetFlag(FLAGS_vocabulary);
  spec.zipf = absl::GetFlag(FLAGS_zipf);
  spec.max_values = absl::GetFlag(FLAGS_max_values);
  spec.missing = absl::GetFlag(FLAGS_missing);
  spec.token_weight = absl::GetFlag(FLAGS_token_weight);
  spec.dense_weight = absl::GetFlag(FLAGS_dense_weight);
  spec.bias = absl::GetFlag(FLAGS_bias);
  if (absl::Status valid = pstrain::CheckClickDataSpec(spec); !valid.ok()) {
    pstrain::ExitForBadFlag("pstrain-clickgen", valid.message());
  }
  absl::StatusOr<pstrain::ClickOracle> oracle =
      pstrain::WriteClickData(spec, absl::GetFlag(FLAGS_out), absl::GetFlag(FLAGS_gzip));
  if (!oracle.ok()) {
    std::cerr << "pstrain-clickgen: " << oracle.status().message() << "\n";
    return 1;
  }
  std::cout << pstrain::ClickDataJson(spec, *oracle) << std::endl;
  return 0;
}
