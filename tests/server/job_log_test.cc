#include "server/job_log.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>

#include "gtest/gtest.h"
#include "tests/integration/integration_util.h"

namespace pstrain::server {
namespace {

v1::Job MakeJob(const std::string& id, v1::JobState state) {
  v1::Job job;
  job.set_id(id);
  job.set_state(state);
  job.mutable_spec()->set_name("name-" + id);
  return job;
}

int64_t FileSize(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 ? st.st_size : -1;
}

TEST(JobLogTest, ReplaysTheLatestSnapshotOfEachJobInOrder) {
  testing::TempDir dir;
  std::vector<v1::Job> jobs;
  {
    auto log = *JobLog::Open(dir.path(), &jobs);
    EXPECT_TRUE(jobs.empty());
    ASSERT_TRUE(log->Append(MakeJob("job-000001", v1::JOB_STATE_PENDING)).ok());
    ASSERT_TRUE(log->Append(MakeJob("job-000002", v1::JOB_STATE_PENDING)).ok());
    ASSERT_TRUE(log->Append(MakeJob("job-000001", v1::JOB_STATE_SUCCEEDED)).ok());
  }
  auto log = *JobLog::Open(dir.path(), &jobs);
  ASSERT_EQ(jobs.size(), 2u);
  EXPECT_EQ(jobs[0].id(), "job-000001");
  EXPECT_EQ(jobs[0].state(), v1::JOB_STATE_SUCCEEDED);
  EXPECT_EQ(jobs[1].id(), "job-000002");
  EXPECT_EQ(jobs[1].spec().name(), "name-job-000002");
}

TEST(JobLogTest, ATornLastRecordIsCutOffAndTheLogStaysUsable) {
  testing::TempDir dir;
  const std::string path = dir.path() + "/jobs.log";
  std::vector<v1::Job> jobs;
  {
    auto log = *JobLog::Open(dir.path(), &jobs);
    ASSERT_TRUE(log->Append(MakeJob("job-000001", v1::JOB_STATE_PENDING)).ok());
    ASSERT_TRUE(log->Append(MakeJob("job-000002", v1::JOB_STATE_PENDING)).ok());
  }
  // Cut the last record at every length: as if the process died mid-write.
  const int64_t full = FileSize(path);
  std::ifstream in(path, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const int64_t second = full - static_cast<int64_t>(MakeJob("job-000002", v1::JOB_STATE_PENDING)
                                                          .SerializeAsString()
                                                          .size()) -
                         8;
  for (int64_t cut = second + 1; cut < full; ++cut) {
    std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes.substr(0, cut);
    auto log = JobLog::Open(dir.path(), &jobs);
    ASSERT_TRUE(log.ok()) << log.status();
    ASSERT_EQ(jobs.size(), 1u) << "cut at " << cut;
    EXPECT_EQ(FileSize(path), second);
    ASSERT_TRUE((*log)->Append(MakeJob("job-000003", v1::JOB_STATE_PENDING)).ok());
    log->reset();
    ASSERT_TRUE(JobLog::Open(dir.path(), &jobs).ok());
    ASSERT_EQ(jobs.size(), 2u);
    EXPECT_EQ(jobs[1].id(), "job-000003");
  }
}

TEST(JobLogTest, CorruptionBeforeTheEndIsDataLoss) {
  testing::TempDir dir;
  const std::string path = dir.path() + "/jobs.log";
  std::vector<v1::Job> jobs;
  {
    auto log = *JobLog::Open(dir.path(), &jobs);
    ASSERT_TRUE(log->Append(MakeJob("job-000001", v1::JOB_STATE_PENDING)).ok());
    ASSERT_TRUE(log->Append(MakeJob("job-000002", v1::JOB_STATE_PENDING)).ok());
  }
  const int fd = open(path.c_str(), O_WRONLY);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(pwrite(fd, "X", 1, 10), 1);  // inside the first record's body
  close(fd);
  absl::StatusOr<std::unique_ptr<JobLog>> log = JobLog::Open(dir.path(), &jobs);
  EXPECT_EQ(log.status().code(), absl::StatusCode::kDataLoss) << log.status();
}

// A damaged length in the middle must not pass for a torn tail (which
// would silently drop every record after it).
TEST(JobLogTest, ADamagedLengthInTheMiddleIsDataLoss) {
  testing::TempDir dir;
  const std::string path = dir.path() + "/jobs.log";
  std::vector<v1::Job> jobs;
  {
    auto log = *JobLog::Open(dir.path(), &jobs);
    for (int i = 1; i <= 3; ++i) {
      ASSERT_TRUE(log->Append(MakeJob("job-00000" + std::to_string(i), v1::JOB_STATE_PENDING)).ok());
    }
  }
  const int fd = open(path.c_str(), O_WRONLY);
  ASSERT_GE(fd, 0);
  const char big[4] = {'\x00', '\x10', '\x00', '\x00'};  // 4096: past the end
  ASSERT_EQ(pwrite(fd, big, 4, 0), 4);
  close(fd);
  EXPECT_EQ(JobLog::Open(dir.path(), &jobs).status().code(), absl::StatusCode::kDataLoss);
}

TEST(JobLogTest, AZeroFilledTailIsCutOff) {
  testing::TempDir dir;
  const std::string path = dir.path() + "/jobs.log";
  std::vector<v1::Job> jobs;
  {
    auto log = *JobLog::Open(dir.path(), &jobs);
    ASSERT_TRUE(log->Append(MakeJob("job-000001", v1::JOB_STATE_PENDING)).ok());
  }
  const int64_t good = FileSize(path);
  std::ofstream(path, std::ios::binary | std::ios::app) << std::string(300, '\0');
  ASSERT_TRUE(JobLog::Open(dir.path(), &jobs).ok());
  EXPECT_EQ(jobs.size(), 1u);
  EXPECT_EQ(FileSize(path), good);
}

TEST(JobLogTest, CompactionKeepsOneRecordPerJob) {
  testing::TempDir dir;
  const std::string path = dir.path() + "/jobs.log";
  std::vector<v1::Job> jobs;
  auto log = *JobLog::Open(dir.path(), &jobs);
  v1::Job a = MakeJob("job-000001", v1::JOB_STATE_PENDING);
  v1::Job b = MakeJob("job-000002", v1::JOB_STATE_PENDING);
  for (int i = 0; i < 100; ++i) {
    a.mutable_progress()->set_step(i);
    ASSERT_TRUE(log->Append(a).ok());
    ASSERT_TRUE(log->Append(b).ok());
  }
  const int64_t before = FileSize(path);
  ASSERT_TRUE(log->Compact({&a, &b}).ok());
  EXPECT_LT(FileSize(path) * 50, before);
  EXPECT_EQ(log->appended(), 0);
  ASSERT_TRUE(log->Append(MakeJob("job-000003", v1::JOB_STATE_PENDING)).ok());
  log.reset();
  ASSERT_TRUE(JobLog::Open(dir.path(), &jobs).ok());
  ASSERT_EQ(jobs.size(), 3u);
  EXPECT_EQ(jobs[0].progress().step(), 99);
}

}  // namespace
}  // namespace pstrain::server
