// A parameter-server process: the shard store behind the parameter service,
// and membership with the coordinator, which says which jobs to hold.
#ifndef PSTRAIN_SERVER_PARAMETER_SERVER_H_
#define PSTRAIN_SERVER_PARAMETER_SERVER_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/parameter_service.h"
#include "server/shard_store.h"

namespace pstrain {
class TransportSecurity;
}  // namespace pstrain

namespace pstrain::server {

class ParameterServer {
 public:
  struct Options {
    // Address to listen on; port 0 picks a free port (see address()).
    std::string listen_address = "127.0.0.1:0";
    // What workers dial: "host" (with the bound port) or "host:port".
    // Empty: the listen address, which must not be a wildcard.
    std::string advertise_address;
    // Coordinator host:port. Empty: no membership; jobs are added through
    // store() directly (tests).
    std::string coordinator_address;
    // The node's id (see MembershipClient::Options::node_id); empty: chosen
    // at random.
    std::string node_id;
    // The worker node whose process this server runs in (pstrain-worker
    // --colocated_server): it serves that worker's colocated jobs only.
    // Empty: a server process of its own.
    std::string colocated_with;
    // Exit (Wait() returns) when the coordinator has not answered for this
    // long; zero: never.
    absl::Duration coordinator_loss_timeout = absl::ZeroDuration();
    ShardStore::Options store;
    // What one client may hold open (parameter_service.h).
    ClientLimits client_limits;
    // Measures the calls; null: not measured. Must outlive the server.
    RpcMetrics* rpc = nullptr;
    // Mutual TLS with the server's certificate, for the parameter service
    // and the calls to the coordinator; null: plaintext, which must listen
    // on loopback unless `insecure`. Must outlive the server.
    const TransportSecurity* security = nullptr;
    bool insecure = false;
    // The server's /metrics address, given to the coordinator.
    std::string metrics_address;
    // Also serve the parameter service on an abstract Unix socket (only in
    // plaintext), which workers of this machine find through Hello and use
    // instead of TCP.
    bool local_socket = true;
    // Also take shared-memory connections (only in plaintext), which
    // workers of this machine find through Hello and prefer to any socket:
    // the parameter service through memory both processes map.
    bool shared_memory = true;
    // Also take direct TCP connections (only in plaintext) on a free port
    // of the listen address's host, which workers of other machines find
    // through Hello and prefer to gRPC: the parameter service's messages
    // on a socket of their own, without HTTP/2.
    bool direct_tcp = true;
    // Their pipes' size and largest message.
    ShmOptions shm{};
  };

  // Starts serving and, with a coordinator, registering and heartbeating.
  // UNAVAILABLE if the address cannot be bound; INVALID_ARGUMENT for a
  // wildcard listen address without an advertise address.
  static absl::StatusOr<std::unique_ptr<ParameterServer>> Create(Options options);
  virtual ~ParameterServer() = default;

  // host:port to dial (the advertised address, with the bound port), as
  // registered with the coordinator.
  virtual std::string address() const = 0;
  virtual ShardStore& store() = 0;
  // Its parameter service for a worker of this process (colocated): must
  // not be used after Shutdown.
  virtual InProcessService& in_process() = 0;
  // The port of its direct TCP connections; 0: none.
  virtual int direct_tcp_port() const = 0;

  // Makes Wait() return. Thread-safe, async-signal context excluded.
  virtual void RequestStop() = 0;
  // Blocks until RequestStop(), the loss of the coordinator, or until
  // another process took the node's id (fenced()).
  virtual void Wait() = 0;
  // True once the coordinator said another process holds the node's id.
  virtual bool fenced() const = 0;
  // OK once registered with the coordinator (at once without one), until
  // Shutdown; else UNAVAILABLE saying why. The gRPC health service says
  // SERVING exactly then.
  virtual absl::Status Readiness() const = 0;
  // Stops heartbeats, ends every open wait, and stops the gRPC server
  // (calls still running after `grace` are cancelled). Idempotent.
  virtual void Shutdown(absl::Duration grace) = 0;
};

}  // namespace pstrain::server

#endif  // PSTRAIN_SERVER_PARAMETER_SERVER_H_
