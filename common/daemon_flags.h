// The flags that pstrain's daemons share, defined once, as tls_flags.h
// defines the TLS ones (the exception to "flags live in main()": one
// definition instead of two or three copies). Each group below is defined in
// a file of its own (metrics_flags.cc, node_flags.cc, service_flags.cc), so
// a daemon registers only the groups whose functions it calls. These check
// the flags and, for a bad value, exit 2 with a line on stderr that names
// the flag:
//   every daemon              --metrics_host, --metrics_port,
//                             --metrics_job_grace_s
//   nodes (server, worker)    --coordinator, --node_id,
//                             --coordinator_loss_exit_s, --max_memory_bytes,
//                             --checkpoint_root, --shared_memory, --direct_tcp,
//                             --processes_sharing_cpus
//   services (server,         --listen, --advertise_address, --address_file,
//   coordinator)              --fs_fault_injection
#ifndef PSTRAIN_COMMON_DAEMON_FLAGS_H_
#define PSTRAIN_COMMON_DAEMON_FLAGS_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/file_system.h"
#include "common/metrics.h"

namespace pstrain {

// How long a finished job's series stay exported (--metrics_job_grace_s).
absl::Duration MetricsJobGraceFromFlags(absl::string_view program);
// /metrics served on --metrics_host:--metrics_port (ServeMetrics).
std::unique_ptr<MetricsServer> ServeMetricsFromFlags();

struct NodeFlags {
  std::string coordinator;  // --coordinator, required
  // --node_id, else $PSTRAIN_NODE_ID; empty: the coordinator chooses.
  std::string node_id;
  // --coordinator_loss_exit_s; zero: never.
  absl::Duration coordinator_loss_timeout;
  // --max_memory_bytes: -1 (the daemon's share of the memory it may use),
  // 0 (unlimited) or a positive number.
  int64_t max_memory_bytes = -1;
  std::string checkpoint_root;  // --checkpoint_root; empty: anywhere
  // Shared-memory and direct TCP connections: a server takes them, a
  // worker makes them (plaintext only).
  bool shared_memory = true;
  bool direct_tcp = true;
  // --processes_sharing_cpus: the pstrain processes (this one included)
  // that share the CPUs this one may use; its compute threads are their
  // share (cpu_budget.h). A launcher sets it; 1 by default.
  int processes_sharing_cpus = 1;
};
NodeFlags NodeFlagsFromFlags(absl::string_view program);

struct ServiceFlags {
  // --listen: host:port, port 0 a free one; empty: `default_listen`.
  std::string listen;
  std::string advertise_address;  // --advertise_address
  std::string address_file;       // --address_file; empty: none
  // --fs_fault_injection (testing): the file system to use; null: the
  // machine's.
  std::unique_ptr<FaultInjectingFileSystem> faulty_fs;
};
ServiceFlags ServiceFlagsFromFlags(absl::string_view program, const std::string& default_listen);

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_DAEMON_FLAGS_H_
