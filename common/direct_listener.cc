// The handshake of direct connections (direct_connection.h), both sides:
// the connecting side's Connect (shared memory: a new region handed over
// an abstract Unix socket) and ConnectTcp, and the listener that accepts
// them, checks the region and the instance asked for, and answers.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/direct_connection.h"
#include "common/direct_wire.h"
#include "common/shm_pipe.h"
#include "glog/logging.h"

namespace pstrain {

absl::Status Errno(absl::string_view what) {
  return absl::UnavailableError(absl::StrCat(what, ": ", std::strerror(errno)));
}

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

absl::StatusOr<std::unique_ptr<DirectConnection>> DirectConnection::Connect(
    const std::string& name, uint64_t instance, const ShmOptions& options, absl::Duration timeout) {
  if (absl::Status s = ValidateShmOptions(options); !s.ok()) return s;
  const uint64_t pipe_bytes = static_cast<uint64_t>(options.pipe_bytes);
  absl::StatusOr<ShmRegion> made = CreateShmRegion(pipe_bytes);
  if (!made.ok()) return made.status();
  const auto [region, bytes, memfd] = *made;

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
  if (!ValidateShmOptions(asked).ok()) {
    return refuse(2, absl::InvalidArgumentError("a bad shared region"));
  }
  const size_t bytes = RegionBytes(hello.pipe_bytes);
  absl::StatusOr<void*> mapped = MapPeerRegion(memfd, hello.pipe_bytes);
  if (!mapped.ok()) return refuse(2, mapped.status());
  void* const region = *mapped;
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
