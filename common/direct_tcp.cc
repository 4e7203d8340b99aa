// The TCP carrier of direct connections (direct_connection.h): messages
// written to the socket with sendmsg, many at once, and read through a
// staging buffer (a large body straight into place); the socket's own
// bytes wake the peer.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/direct_connection.h"
#include "common/direct_wire.h"

namespace pstrain {
namespace {

// The iovecs one sendmsg takes.
constexpr int kSendIovecs = 64;

}  // namespace

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

}  // namespace pstrain
