// Model files: a finished job's parameters with the spec that gives them
// meaning. Layout (all integers little-endian):
//   "PSTM" | u32 format version (1) | u32 n | n bytes v1::ModelFileHeader |
//   header.total_floats fp32 values, the model's tensors in flat order.
#ifndef PSTRAIN_COMMON_MODEL_FILE_H_
#define PSTRAIN_COMMON_MODEL_FILE_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "pstrain/v1/job.pb.h"

namespace pstrain {

struct ModelFile {
  v1::ModelFileHeader header;
  std::vector<float> params;
};

// The file's bytes for `params` of a job with `spec` (normalized).
std::string EncodeModelFile(const std::string& job_id, const v1::JobSpec& spec,
                            const std::vector<float>& params);

// INVALID_ARGUMENT, saying what is wrong, for a truncated file, a wrong
// magic or version, a header that does not describe the spec's model, or a
// checksum mismatch.
absl::StatusOr<ModelFile> DecodeModelFile(absl::string_view bytes);

absl::StatusOr<ModelFile> ReadModelFile(const std::string& path);

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_MODEL_FILE_H_
