// Model files: the final parameters of succeeded jobs (common/model_file.h
// has the format). Worker 0 uploads them (UploadModel); users export them
// (ExportModel). Kept in STATE_DIR/models/JOB_ID.pstm, or in memory without
// a state directory. Thread-safe.
#ifndef PSTRAIN_SERVER_MODEL_STORE_H_
#define PSTRAIN_SERVER_MODEL_STORE_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/file_system.h"
#include "grpcpp/grpcpp.h"
#include "pstrain/v1/control.pb.h"
#include "pstrain/v1/membership.pb.h"

namespace pstrain::server {

class ModelStore {
 public:
  // `dir` empty: in memory. The directory is created by Init().
  ModelStore(FileSystem* fs, std::string dir) : fs_(fs), dir_(std::move(dir)) {}
  absl::Status Init();

  // Keeps `bytes` as the job's model file, durably (a file written
  // atomically) or in memory.
  absl::Status Put(const std::string& job_id, std::string bytes);

  // Where a model file is: on disk, or in memory.
  struct Source {
    std::string path;
    std::shared_ptr<const std::string> bytes;
  };
  // NOT_FOUND if the job has none.
  absl::StatusOr<Source> Find(const std::string& job_id) const;

  // Deletes the job's model file, if any (a file that cannot be deleted is
  // logged and left).
  void Remove(const std::string& job_id);

  FileSystem* fs() const { return fs_; }

 private:
  std::string PathOf(const std::string& job_id) const;

  FileSystem* const fs_;
  const std::string dir_;
  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<const std::string>> in_memory_ ABSL_GUARDED_BY(mu_);
};

// What an upload asks of the coordinator.
class ModelUploadHandler {
 public:
  virtual ~ModelUploadHandler() = default;
  struct Upload {
    uint64_t id = 0;        // names the upload in the calls below
    int64_t max_bytes = 0;  // the largest file accepted
  };
  // Starts node_id's upload of job_id's model. The error ends the upload.
  // `cancel` ends the upload's call (CANCELLED); it may be called until
  // EndUpload.
  virtual absl::StatusOr<Upload> BeginUpload(const std::string& node_id,
                                             const std::string& job_id,
                                             std::function<void()> cancel) = 0;
  // The whole file arrived: check and keep it (unless the upload was
  // cancelled meanwhile).
  virtual absl::Status FinishUpload(const std::string& job_id, uint64_t upload,
                                    std::string bytes) = 0;
  // The upload ended (after FinishUpload, or cut short).
  virtual void EndUpload(const std::string& job_id, uint64_t upload) = 0;
};

// The model uploads in progress, one per job at a time. Not thread-safe
// (the coordinator calls it under its lock).
class UploadTable {
 public:
  // Opens an upload of the job, begun at `now`, that `cancel` cuts short;
  // returns its id. ALREADY_EXISTS while another upload of the job is open.
  absl::StatusOr<uint64_t> Open(const std::string& job_id, absl::Time now,
                                std::function<void()> cancel);
  // Whether upload `id` of the job is open (not ended, not cancelled).
  bool IsOpen(const std::string& job_id, uint64_t id) const;
  // Closes upload `id` of the job, if it is open.
  void Close(const std::string& job_id, uint64_t id);
  // Cancels and closes the uploads open for `timeout` or longer at `now`.
  void CancelStalled(absl::Time now, absl::Duration timeout);

 private:
  struct Upload {
    uint64_t id = 0;
    absl::Time began;
    std::function<void()> cancel;
  };
  std::map<std::string, Upload> open_;  // by job
  uint64_t last_id_ = 0;
};

// Whether node `node_id` may upload the model of `job`: the job runs (else
// FAILED_PRECONDITION) and the node is its worker 0 (else
// PERMISSION_DENIED). Returns the largest file accepted.
absl::StatusOr<int64_t> UploadLimit(const v1::Job& job, const std::string& node_id);

// Whether an uploaded model file is of the job: its id, and the
// `total_floats` parameters of the job's model. INVALID_ARGUMENT if not.
absl::Status CheckUploadedModel(const v1::ModelFileHeader& header, const std::string& job_id,
                                int64_t total_floats);

// Reactors for the two streams; they delete themselves when done.
// `certified_node_id`: the id the caller's certificate carries, which the
// upload's node_id must equal; empty: not checked (plaintext).
grpc::ServerReadReactor<v1::UploadModelRequest>* NewModelUpload(
    grpc::CallbackServerContext* context, ModelUploadHandler* handler,
    std::string certified_node_id);
grpc::ServerWriteReactor<v1::ModelFileChunk>* NewModelExport(
    FileSystem* fs, absl::StatusOr<ModelStore::Source> source);

}  // namespace pstrain::server

#endif  // PSTRAIN_SERVER_MODEL_STORE_H_
