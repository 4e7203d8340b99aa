// Sparse frames from a peer against a job with two embedding tables (sync
// and async, server 0 of 1, fuzz::SparseJobAssignment), as the parameter
// service hands them to the shard store: every SPARSE_PUSH and SPARSE_PULL
// is decoded and checked (DecodeSparseFrame: what it accepts holds the
// promised shape) and pushed or pulled, step ends and dense frames mixed
// in; whatever a frame says, the store answers or refuses it.
//
// Input: frames, each [u16 LE length][frame bytes] (as EncodeFrame makes).
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <vector>

#include "common/chunk_codec.h"
#include "common/sparse_frames.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"
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

// What DecodeSparseFrame promises of the sections it returns.
void CheckSections(const Frame& frame) {
  const int dims[] = {2, 3};
  absl::StatusOr<std::vector<SparseSection>> sections = DecodeSparseFrame(frame, dims, 0, 1);
  if (!sections.ok()) {
    if (sections.status().code() != absl::StatusCode::kInvalidArgument) abort();
    return;
  }
  const bool push = frame.header().kind() == v1::FRAME_KIND_SPARSE_PUSH;
  int64_t keys = 0;
  for (size_t i = 0; i < sections->size(); ++i) {
    const SparseSection& s = (*sections)[i];
    if (s.table > 1 || (i > 0 && s.table <= (*sections)[i - 1].table) || s.keys.empty()) abort();
    keys += static_cast<int64_t>(s.keys.size());
    if (push && (s.counts.size() != s.keys.size() ||
                 s.grads.size() != s.keys.size() * static_cast<size_t>(dims[s.table]))) {
      abort();
    }
    for (uint32_t c : s.counts) {
      if (c < 1 || c > kMaxKeyCount) abort();
    }
  }
  if (keys != frame.header().num_keys()) abort();
}

}  // namespace
}  // namespace pstrain

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace pstrain;
  static const v1::ServerAssignment* const kJobs[] = {
      new v1::ServerAssignment(fuzz::SparseJobAssignment("s", "sync")),
      new v1::ServerAssignment(fuzz::SparseJobAssignment("a", "async")),
  };
  server::ShardStore store({});
  for (const v1::ServerAssignment* job : kJobs) {
    if (!store.AddJob(*job).ok()) abort();
    for (const v1::ChunkInfo& c : job->plan().chunks()) {  // the external model's values
      v1::ChunkHeader h;
      h.set_kind(v1::FRAME_KIND_INIT);
      h.set_job_id(job->job_id());
      h.set_generation(1);
      h.set_chunk(c.id());
      h.set_dtype(v1::DTYPE_FP32);
      h.set_num_elements(static_cast<uint32_t>(c.size()));
      const std::vector<float> zeros(c.size(), 0.0f);
      if (!store.Init(*Frame::Parse(EncodeFrame(h, zeros.data()))).ok()) abort();
    }
  }
  auto waiter = std::make_shared<Waiter>();
  size_t at = 0;
  while (at + 2 <= size) {
    const size_t n = std::min<size_t>(data[at] | data[at + 1] << 8, size - at - 2);
    const grpc::Slice slice(data + at + 2, n);
    at += 2 + n;
    absl::StatusOr<Frame> frame = Frame::Parse(grpc::ByteBuffer(&slice, 1));
    if (!frame.ok()) continue;
    switch (frame->header().kind()) {
      case v1::FRAME_KIND_SPARSE_PUSH:
        CheckSections(*frame);
        store.SparsePush(*frame).IgnoreError();
        break;
      case v1::FRAME_KIND_SPARSE_PULL:
        CheckSections(*frame);
        store.SparsePull(*frame, waiter).IgnoreError();
        break;
      case v1::FRAME_KIND_STEP_END:
        store.EndStep(frame->header()).IgnoreError();
        break;
      case v1::FRAME_KIND_PULL:
        store.Pull(frame->header(), waiter).IgnoreError();
        break;
      default:
        store.Push(*std::move(frame), waiter).IgnoreError();
    }
  }
  return 0;
}
