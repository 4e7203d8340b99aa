#include "common/rpc.h"

#include <algorithm>
#include <mutex>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/metrics.h"
#include "common/tls.h"
#include "grpcpp/health_check_service_interface.h"

namespace pstrain {

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()),
                      std::string(status.message()));
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      status.error_message());
}

std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address,
                                           const ChannelOptions& options) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(kMaxMessageBytes);
  args.SetMaxSendMessageSize(kMaxMessageBytes);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 30000);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 10000);
  // Reconnect soon after a peer restarts (gRPC's default backoff grows to
  // two minutes).
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 2000);
  // A distinct argument per pool member keeps gRPC from sharing one subchannel.
  args.SetInt("pstrain.channel_pool_index", options.pool_index);
  std::shared_ptr<grpc::ChannelCredentials> credentials =
      options.security == nullptr ? grpc::InsecureChannelCredentials()
                                  : options.security->ChannelCredentials(options.peer_roles);
  if (options.metrics == nullptr) return grpc::CreateCustomChannel(address, credentials, args);
  return grpc::experimental::CreateCustomChannelWithInterceptors(
      address, credentials, args, options.metrics->ClientInterceptors());
}

void ConfigureServerBuilder(grpc::ServerBuilder& builder, RpcMetrics* metrics) {
  // A process-wide switch that servers built afterwards read.
  static std::once_flag health;
  std::call_once(health, [] { grpc::EnableDefaultHealthCheckService(true); });
  builder.SetMaxReceiveMessageSize(kMaxMessageBytes);
  builder.SetMaxSendMessageSize(kMaxMessageBytes);
  if (metrics != nullptr) builder.experimental().SetInterceptorCreators(metrics->ServerInterceptors());
}

namespace {

// host and port of "host:port" or "[v6]:port"; the port is empty if absent.
std::pair<std::string, std::string> SplitHostPort(const std::string& address) {
  if (!address.empty() && address.front() == '[') {
    const size_t close = address.find(']');
    if (close == std::string::npos) return {address, ""};
    const std::string host = address.substr(0, close + 1);
    return {host, close + 1 < address.size() && address[close + 1] == ':'
                      ? address.substr(close + 2)
                      : ""};
  }
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || address.find(':') != colon) return {address, ""};
  return {address.substr(0, colon), address.substr(colon + 1)};
}

bool IsWildcardHost(const std::string& host) {
  return host.empty() || host == "0.0.0.0" || host == "::" || host == "[::]" || host == "*";
}

}  // namespace

std::string SocketHost(const std::string& address) {
  std::string host = SplitHostPort(address).first;
  if (IsWildcardHost(host)) return "";
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  return host;
}

absl::StatusOr<std::string> AdvertisedAddress(const std::string& listen,
                                              const std::string& advertise, int port) {
  if (!advertise.empty()) {
    auto [host, port_text] = SplitHostPort(advertise);
    int given = 0;
    const bool host_ok =
        !host.empty() && !IsWildcardHost(host) &&
        std::all_of(host.begin(), host.end(), [](char c) {
          return absl::ascii_isalnum(c) || c == '.' || c == '-' || c == '_' || c == '[' ||
                 c == ']' || c == ':';
        });
    if (!host_ok || (!port_text.empty() && (!absl::SimpleAtoi(port_text, &given) || given <= 0 ||
                                            given > 65535))) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--advertise_address: '", advertise, "' is not a host or host:port that peers can dial"));
    }
    return port_text.empty() ? absl::StrCat(host, ":", port) : advertise;
  }
  const std::string host = SplitHostPort(listen).first;
  if (IsWildcardHost(host)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--advertise_address is required: the listen address ", listen,
        " is a wildcard, which peers cannot dial"));
  }
  return absl::StrCat(host, ":", port);
}

}  // namespace pstrain
