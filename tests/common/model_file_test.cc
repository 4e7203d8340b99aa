#include "common/model_file.h"

#include "absl/strings/match.h"
#include "common/job_spec.h"
#include "gtest/gtest.h"
#include "tests/test_util.h"

namespace pstrain {
namespace {

v1::JobSpec Spec() {
  v1::JobSpec spec = *ParseJobSpecYaml(R"(
model: {type: mlp, hidden: [16]}
optimizer: {type: sgd, learning_rate: 0.1}
batch_size: 8
steps: 1
num_servers: 1
num_workers: 1
)");
  return *NormalizeJobSpec(spec);
}

TEST(ModelFileTest, RoundTrip) {
  const v1::JobSpec spec = Spec();
  std::vector<float> params(kernels::NumParams(ModelShapeOf(spec)));
  for (size_t i = 0; i < params.size(); ++i) params[i] = 0.001f * i - 3.0f;
  absl::StatusOr<ModelFile> file = DecodeModelFile(EncodeModelFile("job-7", spec, params));
  PSTRAIN_ASSERT_OK(file);
  EXPECT_EQ(file->header.job_id(), "job-7");
  EXPECT_EQ(file->params, params);
  ASSERT_EQ(file->header.tensors_size(), 4);
  EXPECT_EQ(file->header.tensors(0).name(), "layer0.weight");
}

TEST(ModelFileTest, DamageIsReportedNotTrusted) {
  const v1::JobSpec spec = Spec();
  std::vector<float> params(kernels::NumParams(ModelShapeOf(spec)), 0.5f);
  const std::string good = EncodeModelFile("job-7", spec, params);
  struct Case {
    std::string bytes;
    const char* message;
  };
  std::string flipped = good;
  flipped[flipped.size() - 3] ^= 0x40;
  std::string magic = good;
  magic[0] = 'X';
  std::string version = good;
  version[4] = 9;
  v1::JobSpec other = spec;
  other.mutable_model()->set_hidden(0, 17);
  const std::string mismatched = EncodeModelFile("job-7", other, params);  // sizes disagree
  const Case cases[] = {
      {flipped, "checksum"},
      {good.substr(0, good.size() - 1), "payload"},
      {good.substr(0, 20), "truncated"},
      {good.substr(0, 5), "truncated"},
      {magic, "not a pstrain model file"},
      {version, "version"},
      {mismatched, "match"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<ModelFile> file = DecodeModelFile(c.bytes);
    ASSERT_FALSE(file.ok()) << c.message;
    EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StrContains(file.status().message(), c.message)) << file.status();
  }
}

}  // namespace
}  // namespace pstrain
