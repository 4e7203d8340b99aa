#include "common/init.h"

#include <malloc.h>

#include <csignal>
#include <cstdlib>
#include <iostream>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/files.h"
#include "common/metrics.h"
#include "glog/logging.h"

ABSL_FLAG(bool, check_flags, false,
          "check the command line, print 'flags ok' and exit 0 without starting anything");

namespace pstrain {

bool OnlyCheckingFlags() { return absl::GetFlag(FLAGS_check_flags); }

void ExitForBadFlag(absl::string_view program, absl::string_view what) {
  std::cerr << program << ": " << what << "\n";
  std::exit(2);
}

void ExitIfOnlyCheckingFlags() {
  if (!OnlyCheckingFlags()) return;
  std::cout << "flags ok" << std::endl;
  std::exit(0);
}

void HelpListsOwnFlags() {
  // By default Abseil lists those of a file named after the program, which
  // none of ours is.
  absl::FlagsUsageConfig help;
  help.contains_help_flags = [](absl::string_view file) {
    return !absl::StrContains(file, "absl/");
  };
  help.contains_helpshort_flags = help.contains_help_flags;
  absl::SetFlagsUsageConfig(help);
}

void InitMain(int argc, char** argv, absl::string_view usage) {
  absl::SetProgramUsageMessage(usage);
  HelpListsOwnFlags();
  absl::ParseCommandLine(argc, argv);
  FLAGS_logtostderr = true;
  google::InitGoogleLogging(argv[0]);
  // A crash writes its stack trace to the log. glog's handler also takes
  // SIGTERM, which the daemons handle as a graceful stop: that one goes back.
  google::InstallFailureSignalHandler();
  std::signal(SIGTERM, SIG_DFL);
  SkipMutexDeadlockDetection();
  KeepFreedMemoryForReuse();
}

void KeepFreedMemoryForReuse() {
  // Where glibc's own dynamic thresholds end up after a 32 MiB buffer is
  // freed; setting one fixes both, so both are set.
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 64 << 20);
}

void SkipMutexDeadlockDetection() {
#ifdef NDEBUG
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
#endif
}

void PublishAddress(const std::string& path, const std::string& address) {
  if (path.empty()) return;
  if (absl::Status s = WriteFileAtomically(path, address + "\n"); !s.ok()) {
    std::cerr << "cannot write the address file: " << s << "\n";
    std::exit(1);
  }
}

std::unique_ptr<MetricsServer> ServeMetrics(const std::string& host, int port) {
  absl::StatusOr<std::unique_ptr<MetricsServer>> metrics =
      MetricsServer::Create(absl::StrCat(host, ":", port));
  if (!metrics.ok()) {
    std::cerr << "cannot serve metrics: " << metrics.status() << "\n";
    std::exit(1);
  }
  LOG(INFO) << "metrics on http://" << (*metrics)->address() << "/metrics";
  return std::move(*metrics);
}

}  // namespace pstrain
