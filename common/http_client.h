// A minimal HTTP/1.0 client for the plain-text endpoints pstrain's processes
// and Prometheus serve (/metrics, /healthz, /readyz, /api/v1/...): probes
// (`psctl health`) and tests. No TLS, no redirects, no chunked encoding.
#ifndef PSTRAIN_COMMON_HTTP_CLIENT_H_
#define PSTRAIN_COMMON_HTTP_CLIENT_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace pstrain {

struct HttpResponse {
  int status = 0;  // e.g. 200, 503
  std::string body;
};

// GET `path` (with its query) from `host_port` ("host:port", "[v6]:port"; a
// name is resolved), the whole exchange within `timeout`. UNAVAILABLE if it
// cannot connect or gets no complete response; INVALID_ARGUMENT for an
// address that is not host:port. Bodies beyond 64 MiB are refused.
absl::StatusOr<HttpResponse> HttpGet(const std::string& host_port, const std::string& path,
                                     absl::Duration timeout);

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_HTTP_CLIENT_H_
