#include "worker/direct_carrier.h"

#include <utility>

namespace pstrain::worker {
namespace {

// Which of a server's direct connections carries a stream of `requests`
// (null: none): a small one (a step end, a small model's chunks) the first,
// so that a step's messages meet the same threads on both ends; a larger
// one the connection with the fewest streams open, the first of those.
DirectStreams* DirectFor(const std::vector<std::unique_ptr<DirectStreams>>& direct,
                         const std::vector<grpc::ByteBuffer>& requests) {
  constexpr size_t kSmallStreamBytes = 256 << 10;
  if (direct.empty()) return nullptr;
  size_t bytes = 0;
  for (const grpc::ByteBuffer& r : requests) bytes += r.Length();
  if (bytes <= kSmallStreamBytes) return direct.front().get();
  DirectStreams* best = nullptr;
  int best_open = 0;
  for (const auto& d : direct) {
    const int open = d->open_streams();
    if (best == nullptr || open < best_open) {
      best = d.get();
      best_open = open;
    }
  }
  return best;
}

}  // namespace

DirectCarrier::DirectCarrier(
    std::vector<std::vector<std::unique_ptr<DirectConnection>>> by_server) {
  for (auto& connections : by_server) {
    std::vector<std::unique_ptr<DirectStreams>>& streams = streams_.emplace_back();
    for (std::unique_ptr<DirectConnection>& c : connections) {
      streams.push_back(std::make_unique<DirectStreams>(std::move(c)));
    }
  }
}

bool DirectCarrier::StartExchange(int server, int channel, ParameterMethod method,
                                  std::vector<grpc::ByteBuffer>& requests, absl::Time deadline,
                                  SentFn& on_sent, ReplyFn& on_reply, DoneFn& on_done) {
  DirectStreams* direct = DirectFor(streams_[server], requests);
  return direct != nullptr &&
         direct->StartExchange(method, requests, deadline, on_sent, on_reply, on_done);
}

void DirectCarrier::CancelAll() {
  for (const auto& server : streams_) {
    for (const auto& streams : server) streams->CancelAll();
  }
}

}  // namespace pstrain::worker
