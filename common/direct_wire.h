// What both ends of a direct connection (direct_connection.h) and its
// handshake share: a message's header, the Hello and Reply of the
// handshake, a message on its way out, and the socket helpers. Internal to
// common/direct_*.cc and shm_pipe.cc.
#ifndef PSTRAIN_COMMON_DIRECT_WIRE_H_
#define PSTRAIN_COMMON_DIRECT_WIRE_H_

#include <sys/socket.h>
#include <sys/un.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/direct_connection.h"
#include "grpcpp/support/slice.h"

namespace pstrain {

// A message's header: body length (u32 LE), stream (u32 LE), type, flags,
// two bytes of zeros.
inline constexpr size_t kMessageHeaderBytes = 12;
inline constexpr uint64_t kHelloMagic = 0x4f4c454852545350;  // "PSTRHELO"
// TCP: what one recv takes at most ahead of the message being read; a
// larger remainder of a body goes straight into the body.
inline constexpr size_t kStagedBytes = 64 << 10;

// The handshake: the connecting side sends a Hello with the region's fd;
// the listener answers a Reply.
struct Hello {
  uint64_t magic;
  uint64_t instance;    // the listener it wants
  uint64_t pipe_bytes;  // TCP: 0
};
struct Reply {
  uint64_t magic;
  uint64_t instance;  // the listener's
  uint64_t status;    // 0: accepted; 1: wrong instance; 2: a bad region
};

// A message on its way into the pipe: its header, its body's slices, and
// how far it got.
struct DirectConnection::Outgoing {
  unsigned char header[kMessageHeaderBytes];
  size_t header_sent = 0;
  std::vector<grpc::Slice> body;
  size_t slice = 0;   // the body slice being written
  size_t offset = 0;  // bytes of it written
  std::function<void()> on_written;
  bool ahead = false;  // sent ahead of the queue (SendAll)
};

// UNAVAILABLE with `what` and errno's text.
absl::Status Errno(absl::string_view what);
// sockaddr of abstract socket `name` (sun_path[0] is 0).
socklen_t AbstractAddress(const std::string& name, sockaddr_un* address);
// The process at the other end of a Unix socket; -1 if unknown.
int PeerPid(int fd);
void SetNonBlocking(int fd);
// Reads exactly n bytes within `timeout`; false otherwise.
bool ReadFully(int fd, void* data, size_t n, absl::Duration timeout);
// A TCP connection's peer as gRPC names a peer's host: "ipv4:10.0.0.2",
// "ipv6:[::1]".
std::string TcpPeer(int fd);
// A connected TCP socket, ready for messages: non-blocking, no Nagle
// delay, and ended by the kernel when the peer stops answering (a cut
// network, a machine gone), as gRPC's keepalive ends its connections: a
// probe after 30 s of silence, the end 10 s later without an answer, or
// once sent bytes have waited 40 s for their acknowledgement.
void PrepareTcp(int fd);

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_DIRECT_WIRE_H_
