// The job-spec parser, both ways a spec arrives: the YAML of a job file
// (psctl submit, pstrain-local) and the protobuf of a SubmitJobRequest (any
// gRPC client). Whatever the bytes, the parser returns a spec or an error;
// a spec that normalizes is accepted again unchanged.
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/job_spec.h"
#include "google/protobuf/util/message_differencer.h"
#include "pstrain/v1/control.pb.h"

namespace {

// A spec as parsed: normalizing it gives a spec or an error; an accepted
// spec normalizes to itself, and what the nodes derive from it is defined.
void CheckSpec(const pstrain::v1::JobSpec& parsed) {
  absl::StatusOr<pstrain::v1::JobSpec> spec = pstrain::NormalizeJobSpec(parsed);
  if (!spec.ok()) return;
  absl::StatusOr<pstrain::v1::JobSpec> again = pstrain::NormalizeJobSpec(*spec);
  if (!again.ok() || !google::protobuf::util::MessageDifferencer::Equals(*again, *spec)) abort();
  if (pstrain::TotalSteps(*spec) <= 0 || pstrain::StepsPerEpoch(*spec) <= 0) abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  absl::StatusOr<pstrain::v1::JobSpec> yaml =
      pstrain::ParseJobSpecYaml(absl::string_view(reinterpret_cast<const char*>(data), size));
  if (yaml.ok()) CheckSpec(*yaml);

  pstrain::v1::JobSpec proto;
  if (proto.ParseFromArray(data, static_cast<int>(size))) CheckSpec(proto);
  return 0;
}
