// How a worker reaches the parameter servers. The real transport routes
// each exchange to one of its carriers (carrier.h, routing_transport.h):
// the server of this process, a direct connection, or gRPC; tests wrap it
// to drop, duplicate or delay frames.
#ifndef PSTRAIN_WORKER_TRANSPORT_H_
#define PSTRAIN_WORKER_TRANSPORT_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/chunk_codec.h"
#include "common/direct_connection.h"
#include "common/in_process_service.h"
#include "grpcpp/support/byte_buffer.h"

namespace pstrain {
class RpcMetrics;
class TransportSecurity;
}

namespace pstrain::worker {

using pstrain::ParameterMethod;

// One stream to one server over one of its channels: requests go out in
// order, then the stream is half-closed; on_sent runs once the last request
// is written; every reply is handed to on_reply, whose bytes are valid only
// until it returns (through shared memory they are the pipe's: a caller
// that keeps a reply copies it); on_done runs last, once, with the
// stream's final status. Callbacks run on transport threads.
class ParameterTransport {
 public:
  using SentFn = std::function<void()>;
  using ReplyFn = std::function<void(const grpc::ByteBuffer& reply)>;
  using DoneFn = std::function<void(absl::Status status)>;

  virtual ~ParameterTransport() = default;

  virtual int num_servers() const = 0;
  // Channels to each server (separate connections); StartExchange's
  // `channel` is in [0, channels_per_server()).
  virtual int channels_per_server() const { return 1; }
  // Whether server `server` runs in this process and is called directly:
  // its exchanges are handled on the thread that starts them, which a
  // client starts after those of the other servers (so that they work
  // meanwhile).
  virtual bool in_process(int server) const = 0;

  virtual void StartExchange(int server, int channel, ParameterMethod method,
                             std::vector<grpc::ByteBuffer> requests, absl::Time deadline,
                             SentFn on_sent, ReplyFn on_reply, DoneFn on_done) = 0;

  // Cancels every exchange in flight (they end with CANCELLED).
  virtual void CancelAll() = 0;
};

struct GrpcTransportOptions {
  // Channels per server, each its own TCP connection (channels with equal
  // arguments would share one): a server's chunks are spread over them.
  // The defaults were the fastest all-round in bench/RESULTS.md: more
  // bytes in flight than 4 x 2 chunks did not move more.
  int channels_per_server = 4;
  // Requests a stream sends ahead of their replies. Every request gets one
  // reply, so this bounds the chunks in flight per stream (and what a
  // server holds for it at a sync barrier).
  int window = 2;
  // ... and more while they total at most this many bytes: a stream of
  // small chunks keeps them all in flight instead of waiting a barrier for
  // every `window` of them.
  int64_t window_bytes = 1 << 20;
  // Measures the calls; null: not measured.
  RpcMetrics* metrics = nullptr;
  // Mutual TLS with the worker's certificate (servers must present a
  // server's); null: plaintext. Must outlive the transports.
  const TransportSecurity* security = nullptr;
  // In plaintext, reach a server of this machine over its same-machine
  // socket (an abstract Unix socket) instead of TCP: it names the socket in
  // its Hello reply, and the transport uses it once a second Hello over it
  // comes from the same process. Any failure on the way: TCP.
  bool same_machine_sockets = true;
  // In plaintext, reach a server of this machine that takes shared-memory
  // connections (its Hello names the socket) through memory both processes
  // map, before any socket; if the connection ends (the server went away),
  // its sockets. The transport asks for pipes of shm.pipe_bytes.
  bool shared_memory = true;
  // In plaintext, reach a server that takes direct TCP connections (its
  // Hello names the port) over one of pstrain's own instead of gRPC when no
  // shared memory reaches it: the same messages as shared memory's, on a
  // socket with no HTTP/2 framing; if the connection ends, gRPC.
  bool direct_tcp = true;
  // Shared-memory connections per server, each with a thread on both
  // ends: a large exchange's streams are spread over them, so that the
  // server receives, applies and answers its chunks on as many threads
  // (over TCP one: the kernel's copies bound it, and more threads only
  // share the cores).
  int shm_connections = 2;
  ShmOptions shm{};
  // The parameter service of a server in this process (a colocated one):
  // a server whose Hello names its instance is called directly, in
  // plaintext only. Null: none. Must outlive the transports.
  InProcessService* in_process = nullptr;
};

// INVALID_ARGUMENT, naming the option, unless channels_per_server and
// shm_connections are in [1, 16], window in [1, 1024], window_bytes in
// [0, 1 GiB] and shm valid.
absl::Status ValidateGrpcTransportOptions(const GrpcTransportOptions& options);

// The gRPC transport: options.channels_per_server channels per server
// address, each its own connection (also across transports); a server of
// this machine over its same-machine socket (options.same_machine_sockets),
// through shared memory while it can (options.shared_memory), and any
// other over a direct TCP connection while it can (options.direct_tcp).
// INVALID_ARGUMENT on an empty address list or invalid options.
absl::StatusOr<std::unique_ptr<ParameterTransport>> CreateGrpcTransport(
    const std::vector<std::string>& server_addresses, const GrpcTransportOptions& options = {});

// What a transport dials for the server at `address`: its same-machine
// socket if it offers one and answers over it as the same process (two
// Hello calls, each given `timeout`); else `address`.
std::string SameMachineAddress(const std::string& address,
                               absl::Duration timeout = absl::Seconds(2));

// Makes a transport to a job's servers (by server index). The seam through
// which a worker's transports can be wrapped (fault_injecting_transport.h).
using TransportFactory = std::function<absl::StatusOr<std::unique_ptr<ParameterTransport>>(
    const std::vector<std::string>& server_addresses)>;

// CreateGrpcTransport with `options`.
TransportFactory GrpcTransportFactory(GrpcTransportOptions options = {});

}  // namespace pstrain::worker

#endif  // PSTRAIN_WORKER_TRANSPORT_H_
