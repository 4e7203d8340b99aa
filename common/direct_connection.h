// A message connection between two processes outside gRPC, carried one of
// two ways:
// - through shared memory, between processes of one machine: two byte
//   pipes (one each way) in a memfd_create region that the connecting side
//   makes and hands to the listening side over an abstract Unix socket
//   (SCM_RIGHTS). The socket stays open as the doorbell (a byte wakes a
//   peer that sleeps) and as the liveness signal: a peer that exits,
//   however it dies, closes it, and the other side sees the connection end.
// - over a TCP socket, between any two machines (plaintext): the messages
//   are the socket's bytes, with no HTTP/2 framing and no gRPC threads.
//
// Messages are (type, flags, stream, body) with bodies of any size up to
// Options::max_message_bytes: a body larger than a pipe streams through it.
// No gRPC here beyond its slices (the bodies are gRPC byte buffers, as the
// parameter service's frames are).
//
// Nothing the peer writes is trusted: a length over the limit ends the
// connection; in shared memory, indices are checked against the pipe's
// size, each message is copied out of the pipe before it is handed on
// (unless the receiver takes it borrowed: a body it reads once, as the
// worker's replies, whose frame header is copied before it is parsed), and
// the region is sealed against shrinking (a peer cannot make this process
// fault on its mapping).
//
// Its parts: direct_connection.cc (the messages, the send queue, the
// connection's thread), shm_pipe.h (the shared region and its pipes),
// direct_tcp.cc (the TCP side), direct_listener.cc (the handshake, both
// sides, and the listener); direct_wire.h is what they share.
#ifndef PSTRAIN_COMMON_DIRECT_CONNECTION_H_
#define PSTRAIN_COMMON_DIRECT_CONNECTION_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"

namespace pstrain {

class ShmPipe;  // shm_pipe.h

struct DirectMessage {
  uint8_t type = 0;
  uint8_t flags = 0;
  uint32_t stream = 0;
  // This process's own memory; or, when `borrowed`, the pipe's: valid only
  // until the callback that gets it returns, and written by the peer
  // (read each value once).
  grpc::Slice body;
  // A borrowed body that wraps around the pipe's end: its part from the
  // pipe's start (body holds the part before); else empty.
  grpc::Slice wrapped;
  bool borrowed = false;

  // The whole body, as one buffer (over the same memory).
  grpc::ByteBuffer Body() const {
    const grpc::Slice parts[] = {body, wrapped};
    return grpc::ByteBuffer(parts, wrapped.size() == 0 ? 1 : 2);
  }
};

struct ShmOptions {
  // Bytes of each pipe (one each way): a power of two in [64 KiB, 1 GiB].
  int64_t pipe_bytes = 4 << 20;
  // Largest message body either side accepts; a larger one ends the
  // connection (INVALID_ARGUMENT).
  int64_t max_message_bytes = (64 << 20) + (1 << 20);
};

// INVALID_ARGUMENT, naming the option, unless the options are in range.
absl::Status ValidateShmOptions(const ShmOptions& options);

// One end of a connection. Thread-safe. Send may be called from any
// thread; every callback runs on the connection's own thread, one at a time.
class DirectConnection {
 public:
  using MessageFn = std::function<void(DirectMessage message)>;
  // Called once, last, when the connection ends: the peer went away (or
  // broke the protocol), or Close was called (CANCELLED).
  using ClosedFn = std::function<void(const absl::Status& status)>;

  // Connects to the listener at abstract socket `name`, hands it a new
  // shared region, and checks that the process that accepts is `instance`
  // (its DirectListener's). UNAVAILABLE if nothing listens or it does not
  // answer within `timeout`; FAILED_PRECONDITION if another process does.
  static absl::StatusOr<std::unique_ptr<DirectConnection>> Connect(const std::string& name,
                                                                   uint64_t instance,
                                                                   const ShmOptions& options,
                                                                   absl::Duration timeout);
  // The same over TCP to the listener at `host` (a name or an address)
  // and `port`: UNAVAILABLE if it cannot be reached in `timeout`.
  static absl::StatusOr<std::unique_ptr<DirectConnection>> ConnectTcp(const std::string& host,
                                                                      int port, uint64_t instance,
                                                                      const ShmOptions& options,
                                                                      absl::Duration timeout);
  ~DirectConnection();  // Close()

  // Whether messages of a type may be handed borrowed.
  using BorrowsFn = std::function<bool(uint8_t type)>;

  // Starts the connection's thread: messages from the peer go to
  // on_message from now on; on_tick (if set) runs about once a second,
  // busy or not (deadlines). Once. Through shared memory, a message of a
  // type `borrows` names whose body lies whole in the pipe is handed
  // borrowed (no copy; see DirectMessage), for a callback that reads its
  // body and keeps none of it.
  void Start(MessageFn on_message, ClosedFn on_closed, std::function<void()> on_tick = nullptr,
             BorrowsFn borrows = nullptr);

  // Sends a message whose body is `body` (may be null: none). Written into
  // the pipe (or the socket) at once, on this thread, as far as it has
  // room; the rest by the connection's thread, in order. Returns false
  // (nothing sent) once the connection has ended. `on_written`, if set,
  // runs once the whole message is in the pipe (or the socket): on this
  // thread or on the connection's.
  bool Send(uint8_t type, uint8_t flags, uint32_t stream, const grpc::ByteBuffer* body,
            std::function<void()> on_written = nullptr);
  // The same for a body given as slices.
  bool Send(uint8_t type, uint8_t flags, uint32_t stream, std::vector<grpc::Slice> body,
            std::function<void()> on_written = nullptr);
  // One message of SendAll: Send's arguments.
  struct Message {
    uint8_t type = 0;
    uint8_t flags = 0;
    uint32_t stream = 0;
    const grpc::ByteBuffer* body = nullptr;  // null: none
    std::function<void()> on_written;
  };
  // Sends `messages` in order, as a Send of each would, written together
  // (over TCP one system call where they fit). False (nothing sent) once
  // the connection has ended. `ahead`: they go before every queued message
  // not begun yet (after those sent ahead before them): a short exchange
  // that need not wait behind long ones (the receiver must not rely on
  // their order).
  bool SendAll(std::vector<Message> messages, bool ahead = false);

  // Runs `fn` on the connection's thread soon (after the messages it is
  // handing on now). False if the connection has ended.
  bool Post(std::function<void()> fn);

  // Ends the connection (the peer sees it end) and waits for the
  // connection's thread: on_closed has run when it returns (if Started).
  // Must not be called from a callback.
  void Close();

  // Over shared memory, the peer's process id (from the socket's
  // credentials); over TCP -1.
  int peer_pid() const { return peer_pid_; }
  // Who the peer is: "local process <pid>", or over TCP its address as
  // gRPC names a peer's host ("ipv4:10.0.0.2", "ipv6:[::1]").
  const std::string& peer() const { return peer_; }
  bool over_tcp() const { return region_ == nullptr; }

 private:
  friend class DirectListener;
  struct Outgoing;
  // Shared memory: `region` holds the pipes. TCP: region is null and the
  // socket carries the messages.
  DirectConnection(int socket_fd, void* region, size_t region_bytes, bool is_client,
                   const ShmOptions& options, int peer_pid);

  void Loop();
  // Writes queued messages while the pipe has room. Returns true if
  // anything was written.
  bool FlushLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(send_mu_);
  bool FlushToPipeLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(send_mu_);
  bool FlushToSocketLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(send_mu_);  // direct_tcp.cc
  // Reads what the peer wrote and hands on whole messages. Returns true if
  // anything was read; an error ends the connection.
  absl::StatusOr<bool> Drain();
  // The message whose header was just read, without its body.
  DirectMessage HeaderMessage() const;
  // Copies up to n bytes the peer sent into dst; returns how many.
  size_t ReadIn(unsigned char* dst, size_t n, bool* ring);
  size_t ReadSocket(unsigned char* dst, size_t n);  // direct_tcp.cc
  // TCP: waits (up to `timeout`) for something to do.
  void Sleep(absl::Duration timeout);
  void RingPeer();
  void Wake();
  static std::unique_ptr<Outgoing> MakeOutgoing(uint8_t type, uint8_t flags, uint32_t stream,
                                                std::vector<grpc::Slice> body,
                                                std::function<void()> on_written);
  bool SendQueued(std::vector<std::unique_ptr<Outgoing>> messages, bool ahead = false);

  const int socket_fd_;
  const int wake_fd_;  // eventfd: Send, Post and Close wake the thread
  void* const region_;
  const size_t region_bytes_;
  const ShmOptions options_;
  const int peer_pid_;
  std::string peer_;
  std::unique_ptr<ShmPipe> in_, out_;  // shared memory only
  MessageFn on_message_;
  ClosedFn on_closed_;
  std::function<void()> on_tick_;
  BorrowsFn borrows_;
  std::thread thread_;

  absl::Mutex send_mu_;
  std::deque<std::unique_ptr<Outgoing>> queue_ ABSL_GUARDED_BY(send_mu_);
  std::vector<std::function<void()>> posted_ ABSL_GUARDED_BY(send_mu_);
  bool ended_ ABSL_GUARDED_BY(send_mu_) = false;    // no more sends
  bool closing_ ABSL_GUARDED_BY(send_mu_) = false;  // Close called
  bool started_ ABSL_GUARDED_BY(send_mu_) = false;
  // TCP: a send failed (the peer is gone).
  bool send_failed_ ABSL_GUARDED_BY(send_mu_) = false;

  // The message being read (connection thread only): its header, and
  // once that is in, its body's length and (unless it is awaited whole, to
  // be borrowed) the body copied so far.
  unsigned char header_[12];
  size_t header_got_ = 0;
  size_t body_length_ = 0;
  bool body_started_ = false;
  grpc::Slice body_;
  size_t body_got_ = 0;
  // TCP: bytes received ahead of the message being read, and how the
  // socket ended (ok while it has not).
  std::unique_ptr<unsigned char[]> staged_;
  size_t staged_begin_ = 0, staged_end_ = 0;
  absl::Status receive_end_;
};

// Accepts connections on an abstract Unix socket. Thread-safe.
class DirectListener {
 public:
  using AcceptFn = std::function<void(std::unique_ptr<DirectConnection> connection)>;

  // Listens on abstract socket `name`; each connection that hands over a
  // good region and asks for `instance` goes to on_accept (on the
  // listener's thread; Start it there). UNAVAILABLE if the name is taken.
  static absl::StatusOr<std::unique_ptr<DirectListener>> Listen(const std::string& name,
                                                                uint64_t instance,
                                                                const ShmOptions& options,
                                                                AcceptFn on_accept);
  // The same for TCP connections, on a free port of `host` (an address of
  // this machine; "0.0.0.0" or "::" for every one): port() says which.
  static absl::StatusOr<std::unique_ptr<DirectListener>> ListenTcp(const std::string& host,
                                                                   uint64_t instance,
                                                                   const ShmOptions& options,
                                                                   AcceptFn on_accept);
  ~DirectListener();  // Stop()

  // TCP: the port it listens on; else 0.
  int port() const { return port_; }

  // Stops accepting and waits for the listener's thread. Idempotent.
  void Stop();

 private:
  DirectListener(int fd, bool tcp, uint64_t instance, const ShmOptions& options,
                 AcceptFn on_accept);
  void Loop();
  // The handshake of one accepted socket; on success the connection.
  absl::StatusOr<std::unique_ptr<DirectConnection>> Handshake(int fd);

  const int fd_;
  const bool tcp_;
  int port_ = 0;
  const int wake_fd_;
  const uint64_t instance_;
  const ShmOptions options_;
  AcceptFn on_accept_;
  std::thread thread_;
  absl::Mutex mu_;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_DIRECT_CONNECTION_H_
