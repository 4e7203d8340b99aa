// The checkpoint reader, and the shard store restoring a job from what it
// read: whatever a checkpoint file holds, ReadCheckpoint returns it or
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

// Every file read holds the input's bytes.
class OneFileSystem final : public FileSystemWrapper {
 public:
  OneFileSystem() : FileSystemWrapper(PosixFileSystem()) {}
  void set_contents(std::string contents) { contents_ = std::move(contents); }
  absl::StatusOr<std::string> ReadFile(const std::string& path) override { return contents_; }

 private:
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

    server::ShardStore::Options options;
    options.fs = fs;
    server::ShardStore store(options);
    const absl::Status restored = store.AddJob(*kRestore);
    if (!restored.ok() && !store.JobIds().empty()) abort();
    if (restored.ok() && !read.ok()) abort();
  }
  return 0;
}
