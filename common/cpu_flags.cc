// --cpus of pstrain-server and pstrain-worker (cpu_affinity.h), apart
// from the CPU lists themselves so that only the programs that honour the
// flag list it in --help.
#include <cstdlib>
#include <iostream>

#include "absl/flags/flag.h"
#include "common/cpu_affinity.h"
#include "common/init.h"
#include "glog/logging.h"

ABSL_FLAG(std::string, cpus, "",
          "CPU list (e.g. 0-3 or 0,2,4-7) that every thread of this process runs on; empty: "
          "wherever the system puts them");

namespace pstrain {

void RunOnlyOnFlagCpus(absl::string_view program) {
  const std::string list = absl::GetFlag(FLAGS_cpus);
  if (list.empty()) return;
  absl::StatusOr<std::vector<int>> cpus = ParseCpuList(list);
  absl::Status status = cpus.ok() ? absl::OkStatus() : cpus.status();
  if (status.ok() && !OnlyCheckingFlags()) status = RunProcessOnlyOn(*cpus);
  if (!status.ok()) {
    std::cerr << program << ": --cpus: " << status.message() << "\n";
    std::exit(2);
  }
  if (!OnlyCheckingFlags()) LOG(INFO) << "running on CPUs " << FormatCpuList(*cpus);
}

}  // namespace pstrain
