#include "common/direct_connection.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstring>
#include <new>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"

namespace pstrain {
namespace {

constexpr uint64_t kRegionMagic = 0x314d485352545350;  // "PSTRSHM1", little-endian
constexpr uint64_t kHelloMagic = 0x4f4c454852545350;   // "PSTRHELO"
constexpr size_t kControlBytes = 4096;                 // the region's first page: its header
constexpr size_t kMessageHeaderBytes = 12;
constexpr int64_t kMinPipeBytes = 64 << 10;
constexpr int64_t kMaxPipeBytes = int64_t{1} << 30;
// TCP: what one recv takes at most ahead of the message being read; a
// larger remainder of a body goes straight into the body.
constexpr size_t kStagedBytes = 64 << 10;
// TCP: the iovecs one sendmsg takes.
constexpr int kSendIovecs = 64;

// One direction's indices, each written by one side only, on cache lines
// of their own.
struct PipeControl {
  alignas(64) std::atomic<uint64_t> head;  // bytes written ever (the writer's)
  alignas(64) std::atomic<uint64_t> tail;  // bytes read ever (the reader's)
  // The reader is about to sleep: a writer that sees it rings.
  alignas(64) std::atomic<uint32_t> reader_sleeping;
  // The writer waits for room: a reader that sees it rings.
  alignas(64) std::atomic<uint32_t> writer_waiting;
};
static_assert(std::atomic<uint64_t>::is_always_lock_free);

struct RegionHeader {
  uint64_t magic;
  uint64_t pipe_bytes;
  PipeControl pipes[2];  // [0]: connecting side -> listening side, [1]: back
};
static_assert(sizeof(RegionHeader) <= kControlBytes);

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

size_t RegionBytes(uint64_t pipe_bytes) { return kControlBytes + 2 * pipe_bytes; }

absl::Status Errno(absl::string_view what) {
  return absl::UnavailableError(absl::StrCat(what, ": ", std::strerror(errno)));
}

// sockaddr of abstract socket `name` (sun_path[0] is 0).
socklen_t AbstractAddress(const std::string& name, sockaddr_un* address) {
  std::memset(address, 0, sizeof(*address));
  address->sun_family = AF_UNIX;
  const size_t n = std::min(name.size(), sizeof(address->sun_path) - 1);
  std::memcpy(address->sun_path + 1, name.data(), n);
  return static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + n);
}

int PeerPid(int fd) {
  ucred cred{};
  socklen_t len = sizeof(cred);
  return getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0 ? cred.pid : -1;
}

void SetNonBlocking(int fd) { fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK); }

// A TCP connection's peer as gRPC names a peer's host: "ipv4:10.0.0.2",
// "ipv6:[::1]".
std::string TcpPeer(int fd) {
  sockaddr_storage address{};
  socklen_t len = sizeof(address);
  char text[INET6_ADDRSTRLEN] = "?";
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&address), &len) != 0) return "unknown";
  if (address.ss_family == AF_INET) {
    inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(&address)->sin_addr, text, sizeof(text));
    return absl::StrCat("ipv4:", text);
  }
  inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(&address)->sin6_addr, text, sizeof(text));
  return absl::StrCat("ipv6:[", text, "]");
}

// A connected TCP socket, ready for messages: non-blocking, no Nagle
// delay, and ended by the kernel when the peer stops answering (a cut
// network, a machine gone), as gRPC's keepalive ends its connections: a
// probe after 30 s of silence, the end 10 s later without an answer, or
// once sent bytes have waited 40 s for their acknowledgement.
void PrepareTcp(int fd) {
  const int one = 1, idle_s = 30, probe_interval_s = 5, probes = 2, user_timeout_ms = 40000;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle_s, sizeof(idle_s));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &probe_interval_s, sizeof(probe_interval_s));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &probes, sizeof(probes));
  setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &user_timeout_ms, sizeof(user_timeout_ms));
  SetNonBlocking(fd);
}

// Reads exactly n bytes within `timeout`; false otherwise.
bool ReadFully(int fd, void* data, size_t n, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  auto* out = static_cast<char*>(data);
  while (n > 0) {
    pollfd p{fd, POLLIN, 0};
    const int64_t left = absl::ToInt64Milliseconds(deadline - absl::Now());
    if (left <= 0 || poll(&p, 1, static_cast<int>(left)) <= 0) return false;
    const ssize_t got = recv(fd, out, n, MSG_DONTWAIT);
    if (got == 0 || (got < 0 && errno != EAGAIN && errno != EINTR)) return false;
    if (got > 0) {
      out += got;
      n -= static_cast<size_t>(got);
    }
  }
  return true;
}

}  // namespace

absl::Status ValidateShmOptions(const ShmOptions& options) {
  const int64_t p = options.pipe_bytes;
  if (p < kMinPipeBytes || p > kMaxPipeBytes || (p & (p - 1)) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shared-memory pipe bytes must be a power of two in [64 KiB, 1 GiB], not ", p));
  }
  if (options.max_message_bytes < 1 || options.max_message_bytes > (int64_t{1} << 31)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shared-memory max message bytes must be in [1, 2 GiB], not ", options.max_message_bytes));
  }
  return absl::OkStatus();
}

// One end of one direction. The peer's index is read, never trusted: a
// value that the protocol cannot produce makes the pipe broken().
class DirectConnection::Pipe {
 public:
  Pipe(PipeControl* control, unsigned char* data, uint64_t capacity)
      : control_(control), data_(data), capacity_(capacity) {}

  bool broken() const { return broken_; }

  // Writer: copies up to n bytes in; returns how many. *ring: the reader
  // sleeps and must be woken.
  size_t Write(const unsigned char* src, size_t n, bool* ring) {
    const size_t room = Writable();
    n = std::min(n, room);
    if (n == 0) return 0;
    const size_t at = static_cast<size_t>(head_ & (capacity_ - 1));
    const size_t first = std::min<size_t>(n, capacity_ - at);
    std::memcpy(data_ + at, src, first);
    std::memcpy(data_, src + first, n - first);
    head_ += n;
    control_->head.store(head_, std::memory_order_release);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (control_->reader_sleeping.load(std::memory_order_relaxed) != 0 &&
        control_->reader_sleeping.exchange(0) != 0) {
      *ring = true;
    }
    return n;
  }
  size_t Writable() {
    const uint64_t used = head_ - control_->tail.load(std::memory_order_acquire);
    if (used > capacity_) {
      broken_ = true;
      return 0;
    }
    return static_cast<size_t>(capacity_ - used);
  }

  // Reader: copies up to n bytes out; returns how many. *ring: the writer
  // waits for room and must be woken.
  size_t Read(unsigned char* dst, size_t n, bool* ring) {
    n = std::min(n, Readable());
    if (n == 0) return 0;
    const size_t at = static_cast<size_t>(tail_ & (capacity_ - 1));
    const size_t first = std::min<size_t>(n, capacity_ - at);
    std::memcpy(dst, data_ + at, first);
    std::memcpy(dst + first, data_, n - first);
    Skip(n, ring);
    return n;
  }
  // Reader: the next n bytes where they lie, if they are all written (else
  // false): *first up to the pipe's end, *rest (empty unless they wrap
  // around it) from its start. Skip(n) releases them.
  bool Peek(size_t n, grpc::Slice* first, grpc::Slice* rest) {
    if (Readable() < n) return false;
    const size_t at = static_cast<size_t>(tail_ & (capacity_ - 1));
    const size_t first_bytes = std::min<size_t>(n, capacity_ - at);
    *first = grpc::Slice(data_ + at, first_bytes, grpc::Slice::STATIC_SLICE);
    *rest = grpc::Slice(data_, n - first_bytes, grpc::Slice::STATIC_SLICE);
    return true;
  }
  uint64_t capacity() const { return capacity_; }
  void Skip(size_t n, bool* ring) {
    tail_ += n;
    control_->tail.store(tail_, std::memory_order_release);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (control_->writer_waiting.load(std::memory_order_relaxed) != 0 &&
        control_->writer_waiting.exchange(0) != 0) {
      *ring = true;
    }
  }

  size_t Readable() {
    const uint64_t ready = control_->head.load(std::memory_order_acquire) - tail_;
    if (ready > capacity_) {
      broken_ = true;
      return 0;
    }
    return static_cast<size_t>(ready);
  }

  // Before sleeping: the flags that make the peer ring, set (a seq_cst
  // fence follows in the caller, then a last look).
  void SetReaderSleeping(bool on) { control_->reader_sleeping.store(on ? 1 : 0); }
  void SetWriterWaiting(bool on) { control_->writer_waiting.store(on ? 1 : 0); }

 private:
  PipeControl* const control_;
  unsigned char* const data_;
  const uint64_t capacity_;
  uint64_t head_ = 0;  // the writer's own count
  uint64_t tail_ = 0;  // the reader's own count
  bool broken_ = false;
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

DirectConnection::DirectConnection(int socket_fd, void* region, size_t region_bytes, bool is_client,
                                   const ShmOptions& options, int peer_pid)
    : socket_fd_(socket_fd),
      wake_fd_(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)),
      region_(region),
      region_bytes_(region_bytes),
      options_(options),
      peer_pid_(peer_pid) {
  if (region == nullptr) {
    peer_ = TcpPeer(socket_fd);
    staged_ = std::make_unique<unsigned char[]>(kStagedBytes);
    return;
  }
  peer_ = absl::StrCat("local process ", peer_pid);
  // The pipes' size as checked, not as the shared header says now.
  auto* header = static_cast<RegionHeader*>(region);
  auto* data = static_cast<unsigned char*>(region) + kControlBytes;
  const uint64_t pipe = static_cast<uint64_t>(options.pipe_bytes);
  auto to_listener = std::make_unique<Pipe>(&header->pipes[0], data, pipe);
  auto to_connector = std::make_unique<Pipe>(&header->pipes[1], data + pipe, pipe);
  out_ = is_client ? std::move(to_listener) : std::move(to_connector);
  in_ = is_client ? std::move(to_connector) : std::move(to_listener);
}

DirectConnection::~DirectConnection() {
  Close();
  close(socket_fd_);
  if (wake_fd_ >= 0) close(wake_fd_);
  if (region_ != nullptr) munmap(region_, region_bytes_);
}

absl::StatusOr<std::unique_ptr<DirectConnection>> DirectConnection::Connect(
    const std::string& name, uint64_t instance, const ShmOptions& options, absl::Duration timeout) {
  if (absl::Status s = ValidateShmOptions(options); !s.ok()) return s;
  const uint64_t pipe_bytes = static_cast<uint64_t>(options.pipe_bytes);
  const size_t bytes = RegionBytes(pipe_bytes);
  const int memfd = memfd_create("pstrain-shm", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (memfd < 0) return Errno("memfd_create");
  void* region = MAP_FAILED;
  if (ftruncate(memfd, static_cast<off_t>(bytes)) != 0 ||
      fcntl(memfd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0 ||
      (region = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, memfd, 0)) == MAP_FAILED) {
    absl::Status s = Errno("shared region");
    close(memfd);
    return s;
  }
  auto* header = new (region) RegionHeader{};
  header->magic = kRegionMagic;
  header->pipe_bytes = pipe_bytes;

  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un address;
  const socklen_t address_len = AbstractAddress(name, &address);
  absl::Status status;
  if (fd < 0 || connect(fd, reinterpret_cast<const sockaddr*>(&address), address_len) != 0) {
    status = Errno(absl::StrCat("connect to ", name));
  } else {
    Hello hello{kHelloMagic, instance, pipe_bytes};
    iovec iov{&hello, sizeof(hello)};
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    cmsghdr* cmsg = CMSG_FIRSTHDR(&msg);
    cmsg->cmsg_level = SOL_SOCKET;
    cmsg->cmsg_type = SCM_RIGHTS;
    cmsg->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(cmsg), &memfd, sizeof(int));
    Reply reply{};
    if (sendmsg(fd, &msg, MSG_NOSIGNAL) != static_cast<ssize_t>(sizeof(hello))) {
      status = Errno("shared-memory handshake");
    } else if (!ReadFully(fd, &reply, sizeof(reply), timeout) || reply.magic != kHelloMagic) {
      status = absl::UnavailableError(absl::StrCat("no shared-memory handshake from ", name));
    } else if (reply.status != 0 || reply.instance != instance) {
      status = absl::FailedPreconditionError(
          absl::StrCat(name, " is another process (instance ", reply.instance,
                       "), or refused the region (", reply.status, ")"));
    }
  }
  close(memfd);
  if (!status.ok()) {
    if (fd >= 0) close(fd);
    munmap(region, bytes);
    return status;
  }
  SetNonBlocking(fd);
  return std::unique_ptr<DirectConnection>(
      new DirectConnection(fd, region, bytes, /*is_client=*/true, options, PeerPid(fd)));
}

absl::StatusOr<std::unique_ptr<DirectConnection>> DirectConnection::ConnectTcp(
    const std::string& host, int port, uint64_t instance, const ShmOptions& options,
    absl::Duration timeout) {
  if (absl::Status s = ValidateShmOptions(options); !s.ok()) return s;
  const std::string where = absl::StrCat(host, " port ", port);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (port <= 0 || port > 65535 ||
      getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found) != 0) {
    return absl::UnavailableError(absl::StrCat("cannot resolve ", where));
  }
  const absl::Time deadline = absl::Now() + timeout;
  int fd = -1;
  for (addrinfo* a = found; a != nullptr && fd < 0; a = a->ai_next) {
    fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
    if (fd < 0) continue;
    bool connected = connect(fd, a->ai_addr, a->ai_addrlen) == 0;
    if (!connected && errno == EINPROGRESS) {
      pollfd p{fd, POLLOUT, 0};
      const int64_t left = std::max<int64_t>(0, absl::ToInt64Milliseconds(deadline - absl::Now()));
      int error = 0;
      socklen_t len = sizeof(error);
      connected = poll(&p, 1, static_cast<int>(left)) == 1 &&
                  getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &len) == 0 && error == 0;
    }
    if (!connected) {
      close(fd);
      fd = -1;
    }
  }
  freeaddrinfo(found);
  if (fd < 0) return absl::UnavailableError(absl::StrCat("cannot connect to ", where));
  const Hello hello{kHelloMagic, instance, 0};
  Reply reply{};
  absl::Status status;
  if (send(fd, &hello, sizeof(hello), MSG_NOSIGNAL) != static_cast<ssize_t>(sizeof(hello))) {
    status = Errno(absl::StrCat("handshake with ", where));
  } else if (!ReadFully(fd, &reply, sizeof(reply),
                        std::max(deadline - absl::Now(), absl::ZeroDuration())) ||
             reply.magic != kHelloMagic) {
    status = absl::UnavailableError(absl::StrCat("no handshake from ", where));
  } else if (reply.status != 0 || reply.instance != instance) {
    status = absl::FailedPreconditionError(absl::StrCat(where, " is another process (instance ",
                                                        reply.instance, "), or refused (",
                                                        reply.status, ")"));
  }
  if (!status.ok()) {
    close(fd);
    return status;
  }
  PrepareTcp(fd);
  return std::unique_ptr<DirectConnection>(
      new DirectConnection(fd, nullptr, 0, /*is_client=*/true, options, -1));
}

void DirectConnection::Start(MessageFn on_message, ClosedFn on_closed,
                             std::function<void()> on_tick, BorrowsFn borrows) {
  on_message_ = std::move(on_message);
  on_closed_ = std::move(on_closed);
  on_tick_ = std::move(on_tick);
  borrows_ = std::move(borrows);
  {
    absl::MutexLock lock(&send_mu_);
    started_ = true;
  }
  thread_ = std::thread([this] { Loop(); });
}

bool DirectConnection::Send(uint8_t type, uint8_t flags, uint32_t stream,
                            const grpc::ByteBuffer* body, std::function<void()> on_written) {
  std::vector<grpc::Slice> slices;
  if (body != nullptr && !body->Dump(&slices).ok()) return false;
  return Send(type, flags, stream, std::move(slices), std::move(on_written));
}

bool DirectConnection::Send(uint8_t type, uint8_t flags, uint32_t stream,
                            std::vector<grpc::Slice> body, std::function<void()> on_written) {
  std::vector<std::unique_ptr<Outgoing>> one;
  one.push_back(MakeOutgoing(type, flags, stream, std::move(body), std::move(on_written)));
  return SendQueued(std::move(one));
}

bool DirectConnection::SendAll(std::vector<Message> messages, bool ahead) {
  std::vector<std::unique_ptr<Outgoing>> all;
  for (Message& m : messages) {
    std::vector<grpc::Slice> slices;
    if (m.body != nullptr && !m.body->Dump(&slices).ok()) return false;
    all.push_back(MakeOutgoing(m.type, m.flags, m.stream, std::move(slices),
                               std::move(m.on_written)));
  }
  return SendQueued(std::move(all), ahead);
}

std::unique_ptr<DirectConnection::Outgoing> DirectConnection::MakeOutgoing(
    uint8_t type, uint8_t flags, uint32_t stream, std::vector<grpc::Slice> body,
    std::function<void()> on_written) {
  auto message = std::make_unique<Outgoing>();
  uint64_t length = 0;
  for (const grpc::Slice& s : body) length += s.size();
  const uint32_t n = static_cast<uint32_t>(length);
  for (int i = 0; i < 4; ++i) {
    message->header[i] = static_cast<unsigned char>(n >> (8 * i));
    message->header[4 + i] = static_cast<unsigned char>(stream >> (8 * i));
  }
  message->header[8] = type;
  message->header[9] = flags;
  message->header[10] = message->header[11] = 0;
  message->body = std::move(body);
  message->on_written = std::move(on_written);
  return message;
}

bool DirectConnection::SendQueued(std::vector<std::unique_ptr<Outgoing>> messages,
                                  bool ahead) {
  bool wake;
  {
    absl::MutexLock lock(&send_mu_);
    if (ended_) return false;
    // Where they go: the queue's end; ahead, before the first message that
    // is neither begun nor sent ahead itself.
    auto at = queue_.end();
    if (ahead) {
      at = std::find_if(queue_.begin(), queue_.end(), [](const std::unique_ptr<Outgoing>& m) {
        return m->header_sent == 0 && !m->ahead;
      });
      for (auto& m : messages) m->ahead = true;
    }
    const bool first = at == queue_.begin();
    queue_.insert(at, std::make_move_iterator(messages.begin()),
                  std::make_move_iterator(messages.end()));
    // Nothing ahead of them: straight into the pipe or socket, on this
    // thread.
    if (first) FlushLocked();
    // What did not fit is the connection's thread's to write.
    wake = !queue_.empty();
  }
  if (wake) Wake();
  return true;
}

bool DirectConnection::FlushLocked() {
  return over_tcp() ? FlushToSocketLocked() : FlushToPipeLocked();
}

bool DirectConnection::FlushToSocketLocked() {
  bool progress = false;
  std::vector<std::function<void()>> written;
  while (!queue_.empty() && !send_failed_) {
    // As much of the queue as kSendIovecs pieces hold, in one sendmsg.
    iovec pieces[kSendIovecs];
    int count = 0;
    size_t asked = 0;
    auto add = [&](const void* data, size_t n) {
      if (n == 0 || count == kSendIovecs) return;
      pieces[count++] = {const_cast<void*>(data), n};
      asked += n;
    };
    for (const std::unique_ptr<Outgoing>& m : queue_) {
      if (count == kSendIovecs) break;
      add(m->header + m->header_sent, kMessageHeaderBytes - m->header_sent);
      for (size_t i = m->slice; i < m->body.size(); ++i) {
        const size_t skip = i == m->slice ? m->offset : 0;
        add(m->body[i].begin() + skip, m->body[i].size() - skip);
      }
    }
    msghdr msg{};
    msg.msg_iov = pieces;
    msg.msg_iovlen = static_cast<size_t>(count);
    const ssize_t sent = sendmsg(socket_fd_, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (sent < 0) {
      if (errno == EINTR) continue;
      // EAGAIN: the socket is full; the connection's thread goes on when
      // it has room. Anything else: the peer is gone.
      send_failed_ = errno != EAGAIN && errno != EWOULDBLOCK;
      break;
    }
    progress = true;
    // Messages sent whole leave the queue.
    size_t left = static_cast<size_t>(sent);
    while (!queue_.empty()) {
      Outgoing& m = *queue_.front();
      const size_t header = std::min(left, kMessageHeaderBytes - m.header_sent);
      m.header_sent += header;
      left -= header;
      while (m.header_sent == kMessageHeaderBytes && m.slice < m.body.size()) {
        const size_t n = std::min(left, m.body[m.slice].size() - m.offset);
        m.offset += n;
        left -= n;
        if (m.offset < m.body[m.slice].size()) break;
        ++m.slice;
        m.offset = 0;
      }
      if (m.header_sent < kMessageHeaderBytes || m.slice < m.body.size()) break;
      if (m.on_written) written.push_back(std::move(m.on_written));
      queue_.pop_front();
    }
    if (static_cast<size_t>(sent) < asked) break;  // the socket is full
  }
  for (auto& fn : written) fn();
  return progress;
}

bool DirectConnection::FlushToPipeLocked() {
  bool progress = false;
  bool ring = false;
  std::vector<std::function<void()>> written;
  while (!queue_.empty() && !out_->broken()) {
    Outgoing& m = *queue_.front();
    bool stalled = false;
    if (m.header_sent < kMessageHeaderBytes) {
      const size_t n =
          out_->Write(m.header + m.header_sent, kMessageHeaderBytes - m.header_sent, &ring);
      m.header_sent += n;
      progress |= n > 0;
      stalled = m.header_sent < kMessageHeaderBytes;
    }
    while (!stalled && m.slice < m.body.size()) {
      const grpc::Slice& s = m.body[m.slice];
      const size_t n = out_->Write(s.begin() + m.offset, s.size() - m.offset, &ring);
      m.offset += n;
      progress |= n > 0;
      if (m.offset == s.size()) {
        ++m.slice;
        m.offset = 0;
      } else {
        stalled = true;
      }
    }
    if (stalled) break;
    if (m.on_written) written.push_back(std::move(m.on_written));
    queue_.pop_front();
  }
  if (ring) RingPeer();
  // The callbacks touch only their own state (see the header): safe under
  // the lock, and in order.
  for (auto& fn : written) fn();
  return progress;
}

bool DirectConnection::Post(std::function<void()> fn) {
  {
    absl::MutexLock lock(&send_mu_);
    if (ended_) return false;
    posted_.push_back(std::move(fn));
  }
  Wake();
  return true;
}

void DirectConnection::Close() {
  bool join;
  {
    absl::MutexLock lock(&send_mu_);
    closing_ = true;
    join = started_;
    if (!started_) ended_ = true;
  }
  Wake();
  if (join && thread_.joinable()) thread_.join();
  shutdown(socket_fd_, SHUT_RDWR);
}

void DirectConnection::Wake() {
  const uint64_t one = 1;
  if (write(wake_fd_, &one, sizeof(one)) < 0) {
    // EAGAIN: the counter is full, the thread is awake anyway.
  }
}

void DirectConnection::RingPeer() {
  if (over_tcp()) return;  // the bytes themselves wake the peer
  const char bell = 0;
  if (send(socket_fd_, &bell, 1, MSG_DONTWAIT | MSG_NOSIGNAL) < 0) {
    // EAGAIN: the peer has doorbells enough to read; a broken socket shows
    // in the connection's poll.
  }
}

absl::StatusOr<bool> DirectConnection::Drain() {
  bool any = false;
  bool ring = false;
  while (true) {
    if (header_got_ < kMessageHeaderBytes) {
      const size_t n = ReadIn(header_ + header_got_, kMessageHeaderBytes - header_got_, &ring);
      header_got_ += n;
      any |= n > 0;
      if (header_got_ < kMessageHeaderBytes) break;
      uint32_t length = 0;
      for (int i = 0; i < 4; ++i) length |= static_cast<uint32_t>(header_[i]) << (8 * i);
      if (length > static_cast<uint64_t>(options_.max_message_bytes)) {
        if (ring) RingPeer();
        return absl::InvalidArgumentError(
            absl::StrCat(over_tcp() ? "message" : "shared-memory message", " of ", length,
                         " bytes, more than the ", options_.max_message_bytes, " allowed"));
      }
      body_length_ = length;
      body_started_ = false;
    }
    if (!body_started_) {
      if (!over_tcp() && borrows_ && borrows_(header_[8])) {
        DirectMessage message = HeaderMessage();
        if (in_->Peek(body_length_, &message.body, &message.wrapped)) {
          message.borrowed = true;
          header_got_ = 0;
          on_message_(std::move(message));
          in_->Skip(body_length_, &ring);
          continue;
        }
        // Still being written, and the pipe holds all of it: wait for it
        // rather than copy it as it comes.
        if (body_length_ <= in_->capacity()) break;
      }
      body_ = grpc::Slice(body_length_);
      body_got_ = 0;
      body_started_ = true;
    }
    if (body_got_ < body_.size()) {
      const size_t n =
          ReadIn(const_cast<uint8_t*>(body_.begin()) + body_got_, body_.size() - body_got_, &ring);
      body_got_ += n;
      any |= n > 0;
      if (body_got_ < body_.size()) break;
    }
    DirectMessage message = HeaderMessage();
    message.body = std::move(body_);
    body_ = grpc::Slice();
    header_got_ = 0;
    body_got_ = 0;
    on_message_(std::move(message));
  }
  if (ring) RingPeer();
  if (over_tcp()) {
    if (!receive_end_.ok()) return receive_end_;
  } else if (in_->broken()) {
    return absl::DataLossError("shared-memory pipe: the peer's index is out of range");
  }
  return any;
}

DirectMessage DirectConnection::HeaderMessage() const {
  DirectMessage message;
  message.type = header_[8];
  message.flags = header_[9];
  for (int i = 0; i < 4; ++i) message.stream |= static_cast<uint32_t>(header_[4 + i]) << (8 * i);
  return message;
}

size_t DirectConnection::ReadIn(unsigned char* dst, size_t n, bool* ring) {
  return over_tcp() ? ReadSocket(dst, n) : in_->Read(dst, n, ring);
}

size_t DirectConnection::ReadSocket(unsigned char* dst, size_t n) {
  size_t done = 0;
  while (done < n) {
    if (staged_begin_ < staged_end_) {
      const size_t k = std::min(n - done, staged_end_ - staged_begin_);
      std::memcpy(dst + done, staged_.get() + staged_begin_, k);
      staged_begin_ += k;
      done += k;
      continue;
    }
    if (!receive_end_.ok()) break;
    const bool direct = n - done >= kStagedBytes;
    const ssize_t got = recv(socket_fd_, direct ? dst + done : staged_.get(),
                             direct ? n - done : kStagedBytes, MSG_DONTWAIT);
    if (got > 0) {
      if (direct) {
        done += static_cast<size_t>(got);
      } else {
        staged_begin_ = 0;
        staged_end_ = static_cast<size_t>(got);
      }
      continue;
    }
    if (got < 0 && errno == EINTR) continue;
    if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
    receive_end_ =
        got == 0 ? absl::UnavailableError("the peer closed the connection") : Errno("receive");
  }
  return done;
}

void DirectConnection::Loop() {
  absl::Status end;
  pollfd fds[2] = {{socket_fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
  constexpr absl::Duration kTick = absl::Seconds(1);
  absl::Time next_tick = absl::Now() + kTick;
  while (true) {
    if (on_tick_ && absl::Now() >= next_tick) {
      on_tick_();
      next_tick = absl::Now() + kTick;
    }
    std::vector<std::function<void()>> posted;
    bool progress = false;
    {
      absl::MutexLock lock(&send_mu_);
      if (closing_) {
        end = absl::CancelledError("connection closed");
        break;
      }
      posted.swap(posted_);
      progress |= FlushLocked();
      if (over_tcp() ? send_failed_ : out_->broken()) {
        end = over_tcp()
                  ? absl::UnavailableError("the peer closed the connection")
                  : absl::DataLossError("shared-memory pipe: the peer's index is out of range");
        break;
      }
    }
    for (auto& fn : posted) fn();
    progress |= !posted.empty();
    absl::StatusOr<bool> drained = Drain();
    if (!drained.ok()) {
      end = drained.status();
      break;
    }
    if (progress || *drained) continue;
    if (over_tcp()) {
      Sleep(kTick);
      continue;
    }

    // Nothing to do: say so in the shared flags, look once more, sleep.
    bool waiting_to_write;
    {
      absl::MutexLock lock(&send_mu_);
      waiting_to_write = !queue_.empty();
    }
    in_->SetReaderSleeping(true);
    out_->SetWriterWaiting(waiting_to_write);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    // A body awaited whole is ready once all of it is in.
    const size_t wanted = header_got_ == kMessageHeaderBytes && !body_started_ ? body_length_ : 1;
    const bool ready = in_->Readable() >= wanted || (waiting_to_write && out_->Writable() > 0) ||
                       in_->broken() || out_->broken();
    if (!ready) {
      fds[0].revents = fds[1].revents = 0;
      poll(fds, 2, static_cast<int>(absl::ToInt64Milliseconds(kTick)));
    }
    in_->SetReaderSleeping(false);
    out_->SetWriterWaiting(false);
    uint64_t counter;
    if (read(wake_fd_, &counter, sizeof(counter)) < 0) {
      // EAGAIN: nobody woke us.
    }
    // Doorbells carry no data; an end of stream is the peer gone.
    char bells[256];
    ssize_t got;
    while ((got = recv(socket_fd_, bells, sizeof(bells), MSG_DONTWAIT)) > 0) {
    }
    if (got == 0 || (got < 0 && errno != EAGAIN && errno != EINTR) ||
        (fds[0].revents & (POLLERR | POLLHUP)) != 0) {
      // Take what the peer wrote before it went.
      absl::StatusOr<bool> last = Drain();
      end = last.ok() ? absl::UnavailableError("the shared-memory peer closed the connection")
                      : last.status();
      break;
    }
  }
  {
    absl::MutexLock lock(&send_mu_);
    ended_ = true;
    queue_.clear();
    posted_.clear();
  }
  shutdown(socket_fd_, SHUT_RDWR);
  if (on_closed_) on_closed_(end);
}

void DirectConnection::Sleep(absl::Duration timeout) {
  bool waiting_to_write;
  {
    absl::MutexLock lock(&send_mu_);
    waiting_to_write = !queue_.empty();
  }
  pollfd fds[2] = {{socket_fd_, static_cast<short>(POLLIN | (waiting_to_write ? POLLOUT : 0)), 0},
                   {wake_fd_, POLLIN, 0}};
  poll(fds, 2, static_cast<int>(absl::ToInt64Milliseconds(timeout)));
  uint64_t counter;
  if (read(wake_fd_, &counter, sizeof(counter)) < 0) {
    // EAGAIN: nobody woke us.
  }
}

DirectListener::DirectListener(int fd, bool tcp, uint64_t instance, const ShmOptions& options,
                               AcceptFn on_accept)
    : fd_(fd),
      tcp_(tcp),
      wake_fd_(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)),
      instance_(instance),
      options_(options),
      on_accept_(std::move(on_accept)) {
  thread_ = std::thread([this] { Loop(); });
}

DirectListener::~DirectListener() {
  Stop();
  close(fd_);
  close(wake_fd_);
}

absl::StatusOr<std::unique_ptr<DirectListener>> DirectListener::Listen(const std::string& name,
                                                                       uint64_t instance,
                                                                       const ShmOptions& options,
                                                                       AcceptFn on_accept) {
  if (absl::Status s = ValidateShmOptions(options); !s.ok()) return s;
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un address;
  const socklen_t address_len = AbstractAddress(name, &address);
  if (fd < 0 || bind(fd, reinterpret_cast<const sockaddr*>(&address), address_len) != 0 ||
      listen(fd, 64) != 0) {
    absl::Status s = Errno(absl::StrCat("listen on ", name));
    if (fd >= 0) close(fd);
    return s;
  }
  return std::unique_ptr<DirectListener>(
      new DirectListener(fd, /*tcp=*/false, instance, options, std::move(on_accept)));
}

absl::StatusOr<std::unique_ptr<DirectListener>> DirectListener::ListenTcp(const std::string& host,
                                                                          uint64_t instance,
                                                                          const ShmOptions& options,
                                                                          AcceptFn on_accept) {
  if (absl::Status s = ValidateShmOptions(options); !s.ok()) return s;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.empty() ? nullptr : host.c_str(), "0", &hints, &found) != 0) {
    return absl::UnavailableError(absl::StrCat("cannot resolve ", host));
  }
  int fd = -1;
  int port = 0;
  for (addrinfo* a = found; a != nullptr && fd < 0; a = a->ai_next) {
    fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    sockaddr_storage bound{};
    socklen_t len = sizeof(bound);
    if (bind(fd, a->ai_addr, a->ai_addrlen) != 0 || listen(fd, 64) != 0 ||
        getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len) != 0) {
      close(fd);
      fd = -1;
      continue;
    }
    port = ntohs(bound.ss_family == AF_INET ? reinterpret_cast<sockaddr_in*>(&bound)->sin_port
                                            : reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port);
  }
  freeaddrinfo(found);
  if (fd < 0) return Errno(absl::StrCat("listen on ", host));
  auto listener = std::unique_ptr<DirectListener>(
      new DirectListener(fd, /*tcp=*/true, instance, options, std::move(on_accept)));
  listener->port_ = port;
  return listener;
}

void DirectListener::Stop() {
  {
    absl::MutexLock lock(&mu_);
    if (stopped_) return;
    stopped_ = true;
  }
  const uint64_t one = 1;
  if (write(wake_fd_, &one, sizeof(one)) < 0) {
  }
  thread_.join();
}

void DirectListener::Loop() {
  pollfd fds[2] = {{fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      if (stopped_) return;
    }
    fds[0].revents = fds[1].revents = 0;
    if (poll(fds, 2, -1) <= 0 || (fds[0].revents & POLLIN) == 0) continue;
    const int conn = accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (conn < 0) continue;
    absl::StatusOr<std::unique_ptr<DirectConnection>> connection = Handshake(conn);
    if (!connection.ok()) {
      LOG(WARNING) << "refused a shared-memory connection: " << connection.status();
      close(conn);
      continue;
    }
    on_accept_(*std::move(connection));
  }
}

absl::StatusOr<std::unique_ptr<DirectConnection>> DirectListener::Handshake(int fd) {
  // A peer that connects and sends nothing holds the listener this long.
  constexpr absl::Duration kHandshakeTimeout = absl::Seconds(2);
  pollfd p{fd, POLLIN, 0};
  if (poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(kHandshakeTimeout))) <= 0) {
    return absl::DeadlineExceededError("no handshake");
  }
  Hello hello{};
  int memfd = -1;  // shared memory: the region's, ours to close until mapped
  auto refuse = [&](uint64_t why, absl::Status status) {
    Reply reply{kHelloMagic, instance_, why};
    if (send(fd, &reply, sizeof(reply), MSG_DONTWAIT | MSG_NOSIGNAL) < 0) {
    }
    if (memfd >= 0) close(memfd);
    return status;
  };
  if (tcp_) {
    if (!ReadFully(fd, &hello, sizeof(hello), kHandshakeTimeout) || hello.magic != kHelloMagic ||
        hello.pipe_bytes != 0) {
      return refuse(2, absl::InvalidArgumentError("not a handshake"));
    }
    if (hello.instance != instance_) {
      return refuse(1, absl::FailedPreconditionError(
                           absl::StrCat("asked for instance ", hello.instance, ", not this one")));
    }
    const Reply reply{kHelloMagic, instance_, 0};
    if (send(fd, &reply, sizeof(reply), MSG_NOSIGNAL) != static_cast<ssize_t>(sizeof(reply))) {
      return Errno("handshake reply");
    }
    PrepareTcp(fd);
    return std::unique_ptr<DirectConnection>(
        new DirectConnection(fd, nullptr, 0, /*is_client=*/false, options_, -1));
  }
  iovec iov{&hello, sizeof(hello)};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 4)] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  const ssize_t got = recvmsg(fd, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
  // Every descriptor that came along is ours to close; the first is the region.
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const size_t n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < n; ++i) {
      int received;
      std::memcpy(&received, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
      if (memfd < 0) {
        memfd = received;
      } else {
        close(received);
      }
    }
  }
  if (got != static_cast<ssize_t>(sizeof(hello)) || hello.magic != kHelloMagic || memfd < 0) {
    return refuse(2, absl::InvalidArgumentError("not a shared-memory handshake"));
  }
  if (hello.instance != instance_) {
    return refuse(1, absl::FailedPreconditionError(
                         absl::StrCat("asked for instance ", hello.instance, ", not this one")));
  }
  ShmOptions asked = options_;
  asked.pipe_bytes = static_cast<int64_t>(std::min<uint64_t>(hello.pipe_bytes, uint64_t{1} << 40));
  const size_t bytes = RegionBytes(static_cast<uint64_t>(asked.pipe_bytes));
  struct stat st {};
  // Sealed against shrinking: the peer cannot truncate what is mapped here.
  const int seals = fcntl(memfd, F_GET_SEALS);
  if (!ValidateShmOptions(asked).ok() || fstat(memfd, &st) != 0 ||
      static_cast<size_t>(st.st_size) != bytes || seals < 0 || (seals & F_SEAL_SHRINK) == 0) {
    return refuse(2, absl::InvalidArgumentError("a bad shared region"));
  }
  void* region = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, memfd, 0);
  if (region == MAP_FAILED) return refuse(2, Errno("mmap"));
  const auto* header = static_cast<const RegionHeader*>(region);
  if (header->magic != kRegionMagic || header->pipe_bytes != hello.pipe_bytes) {
    munmap(region, bytes);
    return refuse(2, absl::InvalidArgumentError("a bad shared region header"));
  }
  Reply reply{kHelloMagic, instance_, 0};
  close(memfd);
  memfd = -1;
  if (send(fd, &reply, sizeof(reply), MSG_NOSIGNAL) != static_cast<ssize_t>(sizeof(reply))) {
    munmap(region, bytes);
    return Errno("handshake reply");
  }
  SetNonBlocking(fd);
  return std::unique_ptr<DirectConnection>(
      new DirectConnection(fd, region, bytes, /*is_client=*/false, asked, PeerPid(fd)));
}

}  // namespace pstrain
