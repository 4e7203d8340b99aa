// For testing only: a ParameterTransport that wraps another and injects the
// faults of a bad network: requests and replies dropped, duplicated, delayed
// and reordered, each with its own probability, from a seeded generator
// whose seed is logged, so that a failing run can be repeated. Tests use it
// in-process; pstrain-worker uses it when started with --fault_injection.
//
// What each fault does, so that every one stays something a real network
// or server could do to a stream:
// - drop_request: the stream breaks before the request: neither it nor the
//   requests after it are sent, and the stream ends UNAVAILABLE once the
//   ones before it are answered (a stream never loses a message in the
//   middle: it breaks).
// - duplicate_request: the request is sent twice in a row (a PushPull only:
//   a retried push that the server must recognise).
// - drop_reply, duplicate_reply: a reply is lost, or delivered twice.
// - reorder_reply: a reply is held back and delivered after the next reply
//   of its stream (or at the stream's end).
// - delay: the stream starts late, or a reply arrives late, by a duration
//   drawn uniformly from [min_delay, max_delay].
// Requests are never reordered inside a stream: the client sends them in
// ascending chunk order, which the sync barrier's freedom from deadlock
// rests on (parameter_client.h); delaying whole streams reorders them
// across streams instead.
#ifndef PSTRAIN_WORKER_FAULT_INJECTING_TRANSPORT_H_
#define PSTRAIN_WORKER_FAULT_INJECTING_TRANSPORT_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "worker/transport.h"

namespace pstrain::worker {

struct FaultInjection {
  // Probabilities in [0, 1].
  double drop_request = 0;
  double duplicate_request = 0;
  double drop_reply = 0;
  double duplicate_reply = 0;
  double reorder_reply = 0;
  double delay = 0;  // of a stream's start and, separately, of each reply
  absl::Duration min_delay = absl::ZeroDuration();
  absl::Duration max_delay = absl::Milliseconds(20);
  // 0: drawn from the system's entropy (and logged).
  uint64_t seed = 0;

  bool any() const {
    return drop_request > 0 || duplicate_request > 0 || drop_reply > 0 || duplicate_reply > 0 ||
           reorder_reply > 0 || delay > 0;
  }
};

// "drop_reply=0.05,duplicate_request=0.1,delay=0.2,max_delay_ms=20,seed=7":
// the fields above by name (delays in milliseconds as min_delay_ms and
// max_delay_ms). INVALID_ARGUMENT naming the field for an unknown name or a
// value out of range. The empty string injects nothing.
absl::StatusOr<FaultInjection> ParseFaultInjection(absl::string_view spec);

// What the faults did (they are counted, so that a test can check that they
// happened).
struct FaultCounts {
  int64_t requests_dropped = 0;
  int64_t requests_duplicated = 0;
  int64_t replies_dropped = 0;
  int64_t replies_duplicated = 0;
  int64_t replies_reordered = 0;
  int64_t delays = 0;
};

class FaultInjectingTransport final : public ParameterTransport {
 public:
  // INVALID_ARGUMENT for a probability outside [0, 1] or min_delay >
  // max_delay.
  static absl::StatusOr<std::unique_ptr<FaultInjectingTransport>> Create(
      std::unique_ptr<ParameterTransport> inner, const FaultInjection& faults);
  // Runs what is still delayed at once, then waits for it.
  ~FaultInjectingTransport() override;

  int num_servers() const override;
  int channels_per_server() const override;
  bool in_process(int server) const override;
  void StartExchange(int server, int channel, ParameterMethod method,
                     std::vector<grpc::ByteBuffer> requests, absl::Time deadline,
                     SentFn on_sent, ReplyFn on_reply, DoneFn on_done) override;
  // Also runs every delayed start and reply at once.
  void CancelAll() override;

  FaultCounts counts() const;
  uint64_t seed() const;

 private:
  class Impl;
  explicit FaultInjectingTransport(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace pstrain::worker

#endif  // PSTRAIN_WORKER_FAULT_INJECTING_TRANSPORT_H_
