// The direct carrier of the parameter service: the same streams, limits
// and errors as over gRPC, on direct connections (common/direct_connection.h)
// from processes of this machine through shared memory, or from any over
// TCP, in plaintext only (no certificate is checked). Each connection's
// streams are handled on its own thread, as a gRPC stream's are on gRPC's.
#ifndef PSTRAIN_SERVER_DIRECT_PEERS_H_
#define PSTRAIN_SERVER_DIRECT_PEERS_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/direct_connection.h"
#include "server/parameter_streams.h"

namespace pstrain::server {

// The listeners and the connected peers. Thread-safe.
class DirectPeers {
 public:
  explicit DirectPeers(const StreamContext& context);
  ~DirectPeers();  // Stop()

  // Takes shared-memory connections at abstract socket `name` from clients
  // that ask for `instance`. UNAVAILABLE if the name cannot be bound.
  absl::Status ServeSharedMemory(const std::string& name, uint64_t instance,
                                 const ShmOptions& options);
  // Takes direct TCP connections on a free port of `host` from clients
  // that ask for `instance`. Returns the port.
  absl::StatusOr<int> ServeDirectTcp(const std::string& host, uint64_t instance,
                                     const ShmOptions& options);
  // Stops taking either and ends those open (their streams end as a gone
  // client's do). Idempotent.
  void Stop();

 private:
  class Peer;

  // Starts a peer for each connection `listener` accepts.
  absl::Status AddListener(absl::StatusOr<std::unique_ptr<DirectListener>> listener);
  void Accept(std::unique_ptr<DirectConnection> connection);

  const StreamContext context_;
  absl::Mutex mu_;
  std::vector<std::unique_ptr<DirectListener>> listeners_ ABSL_GUARDED_BY(mu_);
  std::vector<std::unique_ptr<Peer>> peers_ ABSL_GUARDED_BY(mu_);
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace pstrain::server

#endif  // PSTRAIN_SERVER_DIRECT_PEERS_H_
