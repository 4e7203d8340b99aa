// The sections of a job file that NormalizeJobSpec (common/job_spec.h)
// leaves to functions of their own: the embedding tables and the click
// model's parts. Internal to it; FieldError-style INVALID_ARGUMENT naming
// the field.
#ifndef PSTRAIN_COMMON_JOB_SPEC_SECTIONS_H_
#define PSTRAIN_COMMON_JOB_SPEC_SECTIONS_H_

#include <string>

#include "absl/status/status.h"
#include "pstrain/v1/job.pb.h"

namespace pstrain::job_spec_sections {

// Fills in an embedding table's defaults and checks its fields; `at` names
// it in errors (tables[i]).
absl::Status NormalizeTable(const std::string& at, v1::EmbeddingTableSpec& t);
// The click model's MLPs, interaction and pooling.
absl::Status NormalizeClickModel(v1::ClickModelSpec& click);
// data.clicks: files or a generator, the layout and the shuffle window.
absl::Status NormalizeClickData(v1::ClickDataSpec& clicks);
// A click model's tables: one dimension, and every field read from one.
absl::Status CheckClickTables(const v1::JobSpec& spec);

}  // namespace pstrain::job_spec_sections

#endif  // PSTRAIN_COMMON_JOB_SPEC_SECTIONS_H_
