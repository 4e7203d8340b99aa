// The transport CreateGrpcTransport makes: it finds out how each server is
// reached (its Hello: this process's own server, a same-machine socket,
// shared memory, a direct TCP port) and starts every exchange on the first
// carrier (carrier.h) that takes it: in-process, then direct, then gRPC.
#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "common/chunk_codec.h"
#include "common/direct_connection.h"
#include "common/in_process_service.h"
#include "common/rpc.h"
#include "common/status.h"
#include "glog/logging.h"
#include "grpcpp/generic/generic_stub.h"
#include "worker/carrier.h"
#include "worker/direct_carrier.h"
#include "worker/grpc_carrier.h"
#include "worker/in_process_carrier.h"
#include "worker/routing_transport.h"
#include "worker/transport.h"

namespace pstrain::worker {
namespace {

// How a transport reaches one server: the address its channels dial, and
// direct connections if the server takes them: options.shm_connections
// through shared memory if it is a process of this machine, else one over
// TCP.
struct ServerRoute {
  std::string dial;
  std::vector<std::unique_ptr<DirectConnection>> direct;  // none: gRPC only
  bool in_process = false;  // the server of this process (options.in_process)
};

// The server's Hello reply over `target`; nullopt if there is none in time.
std::optional<v1::HelloReply> Hello(const std::string& target, absl::Duration timeout) {
  static std::atomic<int> next_pool_index{1 << 20};  // apart from the data channels
  grpc::GenericStub stub(MakeChannel(target, {.pool_index = next_pool_index++}));
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  grpc::Slice empty(v1::HelloRequest().SerializeAsString());
  const grpc::ByteBuffer request(&empty, 1);
  grpc::ByteBuffer response;
  absl::Notification done;
  grpc::Status status;
  stub.UnaryCall(&context, kHelloMethod, grpc::StubOptions(), &request, &response,
                 [&](grpc::Status s) {
                   status = std::move(s);
                   done.Notify();
                 });
  done.WaitForNotification();
  std::vector<grpc::Slice> slices;
  if (!status.ok() || !response.Dump(&slices).ok()) return std::nullopt;
  std::string bytes;
  for (const grpc::Slice& slice : slices) {
    bytes.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
  }
  v1::HelloReply reply;
  if (!reply.ParseFromString(bytes)) return std::nullopt;
  return reply;
}

// The same-machine socket that `remote` (the Hello reply from `address`)
// names, if it answers as the same process; else `address`.
std::string LocalSocketOf(const std::string& address, const v1::HelloReply& remote,
                          absl::Duration timeout) {
  if (remote.local_address().empty()) return address;
  const std::optional<v1::HelloReply> local = Hello(remote.local_address(), timeout);
  if (!local.has_value() || local->instance() != remote.instance()) {
    VLOG(1) << "server " << address << ": " << remote.local_address()
            << " is not reachable from here, or not the same process: TCP";
    return address;
  }
  VLOG(1) << "server " << address << " reached over " << remote.local_address();
  return remote.local_address();
}

// `count` direct connections to one server that `connect` makes, or none
// if one fails.
std::vector<std::unique_ptr<DirectConnection>> DirectConnections(
    const std::string& address, absl::string_view how, int count,
    absl::FunctionRef<absl::StatusOr<std::unique_ptr<DirectConnection>>()> connect) {
  std::vector<std::unique_ptr<DirectConnection>> connections;
  for (int i = 0; i < count; ++i) {
    absl::StatusOr<std::unique_ptr<DirectConnection>> c = connect();
    if (!c.ok()) {
      VLOG(1) << "server " << address << ": not reached " << how << ": " << c.status();
      return {};
    }
    connections.push_back(*std::move(c));
  }
  LOG(INFO) << "server " << address << " reached " << how << " (" << count << ")";
  return connections;
}

ServerRoute RouteTo(const std::string& address, const GrpcTransportOptions& options) {
  constexpr absl::Duration kHelloTimeout = absl::Seconds(2);
  ServerRoute route;
  route.dial = address;
  if (options.security != nullptr ||
      (!options.same_machine_sockets && !options.shared_memory && !options.direct_tcp &&
       options.in_process == nullptr)) {
    return route;
  }
  const std::optional<v1::HelloReply> remote = Hello(address, kHelloTimeout);
  if (!remote.has_value()) return route;
  if (options.in_process != nullptr && remote->instance() == options.in_process->instance()) {
    VLOG(1) << "server " << address << " is this process's own";
    route.in_process = true;
    return route;
  }
  if (options.same_machine_sockets) route.dial = LocalSocketOf(address, *remote, kHelloTimeout);
  if (options.shared_memory && !remote->shm_address().empty()) {
    // The handshake checks that the process behind the name is the one
    // that answered at `address`.
    route.direct = DirectConnections(address, "through shared memory", options.shm_connections,
                                     [&] {
      return DirectConnection::Connect(remote->shm_address(), remote->instance(), options.shm,
                                       kHelloTimeout);
    });
  }
  if (route.direct.empty() && options.direct_tcp && remote->direct_tcp_port() > 0) {
    route.direct = DirectConnections(address, "over a direct TCP connection", 1, [&] {
      return DirectConnection::ConnectTcp(SocketHost(address), remote->direct_tcp_port(),
                                          remote->instance(), options.shm, kHelloTimeout);
    });
  }
  return route;
}

// The carriers of the routes: in-process (if a route is), direct (if any
// route has connections), gRPC.
std::vector<std::unique_ptr<Carrier>> CarriersOf(std::vector<ServerRoute> routes,
                                                 const GrpcTransportOptions& options) {
  std::vector<std::string> dial;
  std::vector<bool> in_process;
  std::vector<std::vector<std::unique_ptr<DirectConnection>>> direct;
  bool any_direct = false;
  for (ServerRoute& route : routes) {
    dial.push_back(route.dial);
    in_process.push_back(route.in_process);
    any_direct |= !route.direct.empty();
    direct.push_back(std::move(route.direct));
  }
  std::vector<std::unique_ptr<Carrier>> carriers;
  if (std::find(in_process.begin(), in_process.end(), true) != in_process.end()) {
    carriers.push_back(std::make_unique<InProcessCarrier>(options.in_process, in_process));
  }
  if (any_direct) carriers.push_back(std::make_unique<DirectCarrier>(std::move(direct)));
  carriers.push_back(std::make_unique<GrpcCarrier>(dial, options));
  return carriers;
}

}  // namespace

RoutingTransport::RoutingTransport(std::vector<std::unique_ptr<Carrier>> carriers,
                                   std::vector<bool> in_process, int channels_per_server)
    : channels_per_server_(channels_per_server),
      in_process_(std::move(in_process)),
      carriers_(std::move(carriers)) {}

RoutingTransport::~RoutingTransport() {
  CancelAll();
  for (auto& carrier : carriers_) carrier.reset();
}

void RoutingTransport::StartExchange(int server, int channel, ParameterMethod method,
                                     std::vector<grpc::ByteBuffer> requests, absl::Time deadline,
                                     SentFn on_sent, ReplyFn on_reply, DoneFn on_done) {
  for (const auto& carrier : carriers_) {
    if (carrier->StartExchange(server, channel, method, requests, deadline, on_sent, on_reply,
                               on_done)) {
      return;
    }
  }
  on_done(absl::UnavailableError(absl::StrCat("no way to server ", server)));
}

void RoutingTransport::CancelAll() {
  for (const auto& carrier : carriers_) carrier->CancelAll();
}

std::string SameMachineAddress(const std::string& address, absl::Duration timeout) {
  const std::optional<v1::HelloReply> remote = Hello(address, timeout);
  return remote.has_value() ? LocalSocketOf(address, *remote, timeout) : address;
}

absl::Status ValidateGrpcTransportOptions(const GrpcTransportOptions& options) {
  if (options.shm_connections < 1 || options.shm_connections > 16) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shared-memory connections per server must be in [1, 16], not ",
        options.shm_connections));
  }
  if (options.channels_per_server < 1 || options.channels_per_server > 16) {
    return absl::InvalidArgumentError(absl::StrCat(
        "channels per server must be in [1, 16], not ", options.channels_per_server));
  }
  if (options.window < 1 || options.window > 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("stream window must be in [1, 1024], not ", options.window));
  }
  if (options.window_bytes < 0 || options.window_bytes > (int64_t{1} << 30)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "stream window bytes must be in [0, 1 GiB], not ", options.window_bytes));
  }
  return ValidateShmOptions(options.shm);
}

absl::StatusOr<std::unique_ptr<ParameterTransport>> CreateGrpcTransport(
    const std::vector<std::string>& server_addresses, const GrpcTransportOptions& options) {
  if (server_addresses.empty()) return absl::InvalidArgumentError("no server addresses");
  PSTRAIN_RETURN_IF_ERROR(ValidateGrpcTransportOptions(options));
  std::vector<ServerRoute> routes;
  std::vector<bool> in_process;
  for (const std::string& address : server_addresses) {
    routes.push_back(RouteTo(address, options));
    in_process.push_back(routes.back().in_process);
  }
  return std::make_unique<RoutingTransport>(CarriersOf(std::move(routes), options),
                                            std::move(in_process), options.channels_per_server);
}

TransportFactory GrpcTransportFactory(GrpcTransportOptions options) {
  return [options](const std::vector<std::string>& addresses) {
    return CreateGrpcTransport(addresses, options);
  };
}

}  // namespace pstrain::worker
