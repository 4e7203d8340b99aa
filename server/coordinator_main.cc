// pstrain-coordinator: the control plane.
#include <iostream>

#include "absl/flags/flag.h"
#include "common/init.h"
#include "common/process.h"
#include "glog/logging.h"
#include "server/coordinator.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:50050",
          "host:port for the control and membership APIs; port 0 picks a free port");
ABSL_FLAG(std::string, address_file, "",
          "if set, write the bound host:port to this file once serving");
ABSL_FLAG(std::string, state_dir, "",
          "directory for the durable job log and model files; empty: keep nothing");
ABSL_FLAG(int, lease_s, 10, "seconds without a heartbeat after which a node is lost");
ABSL_FLAG(int, heartbeat_interval_ms, 500, "heartbeat interval suggested to nodes");

int main(int argc, char** argv) {
  pstrain::InitMain(argc, argv, "pstrain-coordinator [--listen=host:port] [flags]");
  pstrain::server::Coordinator::Options options;
  options.listen_address = absl::GetFlag(FLAGS_listen);
  options.state_dir = absl::GetFlag(FLAGS_state_dir);
  options.lease = absl::Seconds(absl::GetFlag(FLAGS_lease_s));
  options.heartbeat_interval = absl::Milliseconds(absl::GetFlag(FLAGS_heartbeat_interval_ms));
  if (options.lease <= absl::ZeroDuration() || options.heartbeat_interval <= absl::ZeroDuration()) {
    std::cerr << "--lease_s and --heartbeat_interval_ms must be positive\n";
    return 2;
  }
  pstrain::StopOnSignal signals;
  auto coordinator = pstrain::server::Coordinator::Create(options);
  if (!coordinator.ok()) {
    std::cerr << "pstrain-coordinator: " << coordinator.status() << "\n";
    return 1;
  }
  LOG(INFO) << "coordinator listening on " << (*coordinator)->address();
  pstrain::PublishAddress(absl::GetFlag(FLAGS_address_file), (*coordinator)->address());
  signals.Wait();
  LOG(INFO) << "shutting down";
  (*coordinator)->Shutdown(absl::Seconds(2));
  return 0;
}
