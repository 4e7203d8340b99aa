// The coordinator: the control API (submit, get, list, watch, cancel jobs)
// and membership (register, heartbeat, progress). It schedules jobs onto the
// registered servers and workers, computes their partition plans, follows
// their progress and recovers or fails the jobs of nodes that are lost.
//
// coordinator.cc only builds and drives its parts, each in files of its own:
//   control_service.h     the control API (psctl's calls)
//   membership_service.h  register, heartbeat and assignments, progress
//                         reports, node sessions (node_session.h), model
//                         uploads
//   coordinator_state.h   what they share under one lock, and Commit: a
//                         change is decided on copies (a Txn), written to
//                         the job store (job_store.h) with the lock
//                         released, then installed: reads never wait on
//                         the disk, and nothing is acknowledged, or shown to
//                         a node, before it is durable
//   job_table.h           the jobs' records and the Txn
//   control_loop.h        leases, recovery, scheduling, checkpoints, the
//                         targets file (targets_file.h), clean-up, gauges
// and the decisions, functions of the state without gRPC or a clock:
// scheduler.h (placing jobs), recovery.h (generations, checkpoints, lost
// nodes), job_progress.h (reports into progress and results), node_registry.h
// (ids, incarnations, leases), model_store.h (model files and uploads).
#ifndef PSTRAIN_SERVER_COORDINATOR_H_
#define PSTRAIN_SERVER_COORDINATOR_H_

#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/file_system.h"
#include "common/tls.h"
#include "pstrain/v1/control.pb.h"
#include "server/access.h"
#include "server/coordinator_metrics.h"

namespace pstrain::server {

class Coordinator {
 public:
  struct Options {
    // Address to listen on; port 0 picks a free port (see address()).
    std::string listen_address = "127.0.0.1:0";
    // What nodes and clients dial: "host" (with the bound port) or
    // "host:port". Empty: the listen address, which must not be a wildcard.
    std::string advertise_address;
    // Mutual TLS with the coordinator's certificate; null: plaintext, which
    // must listen on loopback unless `insecure`. Must outlive the
    // coordinator.
    const TransportSecurity* security = nullptr;
    bool insecure = false;
    // The users of the control API; nullopt: no tokens (see access.h).
    std::optional<AuthTokens> auth_tokens;
    // Where jobs and model files are kept durably (created if missing).
    // Empty: in memory only, lost when the process ends.
    std::string state_dir;
    // A node that has not heartbeat for this long is lost, and so are its jobs.
    absl::Duration lease = absl::Seconds(10);
    // The heartbeat interval suggested to nodes.
    absl::Duration heartbeat_interval = absl::Milliseconds(500);
    // Events kept per job for watchers that fall behind.
    int max_queued_events = 10000;
    // Metrics; null: not measured. They must outlive the coordinator.
    CoordinatorMetrics* metrics = nullptr;
    RpcMetrics* rpc = nullptr;
    // The coordinator's own /metrics address, listed in the targets file.
    std::string metrics_address;
    // If set, a Prometheus file_sd targets file listing the /metrics of the
    // coordinator and of every live node, with role and node labels; kept up
    // to date as nodes come and go.
    std::string prometheus_sd_file;
    // The checkpoint directory of jobs submitted without one (their
    // checkpoint.dir): a volume every server mounts at this path. Empty:
    // such jobs are not checkpointed.
    std::string default_checkpoint_dir;
    // The file system of the state directory; null: the machine's. Must
    // outlive the coordinator.
    FileSystem* fs = nullptr;
    // The clock of leases; null: the machine's monotonic clock.
    const Clock* clock = nullptr;

    // What peers may make the coordinator hold, each peer or all of them
    // together. Past a limit a request is refused with RESOURCE_EXHAUSTED
    // and a message naming the limit (and changes nothing), or the oldest
    // records are forgotten, as each says. The daemon's --max_* flags.
    struct Limits {
      // Bytes of one request message, any method (the largest are job
      // files of at most 1 MiB and 1 MiB pieces of a model upload); a
      // larger one is refused by gRPC (RESOURCE_EXHAUSTED) before it is
      // parsed.
      int request_bytes = 4 << 20;
      // Bytes of the specs and plans of jobs new to a node in one heartbeat
      // reply; the other new jobs follow in the next heartbeats (each reply
      // carries at least one, whatever its size).
      int64_t heartbeat_reply_bytes = 16 << 20;
      // Jobs waiting to start (PENDING): a submission beyond is refused.
      int queued_jobs = 1000;
      // Finished jobs remembered (their record and model file): beyond,
      // the oldest finished are forgotten.
      int finished_jobs = 10000;
      // Registrations taken in any minute: one beyond is refused.
      int registrations_per_minute = 600;
      // Lost nodes listed: beyond, the longest lost are forgotten.
      int lost_nodes = 1000;
      // A model upload still open this long after it began is cancelled
      // (worker 0 uploads again).
      absl::Duration upload_timeout = absl::Minutes(5);
    };
    Limits limits;
  };

  // Recovers the state directory, then starts serving. UNAVAILABLE if the
  // address cannot be bound; INVALID_ARGUMENT for a wildcard listen address
  // without an advertise address; the job store's error if it cannot be
  // opened.
  static absl::StatusOr<std::unique_ptr<Coordinator>> Create(Options options);
  virtual ~Coordinator() = default;

  // host:port to dial: the advertised address, with the bound port.
  virtual std::string address() const = 0;

  // Ends every watch, stops the gRPC server (calls still running after
  // `grace` are cancelled) and the control loop. Idempotent.
  virtual void Shutdown(absl::Duration grace) = 0;
};

}  // namespace pstrain::server

#endif  // PSTRAIN_SERVER_COORDINATOR_H_
