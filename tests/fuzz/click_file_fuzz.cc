// The click-log reader. The input's first byte picks a layout (its low four
// bits the integer columns, its high four bits one less than the
// categorical ones); the rest is a file, plain or gzip. Whatever the
// bytes, ReadClickFiles returns samples of that layout or INVALID_ARGUMENT,
// and ParseClickLine on each line appends one well-formed sample or,
// refusing it, leaves the batch as it was.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "common/click_data.h"

namespace {

void CheckShape(const pstrain::ClickBatch& batch) {
  const int64_t n = batch.size();
  if (static_cast<int64_t>(batch.dense.size()) != n * batch.layout.dense ||
      static_cast<int64_t>(batch.bag_starts.size()) != n * batch.layout.fields + 1 ||
      batch.bag_starts.back() != static_cast<int64_t>(batch.keys.size())) {
    abort();
  }
  for (size_t i = 0; i + 1 < batch.bag_starts.size(); ++i) {
    if (batch.bag_starts[i] > batch.bag_starts[i + 1]) abort();
  }
  for (float label : batch.labels) {
    if (label != 0.0f && label != 1.0f) abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const pstrain::ClickLayout layout{.dense = data[0] & 15, .fields = 1 + (data[0] >> 4)};
  const std::string file(reinterpret_cast<const char*>(data) + 1, size - 1);

  pstrain::ClickBatch lines;
  lines.layout = layout;
  for (size_t begin = 0; begin <= file.size();) {
    size_t end = file.find('\n', begin);
    if (end == std::string::npos) end = file.size();
    const pstrain::ClickBatch before = lines;
    const absl::Status status =
        pstrain::ParseClickLine(absl::string_view(file).substr(begin, end - begin), lines);
    if (status.ok() ? lines.size() != before.size() + 1
                    : status.code() != absl::StatusCode::kInvalidArgument || !(lines == before)) {
      abort();
    }
    begin = end + 1;
  }
  CheckShape(lines);

  static const std::string path = "/tmp/pstrain-click-fuzz." + std::to_string(getpid());
  FILE* out = fopen(path.c_str(), "wb");
  if (out == nullptr) abort();
  fwrite(file.data(), 1, file.size(), out);
  fclose(out);
  const absl::StatusOr<pstrain::ClickBatch> read = pstrain::ReadClickFiles({path}, layout);
  unlink(path.c_str());
  if (!read.ok()) {
    if (read.status().code() != absl::StatusCode::kInvalidArgument) abort();
    return 0;
  }
  CheckShape(*read);
  return 0;
}
