// The flags every daemon has (daemon_flags.h). Each group has a file of its
// own, so that a daemon registers only the flags it reads.
#include "common/daemon_flags.h"

#include "absl/flags/flag.h"
#include "common/init.h"

ABSL_FLAG(std::string, metrics_host, "127.0.0.1", "host to serve /metrics on");
ABSL_FLAG(int, metrics_port, 0, "port to serve /metrics on; 0 picks a free port (logged)");
ABSL_FLAG(int, metrics_job_grace_s, 300,
          "seconds a finished job's metric series are still exported");

namespace pstrain {

absl::Duration MetricsJobGraceFromFlags(absl::string_view program) {
  const int seconds = absl::GetFlag(FLAGS_metrics_job_grace_s);
  if (seconds < 0) ExitForBadFlag(program, "--metrics_job_grace_s must be >= 0");
  return absl::Seconds(seconds);
}

std::unique_ptr<MetricsServer> ServeMetricsFromFlags() {
  return ServeMetrics(absl::GetFlag(FLAGS_metrics_host), absl::GetFlag(FLAGS_metrics_port));
}

}  // namespace pstrain
