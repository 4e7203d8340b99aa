// The model-file reader (psctl export's files, pstrain-local's output):
// whatever the bytes, DecodeModelFile returns a model of as many values as
// its header says, or INVALID_ARGUMENT. Each input is tried as it is and
// with the header's payload CRC-32 made right, so that mutations reach the
// checks behind the checksum.
#include <cstdint>
#include <cstdlib>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/file_format.h"
#include "common/model_file.h"
#include "pstrain/v1/job.pb.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

// "PSTM" | version | n | header (n bytes) | payload, with the header's
// payload_crc32 set to the payload's; the input itself if it has no header.
std::string WithPayloadCrc(const std::string& file) {
  if (file.size() < 12) return file;
  const uint32_t n = pstrain::GetU32(file, 8);
  pstrain::v1::ModelFileHeader header;
  if (n > file.size() - 12 || !header.ParseFromArray(file.data() + 12, static_cast<int>(n))) {
    return file;
  }
  header.set_payload_crc32(pstrain::Crc32(file.data() + 12 + n, file.size() - 12 - n));
  const std::string header_bytes = header.SerializeAsString();
  std::string out = file.substr(0, 8);
  pstrain::PutU32(out, static_cast<uint32_t>(header_bytes.size()));
  return out + header_bytes + file.substr(12 + n);
}

void Check(const std::string& bytes) {
  absl::StatusOr<pstrain::ModelFile> model = pstrain::DecodeModelFile(bytes);
  if (!model.ok()) {
    if (model.status().code() != absl::StatusCode::kInvalidArgument) abort();
    return;
  }
  if (static_cast<int64_t>(model->params.size()) != model->header.total_floats()) abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  Check(bytes);
  Check(WithPayloadCrc(bytes));
  return 0;
}
