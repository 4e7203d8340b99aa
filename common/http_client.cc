#include "common/http_client.h"

#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/clock.h"

namespace pstrain {
namespace {

constexpr size_t kMaxResponseBytes = 64 << 20;

// Closes the descriptor when it goes out of scope.
struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) close(fd);
  }
};

// Waits until `fd` is ready for `events` or the deadline passes.
bool WaitFor(int fd, short events, absl::Time deadline) {
  while (true) {
    const int64_t ms = absl::ToInt64Milliseconds(deadline - MonotonicNow());
    if (ms <= 0) return false;
    pollfd p = {fd, events, 0};
    const int n = poll(&p, 1, static_cast<int>(ms));
    if (n > 0) return true;
    if (n == 0 || errno != EINTR) return false;
  }
}

}  // namespace

absl::StatusOr<HttpResponse> HttpGet(const std::string& host_port, const std::string& path,
                                     absl::Duration timeout) {
  const absl::Time deadline = MonotonicNow() + timeout;
  const size_t colon = host_port.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == host_port.size()) {
    return absl::InvalidArgumentError(absl::StrCat("'", host_port, "' is not host:port"));
  }
  std::string host = host_port.substr(0, colon);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  const std::string port = host_port.substr(colon + 1);
  addrinfo hints = {};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (const int err = getaddrinfo(host.c_str(), port.c_str(), &hints, &found); err != 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot resolve ", host_port, ": ", gai_strerror(err)));
  }
  Fd sock;
  std::string connect_error = "no address";
  for (addrinfo* a = found; a != nullptr && sock.fd < 0; a = a->ai_next) {
    const int fd = socket(a->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) continue;
    int err = 0;
    if (connect(fd, a->ai_addr, a->ai_addrlen) != 0) {
      err = errno;
      if (err == EINPROGRESS && WaitFor(fd, POLLOUT, deadline)) {
        socklen_t len = sizeof(err);
        getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
      } else if (err == EINPROGRESS) {
        err = ETIMEDOUT;
      }
    }
    if (err == 0) {
      sock.fd = fd;
    } else {
      connect_error = std::strerror(err);
      close(fd);
    }
  }
  freeaddrinfo(found);
  if (sock.fd < 0) {
    return absl::UnavailableError(absl::StrCat("cannot connect to ", host_port, ": ",
                                               connect_error));
  }
  const std::string request =
      absl::StrCat("GET ", path.empty() ? "/" : path, " HTTP/1.0\r\nHost: ", host_port,
                   "\r\nConnection: close\r\n\r\n");
  for (size_t sent = 0; sent < request.size();) {
    if (!WaitFor(sock.fd, POLLOUT, deadline)) {
      return absl::UnavailableError(absl::StrCat(host_port, ": timed out sending"));
    }
    const ssize_t n = send(sock.fd, request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
    if (n <= 0) return absl::UnavailableError(absl::StrCat(host_port, ": ", std::strerror(errno)));
    sent += static_cast<size_t>(n);
  }
  std::string response;
  char buf[65536];
  while (true) {
    if (!WaitFor(sock.fd, POLLIN, deadline)) {
      return absl::UnavailableError(absl::StrCat(host_port, ": timed out waiting for the answer"));
    }
    const ssize_t n = recv(sock.fd, buf, sizeof(buf), 0);
    if (n == 0) break;
    if (n < 0) {
      if (errno == EAGAIN || errno == EINTR) continue;
      return absl::UnavailableError(absl::StrCat(host_port, ": ", std::strerror(errno)));
    }
    response.append(buf, static_cast<size_t>(n));
    if (response.size() > kMaxResponseBytes) {
      return absl::UnavailableError(absl::StrCat(host_port, ": answer larger than 64 MiB"));
    }
  }
  // "HTTP/1.x NNN reason\r\n" ... "\r\n\r\n" body
  const size_t head_end = response.find("\r\n\r\n");
  const size_t sp = response.find(' ');
  HttpResponse out;
  if (head_end == std::string::npos || sp == std::string::npos || sp > head_end ||
      response.compare(0, 5, "HTTP/") != 0 ||
      !absl::SimpleAtoi(response.substr(sp + 1, 3), &out.status)) {
    return absl::UnavailableError(absl::StrCat(host_port, ": not an HTTP answer"));
  }
  out.body = response.substr(head_end + 4);
  return out;
}

}  // namespace pstrain
