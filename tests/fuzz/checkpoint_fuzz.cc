// The checkpoint readers, and the shard store restoring a job from what it
// read: whatever a checkpoint file holds, ReadCheckpoint returns it or
// DATA_LOSS, the row reader of exports hands out the same rows or
// DATA_LOSS, and AddJob restores the job from it or refuses it (leaving
// nothing held). Each input is tried as it is and with its trailing CRC-32
// made right, so that mutations reach the parser behind the checksum.
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/file_system.h"
#include "server/checkpoint.h"
#include "server/shard_store.h"
#include "tests/fuzz/fuzz_util.h"

namespace pstrain {
namespace {

// Every file read holds the input's bytes, read whole or piece by piece.
class OneFileSystem final : public FileSystemWrapper {
 public:
  OneFileSystem() : FileSystemWrapper(PosixFileSystem()) {}
  void set_contents(std::string contents) { contents_ = std::move(contents); }
  absl::StatusOr<std::string> ReadFile(const std::string& path) override { return contents_; }
  absl::StatusOr<std::unique_ptr<ReadableFile>> OpenForRead(const std::string& path) override {
    return std::unique_ptr<ReadableFile>(new StringFile(contents_));
  }

 private:
  class StringFile final : public ReadableFile {
   public:
    explicit StringFile(std::string contents) : contents_(std::move(contents)) {}
    absl::StatusOr<std::string> Read(size_t n) override {
      std::string out = contents_.substr(at_, n);
      at_ += out.size();
      return out;
    }

   private:
    const std::string contents_;
    size_t at_ = 0;
  };
  std::string contents_;
};

}  // namespace
}  // namespace pstrain

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace pstrain;
  static v1::ServerAssignment* const kRestore = [] {
    auto* a = new v1::ServerAssignment(fuzz::SmallJobAssignment(
        "job-1", "sync", "checkpoint: {dir: /nonexistent/checkpoints, every_steps: 2}\n"));
    a->set_restore_step(2);
    a->set_restore_generation(1);
    return a;
  }();
  static OneFileSystem* const fs = new OneFileSystem;
  const std::string raw(reinterpret_cast<const char*>(data), size);
  for (std::string bytes : {raw, fuzz::WithTrailingCrc(raw)}) {
    fs->set_contents(bytes);
    absl::StatusOr<server::ServerCheckpoint> read = server::ReadCheckpoint(fs, "/checkpoint");
    if (!read.ok() && read.status().code() != absl::StatusCode::kDataLoss) abort();

    // The row reader of exports: every row of every table, or DATA_LOSS.
    absl::StatusOr<std::unique_ptr<server::CheckpointRowReader>> rows =
        server::CheckpointRowReader::Open(fs, "/checkpoint");
    if (!rows.ok() && rows.status().code() != absl::StatusCode::kDataLoss) abort();
    if (rows.ok()) {
      server::SparseTable::Row row;
      for (int t = 0; t < (*rows)->header().tables_size(); ++t) {
        absl::StatusOr<bool> more;
        int64_t n = 0;
        while ((more = (*rows)->NextRow(t, row)).ok() && *more) ++n;
        if (!more.ok() && more.status().code() != absl::StatusCode::kDataLoss) abort();
        if (!more.ok()) break;
        // What ReadCheckpoint read whole, the row reader hands out.
        if (read.ok() && n != static_cast<int64_t>(read->tables[t].rows.size())) abort();
      }
    }

    server::ShardStore::Options options;
    options.fs = fs;
    server::ShardStore store(options);
    const absl::Status restored = store.AddJob(*kRestore);
    if (!restored.ok() && !store.JobIds().empty()) abort();
    if (restored.ok() && !read.ok()) abort();
  }
  return 0;
}
