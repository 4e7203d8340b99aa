// A worker process: registers with the coordinator, runs the job it is given
// (one at a time), reports progress, and stops a job the coordinator no
// longer lists.
#ifndef PSTRAIN_WORKER_WORKER_NODE_H_
#define PSTRAIN_WORKER_WORKER_NODE_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "worker/devices.h"
#include "worker/transport.h"
#include "worker/worker_metrics.h"

namespace pstrain::worker {

class WorkerNode {
 public:
  struct Options {
    std::string coordinator_address;  // host:port, required
    // The node's id (see MembershipClient::Options::node_id); empty: chosen
    // at random.
    std::string node_id;
    // Wait() returns when the coordinator has not answered for this long;
    // zero: never.
    absl::Duration coordinator_loss_timeout = absl::ZeroDuration();
    absl::Duration report_interval = absl::Milliseconds(500);
    // The devices every job runs on.
    DeviceList devices;
    // Metrics; null: not measured. They must outlive the node.
    WorkerMetrics* metrics = nullptr;
    RpcMetrics* rpc = nullptr;
    // Mutual TLS with the worker's certificate to the coordinator; null:
    // plaintext. (The transports to the servers take theirs from
    // make_transport.) Must outlive the node.
    const TransportSecurity* security = nullptr;
    // Makes the transports to the parameter servers; default: gRPC with
    // default options.
    TransportFactory make_transport;
    // The worker's /metrics address, given to the coordinator.
    std::string metrics_address;
    // A job's data.dir must lie in this directory (symbolic links
    // resolved); empty: anywhere.
    std::string data_root;
    // The bytes a job may take in this process (WorkerBytesNeeded), told
    // to the coordinator, which places only jobs that fit; 0: unlimited.
    int64_t max_memory_bytes = 0;
  };

  // INVALID_ARGUMENT without a coordinator address.
  static absl::StatusOr<std::unique_ptr<WorkerNode>> Create(Options options);
  virtual ~WorkerNode() = default;

  virtual void RequestStop() = 0;
  // Blocks until RequestStop(), the loss of the coordinator, or until
  // another process took the node's id (fenced()).
  virtual void Wait() = 0;
  // True once the coordinator said another process holds the node's id.
  virtual bool fenced() const = 0;
  // OK while registered with the coordinator and not shutting down; else
  // UNAVAILABLE saying why.
  virtual absl::Status Readiness() const = 0;
  // Cancels the running job (it is not reported finished) and stops
  // heartbeating. Idempotent.
  virtual void Shutdown() = 0;
};

}  // namespace pstrain::worker

#endif  // PSTRAIN_WORKER_WORKER_NODE_H_
