// Linked into every fuzz target: libFuzzer calls this once before the
// first input.
#include "glog/logging.h"
#include "google/protobuf/stubs/logging.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  // The errors the code under test logs for bad input would flood the run.
  FLAGS_minloglevel = google::GLOG_FATAL;
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}
