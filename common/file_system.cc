#include "common/file_system.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/status.h"
#include "glog/logging.h"

namespace pstrain {
namespace {

absl::Status ErrnoStatus(int err, absl::string_view what, absl::string_view path) {
  const std::string message = absl::StrCat(what, " ", path, ": ", std::strerror(err));
  switch (err) {
    case ENOENT:
      return absl::NotFoundError(message);
    case EACCES:
    case EPERM:
    case EROFS:
      return absl::PermissionDeniedError(message);
    case ENOSPC:
    case EDQUOT:
      return absl::ResourceExhaustedError(message);
    default:
      return absl::InternalError(message);
  }
}

class PosixWritableFile final : public WritableFile {
 public:
  PosixWritableFile(std::string path, int fd, int64_t size)
      : path_(std::move(path)), fd_(fd), size_(size) {}
  ~PosixWritableFile() override {
    if (fd_ >= 0) close(fd_);
  }

  absl::Status Append(absl::string_view data) override {
    size_t done = 0;
    while (done < data.size()) {
      const ssize_t n = write(fd_, data.data() + done, data.size() - done);
      if (n < 0) {
        if (errno == EINTR) continue;
        return ErrnoStatus(errno, "write", path_);
      }
      done += static_cast<size_t>(n);
      size_ += n;
    }
    return absl::OkStatus();
  }
  absl::Status Sync() override {
    if (fdatasync(fd_) != 0) return ErrnoStatus(errno, "fdatasync", path_);
    return absl::OkStatus();
  }
  absl::Status Truncate(int64_t size) override {
    if (ftruncate(fd_, size) != 0) return ErrnoStatus(errno, "truncate", path_);
    size_ = size;
    return absl::OkStatus();
  }
  int64_t Size() const override { return size_; }
  absl::Status Close() override {
    const int fd = fd_;
    fd_ = -1;
    if (fd >= 0 && close(fd) != 0) return ErrnoStatus(errno, "close", path_);
    return absl::OkStatus();
  }

 private:
  const std::string path_;
  int fd_;
  int64_t size_;
};

class PosixReadableFile final : public ReadableFile {
 public:
  PosixReadableFile(std::string path, int fd) : path_(std::move(path)), fd_(fd) {}
  ~PosixReadableFile() override { close(fd_); }
  absl::StatusOr<std::string> Read(size_t n) override {
    std::string out(n, '\0');
    size_t done = 0;
    while (done < n) {
      const ssize_t r = read(fd_, out.data() + done, n - done);
      if (r < 0) {
        if (errno == EINTR) continue;
        return ErrnoStatus(errno, "read", path_);
      }
      if (r == 0) break;
      done += static_cast<size_t>(r);
    }
    out.resize(done);
    return out;
  }

 private:
  const std::string path_;
  const int fd_;
};

class Posix final : public FileSystem {
 public:
  absl::StatusOr<std::string> ReadFile(const std::string& path) override {
    const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return ErrnoStatus(errno, "open", path);
    // Grown as read: a small file costs no more than its size.
    std::string all;
    char buffer[64 << 10];
    while (true) {
      const ssize_t r = read(fd, buffer, sizeof(buffer));
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) {
        const int error = r < 0 ? errno : 0;
        close(fd);
        if (error != 0) return ErrnoStatus(error, "read", path);
        return all;
      }
      all.append(buffer, static_cast<size_t>(r));
    }
  }
  absl::StatusOr<std::unique_ptr<ReadableFile>> OpenForRead(const std::string& path) override {
    const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return ErrnoStatus(errno, "open", path);
    return std::unique_ptr<ReadableFile>(new PosixReadableFile(path, fd));
  }
  absl::StatusOr<std::unique_ptr<WritableFile>> OpenForAppend(const std::string& path,
                                                              bool truncate) override {
    const int fd =
        open(path.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC | (truncate ? O_TRUNC : 0),
             0644);
    if (fd < 0) return ErrnoStatus(errno, "open", path);
    const off_t size = lseek(fd, 0, SEEK_END);
    return std::unique_ptr<WritableFile>(new PosixWritableFile(path, fd, size < 0 ? 0 : size));
  }
  absl::Status Rename(const std::string& from, const std::string& to) override {
    if (rename(from.c_str(), to.c_str()) != 0) return ErrnoStatus(errno, "rename", from);
    return absl::OkStatus();
  }
  absl::Status Remove(const std::string& path) override {
    if (unlink(path.c_str()) != 0 && !(errno == EISDIR && rmdir(path.c_str()) == 0)) {
      return ErrnoStatus(errno, "remove", path);
    }
    return absl::OkStatus();
  }
  absl::Status MakeDirs(const std::string& path) override {
    for (size_t at = 1; at <= path.size(); ++at) {
      if (at < path.size() && path[at] != '/') continue;
      const std::string prefix = path.substr(0, at);
      if (mkdir(prefix.c_str(), 0755) != 0 && errno != EEXIST) {
        return ErrnoStatus(errno, "mkdir", prefix);
      }
    }
    return absl::OkStatus();
  }
  absl::Status SyncDir(const std::string& path) override {
    const int fd = open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return ErrnoStatus(errno, "open", path);
    const int rc = fsync(fd);
    const int err = errno;
    close(fd);
    if (rc != 0) return ErrnoStatus(err, "fsync", path);
    return absl::OkStatus();
  }
  absl::StatusOr<std::vector<std::string>> ListDir(const std::string& path) override {
    DIR* dir = opendir(path.c_str());
    if (dir == nullptr) return ErrnoStatus(errno, "opendir", path);
    std::vector<std::string> names;
    while (dirent* e = readdir(dir)) {
      const std::string name = e->d_name;
      if (name != "." && name != "..") names.push_back(name);
    }
    closedir(dir);
    return names;
  }
  bool Exists(const std::string& path) override { return access(path.c_str(), F_OK) == 0; }
};

std::string Dirname(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

}  // namespace

absl::Status FileSystem::WriteFileAtomically(const std::string& path,
                                             absl::string_view contents) {
  const std::string tmp = absl::StrCat(path, ".tmp.", getpid());
  absl::StatusOr<std::unique_ptr<WritableFile>> file = OpenForAppend(tmp, /*truncate=*/true);
  if (!file.ok()) return file.status();
  absl::Status s = (*file)->Append(contents);
  if (s.ok()) s = (*file)->Sync();
  if (s.ok()) s = (*file)->Close();
  if (s.ok()) s = Rename(tmp, path);
  if (!s.ok()) {
    file->reset();
    Remove(tmp).IgnoreError();
    return s;
  }
  // The rename itself is durable once the directory is.
  return SyncDir(Dirname(path));
}

FileSystem* PosixFileSystem() {
  static Posix* const posix = new Posix;
  return posix;
}

// ---- Faults ----

namespace {

class FaultyWritableFile final : public WritableFile {
 public:
  FaultyWritableFile(FaultInjectingFileSystem* fs, std::string path,
                     std::unique_ptr<WritableFile> inner)
      : fs_(fs), path_(std::move(path)), inner_(std::move(inner)) {}
  absl::Status Append(absl::string_view data) override {
    int64_t allowed = 0;
    bool crash = false;
    const absl::Status fault =
        fs_->BeforeAppend(path_, static_cast<int64_t>(data.size()), &allowed, &crash);
    if (allowed > 0) {
      absl::Status s = inner_->Append(data.substr(0, static_cast<size_t>(allowed)));
      if (!s.ok()) return s;
    }
    if (crash) {
      // As a process killed in the middle of the write leaves the file.
      LOG(ERROR) << "injected crash while writing " << path_ << " (testing only)";
      google::FlushLogFiles(google::GLOG_INFO);
      std::_Exit(134);
    }
    return fault;
  }
  absl::Status Sync() override {
    absl::Status fault = fs_->BeforeSync(path_);
    return fault.ok() ? inner_->Sync() : fault;
  }
  absl::Status Truncate(int64_t size) override { return inner_->Truncate(size); }
  int64_t Size() const override { return inner_->Size(); }
  absl::Status Close() override { return inner_->Close(); }

 private:
  FaultInjectingFileSystem* const fs_;
  const std::string path_;
  const std::unique_ptr<WritableFile> inner_;
};

}  // namespace

absl::StatusOr<FaultInjectingFileSystem::Rule> FaultInjectingFileSystem::ParseRule(
    absl::string_view spec) {
  const std::vector<std::string> parts = absl::StrSplit(spec, ':');
  Rule rule;
  auto bad = [&] {
    return absl::InvalidArgumentError(absl::StrCat(
        "file system fault '", spec,
        "': expected no_space:PATTERN[:ROOM_BYTES], io_error:PATTERN or crash:PATTERN:BYTES"));
  };
  if (parts.size() < 2) return bad();
  rule.path_contains = parts[1];
  if (parts[0] == "no_space" && parts.size() <= 3) {
    rule.fault = Fault::kNoSpace;
    if (parts.size() == 3 && (!absl::SimpleAtoi(parts[2], &rule.room_bytes) || rule.room_bytes < 0)) {
      return bad();
    }
  } else if (parts[0] == "io_error" && parts.size() == 2) {
    rule.fault = Fault::kIoError;
  } else if (parts[0] == "crash" && parts.size() == 3) {
    rule.fault = Fault::kCrash;
    if (!absl::SimpleAtoi(parts[2], &rule.crash_after_bytes) || rule.crash_after_bytes < 0) {
      return bad();
    }
  } else {
    return bad();
  }
  return rule;
}

absl::StatusOr<std::unique_ptr<FaultInjectingFileSystem>> FaultInjectingFileSystem::FromSpec(
    absl::string_view spec) {
  if (spec.empty()) return nullptr;
  PSTRAIN_ASSIGN_OR_RETURN(Rule rule, ParseRule(spec));
  auto fs = std::make_unique<FaultInjectingFileSystem>(PosixFileSystem());
  fs->SetRule(std::move(rule));
  LOG(WARNING) << "injecting file system faults (testing only): " << spec;
  return fs;
}

void FaultInjectingFileSystem::SetRule(Rule rule) {
  absl::MutexLock lock(&mu_);
  rule_ = std::move(rule);
  appended_ = 0;
}

int64_t FaultInjectingFileSystem::faults() const {
  absl::MutexLock lock(&mu_);
  return faults_;
}

bool FaultInjectingFileSystem::Matches(const std::string& path) const {
  return rule_.fault != Fault::kNone &&
         (rule_.path_contains.empty() || path.find(rule_.path_contains) != std::string::npos);
}

absl::StatusOr<std::unique_ptr<WritableFile>> FaultInjectingFileSystem::OpenForAppend(
    const std::string& path, bool truncate) {
  {
    absl::MutexLock lock(&mu_);
    if (Matches(path) && rule_.fault == Fault::kNoSpace && rule_.room_bytes == 0 &&
        !target()->Exists(path)) {
      ++faults_;
      return ErrnoStatus(ENOSPC, "open", path);
    }
  }
  absl::StatusOr<std::unique_ptr<WritableFile>> inner = target()->OpenForAppend(path, truncate);
  if (!inner.ok()) return inner.status();
  return std::unique_ptr<WritableFile>(new FaultyWritableFile(this, path, std::move(*inner)));
}

absl::Status FaultInjectingFileSystem::Rename(const std::string& from, const std::string& to) {
  {
    absl::MutexLock lock(&mu_);
    if ((Matches(from) || Matches(to)) && rule_.fault == Fault::kNoSpace &&
        rule_.room_bytes == 0) {
      ++faults_;
      return ErrnoStatus(ENOSPC, "rename", from);
    }
  }
  return target()->Rename(from, to);
}

absl::Status FaultInjectingFileSystem::BeforeAppend(const std::string& path, int64_t bytes,
                                                    int64_t* allowed, bool* crash) {
  absl::MutexLock lock(&mu_);
  *allowed = bytes;
  *crash = false;
  if (!Matches(path)) return absl::OkStatus();
  switch (rule_.fault) {
    case Fault::kNone:
      return absl::OkStatus();
    case Fault::kNoSpace:
      *allowed = std::min(bytes, rule_.room_bytes);
      rule_.room_bytes -= *allowed;
      if (*allowed == bytes) return absl::OkStatus();
      ++faults_;
      return ErrnoStatus(ENOSPC, "write", path);
    case Fault::kIoError:
      *allowed = 0;
      ++faults_;
      return ErrnoStatus(EIO, "write", path);
    case Fault::kCrash:
      if (appended_ + bytes >= rule_.crash_after_bytes) {
        *allowed = rule_.crash_after_bytes - appended_;
        *crash = true;
      }
      appended_ += *allowed;
      return absl::OkStatus();
  }
  return absl::OkStatus();
}

absl::Status FaultInjectingFileSystem::BeforeSync(const std::string& path) {
  absl::MutexLock lock(&mu_);
  if (Matches(path) && rule_.fault == Fault::kIoError) {
    ++faults_;
    return ErrnoStatus(EIO, "fdatasync", path);
  }
  return absl::OkStatus();
}

}  // namespace pstrain
