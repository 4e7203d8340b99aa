// The coordinator's job-log reader (JobStore::Open): whatever STATE_DIR/
// jobs.log holds, opening it returns the jobs of its good records and cuts
// off a damaged tail, and opening it again returns the same jobs. Each
// input is tried as it is and with every record's CRC-32 made right, so
// that mutations reach the job parser behind the checksums.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/file_format.h"
#include "common/file_system.h"
#include "google/protobuf/util/field_comparator.h"
#include "google/protobuf/util/message_differencer.h"
#include "server/job_store.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

// The records' CRCs recomputed ([u32 length][u32 crc][bytes] each).
std::string WithRecordCrcs(std::string log) {
  size_t at = 0;
  while (at + 8 <= log.size()) {
    const uint32_t n = pstrain::GetU32(log, at);
    if (n > log.size() - at - 8) break;
    std::string crc;
    pstrain::PutU32(crc, pstrain::Crc32(log.data() + at + 8, n));
    log.replace(at + 4, 4, crc);
    at += 8 + n;
  }
  return log;
}

// A directory for the log, removed at exit: on tmpfs where there is one
// (syncs cost nothing there).
std::string ScratchDir() {
  static char name[64];
  for (const char* parent : {"/dev/shm", "/tmp"}) {
    snprintf(name, sizeof(name), "%s/pstrain-job-log-fuzz-XXXXXX", parent);
    if (mkdtemp(name) != nullptr) {
      atexit([] {
        unlink((std::string(name) + "/jobs.log").c_str());
        rmdir(name);
      });
      return name;
    }
  }
  abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using pstrain::server::JobStore;
  static const std::string& dir = *new std::string(ScratchDir());
  pstrain::FileSystem* fs = pstrain::PosixFileSystem();
  const std::string raw(reinterpret_cast<const char*>(data), size);
  for (const std::string& log : {raw, WithRecordCrcs(raw)}) {
    if (!fs->WriteFileAtomically(dir + "/jobs.log", log).ok()) abort();
    std::vector<pstrain::v1::Job> first, second;
    if (!JobStore::Open(fs, dir, &first).ok()) abort();
    if (!JobStore::Open(fs, dir, &second).ok()) abort();
    if (first.size() != second.size()) abort();
    // Field by field, a NaN equal to itself (a record may hold any float).
    google::protobuf::util::DefaultFieldComparator floats;
    floats.set_treat_nan_as_equal(true);
    google::protobuf::util::MessageDifferencer differencer;
    differencer.set_field_comparator(&floats);
    for (size_t i = 0; i < first.size(); ++i) {
      if (!differencer.Compare(first[i], second[i])) abort();
    }
  }
  return 0;
}
