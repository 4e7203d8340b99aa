// The parameter service's request validation: frames from a peer, as the
// parameter service hands them to the shard store, against one sync and one
// async job held by server 0 of 2. Every frame is parsed, checked against
// the worker roster as a TLS caller `worker-0` would be, and pushed or
// pulled; whatever a frame says, the store answers it or refuses it, and
// the parameters stay finite.
//
// Input: frames, each [u16 LE length][frame bytes] (as EncodeFrame makes).
// The jobs are added fresh for every input, so inputs do not interact.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/chunk_codec.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"
#include "server/parameter_service.h"
#include "server/shard_store.h"
#include "tests/fuzz/fuzz_util.h"

namespace pstrain {
namespace {

class Waiter final : public server::ChunkWaiter {
 public:
  void OnValues(const v1::ChunkHeader& request, const server::ChunkValues& values) override {}
  void OnAbort(const absl::Status& status) override {}
  bool Abandoned() const override { return false; }
};

}  // namespace
}  // namespace pstrain

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace pstrain;
  static const v1::ServerAssignment* const kJobs[] = {
      new v1::ServerAssignment(fuzz::SmallJobAssignment("s", "sync")),
      new v1::ServerAssignment(fuzz::SmallJobAssignment("a", "async")),
  };
  server::ShardStore store({});
  server::WorkerRoster roster;
  for (const v1::ServerAssignment* job : kJobs) {
    if (!store.AddJob(*job).ok()) abort();
    roster.Set(job->job_id(), job->generation(),
               {job->worker_nodes().begin(), job->worker_nodes().end()});
  }
  auto waiter = std::make_shared<Waiter>();
  size_t at = 0;
  while (at + 2 <= size) {
    const size_t n = std::min<size_t>(data[at] | data[at + 1] << 8, size - at - 2);
    const grpc::Slice slice(data + at + 2, n);
    at += 2 + n;
    absl::StatusOr<Frame> frame = Frame::Parse(grpc::ByteBuffer(&slice, 1));
    if (!frame.ok()) continue;
    roster.Check("worker-0", frame->header()).IgnoreError();
    if (frame->header().kind() == v1::FRAME_KIND_PULL) {
      store.Pull(frame->header(), waiter).IgnoreError();
    } else if (frame->header().kind() == v1::FRAME_KIND_STEP_END) {
      store.EndStep(frame->header()).IgnoreError();
    } else {
      store.Push(*std::move(frame), waiter).IgnoreError();
    }
  }
  for (const v1::ServerAssignment* job : kJobs) {
    for (const v1::ChunkInfo& c : job->plan().chunks()) {
      if (c.server() != 0) continue;
      absl::StatusOr<server::ShardStore::ChunkSnapshot> chunk =
          store.ReadChunk(job->job_id(), c.id());
      if (!chunk.ok()) abort();
      for (float v : chunk->values) {
        if (!std::isfinite(v)) abort();
      }
    }
  }
  return 0;
}
