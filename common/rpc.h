// gRPC helpers: the one place where absl::Status and grpc::Status meet,
// channel construction with deliberate limits, and deadlines.
#ifndef PSTRAIN_COMMON_RPC_H_
#define PSTRAIN_COMMON_RPC_H_

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"

namespace pstrain {

// Largest gRPC message any pstrain process sends or accepts: the largest
// chunk (64 MiB, the job-spec limit) plus room for the frame header.
inline constexpr int kMaxMessageBytes = 64 * 1024 * 1024 + 64 * 1024;

grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

class RpcMetrics;
class TransportSecurity;
enum class PeerRole;

struct ChannelOptions {
  // Mutual TLS with this process's certificate; null: plaintext.
  const TransportSecurity* security = nullptr;
  // With TLS: the roles the server's certificate may carry (e.g. only a
  // coordinator's); empty: any role.
  std::vector<PeerRole> peer_roles = {};
  // Makes channels with otherwise identical arguments distinct, so that they
  // do not share one TCP connection.
  int pool_index = 0;
  // Measures the channel's calls; null: not measured.
  RpcMetrics* metrics = nullptr;
};

// A channel to `address` with pstrain's message limits, keepalive and
// reconnect settings.
std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address,
                                           const ChannelOptions& options = {});

// Applies pstrain's limits to a server under construction, measures its
// calls with `metrics` if set, and has it serve the standard health service
// (grpc.health.v1.Health, all services SERVING until the server's owner
// says otherwise through grpc::Server::GetHealthCheckService()).
void ConfigureServerBuilder(grpc::ServerBuilder& builder, RpcMetrics* metrics = nullptr);

// What peers dial to reach a server that listens on `listen` and was bound
// to `port`: `advertise` ("host", taking the bound port, or "host:port"), or
// else listen's host when it is not a wildcard. INVALID_ARGUMENT naming
// --advertise_address when the host is a wildcard (0.0.0.0, ::, empty) and
// no advertise address is given, or when the advertise address is not a
// host[:port].
absl::StatusOr<std::string> AdvertisedAddress(const std::string& listen,
                                              const std::string& advertise, int port);

// The host of "host:port" or "[v6]:port" as getaddrinfo takes it: "::1"
// for "[::1]:80"; empty for a wildcard host (every address of the machine).
std::string SocketHost(const std::string& address);

inline std::chrono::system_clock::time_point ToChronoTime(absl::Time t) {
  return absl::ToChronoTime(t);
}

// The metadata that carries a user's bearer token: "authorization: Bearer TOKEN".
inline constexpr char kAuthorizationKey[] = "authorization";
inline constexpr char kBearerPrefix[] = "Bearer ";

// Adds `token` to the call as its bearer token; nothing if it is empty.
inline void AddBearerToken(grpc::ClientContext& context, const std::string& token) {
  if (!token.empty()) context.AddMetadata(kAuthorizationKey, kBearerPrefix + token);
}

// Sets the deadline of `context` to now + timeout.
inline void SetTimeout(grpc::ClientContext& context, absl::Duration timeout) {
  context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
}

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_RPC_H_
