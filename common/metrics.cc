#include "common/metrics.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <exception>
#include <set>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "common/clock.h"
#include "glog/logging.h"
#include "google/protobuf/descriptor.h"
#include "prometheus/collectable.h"
#include "prometheus/text_serializer.h"

namespace pstrain {
namespace {

// process_* metrics from /proc/self, under the names every Prometheus client
// library uses.
class ProcessCollector final : public prometheus::Collectable {
 public:
  std::vector<prometheus::MetricFamily> Collect() const override {
    std::ifstream in("/proc/self/stat");
    std::string stat;
    std::getline(in, stat);
    const size_t close = stat.rfind(')');
    if (close == std::string::npos || close + 2 > stat.size()) return {};
    std::istringstream fields(stat.substr(close + 2));
    // Fields from the 3rd (state) on; utime, stime are the 14th and 15th,
    // starttime the 22nd, vsize the 23rd, rss (pages) the 24th.
    std::vector<std::string> f;
    for (std::string field; fields >> field;) f.push_back(field);
    if (f.size() < 22) return {};
    auto num = [&](int i) { return std::strtod(f[i].c_str(), nullptr); };
    const double ticks = static_cast<double>(sysconf(_SC_CLK_TCK));
    const double cpu = (num(11) + num(12)) / ticks;
    const double start = BootTime() + num(19) / ticks;
    const double vsize = num(20);
    const double rss = num(21) * static_cast<double>(sysconf(_SC_PAGESIZE));
    return {Family("process_cpu_seconds_total", "User and system CPU time spent in seconds.",
                   prometheus::MetricType::Counter, cpu),
            Family("process_resident_memory_bytes", "Resident memory size in bytes.",
                   prometheus::MetricType::Gauge, rss),
            Family("process_virtual_memory_bytes", "Virtual memory size in bytes.",
                   prometheus::MetricType::Gauge, vsize),
            Family("process_start_time_seconds",
                   "Start time of the process since unix epoch in seconds.",
                   prometheus::MetricType::Gauge, start),
            Family("process_open_fds", "Number of open file descriptors.",
                   prometheus::MetricType::Gauge, OpenFds())};
  }

 private:
  static prometheus::MetricFamily Family(const std::string& name, const std::string& help,
                                         prometheus::MetricType type, double value) {
    prometheus::MetricFamily family;
    family.name = name;
    family.help = help;
    family.type = type;
    prometheus::ClientMetric metric;
    if (type == prometheus::MetricType::Counter) {
      metric.counter.value = value;
    } else {
      metric.gauge.value = value;
    }
    family.metric.push_back(metric);
    return family;
  }

  static double BootTime() {
    std::ifstream in("/proc/stat");
    for (std::string line; std::getline(in, line);) {
      if (line.rfind("btime ", 0) == 0) return std::strtod(line.c_str() + 6, nullptr);
    }
    return 0;
  }

  static double OpenFds() {
    DIR* dir = opendir("/proc/self/fd");
    if (dir == nullptr) return 0;
    double n = 0;
    while (dirent* e = readdir(dir)) {
      if (e->d_name[0] != '.') ++n;
    }
    closedir(dir);
    return n - 1;  // the descriptor of this listing
  }
};

// Times one call, server or client side, and counts it when its status is
// sent (server) or received (client).
class RpcInterceptor final : public grpc::experimental::Interceptor {
 public:
  // The name is copied: for generic calls gRPC's pointer does not outlive
  // the call's setup.
  RpcInterceptor(RpcMetrics* metrics, bool server, const char* method)
      : metrics_(metrics),
        server_(server),
        method_(method != nullptr ? method : ""),
        start_(MonotonicNow()) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    using grpc::experimental::InterceptionHookPoints;
    if (methods->QueryInterceptionHookPoint(server_ ? InterceptionHookPoints::PRE_SEND_STATUS
                                                    : InterceptionHookPoints::POST_RECV_STATUS)) {
      grpc::StatusCode code = grpc::StatusCode::UNKNOWN;
      if (server_) {
        code = methods->GetSendStatus().error_code();
      } else if (const grpc::Status* status = methods->GetRecvStatus(); status != nullptr) {
        code = status->error_code();
      }
      metrics_->Observe(server_, method_, code, absl::ToDoubleSeconds(MonotonicNow() - start_));
    }
    methods->Proceed();
  }

 private:
  RpcMetrics* const metrics_;
  const bool server_;
  const std::string method_;
  const absl::Time start_;
};

class ServerFactory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit ServerFactory(RpcMetrics* metrics) : metrics_(metrics) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    return new RpcInterceptor(metrics_, /*server=*/true, info->method());
  }

 private:
  RpcMetrics* const metrics_;
};

class ClientFactory final : public grpc::experimental::ClientInterceptorFactoryInterface {
 public:
  explicit ClientFactory(RpcMetrics* metrics) : metrics_(metrics) {}
  grpc::experimental::Interceptor* CreateClientInterceptor(
      grpc::experimental::ClientRpcInfo* info) override {
    return new RpcInterceptor(metrics_, /*server=*/false, info->method());
  }

 private:
  RpcMetrics* const metrics_;
};

const std::string kUnknownMethod = "unknown";

const char* CodeName(grpc::StatusCode code) {
  static const char* const kNames[] = {
      "OK",        "CANCELLED",         "UNKNOWN",          "INVALID_ARGUMENT",
      "DEADLINE_EXCEEDED", "NOT_FOUND", "ALREADY_EXISTS",   "PERMISSION_DENIED",
      "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE",
      "UNIMPLEMENTED", "INTERNAL",      "UNAVAILABLE",      "DATA_LOSS",
      "UNAUTHENTICATED"};
  const int i = static_cast<int>(code);
  return i >= 0 && i < 17 ? kNames[i] : "UNKNOWN";
}

}  // namespace

absl::Status BuildMetrics(const std::function<void()>& build) {
  try {
    build();
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("metrics: ", e.what()));
  }
  return absl::OkStatus();
}

prometheus::Histogram::BucketBoundaries LatencyBuckets() {
  prometheus::Histogram::BucketBoundaries b;
  for (double v = 1e-5; v < 100; v *= 2.5) b.push_back(v);
  return b;
}

prometheus::Histogram::BucketBoundaries CountBuckets() {
  return {0, 1, 2, 4, 8, 16, 32, 64, 128, 256};
}

absl::StatusOr<std::unique_ptr<RpcMetrics>> RpcMetrics::Create(prometheus::Registry& registry) {
  std::unique_ptr<RpcMetrics> m(new RpcMetrics);
  absl::Status s = BuildMetrics([&] {
    m->server_ = &prometheus::BuildHistogram()
                      .Name("pstrain_rpc_server_seconds")
                      .Help("Time to handle an RPC, by method and status code; _count counts them.")
                      .Register(registry);
    m->client_ = &prometheus::BuildHistogram()
                      .Name("pstrain_rpc_client_seconds")
                      .Help("Time of an RPC as the caller sees it, by method and status code.")
                      .Register(registry);
  });
  if (!s.ok()) return s;
  return m;
}

namespace {

// "/pstrain.v1.Control/GetJob" and the like: every method pstrain serves.
bool IsPstrainMethod(const std::string& name) {
  static const std::set<std::string>* const known = [] {
    auto* methods = new std::set<std::string>;
    const google::protobuf::DescriptorPool* pool =
        google::protobuf::DescriptorPool::generated_pool();
    for (const char* service :
         {"pstrain.v1.Control", "pstrain.v1.Membership", "pstrain.v1.Parameters"}) {
      const google::protobuf::ServiceDescriptor* s = pool->FindServiceByName(service);
      for (int i = 0; s != nullptr && i < s->method_count(); ++i) {
        methods->insert(absl::StrCat("/", service, "/", s->method(i)->name()));
      }
    }
    return methods;
  }();
  return known->contains(name);
}

}  // namespace

void RpcMetrics::Observe(bool server, const std::string& method, grpc::StatusCode code,
                         double seconds) {
  const std::string& name = IsPstrainMethod(method) ? method : kUnknownMethod;
  prometheus::Histogram* h;
  {
    absl::MutexLock lock(&mu_);
    auto key = std::make_tuple(server, name, static_cast<int>(code));
    auto it = bound_.find(key);
    if (it == bound_.end()) {
      auto* family = server ? server_ : client_;
      it = bound_.emplace(key, &family->Add({{"method", name}, {"code", CodeName(code)}},
                                            LatencyBuckets()))
               .first;
    }
    h = it->second;
  }
  h->Observe(seconds);
}

std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>>
RpcMetrics::ServerInterceptors() {
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> v;
  v.push_back(std::make_unique<ServerFactory>(this));
  return v;
}

std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>>
RpcMetrics::ClientInterceptors() {
  std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>> v;
  v.push_back(std::make_unique<ClientFactory>(this));
  return v;
}

MetricsServer::~MetricsServer() {
  stopping_ = true;
  if (thread_.joinable()) thread_.join();
  if (listen_fd_ >= 0) close(listen_fd_);
}

absl::Status MetricsServer::Init() {
  registry_ = std::make_shared<prometheus::Registry>();
  absl::StatusOr<std::unique_ptr<RpcMetrics>> rpc = RpcMetrics::Create(*registry_);
  if (!rpc.ok()) return rpc.status();
  rpc_ = std::move(*rpc);
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::CreateUnserved() {
  std::unique_ptr<MetricsServer> m(new MetricsServer);
  if (absl::Status s = m->Init(); !s.ok()) return s;
  return m;
}

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Create(
    const std::string& bind_address) {
  std::unique_ptr<MetricsServer> m(new MetricsServer);
  if (absl::Status s = m->Init(); !s.ok()) return s;
  const size_t colon = bind_address.rfind(':');
  if (colon == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("metrics address '", bind_address,
                                                   "' is not host:port"));
  }
  const std::string host = bind_address.substr(0, colon);
  const std::string port = bind_address.substr(colon + 1);
  addrinfo hints = {};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.empty() ? nullptr : host.c_str(), port.c_str(), &hints, &found) != 0 ||
      found == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("cannot resolve ", bind_address));
  }
  const int fd = socket(found->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  const int one = 1;
  if (fd >= 0) setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  const bool bound = fd >= 0 && bind(fd, found->ai_addr, found->ai_addrlen) == 0 &&
                     listen(fd, 16) == 0;
  const int err = errno;
  freeaddrinfo(found);
  if (!bound) {
    if (fd >= 0) close(fd);
    return absl::UnavailableError(
        absl::StrCat("cannot serve metrics on ", bind_address, ": ", std::strerror(err)));
  }
  sockaddr_storage addr = {};
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  const int bound_port = addr.ss_family == AF_INET6
                             ? ntohs(reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port)
                             : ntohs(reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
  m->listen_fd_ = fd;
  std::string advertised = host;
  if (host.empty() || host == "0.0.0.0" || host == "::" || host == "[::]") {
    char name[256] = {0};
    gethostname(name, sizeof(name) - 1);
    advertised = name;
  }
  if (advertised.find(':') != std::string::npos && advertised.front() != '[') {
    advertised = absl::StrCat("[", advertised, "]");  // an IPv6 literal
  }
  m->address_ = absl::StrCat(advertised, ":", bound_port);
  m->thread_ = std::thread([raw = m.get()] { raw->Serve(); });
  return m;
}

std::string MetricsServer::Scrape() const {
  std::vector<prometheus::MetricFamily> families = ProcessCollector().Collect();
  std::vector<prometheus::MetricFamily> registered = registry_->Collect();
  families.insert(families.end(), std::make_move_iterator(registered.begin()),
                  std::make_move_iterator(registered.end()));
  return prometheus::TextSerializer().Serialize(families);
}

void MetricsServer::SetReadiness(std::function<absl::Status()> readiness) {
  absl::MutexLock lock(&readiness_mu_);
  readiness_ = std::move(readiness);
}

absl::Status MetricsServer::Readiness() const {
  absl::MutexLock lock(&readiness_mu_);
  return readiness_ ? readiness_() : absl::UnavailableError("starting");
}

void MetricsServer::Serve() {
  while (!stopping_) {
    pollfd p = {listen_fd_, POLLIN, 0};
    if (poll(&p, 1, 200) <= 0) continue;
    // Non-blocking, so that a connection reset after poll cannot block.
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      if (errno != EAGAIN && errno != EWOULDBLOCK && errno != ECONNABORTED) {
        absl::SleepFor(absl::Milliseconds(100));  // e.g. out of descriptors
      }
      continue;
    }
    try {
      HandleConnection(fd);
    } catch (const std::exception& e) {
      LOG(ERROR) << "metrics request failed: " << e.what();
    }
    close(fd);
  }
}

void MetricsServer::HandleConnection(int fd) {
  // The whole exchange has one deadline, so that a slow client cannot hold
  // the only serving thread.
  const absl::Time deadline = MonotonicNow() + absl::Seconds(2);
  auto wait = [&](short events) {
    const int64_t ms = absl::ToInt64Milliseconds(deadline - MonotonicNow());
    pollfd p = {fd, events, 0};
    return ms > 0 && poll(&p, 1, static_cast<int>(ms)) == 1;
  };
  std::string request;
  char buf[1024];
  while (request.find("\r\n\r\n") == std::string::npos &&
         request.find("\n\n") == std::string::npos) {
    if (request.size() > 8192 || !wait(POLLIN)) return;
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n == 0) return;
    if (n < 0) {
      if (errno == EAGAIN || errno == EINTR) continue;
      return;
    }
    request.append(buf, static_cast<size_t>(n));
  }
  const std::string line = request.substr(0, request.find_first_of("\r\n"));
  const size_t sp1 = line.find(' ');
  const size_t sp2 = line.find(' ', sp1 == std::string::npos ? 0 : sp1 + 1);
  const std::string method = line.substr(0, sp1);
  std::string path = sp1 == std::string::npos ? "" : line.substr(sp1 + 1, sp2 - sp1 - 1);
  path = path.substr(0, path.find('?'));
  std::string status = "200 OK", type = "text/plain; version=0.0.4; charset=utf-8", body;
  if (method != "GET" && method != "HEAD") {
    status = "405 Method Not Allowed";
    type = "text/plain; charset=utf-8";
    body = "only GET\n";
  } else if (path == "/metrics") {
    body = Scrape();
  } else if (path == "/healthz") {
    type = "text/plain; charset=utf-8";
    body = "ok\n";
  } else if (path == "/readyz") {
    type = "text/plain; charset=utf-8";
    if (absl::Status ready = Readiness(); ready.ok()) {
      body = "ready\n";
    } else {
      status = "503 Service Unavailable";
      body = absl::StrCat(ready.message(), "\n");
    }
  } else {
    status = "404 Not Found";
    type = "text/plain; charset=utf-8";
    body = "see /metrics, /healthz, /readyz\n";
  }
  std::string response = absl::StrCat("HTTP/1.1 ", status, "\r\nContent-Type: ", type,
                                      "\r\nContent-Length: ", body.size(),
                                      "\r\nConnection: close\r\n\r\n");
  if (method != "HEAD") response += body;
  size_t sent = 0;
  while (sent < response.size()) {
    if (!wait(POLLOUT)) return;
    const ssize_t n = send(fd, response.data() + sent, response.size() - sent, MSG_NOSIGNAL);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
    if (n <= 0) return;
    sent += static_cast<size_t>(n);
  }
}

void ExpiringSeries::Add(const std::string& job_id, std::function<void()> remove) {
  absl::MutexLock lock(&mu_);
  Entry& e = jobs_[job_id];
  ++e.bindings;
  e.due = absl::InfiniteFuture();
  e.removals.push_back(std::move(remove));
}

void ExpiringSeries::AddRemoval(const std::string& job_id, std::function<void()> remove) {
  absl::MutexLock lock(&mu_);
  jobs_[job_id].removals.push_back(std::move(remove));
}

void ExpiringSeries::JobEnded(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end() || it->second.bindings == 0) return;
  if (--it->second.bindings == 0) it->second.due = MonotonicNow() + grace_;
}

void ExpiringSeries::Sweep() {
  std::vector<std::function<void()>> run;
  {
    absl::MutexLock lock(&mu_);
    const absl::Time now = MonotonicNow();
    for (auto it = jobs_.begin(); it != jobs_.end();) {
      if (it->second.bindings > 0 || it->second.due > now) {
        ++it;
        continue;
      }
      for (auto& remove : it->second.removals) run.push_back(std::move(remove));
      it = jobs_.erase(it);
    }
  }
  for (auto& remove : run) remove();
}

}  // namespace pstrain
