#include "server/job_log.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <cerrno>
#include <cstring>
#include <map>

#include "absl/strings/str_cat.h"
#include "common/files.h"
#include "glog/logging.h"

namespace pstrain::server {
namespace {

// No job snapshot comes near this; a larger length is corruption.
constexpr uint32_t kMaxRecordBytes = 64 << 20;

absl::Status Errno(absl::string_view what) {
  return absl::InternalError(absl::StrCat(what, ": ", std::strerror(errno)));
}

void PutU32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

uint32_t GetU32(const std::string& s, size_t at) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) {
    v |= static_cast<uint32_t>(static_cast<unsigned char>(s[at + i])) << (8 * i);
  }
  return v;
}

uint32_t Crc(const std::string& bytes) {
  return static_cast<uint32_t>(
      crc32(0L, reinterpret_cast<const Bytef*>(bytes.data()), static_cast<uInt>(bytes.size())));
}

// Whether a well-formed record starts anywhere after `at`: then the bad one
// at `at` is not a torn tail but damage in the middle.
bool GoodRecordAfter(const std::string& bytes, size_t at) {
  for (size_t off = at + 1; off + 8 <= bytes.size(); ++off) {
    const uint32_t len = GetU32(bytes, off);
    if (len == 0 || len > kMaxRecordBytes || bytes.size() - off - 8 < len) continue;
    if (Crc(bytes.substr(off + 8, len)) == GetU32(bytes, off + 4)) return true;
  }
  return false;
}

std::string Record(const v1::Job& job) {
  const std::string body = job.SerializeAsString();
  std::string out;
  PutU32(out, static_cast<uint32_t>(body.size()));
  PutU32(out, Crc(body));
  return out + body;
}

absl::Status WriteAll(int fd, const std::string& bytes, absl::string_view path) {
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return Errno(absl::StrCat("write ", path));
    }
    done += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::Status SyncDir(const std::string& dir) {
  const int fd = open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return Errno(absl::StrCat("open ", dir));
  const int rc = fsync(fd);
  close(fd);
  return rc == 0 ? absl::OkStatus() : Errno(absl::StrCat("fsync ", dir));
}

}  // namespace

absl::StatusOr<std::unique_ptr<JobLog>> JobLog::Open(const std::string& dir,
                                                     std::vector<v1::Job>* jobs) {
  if (mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) return Errno(absl::StrCat("mkdir ", dir));
  const std::string path = dir + "/jobs.log";
  std::string bytes;
  if (access(path.c_str(), F_OK) == 0) {
    absl::StatusOr<std::string> existing = ReadFile(path);
    if (!existing.ok()) return existing.status();
    bytes = std::move(*existing);
  }
  // Replay: the latest record of each job wins; keep first-seen order.
  std::map<std::string, size_t> index;
  jobs->clear();
  size_t at = 0;
  while (at < bytes.size()) {
    const size_t left = bytes.size() - at;
    const uint32_t len = left >= 8 ? GetU32(bytes, at) : 0;
    v1::Job job;
    const bool good = left >= 8 && len > 0 && len <= kMaxRecordBytes && left - 8 >= len &&
                      Crc(bytes.substr(at + 8, len)) == GetU32(bytes, at + 4) &&
                      job.ParseFromArray(bytes.data() + at + 8, static_cast<int>(len)) &&
                      !job.id().empty();
    if (!good) {
      // A crash in the middle of an append tears the last record: its header
      // is cut short, its body is, or (on some file systems) it reads as
      // zeros. Anything else is corruption.
      const bool zeros = bytes.find_first_not_of('\0', at) == std::string::npos;
      const bool cut_short = left < 8 || (len > 0 && len <= kMaxRecordBytes && left - 8 <= len);
      if ((!zeros && !cut_short) || GoodRecordAfter(bytes, at)) {
        return absl::DataLossError(absl::StrCat(path, ": corrupt record at byte ", at));
      }
      LOG(WARNING) << path << ": dropping a torn record at byte " << at << " (" << left
                   << " bytes)";
      if (truncate(path.c_str(), static_cast<off_t>(at)) != 0) {
        return Errno(absl::StrCat("truncate ", path));
      }
      break;
    }
    auto [it, inserted] = index.emplace(job.id(), jobs->size());
    if (inserted) {
      jobs->push_back(std::move(job));
    } else {
      (*jobs)[it->second] = std::move(job);
    }
    at += 8 + len;
  }
  const int fd = open(path.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) return Errno(absl::StrCat("open ", path));
  if (absl::Status s = SyncDir(dir); !s.ok()) {
    close(fd);
    return s;
  }
  return std::unique_ptr<JobLog>(new JobLog(dir, fd));
}

JobLog::~JobLog() { close(fd_); }

absl::Status JobLog::Append(const v1::Job& job) {
  const std::string path = dir_ + "/jobs.log";
  const off_t end = lseek(fd_, 0, SEEK_END);
  absl::Status status = WriteAll(fd_, Record(job), path);
  if (status.ok() && fdatasync(fd_) != 0) status = Errno(absl::StrCat("fdatasync ", path));
  if (!status.ok()) {
    // Leave no partial record behind: later appends must follow good ones.
    if (end >= 0 && ftruncate(fd_, end) != 0) {
      LOG(ERROR) << "cannot cut a failed append off " << path;
    }
    return status;
  }
  ++appended_;
  return absl::OkStatus();
}

absl::Status JobLog::Compact(const std::vector<const v1::Job*>& jobs) {
  const std::string path = dir_ + "/jobs.log";
  const std::string tmp = path + ".compact";
  std::string bytes;
  for (const v1::Job* job : jobs) bytes += Record(*job);
  // Opened for appending: after the rename this descriptor is the log.
  const int fd = open(tmp.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return Errno(absl::StrCat("open ", tmp));
  absl::Status s = WriteAll(fd, bytes, tmp);
  if (s.ok() && fsync(fd) != 0) s = Errno(absl::StrCat("fsync ", tmp));
  if (s.ok() && rename(tmp.c_str(), path.c_str()) != 0) s = Errno(absl::StrCat("rename ", tmp));
  if (!s.ok()) {
    close(fd);
    unlink(tmp.c_str());
    return s;  // the old log and descriptor stay in use
  }
  close(fd_);
  fd_ = fd;
  appended_ = 0;
  return SyncDir(dir_);
}

}  // namespace pstrain::server
