#include "server/job_store.h"

#include "absl/strings/str_cat.h"
#include "common/file_format.h"
#include "glog/logging.h"

namespace pstrain::server {
namespace {

// The record at `at`, if a whole good one starts there: its length (the
// body's) and the job in it.
bool ReadRecord(const std::string& bytes, size_t at, uint32_t* len, v1::Job* job) {
  const size_t left = bytes.size() - at;
  if (left < 8) return false;
  *len = GetU32(bytes, at);
  if (*len == 0 || *len > JobStore::kMaxRecordBytes || left - 8 < *len) return false;
  if (Crc32(bytes.data() + at + 8, *len) != GetU32(bytes, at + 4)) return false;
  return job->ParseFromArray(bytes.data() + at + 8, static_cast<int>(*len)) && !job->id().empty();
}

// Where the next good record after `at` starts; npos if none does.
size_t NextGoodRecord(const std::string& bytes, size_t at) {
  uint32_t len;
  v1::Job job;
  for (size_t off = at + 1; off + 8 <= bytes.size(); ++off) {
    if (ReadRecord(bytes, off, &len, &job)) return off;
  }
  return std::string::npos;
}

std::string Record(const std::string& body) {
  std::string out;
  PutU32(out, static_cast<uint32_t>(body.size()));
  PutU32(out, Crc32(body.data(), body.size()));
  return out + body;
}

}  // namespace

absl::StatusOr<std::unique_ptr<JobStore>> JobStore::Open(FileSystem* fs, const std::string& dir,
                                                         std::vector<v1::Job>* jobs) {
  if (absl::Status s = fs->MakeDirs(dir); !s.ok()) return s;
  std::unique_ptr<JobStore> store(new JobStore(fs, dir));
  const std::string path = store->path();
  std::string bytes;
  if (fs->Exists(path)) {
    absl::StatusOr<std::string> existing = fs->ReadFile(path);
    if (!existing.ok()) return existing.status();
    bytes = std::move(*existing);
  }
  // Replay: the latest record of each job wins; keep first-seen order.
  std::map<std::string, size_t> index;
  jobs->clear();
  size_t at = 0;
  size_t end = bytes.size();  // where good records end
  while (at < bytes.size()) {
    uint32_t len;
    v1::Job job;
    if (!ReadRecord(bytes, at, &len, &job)) {
      const size_t next = NextGoodRecord(bytes, at);
      if (next == std::string::npos) {
        // A crash in the middle of an append tears the last record: its
        // header or body is cut short, or (on some file systems) it reads
        // as zeros. Whatever it is, nothing good follows it.
        LOG(WARNING) << path << ": cutting off a torn or damaged record at byte " << at << " ("
                     << bytes.size() - at << " bytes to the end)";
        end = at;
        break;
      }
      LOG(ERROR) << path << ": skipping a damaged record at byte " << at << " (" << next - at
                 << " bytes up to the next good one); the jobs of the records after it are kept";
      ++store->skipped_;
      at = next;
      continue;
    }
    std::string body = bytes.substr(at + 8, len);
    auto [it, inserted] = index.emplace(job.id(), jobs->size());
    if (inserted) {
      store->order_.push_back(job.id());
      jobs->push_back(std::move(job));
    } else {
      (*jobs)[it->second] = std::move(job);
    }
    store->latest_[(*jobs)[it->second].id()] = std::move(body);
    at += 8 + len;
  }
  absl::StatusOr<std::unique_ptr<WritableFile>> file = fs->OpenForAppend(path, false);
  if (!file.ok()) return file.status();
  store->file_ = std::move(*file);
  if (end < bytes.size()) {
    if (absl::Status s = store->file_->Truncate(static_cast<int64_t>(end)); !s.ok()) return s;
  }
  if (absl::Status s = fs->SyncDir(dir); !s.ok()) return s;
  return store;
}

JobStore::~JobStore() {
  if (file_ != nullptr) file_->Close().IgnoreError();
}

absl::Status JobStore::Write(const std::vector<const v1::Job*>& jobs) {
  if (broken_) {
    return absl::FailedPreconditionError(
        absl::StrCat(path(), ": a failed write could not be cut off; restart to repair the log"));
  }
  std::string bytes;
  std::vector<std::pair<const v1::Job*, std::string>> bodies;
  for (const v1::Job* job : jobs) {
    std::string body = job->SerializeAsString();
    if (body.size() > kMaxRecordBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("job ", job->id(), ": its record of ", body.size(),
                       " bytes is larger than the job log's limit of ", kMaxRecordBytes));
    }
    bytes += Record(body);
    bodies.emplace_back(job, std::move(body));
  }
  const int64_t end = file_->Size();
  absl::Status status = file_->Append(bytes);
  if (status.ok()) status = file_->Sync();
  if (!status.ok()) {
    // Leave no partial record behind: later appends must follow good ones.
    if (absl::Status cut = file_->Truncate(end); !cut.ok()) {
      LOG(ERROR) << "cannot cut a failed append off " << path() << ": " << cut;
      broken_ = true;
    }
    return status;
  }
  for (auto& [job, body] : bodies) {
    if (latest_.emplace(job->id(), std::string()).second) order_.push_back(job->id());
    latest_[job->id()] = std::move(body);
  }
  appended_ += static_cast<int64_t>(jobs.size());
  if (appended_ > 1000 + 2 * static_cast<int64_t>(latest_.size())) {
    if (absl::Status s = Compact(); !s.ok()) LOG(ERROR) << "compaction: " << s;
  }
  return absl::OkStatus();
}

void JobStore::Forget(const std::string& job_id) {
  if (latest_.erase(job_id) > 0) std::erase(order_, job_id);
}

absl::Status JobStore::Compact() {
  const std::string tmp = path() + ".compact";
  std::string bytes;
  for (const std::string& id : order_) bytes += Record(latest_.at(id));
  absl::StatusOr<std::unique_ptr<WritableFile>> file = fs_->OpenForAppend(tmp, true);
  if (!file.ok()) return file.status();
  absl::Status s = (*file)->Append(bytes);
  if (s.ok()) s = (*file)->Sync();
  // Opened for appending: after the rename this handle is the log.
  if (s.ok()) s = fs_->Rename(tmp, path());
  if (!s.ok()) {
    file->reset();
    fs_->Remove(tmp).IgnoreError();
    return s;  // the old log and handle stay in use
  }
  file_->Close().IgnoreError();
  file_ = std::move(*file);
  appended_ = 0;
  return fs_->SyncDir(dir_);
}

}  // namespace pstrain::server
