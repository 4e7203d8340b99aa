// The client library's calls of the control API (include/pstrain/client.h):
// submitting a job, and the checks a joining worker makes. Internal to
// client.cc and client_control.cc.
#ifndef PSTRAIN_WORKER_CLIENT_CONTROL_H_
#define PSTRAIN_WORKER_CLIENT_CONTROL_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/tls.h"
#include "pstrain/client.h"

namespace pstrain {

// INVALID_ARGUMENT naming the field unless `c` names a coordinator and a
// positive timeout.
absl::Status CheckConnect(const ConnectOptions& c);

// The TLS identity of c's files; null without them (plaintext).
absl::StatusOr<std::unique_ptr<TransportSecurity>> LoadSecurity(const ConnectOptions& c);

// OK if job `job_id` exists and trains an external model, which this
// process may then run as a worker; INVALID_ARGUMENT for a built-in model
// (pool workers run it); the coordinator's error otherwise (retried while
// it is UNAVAILABLE, within c.timeout).
absl::Status CheckJobIsExternal(const ConnectOptions& c, const TransportSecurity* security,
                                const std::string& job_id);

}  // namespace pstrain

#endif  // PSTRAIN_WORKER_CLIENT_CONTROL_H_
