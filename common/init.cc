#include "common/init.h"

#include <cstdlib>
#include <iostream>

#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "common/files.h"
#include "glog/logging.h"

namespace pstrain {

void InitMain(int argc, char** argv, absl::string_view usage) {
  absl::SetProgramUsageMessage(usage);
  absl::ParseCommandLine(argc, argv);
  FLAGS_logtostderr = true;
  google::InitGoogleLogging(argv[0]);
}

void PublishAddress(const std::string& path, const std::string& address) {
  if (path.empty()) return;
  if (absl::Status s = WriteFileAtomically(path, address + "\n"); !s.ok()) {
    std::cerr << "cannot write the address file: " << s << "\n";
    std::exit(1);
  }
}

}  // namespace pstrain
