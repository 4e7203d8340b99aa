// The in-process carrier of the parameter service: the streams of the
// worker in this very process (a colocated server's), handled by direct
// calls on the worker's thread, with the same limits and errors as over
// gRPC.
#ifndef PSTRAIN_SERVER_IN_PROCESS_SESSIONS_H_
#define PSTRAIN_SERVER_IN_PROCESS_SESSIONS_H_

#include <memory>

#include "common/in_process_service.h"
#include "server/parameter_streams.h"

namespace pstrain::server {

// A session for one transport of this process's worker; it must not
// outlive `context`'s parts.
std::unique_ptr<InProcessService::Session> OpenInProcessSession(const StreamContext& context);

}  // namespace pstrain::server

#endif  // PSTRAIN_SERVER_IN_PROCESS_SESSIONS_H_
