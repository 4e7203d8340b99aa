#include "server/parameter_streams.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "server/sparse_shard.h"

namespace pstrain::server {

void ReplyingStream::OnValues(const v1::ChunkHeader& request, const ChunkValues& values) {
  v1::ChunkHeader reply;
  const bool rows = request.kind() == v1::FRAME_KIND_SPARSE_PULL;
  reply.set_kind(rows ? v1::FRAME_KIND_ROWS : v1::FRAME_KIND_VALUES);
  if (rows) reply.set_num_keys(request.num_keys());
  reply.set_job_id(request.job_id());
  reply.set_worker(request.worker());
  reply.set_step(request.step());
  reply.set_chunk(request.chunk());
  reply.set_version(values.version);
  reply.set_dtype(values.dtype);
  reply.set_num_elements(static_cast<uint32_t>(values.num_values));
  Reply(EncodeFrameShared(reply, values.data, values.owner));
}

absl::Status StreamRequests::Handle(const grpc::ByteBuffer& request,
                                    const std::shared_ptr<ReplyingStream>& stream, bool borrowed) {
  absl::StatusOr<Frame> frame = Frame::Parse(request);
  if (!frame.ok()) return frame.status();
  const v1::FrameKind kind = frame->header().kind();
  const v1::FrameKind expected = method_ == Method::kPull ? v1::FRAME_KIND_PULL
                                                          : v1::FRAME_KIND_PUSH;
  const bool step_end = method_ == Method::kPush && kind == v1::FRAME_KIND_STEP_END;
  const bool init = method_ == Method::kPush && kind == v1::FRAME_KIND_INIT;
  const bool sparse_push = method_ == Method::kPush && kind == v1::FRAME_KIND_SPARSE_PUSH;
  const bool sparse_init = method_ == Method::kPush && kind == v1::FRAME_KIND_SPARSE_INIT;
  const bool sparse_pull = method_ == Method::kPull && kind == v1::FRAME_KIND_SPARSE_PULL;
  if (kind != expected && !step_end && !init && !sparse_push && !sparse_init && !sparse_pull) {
    return absl::InvalidArgumentError(
        absl::StrCat("frame kind ", v1::FrameKind_Name(kind), " not allowed on this method"));
  }
  if (caller_.has_value()) PSTRAIN_RETURN_IF_ERROR(roster_->Check(*caller_, frame->header()));
  PSTRAIN_RETURN_IF_ERROR(stream->ExpectReply());
  absl::Status status;
  switch (method_) {
    case Method::kPush: {
      v1::ChunkHeader ack = frame->header();
      status = step_end      ? store_->EndStep(ack)
               : init        ? store_->Init(borrowed ? frame->OwnedCopy() : *frame)
               : sparse_push ? store_->SparsePush(*frame)
               : sparse_init ? store_->SparseInit(*frame)
                             : store_->Push(*std::move(frame), nullptr, borrowed);
      if (status.ok()) {
        ack.set_kind(v1::FRAME_KIND_ACK);
        ack.set_num_elements(0);
        stream->Reply(EncodeFrame(ack, nullptr));
      }
      break;
    }
    case Method::kPushPull:
      parked_.emplace(frame->header().job_id(), frame->header().chunk());
      status = store_->Push(*std::move(frame), stream, borrowed);
      break;
    case Method::kPull:
      if (sparse_pull) {
        parked_.emplace(frame->header().job_id(), kNoChunk);
        status = store_->SparsePull(*frame, stream);
        break;
      }
      parked_.emplace(frame->header().job_id(), frame->header().chunk());
      status = store_->Pull(frame->header(), stream);
      break;
  }
  return status;
}

void StreamRequests::DropWaits() {
  for (const auto& [job_id, chunk] : parked_) store_->DropAbandonedWaits(job_id, chunk);
  parked_.clear();
}

absl::Status ClientLoad::OpenStream(const std::string& client) {
  absl::MutexLock lock(&mu_);
  Load& load = clients_[client];
  if (load.streams >= limits_.streams) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "client ", client, " has ", load.streams,
        " streams open, the most this server allows (--max_streams_per_client)"));
  }
  ++load.streams;
  return absl::OkStatus();
}

void ClientLoad::CloseStream(const std::string& client) {
  absl::MutexLock lock(&mu_);
  auto it = clients_.find(client);
  --it->second.streams;
  Forget(it);
}

absl::Status ClientLoad::Owe(const std::string& client) {
  absl::MutexLock lock(&mu_);
  Load& load = clients_[client];
  if (load.owed >= limits_.owed_replies) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "client ", client, " is owed ", load.owed,
        " replies (waiting pulls and pushes), the most this server allows "
        "(--max_waits_per_client)"));
  }
  ++load.owed;
  return absl::OkStatus();
}

void ClientLoad::Paid(const std::string& client, int64_t replies) {
  if (replies == 0) return;
  absl::MutexLock lock(&mu_);
  auto it = clients_.find(client);
  it->second.owed -= replies;
  Forget(it);
}

void ClientLoad::Forget(std::map<std::string, Load>::iterator it) {
  if (it->second.streams == 0 && it->second.owed == 0) clients_.erase(it);
}

void WorkerRoster::Set(const std::string& job_id, int64_t generation,
                       std::vector<std::string> workers) {
  absl::MutexLock lock(&mu_);
  Job& job = jobs_[job_id];
  if (job.current.generation == generation) {
    job.current.workers = std::move(workers);
    return;
  }
  job.previous = std::move(job.current);
  job.current = {.generation = generation, .workers = std::move(workers)};
}

void WorkerRoster::Remove(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  jobs_.erase(job_id);
}

absl::Status WorkerRoster::Check(const std::string& caller, const v1::ChunkHeader& header) const {
  absl::ReaderMutexLock lock(&mu_);
  auto it = jobs_.find(header.job_id());
  if (it == jobs_.end()) {
    return absl::NotFoundError(absl::StrCat("job ", header.job_id().substr(0, 80), " is not held"));
  }
  const Job& job = it->second;
  const Generation* generation = header.generation() == job.current.generation ? &job.current
                                 : header.generation() == job.previous.generation
                                     ? &job.previous
                                     : nullptr;
  if (generation == nullptr) {
    if (header.generation() > job.current.generation) {
      return absl::UnavailableError(
          absl::StrCat("generation ", header.generation(), " is not loaded yet"));
    }
    return absl::AbortedError(absl::StrCat("generation ", header.generation(), " is over"));
  }
  const std::vector<std::string>& workers = generation->workers;
  if (header.kind() == v1::FRAME_KIND_PUSH || header.kind() == v1::FRAME_KIND_STEP_END ||
      header.kind() == v1::FRAME_KIND_INIT || header.kind() == v1::FRAME_KIND_SPARSE_PUSH ||
      header.kind() == v1::FRAME_KIND_SPARSE_INIT) {
    if (header.worker() < workers.size() && workers[header.worker()] == caller) {
      return absl::OkStatus();
    }
    return absl::PermissionDeniedError(absl::StrCat("node '", caller, "' is not worker ",
                                                    header.worker(), " of ", header.job_id()));
  }
  if (std::find(workers.begin(), workers.end(), caller) != workers.end()) return absl::OkStatus();
  return absl::PermissionDeniedError(
      absl::StrCat("node '", caller, "' is not a worker of ", header.job_id()));
}

}  // namespace pstrain::server
