// The flags of services: pstrain-server and pstrain-coordinator
// (daemon_flags.h).
#include "common/daemon_flags.h"

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "common/init.h"

ABSL_FLAG(std::string, listen, "",
          "host:port of the service (the coordinator's control and membership APIs, a "
          "server's parameter service); port 0 picks a free port; default: 127.0.0.1:50050 "
          "for pstrain-coordinator, 127.0.0.1:0 for pstrain-server");
ABSL_FLAG(std::string, advertise_address, "",
          "what peers dial: host (with the bound port) or host:port, in which a server's "
          "{node_id} stands for its id (e.g. {node_id}.pstrain-server:50051 in a "
          "StatefulSet); required when --listen is a wildcard (0.0.0.0, [::]); default: the "
          "listen address");
ABSL_FLAG(std::string, address_file, "",
          "if set, write the bound host:port to this file once serving");
ABSL_FLAG(std::string, fs_fault_injection, "",
          "testing only: make writes to files whose path contains PATTERN fail or crash the "
          "process: no_space:PATTERN[:ROOM_BYTES], io_error:PATTERN or crash:PATTERN:BYTES");

namespace pstrain {

ServiceFlags ServiceFlagsFromFlags(absl::string_view program, const std::string& default_listen) {
  ServiceFlags flags;
  flags.listen = absl::GetFlag(FLAGS_listen);
  if (flags.listen.empty()) flags.listen = default_listen;
  flags.advertise_address = absl::GetFlag(FLAGS_advertise_address);
  flags.address_file = absl::GetFlag(FLAGS_address_file);
  absl::StatusOr<std::unique_ptr<FaultInjectingFileSystem>> faulty_fs =
      FaultInjectingFileSystem::FromSpec(absl::GetFlag(FLAGS_fs_fault_injection));
  if (!faulty_fs.ok()) {
    ExitForBadFlag(program, absl::StrCat("--fs_fault_injection: ", faulty_fs.status().message()));
  }
  flags.faulty_fs = *std::move(faulty_fs);
  return flags;
}

}  // namespace pstrain
