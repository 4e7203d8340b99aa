// transport: W workers push a gradient of the whole model to S servers and
// pull the new values back (sync PushPull over gRPC on loopback), against
// plain loopback TCP moving the same bytes in the same pattern.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "bench/bench.h"
#include "bench/bench_util.h"
#include "common/partition.h"
#include "common/status.h"
#include "glog/logging.h"
#include "worker/parameter_client.h"
#include "worker/transport.h"

namespace pstrain::bench {
namespace {

constexpr double kMiB = 1 << 20;

// Steps that move about `bytes` in all (at least 3, at most 100).
int StepsFor(double bytes, double bytes_per_step) {
  return static_cast<int>(std::clamp(bytes / bytes_per_step, 3.0, 100.0));
}

// One sync PushPull of the whole model per worker and step; the first
// step (connections, first touch of the buffers) is not timed. Returns
// bytes moved (pushed plus pulled) per second.
absl::StatusOr<double> PstrainRate(const v1::JobSpec& spec, const v1::PartitionPlan& plan,
                                   const worker::GrpcTransportOptions& grpc, int steps) {
  PSTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<LocalServers> servers,
                           LocalServers::Start("bench", spec, plan));
  const int workers = spec.num_workers();
  std::barrier warm(workers + 1);
  std::vector<absl::Status> status(workers);
  std::vector<std::thread> threads;
  for (int w = 0; w < workers; ++w) {
    threads.emplace_back([&, w] {
      absl::StatusOr<std::unique_ptr<worker::ParameterTransport>> transport =
          worker::CreateGrpcTransport(servers->addresses(), grpc);
      if (!transport.ok()) {
        status[w] = transport.status();
        warm.arrive_and_drop();
        return;
      }
      worker::ParameterClient::Options options;
      options.job_id = "bench";
      options.worker = w;
      options.mode = v1::MODE_SYNC;
      options.plan = plan;
      worker::ParameterClient client(options, transport->get());
      auto grad = std::make_shared<std::vector<float>>(plan.total_floats(), 1e-3f);
      std::vector<float> params(plan.total_floats());
      status[w] = client.PushPull(0, grad, params.data());
      warm.arrive_and_wait();
      for (int step = 1; step <= steps && status[w].ok(); ++step) {
        status[w] = client.PushPull(step, grad, params.data());
      }
    });
  }
  warm.arrive_and_wait();
  const absl::Time start = absl::Now();
  for (std::thread& t : threads) t.join();
  const double seconds = SecondsSince(start);
  for (const absl::Status& s : status) PSTRAIN_RETURN_IF_ERROR(s);
  return 2.0 * plan.total_floats() * 4 * workers * steps / seconds;
}

bool WriteAll(int fd, const char* data, size_t n) {
  while (n > 0) {
    const ssize_t sent = send(fd, data, n, MSG_NOSIGNAL);
    if (sent <= 0) return false;
    data += sent;
    n -= static_cast<size_t>(sent);
  }
  return true;
}

bool ReadAll(int fd, char* data, size_t n) {
  while (n > 0) {
    const ssize_t got = recv(fd, data, n, 0);
    if (got <= 0) return false;
    data += got;
    n -= static_cast<size_t>(got);
  }
  return true;
}

// The same pattern over plain sockets: every worker connects to every
// server; per step each connection sends the server's share of the model
// and reads as many bytes back, which the server echoes from one reused
// buffer. Returns bytes moved per second.
absl::StatusOr<double> RawTcpRate(const std::vector<int64_t>& share_bytes, int workers,
                                  int steps) {
  const int servers = static_cast<int>(share_bytes.size());
  std::vector<int> listeners;
  std::vector<uint16_t> ports;
  for (int s = 0; s < servers; ++s) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(addr);
    if (fd < 0 || bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
        listen(fd, workers) != 0 ||
        getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
      return absl::InternalError(absl::StrCat("loopback listener: ", std::strerror(errno)));
    }
    listeners.push_back(fd);
    ports.push_back(ntohs(addr.sin_port));
  }
  std::vector<std::thread> echoes;
  for (int s = 0; s < servers; ++s) {
    for (int w = 0; w < workers; ++w) {
      echoes.emplace_back([fd = listeners[s], bytes = share_bytes[s]] {
        const int conn = accept(fd, nullptr, nullptr);
        if (conn < 0) return;
        std::vector<char> buffer(bytes);
        while (ReadAll(conn, buffer.data(), bytes) && WriteAll(conn, buffer.data(), bytes)) {
        }
        close(conn);
      });
    }
  }
  std::barrier warm(servers * workers + 1);
  std::atomic<bool> failed{false};
  std::vector<std::thread> clients;
  for (int w = 0; w < workers; ++w) {
    for (int s = 0; s < servers; ++s) {
      clients.emplace_back([&, port = ports[s], bytes = share_bytes[s]] {
        const int fd = socket(AF_INET, SOCK_STREAM, 0);
        sockaddr_in addr{};
        addr.sin_family = AF_INET;
        addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        addr.sin_port = htons(port);
        std::vector<char> out(bytes, 1), in(bytes);
        bool ok = fd >= 0 && connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
        ok = ok && WriteAll(fd, out.data(), bytes) && ReadAll(fd, in.data(), bytes);
        warm.arrive_and_wait();
        for (int step = 0; ok && step < steps; ++step) {
          ok = WriteAll(fd, out.data(), bytes) && ReadAll(fd, in.data(), bytes);
        }
        if (!ok) failed = true;
        if (fd >= 0) close(fd);
      });
    }
  }
  warm.arrive_and_wait();
  const absl::Time start = absl::Now();
  for (std::thread& t : clients) t.join();
  const double seconds = SecondsSince(start);
  // Wakes echo threads still in accept (a client that never connected).
  for (int fd : listeners) shutdown(fd, SHUT_RDWR);
  for (std::thread& t : echoes) t.join();
  for (int fd : listeners) close(fd);
  if (failed) return absl::InternalError("a loopback connection failed");
  int64_t total = 0;
  for (int64_t b : share_bytes) total += b;
  return 2.0 * total * workers * steps / seconds;
}

// iperf3's loopback figure in bytes/s, or 0 when iperf3 is not installed.
double Iperf3Rate() {
  if (std::system("command -v iperf3 > /dev/null 2>&1") != 0) return 0;
  const int port = 40000 + static_cast<int>(getpid() % 20000);
  if (std::system(absl::StrFormat("iperf3 -s -1 -D -p %d > /dev/null 2>&1", port).c_str()) != 0) {
    return 0;
  }
  absl::SleepFor(absl::Milliseconds(300));
  FILE* pipe = popen(absl::StrFormat("iperf3 -c 127.0.0.1 -p %d -t 2 -J 2>/dev/null", port).c_str(),
                     "r");
  if (pipe == nullptr) return 0;
  std::string json;
  char buffer[4096];
  while (size_t n = fread(buffer, 1, sizeof(buffer), pipe)) json.append(buffer, n);
  pclose(pipe);
  const size_t sum = json.find("\"sum_received\"");
  const size_t key = sum == std::string::npos ? sum : json.find("\"bits_per_second\":", sum);
  if (key == std::string::npos) return 0;
  return std::atof(json.c_str() + key + 18) / 8;
}

}  // namespace

int RunTransportBench(const TransportBenchOptions& options) {
  const worker::GrpcTransportOptions& grpc = options.grpc;
  std::printf("channels per server: %d, window: %d, chunk: %lld bytes\n", grpc.channels_per_server,
              grpc.window, static_cast<long long>(options.chunk_bytes));
  Table table("transport", {"model_MiB", "servers", "workers", "steps", "pstrain_MiB/s",
                            "tcp_MiB/s", "ratio"});
  for (int mib : options.model_mib) {
    for (int servers : options.servers) {
      for (int workers : options.workers) {
        const v1::JobSpec spec = JobOfSize(static_cast<int64_t>(mib * kMiB / 4), servers,
                                           workers, options.chunk_bytes);
        const v1::PartitionPlan plan = PlanOf(spec);
        const double model_bytes = 4.0 * plan.total_floats();
        const int steps = StepsFor(options.bytes_per_config, 2 * model_bytes * workers);
        absl::StatusOr<double> ours = PstrainRate(spec, plan, grpc, steps);
        std::vector<int64_t> shares;
        for (int64_t floats : ServerLoads(plan)) shares.push_back(4 * floats);
        absl::StatusOr<double> tcp = RawTcpRate(shares, workers, steps);
        if (!ours.ok() || !tcp.ok()) {
          LOG(ERROR) << "transport " << mib << " MiB, " << servers << " servers, " << workers
                     << " workers: " << (ours.ok() ? tcp.status() : ours.status());
          return 1;
        }
        table.Add(Table::Row()
                      .Number(model_bytes / kMiB, 1)
                      .Int(servers)
                      .Int(workers)
                      .Int(steps)
                      .Number(*ours / kMiB, 0)
                      .Number(*tcp / kMiB, 0)
                      .Number(*ours / *tcp, 3));
      }
    }
  }
  table.Finish();
  if (const double iperf = Iperf3Rate(); iperf > 0) {
    std::printf("iperf3 loopback, one stream: %.0f MiB/s\n", iperf / kMiB);
  } else {
    std::printf("iperf3: not installed (apt-get install iperf3 to add its figure)\n");
  }
  return 0;
}

}  // namespace pstrain::bench
