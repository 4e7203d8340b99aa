// Full and failing disks under real processes: the coordinator's state
// directory on a real tmpfs that fills up, and the servers' checkpoint
// directory full or failing. Nothing crashes, writes are refused, nothing
// acknowledged is lost, and training goes on. (The file-system seam tests
// in tests/server cover every write path in-process; these need root to
// mount a tmpfs, and are skipped where it cannot be.)
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/rpc.h"
#include "gtest/gtest.h"
#include "tests/cluster_util.h"
#include "tests/integration/cluster_fixture.h"
#include "tests/test_util.h"

namespace pstrain::testing {
namespace {

// A tmpfs of `bytes` mounted on a directory of its own; unmounted by the
// destructor.
class SmallTmpfs {
 public:
  SmallTmpfs(const std::string& dir, int64_t bytes) : dir_(dir) {
    mkdir(dir_.c_str(), 0755);
    mounted_ = geteuid() == 0 &&
               mount("tmpfs", dir_.c_str(), "tmpfs", 0,
                     absl::StrCat("size=", bytes).c_str()) == 0;
  }
  ~SmallTmpfs() {
    if (mounted_) umount2(dir_.c_str(), MNT_DETACH);
  }
  bool mounted() const { return mounted_; }
  // Fills what is left with one file.
  void Fill() {
    std::ofstream out(dir_ + "/filler", std::ios::binary);
    const std::string block(4096, 'x');
    while (out.write(block.data(), block.size())) {
    }
  }
  void Empty() { unlink((dir_ + "/filler").c_str()); }

 private:
  const std::string dir_;
  bool mounted_ = false;
};

class DiskFullTest : public ClusterFixture {};

TEST_F(DiskFullTest, ACoordinatorOnAFullDiskRefusesWritesAndLosesNothing) {
  SmallTmpfs disk(dir_.path() + "/disk", 1 << 20);
  if (!disk.mounted()) GTEST_SKIP() << "cannot mount a tmpfs here (needs root)";
  cli::LocalCluster::Options options;
  options.state_dir = dir_.path() + "/disk/state";
  ASSERT_NO_FATAL_FAILURE(StartCluster(0, 0, options));
  const v1::JobSpec spec = MlpSpec(v1::OPTIMIZER_TYPE_ADAM, 1e-3f, 1, 32, 1, 10);
  const std::string kept = Submit(spec);
  ASSERT_FALSE(kept.empty());

  // The disk fills; the job log's last page may still take a few records,
  // then a submission is refused.
  disk.Fill();
  std::vector<std::string> acknowledged = {kept};
  grpc::Status refused;
  for (int i = 0; i < 200 && refused.ok(); ++i) {
    v1::SubmitJobRequest request;
    *request.mutable_spec() = spec;
    v1::SubmitJobResponse response;
    grpc::ClientContext context;
    SetTimeout(context, absl::Seconds(10));
    refused = control_->SubmitJob(&context, request, &response);
    if (refused.ok()) acknowledged.push_back(response.job_id());
  }
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::UNAVAILABLE) << refused.error_message();
  EXPECT_TRUE(absl::StrContains(refused.error_message(), "No space left")) << refused.error_message();
  EXPECT_EQ(Get(kept).state(), v1::JOB_STATE_PENDING) << "reads are served";
  EXPECT_FALSE(cluster_->CheckChildren().has_value()) << "the coordinator is still up";

  disk.Empty();
  acknowledged.push_back(Submit(spec));
  ASSERT_FALSE(acknowledged.back().empty());
  PSTRAIN_ASSERT_OK(cluster_->RestartCoordinator());
  for (const std::string& id : acknowledged) EXPECT_EQ(Get(id).id(), id);
  v1::ListJobsResponse all;
  grpc::ClientContext list_context;
  SetTimeout(list_context, absl::Seconds(10));
  PSTRAIN_ASSERT_OK(control_->ListJobs(&list_context, v1::ListJobsRequest(), &all));
  EXPECT_EQ(all.jobs_size(), static_cast<int>(acknowledged.size()))
      << "every acknowledged job, and no refused one";
}

// Checkpoints that cannot be written (a full disk, or one whose writes
// fail) are lost, not the job: it trains to the end, and no checkpoint is
// counted complete that is not on the disk.
TEST_F(DiskFullTest, CheckpointsThatCannotBeWrittenDoNotStopTraining) {
  SmallTmpfs disk(dir_.path() + "/disk", 64 << 10);  // less than one checkpoint
  if (!disk.mounted()) GTEST_SKIP() << "cannot mount a tmpfs here (needs root)";
  cli::LocalCluster::Options options;
  options.server_flags[1] = {"--fs_fault_injection=io_error:.ckpt"};
  ASSERT_NO_FATAL_FAILURE(StartCluster(2, 2, options));
  for (const std::string& dir : {dir_.path() + "/disk", dir_.path() + "/failing"}) {
    v1::JobSpec spec = MlpSpec(v1::OPTIMIZER_TYPE_ADAM, 1e-3f, 2, 32, 2, 200);
    spec.mutable_checkpoint()->set_dir(dir);
    spec.mutable_checkpoint()->set_every_steps(20);
    const v1::Job job = WaitForEnd(Submit(spec));
    ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.reason();
    EXPECT_EQ(job.last_checkpoint_step(), 0) << dir;
    EXPECT_GE(job.result().test_accuracy(), 0.6f);
  }
  for (const std::string server : {"server-0", "server-1"}) {
    std::ifstream in(absl::StrCat(dir_.path(), "/", server, ".log"));
    std::stringstream log;
    log << in.rdbuf();
    EXPECT_TRUE(absl::StrContains(log.str(), "not written")) << server;
  }
}

}  // namespace
}  // namespace pstrain::testing
