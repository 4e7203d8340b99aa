#include "server/job_store.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>

#include "gtest/gtest.h"
#include "tests/integration/integration_util.h"
#include "tests/test_util.h"

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

std::string Contents(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

std::unique_ptr<JobStore> Open(const std::string& dir, std::vector<v1::Job>* jobs,
                               FileSystem* fs = PosixFileSystem()) {
  absl::StatusOr<std::unique_ptr<JobStore>> store = JobStore::Open(fs, dir, jobs);
  PSTRAIN_EXPECT_OK(store);
  return store.ok() ? std::move(*store) : nullptr;
}

TEST(JobStoreTest, ReplaysTheLatestSnapshotOfEachJobInOrder) {
  testing::TempDir dir;
  std::vector<v1::Job> jobs;
  {
    auto store = Open(dir.path(), &jobs);
    EXPECT_TRUE(jobs.empty());
    PSTRAIN_ASSERT_OK(store->Write(MakeJob("job-000001", v1::JOB_STATE_PENDING)));
    const v1::Job second = MakeJob("job-000002", v1::JOB_STATE_PENDING);
    const v1::Job first_done = MakeJob("job-000001", v1::JOB_STATE_SUCCEEDED);
    PSTRAIN_ASSERT_OK(store->Write({&second, &first_done}));  // one sync for both
  }
  auto store = Open(dir.path(), &jobs);
  ASSERT_EQ(jobs.size(), 2u);
  EXPECT_EQ(jobs[0].id(), "job-000001");
  EXPECT_EQ(jobs[0].state(), v1::JOB_STATE_SUCCEEDED);
  EXPECT_EQ(jobs[1].id(), "job-000002");
  EXPECT_EQ(jobs[1].spec().name(), "name-job-000002");
}

TEST(JobStoreTest, ATornLastRecordIsCutOffAndTheStoreStaysUsable) {
  testing::TempDir dir;
  const std::string path = dir.path() + "/jobs.log";
  std::vector<v1::Job> jobs;
  {
    auto store = Open(dir.path(), &jobs);
    PSTRAIN_ASSERT_OK(store->Write(MakeJob("job-000001", v1::JOB_STATE_PENDING)));
    PSTRAIN_ASSERT_OK(store->Write(MakeJob("job-000002", v1::JOB_STATE_PENDING)));
  }
  // Cut the last record at every length: as if the process died mid-write.
  const int64_t full = FileSize(path);
  const std::string bytes = Contents(path);
  const int64_t second =
      full - static_cast<int64_t>(
                 MakeJob("job-000002", v1::JOB_STATE_PENDING).SerializeAsString().size()) -
      8;
  for (int64_t cut = second + 1; cut < full; ++cut) {
    std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes.substr(0, cut);
    auto store = Open(dir.path(), &jobs);
    ASSERT_NE(store, nullptr);
    ASSERT_EQ(jobs.size(), 1u) << "cut at " << cut;
    EXPECT_EQ(FileSize(path), second);
    PSTRAIN_ASSERT_OK(store->Write(MakeJob("job-000003", v1::JOB_STATE_PENDING)));
    store.reset();
    ASSERT_NE(Open(dir.path(), &jobs), nullptr);
    ASSERT_EQ(jobs.size(), 2u);
    EXPECT_EQ(jobs[1].id(), "job-000003");
  }
}

// A damaged record costs only itself: the records after it are read, and a
// job whose latest record is damaged keeps its previous one.
TEST(JobStoreTest, ADamagedRecordInTheMiddleCostsOnlyItself) {
  testing::TempDir dir;
  const std::string path = dir.path() + "/jobs.log";
  std::vector<v1::Job> jobs;
  int64_t third_at = 0;
  {
    auto store = Open(dir.path(), &jobs);
    PSTRAIN_ASSERT_OK(store->Write(MakeJob("job-000001", v1::JOB_STATE_PENDING)));
    PSTRAIN_ASSERT_OK(store->Write(MakeJob("job-000002", v1::JOB_STATE_PENDING)));
    third_at = FileSize(path);
    PSTRAIN_ASSERT_OK(store->Write(MakeJob("job-000001", v1::JOB_STATE_RUNNING)));
    PSTRAIN_ASSERT_OK(store->Write(MakeJob("job-000003", v1::JOB_STATE_PENDING)));
  }
  const int fd = open(path.c_str(), O_WRONLY);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(pwrite(fd, "X", 1, third_at + 12), 1);  // inside the third record's body
  close(fd);
  absl::StatusOr<std::unique_ptr<JobStore>> store = JobStore::Open(PosixFileSystem(), dir.path(), &jobs);
  PSTRAIN_ASSERT_OK(store.status());
  EXPECT_EQ((*store)->skipped_records(), 1);
  ASSERT_EQ(jobs.size(), 3u);
  EXPECT_EQ(jobs[0].id(), "job-000001");
  EXPECT_EQ(jobs[0].state(), v1::JOB_STATE_PENDING) << "its previous record";
  EXPECT_EQ(jobs[2].id(), "job-000003");
  // Appends go on after the good records.
  PSTRAIN_ASSERT_OK((*store)->Write(MakeJob("job-000004", v1::JOB_STATE_PENDING)));
  store->reset();
  ASSERT_NE(Open(dir.path(), &jobs), nullptr);
  EXPECT_EQ(jobs.size(), 4u);
}

// A damaged length at the start must not pass for a torn tail (which
// would drop every record after it).
TEST(JobStoreTest, ADamagedLengthAtTheStartCostsOnlyItsRecord) {
  testing::TempDir dir;
  const std::string path = dir.path() + "/jobs.log";
  std::vector<v1::Job> jobs;
  {
    auto store = Open(dir.path(), &jobs);
    for (int i = 1; i <= 3; ++i) {
      PSTRAIN_ASSERT_OK(
          store->Write(MakeJob("job-00000" + std::to_string(i), v1::JOB_STATE_PENDING)));
    }
  }
  const int fd = open(path.c_str(), O_WRONLY);
  ASSERT_GE(fd, 0);
  const char big[4] = {'\x00', '\x10', '\x00', '\x00'};  // 4096: past the end
  ASSERT_EQ(pwrite(fd, big, 4, 0), 4);
  close(fd);
  ASSERT_NE(Open(dir.path(), &jobs), nullptr);
  ASSERT_EQ(jobs.size(), 2u);
  EXPECT_EQ(jobs[0].id(), "job-000002");
  EXPECT_EQ(jobs[1].id(), "job-000003");
}

TEST(JobStoreTest, AZeroFilledTailIsCutOff) {
  testing::TempDir dir;
  const std::string path = dir.path() + "/jobs.log";
  std::vector<v1::Job> jobs;
  {
    auto store = Open(dir.path(), &jobs);
    PSTRAIN_ASSERT_OK(store->Write(MakeJob("job-000001", v1::JOB_STATE_PENDING)));
  }
  const int64_t good = FileSize(path);
  std::ofstream(path, std::ios::binary | std::ios::app) << std::string(300, '\0');
  ASSERT_NE(Open(dir.path(), &jobs), nullptr);
  EXPECT_EQ(jobs.size(), 1u);
  EXPECT_EQ(FileSize(path), good);
}

TEST(JobStoreTest, TheLogIsCompactedOnceItHasGrown) {
  testing::TempDir dir;
  const std::string path = dir.path() + "/jobs.log";
  std::vector<v1::Job> jobs;
  auto store = Open(dir.path(), &jobs);
  v1::Job a = MakeJob("job-000001", v1::JOB_STATE_PENDING);
  const v1::Job b = MakeJob("job-000002", v1::JOB_STATE_PENDING);
  int64_t largest = 0;
  bool compacted = false;
  for (int i = 0; i < 1200; ++i) {
    a.mutable_progress()->set_step(i);
    const int64_t appended = store->appended();
    PSTRAIN_ASSERT_OK(store->Write({&a, &b}));
    if (store->appended() < appended) {
      compacted = true;
      EXPECT_LT(FileSize(path) * 100, largest) << "compacted to one record per job";
    }
    largest = std::max(largest, FileSize(path));
  }
  EXPECT_TRUE(compacted);
  PSTRAIN_ASSERT_OK(store->Write(MakeJob("job-000003", v1::JOB_STATE_PENDING)));
  store.reset();
  ASSERT_NE(Open(dir.path(), &jobs), nullptr);
  ASSERT_EQ(jobs.size(), 3u);
  EXPECT_EQ(jobs[0].progress().step(), 1199);
}

// The store never acknowledges what its own replay could not read.
TEST(JobStoreTest, ARecordTooLargeToReplayIsRefusedAndChangesNothing) {
  testing::TempDir dir;
  std::vector<v1::Job> jobs;
  auto store = Open(dir.path(), &jobs);
  PSTRAIN_ASSERT_OK(store->Write(MakeJob("job-000001", v1::JOB_STATE_PENDING)));
  v1::Job huge = MakeJob("job-000002", v1::JOB_STATE_PENDING);
  huge.mutable_spec()->mutable_data()->set_dir(std::string(JobStore::kMaxRecordBytes, 'd'));
  const v1::Job small = MakeJob("job-000003", v1::JOB_STATE_PENDING);
  const absl::Status s = store->Write({&small, &huge});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  store.reset();
  ASSERT_NE(Open(dir.path(), &jobs), nullptr);
  ASSERT_EQ(jobs.size(), 1u) << "nothing of the refused write was recorded";
}

TEST(JobStoreTest, AFullOrFailingDiskRefusesWritesAndLosesNothingAcknowledged) {
  testing::TempDir dir;
  FaultInjectingFileSystem fs(PosixFileSystem());
  std::vector<v1::Job> jobs;
  auto store = Open(dir.path(), &jobs, &fs);
  PSTRAIN_ASSERT_OK(store->Write(MakeJob("job-000001", v1::JOB_STATE_PENDING)));

  // Full: a write that does not fit leaves nothing of itself behind.
  fs.SetRule({.path_contains = "jobs.log", .fault = FaultInjectingFileSystem::Fault::kNoSpace,
              .room_bytes = 10});
  EXPECT_EQ(store->Write(MakeJob("job-000002", v1::JOB_STATE_PENDING)).code(),
            absl::StatusCode::kResourceExhausted);
  // Failing: the sync reports an I/O error.
  fs.SetRule({.path_contains = "jobs.log", .fault = FaultInjectingFileSystem::Fault::kIoError});
  EXPECT_FALSE(store->Write(MakeJob("job-000003", v1::JOB_STATE_PENDING)).ok());
  EXPECT_GE(fs.faults(), 2);

  // Room again: writing goes on after the last good record.
  fs.SetRule({});
  PSTRAIN_ASSERT_OK(store->Write(MakeJob("job-000004", v1::JOB_STATE_PENDING)));
  store.reset();
  ASSERT_NE(Open(dir.path(), &jobs), nullptr);
  ASSERT_EQ(jobs.size(), 2u);
  EXPECT_EQ(jobs[0].id(), "job-000001");
  EXPECT_EQ(jobs[1].id(), "job-000004");
}

}  // namespace
}  // namespace pstrain::server
