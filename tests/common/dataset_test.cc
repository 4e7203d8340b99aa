#include "common/dataset.h"

#include <unistd.h>
#include <zlib.h>

#include <cstdlib>
#include <set>

#include "absl/strings/match.h"
#include "common/job_spec.h"
#include "gtest/gtest.h"
#include "tests/test_util.h"
#include "worker/in_process.h"

namespace pstrain {
namespace {

class DatasetTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/pstrain-dataset-test.XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { std::system(("rm -rf " + dir_).c_str()); }

  std::string WriteGz(const std::string& name, const std::string& bytes, bool truncate_gzip) {
    const std::string path = dir_ + "/" + name;
    gzFile f = gzopen(path.c_str(), "wb");
    gzwrite(f, bytes.data(), bytes.size());
    gzclose(f);
    if (truncate_gzip) {
      // Cut the compressed stream itself in half.
      FILE* fp = fopen(path.c_str(), "rb");
      fseek(fp, 0, SEEK_END);
      const long size = ftell(fp);
      fclose(fp);
      truncate(path.c_str(), size / 2);
    }
    return path;
  }

  static std::string Idx(uint32_t magic, std::vector<uint32_t> dims, size_t payload) {
    std::string s;
    auto put = [&s](uint32_t v) {
      for (int i = 3; i >= 0; --i) s += static_cast<char>((v >> (8 * i)) & 0xff);
    };
    put(magic);
    for (uint32_t d : dims) put(d);
    s.append(payload, '\x01');
    return s;
  }

  std::string dir_;
};

TEST_F(DatasetTest, ReadsFashionMnist) {
  absl::StatusOr<Dataset> train = LoadFashionMnist(testing::kFashionDir, true);
  PSTRAIN_ASSERT_OK(train);
  EXPECT_EQ(train->num_samples, 60000);
  EXPECT_EQ(train->input_dim, 784);
  std::vector<int> per_class(10, 0);
  for (int32_t label : train->labels) ++per_class[label];
  for (int count : per_class) EXPECT_EQ(count, 6000);
  absl::StatusOr<Dataset> test = LoadFashionMnist(testing::kFashionDir, false);
  PSTRAIN_ASSERT_OK(test);
  EXPECT_EQ(test->num_samples, 10000);
}

TEST_F(DatasetTest, SmallValidFile) {
  const std::string images = WriteGz("i.gz", Idx(0x803, {3, 2, 2}, 12), false);
  const std::string labels = WriteGz("l.gz", Idx(0x801, {3}, 3), false);
  absl::StatusOr<Dataset> d = LoadIdx(images, labels, 10);
  PSTRAIN_ASSERT_OK(d);
  EXPECT_EQ(d->num_samples, 3);
  EXPECT_EQ(d->input_dim, 4);
}

TEST_F(DatasetTest, ClearErrors) {
  const std::string labels = WriteGz("l.gz", Idx(0x801, {3}, 3), false);
  struct Case {
    std::string images;
    const char* message;
  } cases[] = {
      {WriteGz("magic.gz", Idx(0x801, {3, 2, 2}, 12), false), "wrong magic"},
      {WriteGz("short.gz", Idx(0x803, {3, 2, 2}, 11), false), "truncated"},
      {WriteGz("header.gz", "\x00\x00\x08", false), "truncated"},
      {WriteGz("gz.gz", Idx(0x803, {300, 28, 28}, 300 * 784), true), "truncated gzip"},
      {WriteGz("count.gz", Idx(0x803, {2, 2, 2}, 8), false), "labels"},
      {dir_ + "/missing.gz", "No such file"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<Dataset> d = LoadIdx(c.images, labels, 10);
    ASSERT_FALSE(d.ok()) << c.images;
    EXPECT_TRUE(absl::StrContains(d.status().message(), c.message)) << d.status();
    EXPECT_TRUE(absl::StrContains(d.status().message(), c.images)) << d.status();
  }
}

// A data directory whose files do not fit the job is refused before a
// step reads past them: fewer training samples than the epochs are planned
// for, or images of another size than the model's input.
TEST_F(DatasetTest, DataThatDoesNotFitTheJobIsRefused) {
  v1::JobSpec job;
  job.mutable_model()->set_type(v1::MODEL_TYPE_SOFTMAX);
  job.mutable_optimizer()->set_type(v1::OPTIMIZER_TYPE_SGD);
  job.mutable_optimizer()->set_learning_rate(0.1f);
  job.set_batch_size(8);
  job.set_steps(10);
  job.set_num_servers(1);
  job.set_num_workers(1);
  absl::StatusOr<v1::JobSpec> spec = NormalizeJobSpec(job);
  PSTRAIN_ASSERT_OK(spec);
  struct Case {
    std::vector<uint32_t> image_dims;
    const char* message;
  } cases[] = {
      {{100, 28, 28}, "the training set has 100 samples; the job's epochs are planned for 60000"},
      {{20, 2, 2}, "the training set's images have 4 values; the model takes 784"},
  };
  for (const Case& c : cases) {
    const uint32_t n = c.image_dims[0];
    const std::string images =
        WriteGz("i.gz", Idx(0x803, c.image_dims, size_t{n} * c.image_dims[1] * c.image_dims[2]),
                false);
    const std::string labels = WriteGz("l.gz", Idx(0x801, {n}, n), false);
    absl::StatusOr<Dataset> data = LoadIdx(images, labels, 10);
    PSTRAIN_ASSERT_OK(data);
    absl::Status fits = CheckDataFitsJob(*spec, *data, /*train=*/true);
    EXPECT_EQ(fits.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(fits.message(), std::string("data.dir: ") + c.message);
    absl::StatusOr<std::vector<float>> trained = worker::TrainInProcess(*spec, 10, *data);
    EXPECT_EQ(trained.status(), fits);
  }
  absl::StatusOr<Dataset> real = LoadFashionMnist(testing::kFashionDir, true);
  PSTRAIN_ASSERT_OK(real);
  PSTRAIN_EXPECT_OK(CheckDataFitsJob(*spec, *real, /*train=*/true));
}

TEST(EpochOrderTest, PermutationThatDependsOnSeedAndEpoch) {
  const std::vector<int64_t> a = EpochOrder(1, 0, 1000);
  EXPECT_EQ(std::set<int64_t>(a.begin(), a.end()).size(), 1000u);
  EXPECT_EQ(*std::min_element(a.begin(), a.end()), 0);
  EXPECT_EQ(*std::max_element(a.begin(), a.end()), 999);
  EXPECT_EQ(a, EpochOrder(1, 0, 1000));
  EXPECT_NE(a, EpochOrder(1, 1, 1000));
  EXPECT_NE(a, EpochOrder(2, 0, 1000));
}

}  // namespace
}  // namespace pstrain
