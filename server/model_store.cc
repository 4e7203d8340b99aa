#include "server/model_store.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/job_spec.h"
#include "common/rpc.h"
#include "glog/logging.h"

namespace pstrain::server {
namespace {

constexpr size_t kModelPieceBytes = 1 << 20;

// Receives worker 0's model file.
class ModelUpload final : public grpc::ServerReadReactor<v1::UploadModelRequest> {
 public:
  ModelUpload(grpc::CallbackServerContext* context, ModelUploadHandler* handler,
              std::string certified_node_id)
      : context_(context), handler_(handler), certified_node_id_(std::move(certified_node_id)) {
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // the client is done sending
      Finish(ToGrpcStatus(began_ ? handler_->FinishUpload(job_id_, upload_.id, std::move(data_))
                                 : absl::InvalidArgumentError("empty upload")));
      return;
    }
    if (!began_) {
      job_id_ = request_.job_id();
      if (!certified_node_id_.empty() && request_.node_id() != certified_node_id_) {
        Finish(grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                            absl::StrCat("the certificate '", certified_node_id_,
                                         "' does not carry the node id '",
                                         request_.node_id().substr(0, 80), "'")));
        return;
      }
      absl::StatusOr<ModelUploadHandler::Upload> upload = handler_->BeginUpload(
          request_.node_id(), job_id_, [context = context_] { context->TryCancel(); });
      if (!upload.ok()) {
        Finish(ToGrpcStatus(upload.status()));
        return;
      }
      began_ = true;
      upload_ = *upload;
    }
    if (static_cast<int64_t>(data_.size() + request_.data().size()) > upload_.max_bytes) {
      Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "model file larger than the model"));
      return;
    }
    data_ += request_.data();
    StartRead(&request_);
  }

  void OnDone() override {
    if (began_) handler_->EndUpload(job_id_, upload_.id);
    delete this;
  }

 private:
  grpc::CallbackServerContext* const context_;
  ModelUploadHandler* const handler_;
  const std::string certified_node_id_;
  v1::UploadModelRequest request_;
  std::string job_id_, data_;
  bool began_ = false;
  ModelUploadHandler::Upload upload_;
};

// Sends a model file in pieces, reading as it goes.
class ModelExport final : public grpc::ServerWriteReactor<v1::ModelFileChunk> {
 public:
  ModelExport(FileSystem* fs, absl::StatusOr<ModelStore::Source> source) {
    if (!source.ok()) {
      Finish(ToGrpcStatus(source.status()));
      return;
    }
    source_ = std::move(*source);
    if (source_.bytes == nullptr) {
      absl::StatusOr<std::unique_ptr<ReadableFile>> file = fs->OpenForRead(source_.path);
      if (!file.ok()) {
        Finish(grpc::Status(grpc::StatusCode::INTERNAL, "cannot read the model file"));
        return;
      }
      file_ = std::move(*file);
    }
    Next();
  }
  void OnWriteDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status::CANCELLED);
      return;
    }
    Next();
  }
  void OnDone() override { delete this; }

 private:
  void Next() {
    std::string piece;
    if (source_.bytes != nullptr) {
      const size_t n = std::min(kModelPieceBytes, source_.bytes->size() - sent_);
      piece.assign(*source_.bytes, sent_, n);
    } else {
      absl::StatusOr<std::string> read = file_->Read(kModelPieceBytes);
      if (!read.ok()) {
        Finish(grpc::Status(grpc::StatusCode::INTERNAL, "cannot read the model file"));
        return;
      }
      piece = std::move(*read);
    }
    if (piece.empty()) {
      Finish(grpc::Status::OK);
      return;
    }
    sent_ += piece.size();
    piece_.set_data(std::move(piece));
    StartWrite(&piece_);
  }

  ModelStore::Source source_;
  std::unique_ptr<ReadableFile> file_;
  size_t sent_ = 0;
  v1::ModelFileChunk piece_;
};

}  // namespace

absl::StatusOr<uint64_t> UploadTable::Open(const std::string& job_id, absl::Time now,
                                           std::function<void()> cancel) {
  const uint64_t id = ++last_id_;
  if (!open_.emplace(job_id, Upload{id, now, std::move(cancel)}).second) {
    return absl::AlreadyExistsError(absl::StrCat("a model of ", job_id, " is being uploaded"));
  }
  return id;
}

bool UploadTable::IsOpen(const std::string& job_id, uint64_t id) const {
  auto it = open_.find(job_id);
  return it != open_.end() && it->second.id == id;
}

void UploadTable::Close(const std::string& job_id, uint64_t id) {
  if (IsOpen(job_id, id)) open_.erase(job_id);
}

void UploadTable::CancelStalled(absl::Time now, absl::Duration timeout) {
  std::erase_if(open_, [&](auto& entry) {
    const auto& [job_id, upload] = entry;
    if (now - upload.began < timeout) return false;
    LOG(WARNING) << "job " << job_id << ": the model upload did not end within "
                 << absl::FormatDuration(timeout) << "; cancelled";
    upload.cancel();  // the call ends; a new upload may begin at once
    return true;
  });
}

absl::StatusOr<int64_t> UploadLimit(const v1::Job& job, const std::string& node_id) {
  if (job.state() != v1::JOB_STATE_RUNNING) {
    return absl::FailedPreconditionError(absl::StrCat(job.id(), " is not running"));
  }
  if (job.worker_nodes_size() == 0 || job.worker_nodes(0) != node_id) {
    return absl::PermissionDeniedError(
        absl::StrCat("node '", node_id, "' is not worker 0 of ", job.id()));
  }
  return NumParamsOf(job.spec()) * 4 + 64 * 1024;
}

absl::Status CheckUploadedModel(const v1::ModelFileHeader& header, const std::string& job_id,
                                int64_t total_floats) {
  if (header.job_id() != job_id || header.total_floats() != total_floats) {
    return absl::InvalidArgumentError("the model file does not belong to this job");
  }
  return absl::OkStatus();
}

absl::Status ModelStore::Init() { return dir_.empty() ? absl::OkStatus() : fs_->MakeDirs(dir_); }

std::string ModelStore::PathOf(const std::string& job_id) const {
  return absl::StrCat(dir_, "/", job_id, ".pstm");
}

absl::Status ModelStore::Put(const std::string& job_id, std::string bytes) {
  if (!dir_.empty()) return fs_->WriteFileAtomically(PathOf(job_id), bytes);
  absl::MutexLock lock(&mu_);
  in_memory_[job_id] = std::make_shared<const std::string>(std::move(bytes));
  return absl::OkStatus();
}

absl::StatusOr<ModelStore::Source> ModelStore::Find(const std::string& job_id) const {
  if (!dir_.empty()) {
    const std::string path = PathOf(job_id);
    if (!fs_->Exists(path)) return absl::NotFoundError(absl::StrCat("no model file of ", job_id));
    return Source{path, nullptr};
  }
  absl::MutexLock lock(&mu_);
  auto it = in_memory_.find(job_id);
  if (it == in_memory_.end()) return absl::NotFoundError(absl::StrCat("no model file of ", job_id));
  return Source{"", it->second};
}

void ModelStore::Remove(const std::string& job_id) {
  if (dir_.empty()) {
    absl::MutexLock lock(&mu_);
    in_memory_.erase(job_id);
    return;
  }
  const std::string path = PathOf(job_id);
  if (!fs_->Exists(path)) return;
  if (absl::Status s = fs_->Remove(path); !s.ok()) {
    LOG(WARNING) << "cannot delete " << path << ": " << s;
  }
}

grpc::ServerReadReactor<v1::UploadModelRequest>* NewModelUpload(
    grpc::CallbackServerContext* context, ModelUploadHandler* handler,
    std::string certified_node_id) {
  return new ModelUpload(context, handler, std::move(certified_node_id));
}

grpc::ServerWriteReactor<v1::ModelFileChunk>* NewModelExport(
    FileSystem* fs, absl::StatusOr<ModelStore::Source> source) {
  return new ModelExport(fs, std::move(source));
}

}  // namespace pstrain::server
