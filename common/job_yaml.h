// Job files: YAML text mapped onto a JobSpec by the proto's own field
// names (job.proto documents the fields; docs/job-files.md the files).
#ifndef PSTRAIN_COMMON_JOB_YAML_H_
#define PSTRAIN_COMMON_JOB_YAML_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "pstrain/v1/job.pb.h"

namespace pstrain {

// Maps YAML text onto a JobSpec: keys are the proto's field names, nested
// messages are mappings, repeated fields are sequences, enum values are their
// names without the enum's prefix, in any case. INVALID_ARGUMENT naming the
// field (e.g. "model.hidden[1]: expected an integer") on unknown or duplicate
// keys, wrong types, out-of-range numbers, YAML syntax errors and a text of
// more than kMaxJobFileBytes. Applies no defaults and validates nothing else.
absl::StatusOr<v1::JobSpec> ParseJobSpecYaml(absl::string_view yaml);

// Reads and parses a job file; NOT_FOUND if it cannot be read.
absl::StatusOr<v1::JobSpec> LoadJobSpecFile(const std::string& path);

// INVALID_ARGUMENT "PATH: WHAT" for the field at `path` ("model.hidden[1]"),
// the form of every error about a job's fields.
absl::Status FieldError(const std::string& path, absl::string_view what);

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_JOB_YAML_H_
