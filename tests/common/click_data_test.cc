#include "common/click_data.h"

#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/click_generator.h"
#include "common/files.h"
#include "common/roc_auc.h"
#include "gtest/gtest.h"
#include "tests/test_util.h"

namespace pstrain {
namespace {

class ClickDataTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/pstrain-click-test.XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { std::system(("rm -rf " + dir_).c_str()); }

  std::string Write(const std::string& name, const std::string& text, bool gzip = false) {
    const std::string path = dir_ + "/" + name;
    if (gzip) {
      gzFile f = gzopen(path.c_str(), "wb");
      gzwrite(f, text.data(), text.size());
      gzclose(f);
    } else {
      std::ofstream(path) << text;
    }
    return path;
  }

  // Lines "label \t id \t id-as-token \t id%7" of a layout of 1 dense
  // feature and 2 fields: every line is told apart by its first key.
  static std::string NumberedLines(int64_t first, int64_t n) {
    std::string text;
    for (int64_t id = first; id < first + n; ++id) {
      absl::StrAppend(&text, id % 3 == 0 ? "1" : "0", "\t", id, "\t", absl::Hex(id), "\t",
                      absl::Hex(id % 7), "\n");
    }
    return text;
  }
  static constexpr ClickLayout kSmall{.dense = 1, .fields = 2};

  // The first keys of the samples a stream gives worker w of `workers`,
  // global batch after global batch, until the epoch ends.
  std::vector<std::vector<uint64_t>> WorkerBatches(const ClickStreamOptions& options, int w,
                                                   int workers, int batch) {
    auto stream = ClickStream::Open(options);
    EXPECT_TRUE(stream.ok()) << stream.status();
    std::vector<std::vector<uint64_t>> batches;
    const int64_t global = int64_t{batch} * workers;
    for (int64_t t = 0;; ++t) {
      absl::StatusOr<int64_t> available = (*stream)->Available((t + 1) * global);
      EXPECT_TRUE(available.ok()) << available.status();
      if (*available < (t + 1) * global) break;
      ClickBatch samples;
      samples.layout = options.layout;
      EXPECT_TRUE((*stream)->Read(t * global + int64_t{w} * batch, batch, samples).ok());
      std::vector<uint64_t> ids;
      for (int64_t s = 0; s < samples.size(); ++s)
        ids.push_back(samples.keys[samples.bag_starts[2 * s]]);
      batches.push_back(ids);
    }
    return batches;
  }

  std::string dir_;
};

TEST_F(ClickDataTest, ACriteoLineParsesWithItsEmptyColumns) {
  // Criteo's layout: 13 integers, 26 categories; empty ones and a negative integer.
  std::vector<std::string> columns = {"1", "5", "", "-3", "0"};
  for (int i = 5; i <= 13; ++i) columns.push_back(absl::StrCat(i * 10));
  for (int f = 0; f < 26; ++f)
    columns.push_back(f == 7 ? "" : absl::StrCat(absl::Hex(0x68fd1e64 + f)));
  columns.back() += "\r";
  ClickBatch batch;
  PSTRAIN_ASSERT_OK(ParseClickLine(absl::StrJoin(columns, "\t"), batch));
  ASSERT_EQ(batch.size(), 1);
  EXPECT_EQ(batch.labels[0], 1.0f);
  ASSERT_EQ(batch.dense.size(), 13u);
  EXPECT_FLOAT_EQ(batch.dense[0], std::log1p(5.0f));
  EXPECT_EQ(batch.dense[1], 0.0f);  // empty
  EXPECT_EQ(batch.dense[2], 0.0f);  // negative
  EXPECT_EQ(batch.dense[3], 0.0f);
  ASSERT_EQ(batch.bag_starts.size(), 27u);
  EXPECT_EQ(batch.keys.size(), 25u);
  EXPECT_EQ(batch.bag_starts[8] - batch.bag_starts[7], 0);
  EXPECT_EQ(batch.keys[0], 0x68fd1e64u);
  EXPECT_EQ(batch.keys.back(), 0x68fd1e64u + 25);
}

TEST_F(ClickDataTest, AMultiValuedFieldIsABagOfKeys) {
  ClickBatch batch;
  batch.layout = kSmall;
  PSTRAIN_ASSERT_OK(ParseClickLine("0\t7\ta,B,ffffffffffffffff\t", batch));
  EXPECT_EQ(batch.keys, (std::vector<uint64_t>{0xa, 0xb, ~uint64_t{0}}));
  EXPECT_EQ(batch.bag_starts, (std::vector<int64_t>{0, 3, 3}));
}

TEST_F(ClickDataTest, ABadLineIsRefusedNamingItsColumnAndChangesNothing) {
  ClickBatch batch;
  batch.layout = kSmall;
  PSTRAIN_ASSERT_OK(ParseClickLine("1\t2\tab\tcd", batch));
  const ClickBatch before = batch;
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"", "1 tab-separated columns, expected 4"},
      {"1\t2\tab", "3 tab-separated columns"},
      {"1\t2\tab\tcd\tef", "5 tab-separated columns"},
      {"2\t2\tab\tcd", "column 1 (label): \"2\" is not 0 or 1"},
      {"1\t2x\tab\tcd", "column 2 (integer feature 1): \"2x\" is not a 64-bit integer"},
      {"1\t99999999999999999999\tab\tcd", "is not a 64-bit integer"},
      {"1\t2\tzz\tcd", "column 3 (categorical feature 1): \"zz\" is not a token"},
      {"1\t2\tab\t12345678901234567", "column 4 (categorical feature 2)"},
      {"1\t2\ta,,b\tcd", "\"\" is not a token"},
      {"1\t2\tab,\tcd", "\"\" is not a token"},
      {"1\t2\t-1\tcd", "\"-1\" is not a token"},
  };
  for (const auto& [line, message] : cases) {
    const absl::Status status = ParseClickLine(line, batch);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << line;
    EXPECT_TRUE(absl::StrContains(status.message(), message)) << status << " for " << line;
    EXPECT_EQ(batch, before) << line;
  }
}

TEST_F(ClickDataTest, WorkersTogetherReadWhatOneProcessReadsOfEveryGlobalBatch) {
  // Three files, the middle one gzip, windows of 16 lines across them.
  ClickStreamOptions options{.files = {Write("a.txt", NumberedLines(0, 50)),
                                       Write("b.txt.gz", NumberedLines(50, 37), true),
                                       Write("c.txt", NumberedLines(87, 20))},
                             .layout = kSmall,
                             .seed = 5,
                             .epoch = 2,
                             .shuffle_window = 16};
  const auto one = WorkerBatches(options, 0, 1, 12);
  ASSERT_EQ(one.size(), 107u / 12);  // the last 11 lines do not fill a global batch
  std::set<uint64_t> seen;
  for (const auto& batch : one) seen.insert(batch.begin(), batch.end());
  EXPECT_EQ(seen.size(), 96u);  // no line twice
  for (int workers : {2, 3, 4}) {
    std::vector<std::vector<std::vector<uint64_t>>> each;
    for (int w = 0; w < workers; ++w)
      each.push_back(WorkerBatches(options, w, workers, 12 / workers));
    for (size_t t = 0; t < one.size(); ++t) {
      std::vector<uint64_t> together;
      for (int w = 0; w < workers; ++w) {
        ASSERT_EQ(each[w].size(), one.size()) << workers << " workers";
        together.insert(together.end(), each[w][t].begin(), each[w][t].end());
      }
      EXPECT_EQ(together, one[t]) << workers << " workers, global batch " << t;
    }
  }
}

TEST_F(ClickDataTest, TheOrderIsAWindowedShuffleDrawnFromSeedAndEpoch) {
  ClickStreamOptions options{.files = {Write("a.txt", NumberedLines(0, 64))},
                             .layout = kSmall,
                             .seed = 1,
                             .shuffle_window = 16};
  const auto epoch0 = WorkerBatches(options, 0, 1, 64)[0];
  // Each window of 16 lines stays in its place, its lines permuted.
  for (int k = 0; k < 4; ++k) {
    std::vector<uint64_t> window(epoch0.begin() + 16 * k, epoch0.begin() + 16 * (k + 1));
    EXPECT_FALSE(std::is_sorted(window.begin(), window.end())) << "window " << k;
    std::sort(window.begin(), window.end());
    for (int i = 0; i < 16; ++i) EXPECT_EQ(window[i], uint64_t(16 * k + i));
  }
  EXPECT_EQ(WorkerBatches(options, 0, 1, 64)[0], epoch0);  // the same again
  options.epoch = 1;
  EXPECT_NE(WorkerBatches(options, 0, 1, 64)[0], epoch0);
  options.epoch = 0;
  options.seed = 2;
  EXPECT_NE(WorkerBatches(options, 0, 1, 64)[0], epoch0);
  options.shuffle_window = 0;
  std::vector<uint64_t> file_order(64);
  for (int i = 0; i < 64; ++i) file_order[i] = i;
  EXPECT_EQ(WorkerBatches(options, 0, 1, 64)[0], file_order);
}

TEST_F(ClickDataTest, PlainAndGzipFilesReadTheSame) {
  const std::string text = NumberedLines(0, 300);
  PSTRAIN_ASSERT_OK_AND_ASSIGN(ClickBatch plain, ReadClickFiles({Write("p.txt", text)}, kSmall));
  PSTRAIN_ASSERT_OK_AND_ASSIGN(ClickBatch gzip,
                               ReadClickFiles({Write("g.gz", text, true)}, kSmall));
  EXPECT_EQ(plain.size(), 300);
  EXPECT_EQ(plain, gzip);
  PSTRAIN_ASSERT_OK_AND_ASSIGN(ClickBatch first, ReadClickFiles({Write("p.txt", text)}, kSmall, 7));
  EXPECT_EQ(first.size(), 7);
  // A last line without its newline is a line.
  PSTRAIN_ASSERT_OK_AND_ASSIGN(ClickBatch unterminated,
                               ReadClickFiles({Write("u.txt", "1\t2\tab\tcd")}, kSmall));
  EXPECT_EQ(unterminated.size(), 1);
}

TEST_F(ClickDataTest, BadFilesAreRefusedNamingTheFileAndLine) {
  EXPECT_EQ(ReadClickFiles({dir_ + "/missing.txt"}, kSmall).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(ReadClickFiles({}, kSmall).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ReadClickFiles({dir_}, kSmall).status().code(), absl::StatusCode::kInvalidArgument);

  const std::string bad =
      Write("bad.txt", NumberedLines(0, 5) + "1\t2\tab\n" + NumberedLines(5, 5));
  absl::Status status = ReadClickFiles({bad}, kSmall).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(status.message(), "bad.txt:6: 3 tab-separated columns")) << status;

  std::string long_line(kMaxClickLineBytes + 10, 'a');
  status =
      ReadClickFiles({Write("long.txt", NumberedLines(0, 2) + long_line + "\n")}, kSmall).status();
  EXPECT_TRUE(absl::StrContains(status.message(), "long.txt:3: line longer than")) << status;

  const std::string gz = Write("cut.gz", NumberedLines(0, 20000), true);
  PSTRAIN_ASSERT_OK_AND_ASSIGN(std::string bytes, ReadFile(gz));
  std::ofstream(gz, std::ios::binary | std::ios::trunc) << bytes.substr(0, bytes.size() / 2);
  status = ReadClickFiles({gz}, kSmall).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(status.message(), "corrupt or truncated gzip")) << status;
}

TEST_F(ClickDataTest, AStreamForgetsWhatLiesBehindIt) {
  auto stream = ClickStream::Open(
      {.files = {Write("a.txt", NumberedLines(0, 40))}, .layout = kSmall, .shuffle_window = 8});
  PSTRAIN_ASSERT_OK(stream);
  ClickBatch batch;
  batch.layout = kSmall;
  PSTRAIN_ASSERT_OK((*stream)->Read(20, 4, batch));
  EXPECT_EQ((*stream)->Read(3, 1, batch).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*stream)->Read(38, 3, batch).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(batch.size(), 4);
  PSTRAIN_ASSERT_OK_AND_ASSIGN(int64_t available, (*stream)->Available(1000));
  EXPECT_EQ(available, 40);
}

ClickDataSpec SmallSpec() {
  ClickDataSpec spec;
  spec.train_rows = 2000;
  spec.test_rows = 500;
  spec.layout = {.dense = 3, .fields = 4};
  spec.vocabulary = 100;
  spec.max_values = 3;
  spec.missing = 0.1;
  return spec;
}

TEST_F(ClickDataTest, GeneratedFilesReadBackAsTheGeneratorsSamples) {
  const ClickDataSpec spec = SmallSpec();
  PSTRAIN_ASSERT_OK_AND_ASSIGN(ClickOracle oracle, WriteClickData(spec, dir_ + "/data", true));
  PSTRAIN_ASSERT_OK_AND_ASSIGN(ClickBatch read,
                               ReadClickFiles({dir_ + "/data/train.txt.gz"}, spec.layout));
  ClickBatch generated;
  generated.layout = spec.layout;
  const ClickGenerator generator(spec);
  for (int64_t i = 0; i < spec.train_rows; ++i)
    generator.Generate(ClickSplit::kTrain, i, generated);
  EXPECT_EQ(read, generated);
  // Missing features and several tokens a field occur.
  int64_t empty = 0, multi = 0;
  for (size_t b = 0; b + 1 < generated.bag_starts.size(); ++b) {
    const int64_t n = generated.bag_starts[b + 1] - generated.bag_starts[b];
    empty += n == 0;
    multi += n > 1;
  }
  EXPECT_GT(empty, 0);
  EXPECT_GT(multi, 0);
  PSTRAIN_ASSERT_OK_AND_ASSIGN(std::string json, ReadFile(dir_ + "/data/clicks.json"));
  EXPECT_EQ(json, ClickDataJson(spec, oracle) + "\n");
  EXPECT_TRUE(absl::StrContains(json, "\"oracle_auc\": ")) << json;
  // The same spec writes the same bytes.
  PSTRAIN_ASSERT_OK(WriteClickData(spec, dir_ + "/again", false));
  PSTRAIN_ASSERT_OK_AND_ASSIGN(std::string test, ReadFile(dir_ + "/again/test.txt"));
  PSTRAIN_ASSERT_OK(WriteClickData(spec, dir_ + "/again2", false));
  PSTRAIN_ASSERT_OK_AND_ASSIGN(std::string test2, ReadFile(dir_ + "/again2/test.txt"));
  EXPECT_EQ(test, test2);
  EXPECT_EQ(std::count(test.begin(), test.end(), '\n'), spec.test_rows);
}

TEST_F(ClickDataTest, TokensFollowZipfAndDistinctRanksAreDistinctKeys) {
  ClickDataSpec spec = SmallSpec();
  spec.missing = 0;
  spec.max_values = 1;
  spec.layout = {.dense = 0, .fields = 1};
  spec.vocabulary = 1000;
  spec.zipf = 1.2;
  const ClickGenerator generator(spec);
  std::set<uint64_t> keys;
  for (uint64_t rank = 1; rank <= 1000; ++rank) keys.insert(generator.TokenKey(0, rank));
  EXPECT_EQ(keys.size(), 1000u);
  ClickBatch batch;
  batch.layout = spec.layout;
  const int n = 200000;
  for (int i = 0; i < n; ++i) generator.Generate(ClickSplit::kTrain, i, batch);
  double harmonic = 0;
  for (int r = 1; r <= 1000; ++r) harmonic += std::pow(r, -spec.zipf);
  for (uint64_t rank : {1, 2, 10}) {
    const double expected = std::pow(rank, -spec.zipf) / harmonic;
    const double seen =
        std::count(batch.keys.begin(), batch.keys.end(), generator.TokenKey(0, rank)) / double(n);
    EXPECT_NEAR(seen, expected, 5 * std::sqrt(expected / n)) << "rank " << rank;
  }
  // A vocabulary of 10^8 draws from the whole range.
  spec.vocabulary = 100000000;
  spec.zipf = 0.8;
  const ClickGenerator wide(spec);
  batch.Clear();
  for (int i = 0; i < 1000; ++i) wide.Generate(ClickSplit::kTrain, i, batch);
  EXPECT_GT(std::set<uint64_t>(batch.keys.begin(), batch.keys.end()).size(), 900u);
}

TEST_F(ClickDataTest, TheDenseOnlyOracleIsFarBelowTheFullOracle) {
  ClickDataSpec spec;  // the generator's defaults
  spec.test_rows = 50000;
  const ClickOracle oracle = MeasureClickOracle(spec);
  EXPECT_GT(oracle.auc, 0.75);
  EXPECT_GE(oracle.auc - oracle.dense_only_auc, 0.05);
  EXPECT_GT(oracle.dense_only_auc, 0.6);  // the integer features matter too
  EXPECT_GT(oracle.positive_rate, 0.1);
  EXPECT_LT(oracle.positive_rate, 0.5);
}

TEST_F(ClickDataTest, ASpecOutsideItsRangesIsRefused) {
  const std::vector<std::pair<std::function<void(ClickDataSpec&)>, std::string>> cases = {
      {[](ClickDataSpec& s) { s.train_rows = 0; }, "train_rows"},
      {[](ClickDataSpec& s) { s.vocabulary = (int64_t{1} << 32) + 1; }, "vocabulary"},
      {[](ClickDataSpec& s) { s.zipf = 0; }, "zipf"},
      {[](ClickDataSpec& s) { s.zipf = std::nan(""); }, "zipf"},
      {[](ClickDataSpec& s) { s.missing = 1; }, "missing"},
      {[](ClickDataSpec& s) { s.layout.fields = 0; }, "fields"},
      {[](ClickDataSpec& s) { s.max_values = 0; }, "max_values"},
  };
  for (const auto& [change, name] : cases) {
    ClickDataSpec spec;
    change(spec);
    const absl::Status status = CheckClickDataSpec(spec);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << name;
    EXPECT_TRUE(absl::StrContains(status.message(), name)) << status;
  }
}

TEST(RocAucTest, CountsPairsRankedRightWithTiesOneHalf) {
  EXPECT_DOUBLE_EQ(RocAuc({0.1, 0.4, 0.35, 0.8}, {0, 0, 1, 1}), 0.75);
  EXPECT_DOUBLE_EQ(RocAuc({1, 2, 3}, {0, 1, 1}), 1.0);
  EXPECT_DOUBLE_EQ(RocAuc({3, 2, 1}, {0, 1, 1}), 0.0);
  EXPECT_DOUBLE_EQ(RocAuc({5, 5, 5, 5}, {0, 1, 0, 1}), 0.5);
  EXPECT_DOUBLE_EQ(RocAuc({1, 2, 2, 3}, {0, 0, 1, 1}), 0.875);
  EXPECT_TRUE(std::isnan(RocAuc({1, 2}, {1, 1})));
  EXPECT_NEAR(MeanLogLoss({0.0, 0.0}, {0, 1}), std::log(2.0), 1e-15);
  EXPECT_NEAR(MeanLogLoss({1000.0, -1000.0}, {1, 0}), 0.0, 1e-15);
  EXPECT_NEAR(MeanLogLoss({-1000.0}, {1}), 1000.0, 1e-9);
}

}  // namespace
}  // namespace pstrain
