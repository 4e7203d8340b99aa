// The metrics a training script reports of its own (Client::ReportMetrics,
// pstrain.torch's step(metrics=...) and finish(metrics=...)): what the
// client library and the coordinator accept.
#ifndef PSTRAIN_COMMON_SCRIPT_METRICS_H_
#define PSTRAIN_COMMON_SCRIPT_METRICS_H_

#include <string>

#include "absl/status/status.h"
#include "google/protobuf/map.h"

namespace pstrain {

// Names a worker may give in all (each is a Prometheus series of the job).
inline constexpr int kMaxScriptMetrics = 32;

// INVALID_ARGUMENT unless each name is 1-64 of [A-Za-z0-9_] not starting
// with a digit, each value finite, and there are at most kMaxScriptMetrics
// names; the message names what is wrong.
absl::Status CheckScriptMetrics(const google::protobuf::Map<std::string, double>& metrics);

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_SCRIPT_METRICS_H_
