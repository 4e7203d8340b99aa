// The file operations behind pstrain's durable state (the coordinator's job
// log and model files, the servers' checkpoints), behind one interface so
// that tests can make them fail the way a disk does: full, failing, or the
// process dying half-way through a write (LevelDB's Env / EnvWrapper).
//
// Errors map errno to codes: ENOENT is NOT_FOUND, EACCES/EPERM
// PERMISSION_DENIED, ENOSPC/EDQUOT RESOURCE_EXHAUSTED, anything else
// INTERNAL; the message names the path and the system's reason.
#ifndef PSTRAIN_COMMON_FILE_SYSTEM_H_
#define PSTRAIN_COMMON_FILE_SYSTEM_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace pstrain {

// A file open for appending. Not thread-safe.
class WritableFile {
 public:
  virtual ~WritableFile() = default;  // closes (errors are lost: Close() first)
  virtual absl::Status Append(absl::string_view data) = 0;
  // The appended bytes are durable (fdatasync).
  virtual absl::Status Sync() = 0;
  // Cuts the file back to `size` bytes (an append that failed half-way).
  virtual absl::Status Truncate(int64_t size) = 0;
  // Bytes in the file as far as this handle knows.
  virtual int64_t Size() const = 0;
  virtual absl::Status Close() = 0;
};

// A file open for reading from the start. Not thread-safe.
class ReadableFile {
 public:
  virtual ~ReadableFile() = default;
  // Up to `n` bytes; empty at the end of the file.
  virtual absl::StatusOr<std::string> Read(size_t n) = 0;
};

// Thread-safe.
class FileSystem {
 public:
  virtual ~FileSystem() = default;

  // The whole file.
  virtual absl::StatusOr<std::string> ReadFile(const std::string& path) = 0;
  virtual absl::StatusOr<std::unique_ptr<ReadableFile>> OpenForRead(const std::string& path) = 0;
  // Creates the file if missing; `truncate` empties it, else appends.
  virtual absl::StatusOr<std::unique_ptr<WritableFile>> OpenForAppend(const std::string& path,
                                                                      bool truncate) = 0;
  virtual absl::Status Rename(const std::string& from, const std::string& to) = 0;
  virtual absl::Status Remove(const std::string& path) = 0;
  // Creates the directory and its parents if missing.
  virtual absl::Status MakeDirs(const std::string& path) = 0;
  // Makes renames and creations in the directory durable.
  virtual absl::Status SyncDir(const std::string& path) = 0;
  // Names in the directory (no "." or ".."); NOT_FOUND if it is missing.
  virtual absl::StatusOr<std::vector<std::string>> ListDir(const std::string& path) = 0;
  virtual bool Exists(const std::string& path) = 0;

  // Writes `contents` to a temporary file beside `path`, syncs it, renames
  // it over `path` and syncs the directory: readers see the old or the new
  // contents, never a part, and the new contents survive a machine crash.
  // On error the temporary file is removed and `path` is unchanged.
  absl::Status WriteFileAtomically(const std::string& path, absl::string_view contents);
};

// The machine's file system (POSIX). Stateless; lives for the process.
FileSystem* PosixFileSystem();

// Forwards everything to `target`; override what a test changes.
class FileSystemWrapper : public FileSystem {
 public:
  explicit FileSystemWrapper(FileSystem* target) : target_(target) {}
  absl::StatusOr<std::string> ReadFile(const std::string& path) override {
    return target_->ReadFile(path);
  }
  absl::StatusOr<std::unique_ptr<ReadableFile>> OpenForRead(const std::string& path) override {
    return target_->OpenForRead(path);
  }
  absl::StatusOr<std::unique_ptr<WritableFile>> OpenForAppend(const std::string& path,
                                                              bool truncate) override {
    return target_->OpenForAppend(path, truncate);
  }
  absl::Status Rename(const std::string& from, const std::string& to) override {
    return target_->Rename(from, to);
  }
  absl::Status Remove(const std::string& path) override { return target_->Remove(path); }
  absl::Status MakeDirs(const std::string& path) override { return target_->MakeDirs(path); }
  absl::Status SyncDir(const std::string& path) override { return target_->SyncDir(path); }
  absl::StatusOr<std::vector<std::string>> ListDir(const std::string& path) override {
    return target_->ListDir(path);
  }
  bool Exists(const std::string& path) override { return target_->Exists(path); }

 protected:
  FileSystem* target() const { return target_; }

 private:
  FileSystem* const target_;
};

// For testing: fails or crashes the writes to paths that contain a given
// string, as a full or failing disk would, or as a process killed in the
// middle of a write would leave them.
class FaultInjectingFileSystem final : public FileSystemWrapper {
 public:
  enum class Fault {
    kNone,
    kNoSpace,   // Append, creating files and renames fail with ENOSPC
    kIoError,   // Append and Sync fail with EIO
    kCrash,     // the process aborts once `crash_after_bytes` were appended
  };
  struct Rule {
    std::string path_contains;  // empty: every path
    Fault fault = Fault::kNone;
    // kNoSpace: bytes that may still be appended before the disk is full.
    int64_t room_bytes = 0;
    // kCrash: bytes appended (to matching files, in total) before the abort.
    int64_t crash_after_bytes = 0;
  };

  explicit FaultInjectingFileSystem(FileSystem* target) : FileSystemWrapper(target) {}

  // "no_space:PATTERN[:ROOM]", "io_error:PATTERN" or
  // "crash:PATTERN:BYTES" (for --fs_fault_injection of the daemons).
  static absl::StatusOr<Rule> ParseRule(absl::string_view spec);
  // The machine's file system with the rule `spec` (a daemon's
  // --fs_fault_injection); null for an empty spec.
  static absl::StatusOr<std::unique_ptr<FaultInjectingFileSystem>> FromSpec(
      absl::string_view spec);

  // Replaces the rule (kNone: no faults).
  void SetRule(Rule rule);
  // Writes that the rule refused or cut short so far.
  int64_t faults() const;

  absl::StatusOr<std::unique_ptr<WritableFile>> OpenForAppend(const std::string& path,
                                                              bool truncate) override;
  absl::Status Rename(const std::string& from, const std::string& to) override;

  // Called by the files it opened before appending `bytes` to `path`: how
  // many of them to write (`allowed`), then the error to return (OK: none),
  // or, for kCrash, that the process ends once they are written.
  absl::Status BeforeAppend(const std::string& path, int64_t bytes, int64_t* allowed,
                            bool* crash);
  absl::Status BeforeSync(const std::string& path);

 private:
  bool Matches(const std::string& path) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  Rule rule_ ABSL_GUARDED_BY(mu_);
  int64_t appended_ ABSL_GUARDED_BY(mu_) = 0;  // to matching files under the rule
  int64_t faults_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_FILE_SYSTEM_H_
