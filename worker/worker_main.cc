// pstrain-worker: trains the jobs the coordinator assigns, one at a time.
#include <iostream>

#include "absl/flags/flag.h"
#include "common/init.h"
#include "common/process.h"
#include "glog/logging.h"
#include "kernels/cpu/cpu_kernels.h"
#include "worker/worker_node.h"

ABSL_FLAG(std::string, coordinator, "", "coordinator host:port (required)");
ABSL_FLAG(int, coordinator_loss_exit_s, 0,
          "exit when the coordinator has not answered for this many seconds; 0: never");
ABSL_FLAG(int, blas_threads, 1, "OpenBLAS threads in this process");
ABSL_FLAG(int, report_interval_ms, 500, "interval of progress reports to the coordinator");
ABSL_FLAG(int, step_delay_ms, 0, "testing: sleep this long in every training step");

int main(int argc, char** argv) {
  pstrain::InitMain(argc, argv, "pstrain-worker --coordinator=host:port [flags]");
  pstrain::worker::WorkerNode::Options options;
  options.coordinator_address = absl::GetFlag(FLAGS_coordinator);
  options.coordinator_loss_timeout = absl::Seconds(absl::GetFlag(FLAGS_coordinator_loss_exit_s));
  options.report_interval = absl::Milliseconds(absl::GetFlag(FLAGS_report_interval_ms));
  options.step_delay = absl::Milliseconds(absl::GetFlag(FLAGS_step_delay_ms));
  if (options.coordinator_address.empty()) {
    std::cerr << "pstrain-worker: --coordinator is required\n";
    return 2;
  }
  if (absl::GetFlag(FLAGS_blas_threads) < 1) {
    std::cerr << "pstrain-worker: --blas_threads must be >= 1\n";
    return 2;
  }
  pstrain::kernels::SetBlasThreads(absl::GetFlag(FLAGS_blas_threads));
  pstrain::StopOnSignal signals;
  auto node = pstrain::worker::WorkerNode::Create(options);
  if (!node.ok()) {
    std::cerr << "pstrain-worker: " << node.status() << "\n";
    return 1;
  }
  signals.OnSignal([&] { (*node)->RequestStop(); });
  (*node)->Wait();
  signals.OnSignal(nullptr);
  (*node)->Shutdown();
  return 0;
}
