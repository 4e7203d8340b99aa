#include "server/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <fstream>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "tests/integration/integration_util.h"
#include "tests/test_util.h"

namespace pstrain::server {
namespace {

ServerCheckpoint Sample(int64_t step) {
  ServerCheckpoint c;
  c.job_id = "job-000001";
  c.server_index = 1;
  c.num_servers = 2;
  c.step = step;
  c.generation = 3;
  c.total_floats = 1000;
  for (uint32_t id : {1u, 3u}) {
    ChunkCheckpoint& chunk = c.chunks.emplace_back();
    chunk.id = id;
    chunk.version = step;
    for (int i = 0; i < 100; ++i) chunk.values.push_back(id * 1000 + i + 0.5f);
    for (int i = 0; i < 200; ++i) chunk.state.push_back(-i * 0.25f);
  }
  return c;
}

// The steps of server 1's checkpoints of job-000001 in `dir`.
std::vector<int64_t> StepsOnDisk(const std::string& dir) {
  std::vector<int64_t> out;
  for (const v1::CheckpointRecord& r :
       ListCheckpoints(PosixFileSystem(), dir, "job-000001", 1, false)) {
    out.push_back(r.step());
  }
  return out;
}

// Generation 3's checkpoint of `step`, as the coordinator records it.
v1::CheckpointRecord Record(int64_t step) {
  v1::CheckpointRecord r;
  r.set_step(step);
  r.set_generation(3);
  return r;
}

std::string Contents(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

TEST(CheckpointTest, WrittenAtomicallyAndReadBack) {
  testing::TempDir dir;
  const ServerCheckpoint c = Sample(200);
  absl::StatusOr<int64_t> bytes = WriteCheckpoint(PosixFileSystem(), dir.path(), c);
  PSTRAIN_ASSERT_OK(bytes.status());
  const std::string path = CheckpointPath(dir.path(), c.job_id, 1, 200, 3);
  EXPECT_TRUE(absl::EndsWith(path, "/job-000001/server-1/step-000000000200.g3.ckpt")) << path;
  EXPECT_EQ(static_cast<int64_t>(Contents(path).size()), *bytes);
  absl::StatusOr<ServerCheckpoint> read = ReadCheckpoint(PosixFileSystem(), path);
  PSTRAIN_ASSERT_OK(read.status());
  EXPECT_EQ(read->job_id, c.job_id);
  EXPECT_EQ(read->step, 200);
  EXPECT_EQ(read->generation, 3);
  ASSERT_EQ(read->chunks.size(), 2u);
  EXPECT_EQ(read->chunks[1].id, 3u);
  EXPECT_EQ(read->chunks[1].values, c.chunks[1].values);
  EXPECT_EQ(read->chunks[1].state, c.chunks[1].state);
  const std::vector<v1::CheckpointRecord> listed =
      ListCheckpoints(PosixFileSystem(), dir.path(), c.job_id, 1, false);
  ASSERT_EQ(listed.size(), 1u);
  EXPECT_EQ(listed[0].step(), 200);
  EXPECT_EQ(listed[0].generation(), 3);
}

// A byte flipped anywhere, or the file cut anywhere: detected, and the
// message names the file and why.
TEST(CheckpointTest, DamageAnywhereIsDetectedAndNamed) {
  testing::TempDir dir;
  const ServerCheckpoint c = Sample(100);
  PSTRAIN_ASSERT_OK(WriteCheckpoint(PosixFileSystem(), dir.path(), c).status());
  const std::string path = CheckpointPath(dir.path(), c.job_id, 1, 100, 3);
  const std::string good = Contents(path);
  for (size_t at : {size_t{0}, size_t{5}, size_t{20}, good.size() / 2, good.size() - 1}) {
    std::string bad = good;
    bad[at] ^= 0x10;
    std::ofstream(path, std::ios::binary | std::ios::trunc) << bad;
    absl::StatusOr<ServerCheckpoint> read = ReadCheckpoint(PosixFileSystem(), path);
    EXPECT_EQ(read.status().code(), absl::StatusCode::kDataLoss) << "flip at " << at;
    EXPECT_TRUE(absl::StrContains(read.status().message(), path)) << read.status();
    EXPECT_TRUE(absl::StrContains(read.status().message(), at == 0 ? "bad magic" : "CRC-32"))
        << read.status();
  }
  for (size_t cut : {size_t{3}, size_t{15}, good.size() / 3, good.size() - 4, good.size() - 1}) {
    std::ofstream(path, std::ios::binary | std::ios::trunc) << good.substr(0, cut);
    absl::StatusOr<ServerCheckpoint> read = ReadCheckpoint(PosixFileSystem(), path);
    EXPECT_EQ(read.status().code(), absl::StatusCode::kDataLoss) << "cut at " << cut;
  }
  EXPECT_EQ(ReadCheckpoint(PosixFileSystem(), dir.path() + "/nope").status().code(),
            absl::StatusCode::kNotFound);
}

// A disk that fills up in the middle of a write leaves the final name
// untouched and no partial file behind.
TEST(CheckpointTest, AFailedWriteLeavesNothingUnderTheFinalName) {
  testing::TempDir dir;
  FaultInjectingFileSystem fs(PosixFileSystem());
  PSTRAIN_ASSERT_OK(WriteCheckpoint(&fs, dir.path(), Sample(100)).status());
  fs.SetRule({.path_contains = ".ckpt",
              .fault = FaultInjectingFileSystem::Fault::kNoSpace,
              .room_bytes = 500});
  const absl::StatusOr<int64_t> failed = WriteCheckpoint(&fs, dir.path(), Sample(200));
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kResourceExhausted) << failed.status();
  fs.SetRule({});
  const std::vector<v1::CheckpointRecord> listed =
      ListCheckpoints(&fs, dir.path(), "job-000001", 1, false);
  ASSERT_EQ(listed.size(), 1u);
  EXPECT_EQ(listed[0].step(), 100);
  absl::StatusOr<std::vector<std::string>> names =
      fs.ListDir(CheckpointDirOf(dir.path(), "job-000001", 1));
  EXPECT_EQ(names->size(), 1u) << "no temporary file left";
}

TEST(CheckpointTest, PartialFilesAreRemovedAndOldOnesPruned) {
  testing::TempDir dir;
  for (int64_t step : {100, 200, 300, 400}) {
    PSTRAIN_ASSERT_OK(WriteCheckpoint(PosixFileSystem(), dir.path(), Sample(step)).status());
  }
  const std::string partial = CheckpointPath(dir.path(), "job-000001", 1, 500, 3) + ".tmp";
  std::ofstream(partial) << "half a checkpoint";
  std::vector<v1::CheckpointRecord> listed =
      ListCheckpoints(PosixFileSystem(), dir.path(), "job-000001", 1, /*remove_partial=*/true);
  EXPECT_EQ(listed.size(), 4u);
  EXPECT_FALSE(PosixFileSystem()->Exists(partial));
  auto steps = [&] { return StepsOnDisk(dir.path()); };
  // The newest 2, the one the coordinator still needs (100), and those
  // newer than it (200): the coordinator may have just recorded one as
  // complete, which the server hears of later.
  PruneCheckpoints(PosixFileSystem(), dir.path(), "job-000001", 1, 2, {Record(100)});
  EXPECT_EQ(steps(), (std::vector<int64_t>{100, 200, 300, 400}));
  // Once it keeps 300, the older ones go.
  PruneCheckpoints(PosixFileSystem(), dir.path(), "job-000001", 1, 2, {Record(300)});
  EXPECT_EQ(steps(), (std::vector<int64_t>{300, 400}));
  // A coordinator that recorded none: the newest keep + kUnrecordedSlack.
  std::vector<int64_t> expected;
  for (int64_t step = 500; step <= 2000; step += 100) {
    PSTRAIN_ASSERT_OK(WriteCheckpoint(PosixFileSystem(), dir.path(), Sample(step)).status());
    if (step > 2000 - 100 * (2 + kUnrecordedSlack)) expected.push_back(step);
  }
  PruneCheckpoints(PosixFileSystem(), dir.path(), "job-000001", 1, 2, {});
  EXPECT_EQ(steps(), expected);
}

// A checkpoint of one table (dim 1, one float of state) at `step`: the
// rows of `keys` (each row's value is key + step), incremental over `base`
// (0: full) with `deleted`.
ServerCheckpoint WithTable(int64_t step, int64_t base, std::vector<uint64_t> keys,
                           std::vector<uint64_t> deleted) {
  ServerCheckpoint c = Sample(step);
  c.base_step = base;
  c.base_generation = base != 0 ? c.generation : 0;
  TableCheckpoint& t = c.tables.emplace_back();
  t.dim = 1;
  t.state_floats = 1;
  t.version = step;
  for (uint64_t key : keys) {
    t.rows.push_back(SparseTable::Row{.key = key,
                                      .values = {static_cast<float>(key + step)},
                                      .state = {0.5f},
                                      .last_step = step - 1,
                                      .touches = 1,
                                      .updates = 1});
  }
  t.deleted = std::move(deleted);
  t.filter = {.counters = {static_cast<uint16_t>(step), 7}, .current = 1, .current_sightings = step};
  return c;
}

// (key, value) of a read checkpoint's table.
std::vector<std::pair<uint64_t, float>> RowsOf(const ServerCheckpoint& c) {
  std::vector<std::pair<uint64_t, float>> rows;
  for (const SparseTable::Row& row : c.tables.at(0).rows) rows.emplace_back(row.key, row.values[0]);
  return rows;
}

TEST(CheckpointTest, AnIncrementalChainReadsBackAsTheWholeTables) {
  testing::TempDir dir;
  FileSystem* fs = PosixFileSystem();
  // Step 10 full; 20 changes 2, admits 4, evicts 3; 30 admits 3 again and
  // 6, evicts 4 and 5.
  PSTRAIN_ASSERT_OK(WriteCheckpoint(fs, dir.path(), WithTable(10, 0, {1, 2, 3, 5}, {})).status());
  PSTRAIN_ASSERT_OK(WriteCheckpoint(fs, dir.path(), WithTable(20, 10, {2, 4}, {3})).status());
  PSTRAIN_ASSERT_OK(WriteCheckpoint(fs, dir.path(), WithTable(30, 20, {3, 6}, {4, 5})).status());
  absl::StatusOr<ServerCheckpoint> at30 =
      ReadCheckpointChain(fs, dir.path(), "job-000001", 1, 30, 3);
  PSTRAIN_ASSERT_OK(at30.status());
  using Rows = std::vector<std::pair<uint64_t, float>>;
  EXPECT_EQ(RowsOf(*at30), (Rows{{1, 11}, {2, 22}, {3, 33}, {6, 36}}));
  EXPECT_EQ(at30->tables[0].filter,  // the newest file's
            (AdmissionFilter{.counters = {30, 7}, .current = 1, .current_sightings = 30}));
  EXPECT_EQ(at30->chunks[0].version, 30);
  EXPECT_EQ(at30->base_step, 0);
  EXPECT_TRUE(at30->tables[0].deleted.empty());
  absl::StatusOr<ServerCheckpoint> at20 =
      ReadCheckpointChain(fs, dir.path(), "job-000001", 1, 20, 3);
  PSTRAIN_ASSERT_OK(at20.status());
  EXPECT_EQ(RowsOf(*at20), (Rows{{1, 11}, {2, 22}, {4, 24}, {5, 15}}));
  // A single file holds only the changes.
  absl::StatusOr<ServerCheckpoint> delta =
      ReadCheckpoint(fs, CheckpointPath(dir.path(), "job-000001", 1, 30, 3));
  PSTRAIN_ASSERT_OK(delta.status());
  EXPECT_EQ(delta->base_step, 20);
  EXPECT_EQ(RowsOf(*delta), (Rows{{3, 33}, {6, 36}}));
  EXPECT_EQ(delta->tables[0].deleted, (std::vector<uint64_t>{4, 5}));

  // A chain with a link missing reads back as nothing, naming the link.
  const std::string base = CheckpointPath(dir.path(), "job-000001", 1, 20, 3);
  PSTRAIN_ASSERT_OK(fs->Remove(base));
  at30 = ReadCheckpointChain(fs, dir.path(), "job-000001", 1, 30, 3);
  EXPECT_EQ(at30.status().code(), absl::StatusCode::kDataLoss) << at30.status();
  EXPECT_TRUE(absl::StrContains(at30.status().message(), base)) << at30.status();
  PSTRAIN_EXPECT_OK(ReadCheckpointChain(fs, dir.path(), "job-000001", 1, 10, 3).status());
  // A link under another's name (its own base: a cycle) is refused, not
  // followed forever.
  std::ofstream(base, std::ios::binary)
      << Contents(CheckpointPath(dir.path(), "job-000001", 1, 30, 3));
  at30 = ReadCheckpointChain(fs, dir.path(), "job-000001", 1, 30, 3);
  EXPECT_EQ(at30.status().code(), absl::StatusCode::kDataLoss) << at30.status();
  EXPECT_TRUE(absl::StrContains(at30.status().message(), "holds step 30")) << at30.status();
  PSTRAIN_ASSERT_OK(fs->Remove(base));
  // And an incremental checkpoint over a base that is not on disk (its
  // write failed) is not written at all.
  absl::StatusOr<int64_t> orphan = WriteCheckpoint(fs, dir.path(), WithTable(40, 20, {1}, {}));
  EXPECT_EQ(orphan.status().code(), absl::StatusCode::kFailedPrecondition) << orphan.status();
  EXPECT_FALSE(fs->Exists(CheckpointPath(dir.path(), "job-000001", 1, 40, 3)));
}

// Large checkpoints read row by row: the same rows as ReadCheckpoint's,
// table after table (a later table skips the rest of the one before), and
// damage found before any row is handed out.
TEST(CheckpointTest, ARowReaderHandsOutEveryTablesRowsInOrder) {
  testing::TempDir dir;
  FileSystem* fs = PosixFileSystem();
  ServerCheckpoint c = WithTable(10, 0, {1, 5, 9}, {});
  c.tables.push_back(WithTable(10, 0, {2, 4}, {}).tables[0]);
  c.tables[1].index = 1;
  PSTRAIN_ASSERT_OK(WriteCheckpoint(fs, dir.path(), c).status());
  const std::string path = CheckpointPath(dir.path(), "job-000001", 1, 10, 3);
  for (bool skip_first : {false, true}) {
    absl::StatusOr<std::unique_ptr<CheckpointRowReader>> reader =
        CheckpointRowReader::Open(fs, path);
    PSTRAIN_ASSERT_OK(reader);
    EXPECT_EQ((*reader)->header().tables(1).rows(), 2);
    std::vector<std::vector<uint64_t>> keys(2);
    SparseTable::Row row;
    for (int t = skip_first ? 1 : 0; t < 2; ++t) {
      while (true) {
        absl::StatusOr<bool> more = (*reader)->NextRow(t, row);
        PSTRAIN_ASSERT_OK(more);
        if (!*more) break;
        keys[t].push_back(row.key);
        EXPECT_EQ(row.values, std::vector<float>{static_cast<float>(row.key + 10)});
        EXPECT_EQ(row.state, std::vector<float>{0.5f});
      }
    }
    const std::vector<uint64_t> first =
        skip_first ? std::vector<uint64_t>() : std::vector<uint64_t>({1, 5, 9});
    EXPECT_EQ(keys[0], first);
    EXPECT_EQ(keys[1], (std::vector<uint64_t>{2, 4}));
    EXPECT_EQ((*reader)->NextRow(0, row).status().code(), absl::StatusCode::kInvalidArgument);
  }
  std::string bytes = Contents(path);
  bytes[bytes.size() / 2] ^= 1;
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
  absl::StatusOr<std::unique_ptr<CheckpointRowReader>> damaged =
      CheckpointRowReader::Open(fs, path);
  EXPECT_EQ(damaged.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_TRUE(absl::StrContains(damaged.status().message(), path)) << damaged.status();
}

TEST(CheckpointTest, PruningKeepsTheChainOfEveryCheckpointKept) {
  testing::TempDir dir;
  FileSystem* fs = PosixFileSystem();
  // Full at 100 and 400; the others incremental over the one before.
  for (const auto& [step, base] : std::vector<std::pair<int64_t, int64_t>>{
           {100, 0}, {200, 100}, {300, 200}, {400, 0}, {500, 400}}) {
    PSTRAIN_ASSERT_OK(WriteCheckpoint(fs, dir.path(), WithTable(step, base, {1}, {})).status());
  }
  auto steps = [&] { return StepsOnDisk(dir.path()); };
  // The newest (500, over 400) and the retained 300 (over 200, over 100).
  PruneCheckpoints(fs, dir.path(), "job-000001", 1, 1, {Record(300), Record(500)});
  EXPECT_EQ(steps(), (std::vector<int64_t>{100, 200, 300, 400, 500}));
  PruneCheckpoints(fs, dir.path(), "job-000001", 1, 1, {Record(500)});
  EXPECT_EQ(steps(), (std::vector<int64_t>{400, 500}));
  PSTRAIN_EXPECT_OK(ReadCheckpointChain(fs, dir.path(), "job-000001", 1, 500, 3).status());
}

TEST(CheckpointWriterTest, WritesInTheBackgroundInOrder) {
  testing::TempDir dir;
  std::vector<int64_t> done;
  absl::Mutex mu;
  {
    CheckpointWriter writer(PosixFileSystem());
    for (int64_t step : {10, 20, 30}) {
      writer.Enqueue(dir.path(), Sample(step),
                     [&, step](const absl::StatusOr<int64_t>& bytes, double) {
                       PSTRAIN_EXPECT_OK(bytes);
                       absl::MutexLock lock(&mu);
                       done.push_back(step);
                     });
    }
  }  // the destructor writes what is queued
  EXPECT_EQ(done, (std::vector<int64_t>{10, 20, 30}));
}

}  // namespace
}  // namespace pstrain::server
