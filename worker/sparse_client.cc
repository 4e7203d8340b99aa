#include "worker/sparse_client.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/clock.h"
#include "common/status.h"

namespace pstrain::worker {
namespace {

constexpr uint32_t kNoChunk = 0xffffffffu;

// The sections of each server's frame: the keys (and for a push their
// counts and gradients) of each table that live there, tables ascending,
// with each key's place in its table's list.
struct ServerFrames {
  std::vector<std::vector<SparseSection>> sections;       // by server
  std::vector<std::vector<std::vector<size_t>>> places;  // by server, section, key
};

ServerFrames ByServer(const std::vector<SparseClient::TableKeys>& tables,
                      const std::vector<int>& dims, int servers, bool with_grads) {
  ServerFrames frames;
  frames.sections.resize(servers);
  frames.places.resize(servers);
  for (uint32_t t = 0; t < tables.size(); ++t) {
    const SparseClient::TableKeys& table = tables[t];
    std::vector<int> section(servers, -1);
    for (size_t i = 0; i < table.keys.size(); ++i) {
      const uint32_t s = RowServer(t, table.keys[i], static_cast<uint32_t>(servers));
      if (section[s] < 0) {
        section[s] = static_cast<int>(frames.sections[s].size());
        frames.sections[s].emplace_back().table = t;
        frames.places[s].emplace_back();
      }
      SparseSection& out = frames.sections[s][section[s]];
      frames.places[s][section[s]].push_back(i);
      out.keys.push_back(table.keys[i]);
      if (with_grads) {
        out.counts.push_back(table.counts[i]);
        out.grads.insert(out.grads.end(), table.grads.begin() + i * dims[t],
                         table.grads.begin() + (i + 1) * dims[t]);
      }
    }
  }
  return frames;
}

}  // namespace

SparseClient::Options SparseClient::OptionsFor(const v1::WorkerAssignment& assignment,
                                               const v1::JobSpec& spec, RetryPolicy retry) {
  Options options;
  options.job_id = assignment.job_id();
  options.worker = assignment.worker_index();
  options.generation = assignment.generation();
  for (const v1::EmbeddingTableSpec& table : spec.tables()) options.dims.push_back(table.dim());
  std::vector<bool> has_chunk(assignment.plan().num_servers(), false);
  for (const v1::ChunkInfo& c : assignment.plan().chunks()) has_chunk[c.server()] = true;
  for (uint32_t s = 0; s < has_chunk.size(); ++s) {
    if (!has_chunk[s]) options.servers_without_chunks.push_back(static_cast<int>(s));
  }
  options.retry = std::move(retry);
  return options;
}

SparseClient::SparseClient(Options options, ParameterTransport* transport)
    : options_(std::move(options)), transport_(transport) {}

void SparseClient::Cancel() {
  cancelled_ = true;
  transport_->CancelAll();
}

v1::ChunkHeader SparseClient::Header(v1::FrameKind kind, int64_t step) const {
  v1::ChunkHeader h;
  h.set_kind(kind);
  h.set_job_id(options_.job_id);
  h.set_worker(options_.worker);
  h.set_generation(options_.generation);
  h.set_step(step);
  h.set_chunk(kNoChunk);
  h.set_dtype(v1::DTYPE_FP32);
  return h;
}

absl::Status SparseClient::ExchangeAll(ParameterMethod method,
                                       const std::vector<grpc::ByteBuffer>& requests,
                                       std::vector<std::optional<Frame>>* replies) {
  const int servers = static_cast<int>(requests.size());
  replies->assign(servers, std::nullopt);
  std::vector<int> pending;
  for (int s = 0; s < servers; ++s) {
    if (requests[s].Length() > 0) pending.push_back(s);
  }
  Backoff backoff(options_.retry);
  const absl::Time give_up = MonotonicNow() + options_.retry.patience();
  while (!pending.empty()) {
    if (cancelled_) return absl::CancelledError("sparse client cancelled");
    struct Call {
      absl::Notification done;
      absl::Mutex mu;
      std::optional<Frame> reply ABSL_GUARDED_BY(mu);
      absl::Status status ABSL_GUARDED_BY(mu);
    };
    std::vector<std::shared_ptr<Call>> calls;
    for (int s : pending) {
      auto call = std::make_shared<Call>();
      calls.push_back(call);
      transport_->StartExchange(
          s, 0, method, {requests[s]}, MonotonicNow() + options_.retry.patience(), [] {},
          [call](const grpc::ByteBuffer& reply) {
            absl::StatusOr<Frame> frame = Frame::Parse(reply);
            absl::MutexLock lock(&call->mu);
            if (frame.ok()) {
              call->reply = frame->OwnedCopy();  // the bytes may be a pipe's
            } else {
              call->status = frame.status();
            }
          },
          [call](absl::Status status) {
            {
              absl::MutexLock lock(&call->mu);
              if (call->status.ok()) call->status = status;
            }
            call->done.Notify();
          });
    }
    std::vector<int> again;
    absl::Status last_error;
    for (size_t i = 0; i < calls.size(); ++i) {
      calls[i]->done.WaitForNotification();
      absl::MutexLock lock(&calls[i]->mu);
      if (calls[i]->status.ok() && calls[i]->reply.has_value()) {
        (*replies)[pending[i]] = std::move(calls[i]->reply);
        continue;
      }
      absl::Status status = calls[i]->status.ok()
                                ? absl::UnavailableError("the stream ended without a reply")
                                : calls[i]->status;
      status = absl::Status(status.code(), absl::StrCat("server ", pending[i], ": ",
                                                        status.message()));
      if (!options_.retry.Retryable(status) || cancelled_) return status;
      last_error = status;
      again.push_back(pending[i]);
    }
    if (again.empty()) break;
    if (MonotonicNow() > give_up) {
      return absl::DeadlineExceededError(
          absl::StrCat("sparse exchange: no reply within ",
                       absl::FormatDuration(options_.retry.patience()), "; ",
                       last_error.ToString()));
    }
    absl::SleepFor(backoff.Next());
    pending = std::move(again);
  }
  return absl::OkStatus();
}

absl::Status SparseClient::Pull(int64_t step, int64_t version, int64_t pushed_steps,
                                const std::vector<TableKeys>& tables,
                                std::vector<std::vector<float>>& rows) {
  const int servers = transport_->num_servers();
  const ServerFrames frames = ByServer(tables, options_.dims, servers, /*with_grads=*/false);
  // Every server, with keys there or not: the answer says that its tables
  // have reached `version`, which this worker's push and step end of the
  // step need (a server a step ahead of the others' pushes refuses them).
  std::vector<grpc::ByteBuffer> requests(servers);
  for (int s = 0; s < servers; ++s) {
    int64_t keys = 0;
    const std::string payload = EncodeSparsePayload(frames.sections[s], false, &keys);
    v1::ChunkHeader h = Header(v1::FRAME_KIND_SPARSE_PULL, step);
    h.set_version(version);
    h.set_pushed_steps(pushed_steps);
    h.set_num_keys(static_cast<uint32_t>(keys));
    h.set_num_elements(static_cast<uint32_t>(payload.size() / 4));
    requests[s] = EncodeFrame(h, payload.empty() ? nullptr : payload.data());
  }
  std::vector<std::optional<Frame>> replies;
  if (absl::Status s = ExchangeAll(ParameterMethod::kPull, requests, &replies); !s.ok()) return s;
  rows.resize(tables.size());
  for (uint32_t t = 0; t < tables.size(); ++t) {
    rows[t].assign(tables[t].keys.size() * options_.dims[t], 0.0f);
  }
  for (int s = 0; s < servers; ++s) {
    const Frame& reply = *replies[s];
    int64_t expected = 0;
    for (const SparseSection& section : frames.sections[s]) {
      expected += static_cast<int64_t>(section.keys.size()) * options_.dims[section.table];
    }
    if (reply.header().kind() != v1::FRAME_KIND_ROWS ||
        static_cast<int64_t>(reply.header().num_elements()) != expected ||
        reply.header().dtype() != v1::DTYPE_FP32) {
      return absl::InternalError(absl::StrCat("server ", s, " answered a sparse pull with ",
                                              reply.header().num_elements(), " values of kind ",
                                              v1::FrameKind_Name(reply.header().kind()),
                                              "; expected ", expected, " in ROWS"));
    }
    int64_t at = 0;  // rows come in the order asked
    for (size_t k = 0; k < frames.sections[s].size(); ++k) {
      const uint32_t t = frames.sections[s][k].table;
      const int dim = options_.dims[t];
      for (const size_t i : frames.places[s][k]) {
        reply.ReadValues(at, dim, rows[t].data() + i * dim);
        at += dim;
      }
    }
  }
  return absl::OkStatus();
}

absl::Status SparseClient::Push(int64_t step, const std::vector<TableKeys>& tables) {
  const int servers = transport_->num_servers();
  const ServerFrames frames = ByServer(tables, options_.dims, servers, /*with_grads=*/true);
  std::vector<grpc::ByteBuffer> requests(servers);
  for (int s = 0; s < servers; ++s) {
    int64_t keys = 0;
    const std::string payload = EncodeSparsePayload(frames.sections[s], true, &keys);
    v1::ChunkHeader h = Header(v1::FRAME_KIND_SPARSE_PUSH, step);
    h.set_version(step);
    h.set_num_keys(static_cast<uint32_t>(keys));
    h.set_num_elements(static_cast<uint32_t>(payload.size() / 4));
    requests[s] = EncodeFrame(h, payload.empty() ? nullptr : payload.data());
  }
  std::vector<std::optional<Frame>> replies;
  return ExchangeAll(ParameterMethod::kPush, requests, &replies);
}

absl::Status SparseClient::Init(const std::vector<InitialRows>& tables) {
  constexpr int64_t kFrameFloats = (4 << 20) / 4;
  const int servers = transport_->num_servers();
  std::vector<InitialRows> ordered = tables;  // a frame's sections go by table
  std::sort(ordered.begin(), ordered.end(),
            [](const InitialRows& a, const InitialRows& b) { return a.table < b.table; });
  // keys[s][i]: the keys of ordered[i] that server s holds, ascending.
  std::vector<std::vector<std::vector<uint64_t>>> keys(
      servers, std::vector<std::vector<uint64_t>>(ordered.size()));
  for (size_t i = 0; i < ordered.size(); ++i) {
    for (int64_t k = 0; k < ordered[i].count; ++k) {
      const uint64_t key = static_cast<uint64_t>(k);
      keys[RowServer(ordered[i].table, key, static_cast<uint32_t>(servers))][i].push_back(key);
    }
  }
  // Where each server's next frame begins: (table, key position).
  std::vector<std::pair<size_t, size_t>> next(servers, {0, 0});
  while (true) {
    std::vector<grpc::ByteBuffer> requests(servers);
    bool any = false;
    for (int s = 0; s < servers; ++s) {
      std::vector<SparseSection> sections;
      int64_t floats = 0;
      auto& [i, at] = next[s];
      while (i < ordered.size() && floats < kFrameFloats) {
        const std::vector<uint64_t>& held = keys[s][i];
        const int dim = options_.dims[ordered[i].table];
        const size_t n = std::min<size_t>(held.size() - at,
                                          std::max<int64_t>(1, (kFrameFloats - floats) / dim));
        if (n > 0) {
          SparseSection& section = sections.emplace_back();
          section.table = ordered[i].table;
          section.keys.assign(held.begin() + at, held.begin() + at + n);
          section.counts.assign(n, 1);
          for (const uint64_t key : section.keys) {
            const float* row = ordered[i].rows + static_cast<int64_t>(key) * dim;
            section.grads.insert(section.grads.end(), row, row + dim);
          }
          floats += static_cast<int64_t>(n) * dim;
          at += n;
        }
        if (at == held.size()) {
          ++i;
          at = 0;
        }
      }
      if (sections.empty()) continue;
      any = true;
      int64_t n = 0;
      const std::string payload = EncodeSparsePayload(sections, true, &n);
      v1::ChunkHeader h = Header(v1::FRAME_KIND_SPARSE_INIT, 0);
      h.set_num_keys(static_cast<uint32_t>(n));
      h.set_num_elements(static_cast<uint32_t>(payload.size() / 4));
      requests[s] = EncodeFrame(h, payload.data());
    }
    if (!any) return absl::OkStatus();
    std::vector<std::optional<Frame>> replies;
    PSTRAIN_RETURN_IF_ERROR(ExchangeAll(ParameterMethod::kPush, requests, &replies));
  }
}

absl::Status SparseClient::EndStep(int64_t step, float gradient_max_abs) {
  std::vector<grpc::ByteBuffer> requests(transport_->num_servers());
  for (int s : options_.servers_without_chunks) {
    v1::ChunkHeader h = Header(v1::FRAME_KIND_STEP_END, step);
    h.set_version(step);
    h.set_gradient_max_abs(gradient_max_abs);
    requests[s] = EncodeFrame(h, nullptr);
  }
  std::vector<std::optional<Frame>> replies;
  return ExchangeAll(ParameterMethod::kPush, requests, &replies);
}

}  // namespace pstrain::worker
