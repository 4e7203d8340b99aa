// transport: W workers push a gradient of the whole model to S servers in a
// process of their own and pull the new values back (sync PushPull on
// loopback TCP over direct connections and over gRPC, over the servers'
// same-machine sockets, and through shared memory), against the same bytes
// moved in the same pattern by plain sockets of the same kind, and, for
// shared memory, by memcpy; gRPC over TCP also against a plain gRPC program
// making the same exchanges.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstddef>
#include <cstring>
#include <filesystem>
#include <limits>
#include <thread>

#include "absl/algorithm/container.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/notification.h"
#include "bench/bench.h"
#include "bench/bench_util.h"
#include "bench/grpc_echo.h"
#include "bench/transport_util.h"
#include "common/files.h"
#include "common/partition.h"
#include "common/process.h"
#include "common/status.h"
#include "glog/logging.h"
#include "kernels/cpu/cpu_kernels.h"
#include "worker/parameter_client.h"
#include "worker/transport.h"

namespace pstrain::bench {
namespace {

constexpr double kMiB = 1 << 20;

// One sync PushPull of the whole model per worker and step, for `duration`
// after an untimed first step (connections, first touch of the buffers).
// Returns bytes moved (pushed plus pulled) per second; *steps: the timed
// steps.
absl::StatusOr<double> PstrainRate(const v1::JobSpec& spec, const v1::PartitionPlan& plan,
                                   const std::vector<std::string>& addresses,
                                   const worker::GrpcTransportOptions& grpc,
                                   absl::Duration duration, int64_t* steps) {
  const int workers = spec.num_workers();
  PSTRAIN_ASSIGN_OR_RETURN(
      const double seconds,
      RunTimedSteps(
          workers, /*warm_steps=*/1, duration,
          [&](int w) -> absl::StatusOr<BenchStep> {
            // The client goes before the transport it uses.
            struct Worker {
              std::unique_ptr<worker::ParameterTransport> transport;
              std::unique_ptr<worker::ParameterClient> client;
              std::shared_ptr<std::vector<float>> grad;
              std::vector<float> params;
            };
            auto me = std::make_shared<Worker>();
            PSTRAIN_ASSIGN_OR_RETURN(me->transport, worker::CreateGrpcTransport(addresses, grpc));
            worker::ParameterClient::Options options;
            options.job_id = "bench";
            options.worker = w;
            options.mode = v1::MODE_SYNC;
            options.plan = plan;
            me->client = std::make_unique<worker::ParameterClient>(options, me->transport.get());
            me->grad = std::make_shared<std::vector<float>>(plan.total_floats(), 1e-3f);
            me->params.resize(plan.total_floats());
            return [me](int64_t step) {
              return me->client->PushPull(step, me->grad, me->params.data());
            };
          },
          steps));
  return 2.0 * plan.total_floats() * 4 * workers * *steps / seconds;
}

// One step of a plain-socket client: sends `bytes` of `out` while it reads
// as many echoed bytes into `in`, both at once (the echo starts before the
// last byte is sent, as pstrain's replies do). False if the connection
// failed.
bool SendAndReceive(int fd, const char* out, char* in, size_t bytes) {
  size_t sent = 0, received = 0;
  while (received < bytes) {
    pollfd p{fd, static_cast<short>(POLLIN | (sent < bytes ? POLLOUT : 0)), 0};
    if (poll(&p, 1, 10000) <= 0) return false;
    if ((p.revents & POLLOUT) && sent < bytes) {
      const ssize_t n = send(fd, out + sent, std::min<size_t>(bytes - sent, 1 << 20),
                             MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n < 0 && errno != EAGAIN) return false;
      if (n > 0) sent += static_cast<size_t>(n);
    }
    if (p.revents & (POLLIN | POLLHUP | POLLERR)) {
      const ssize_t n = recv(fd, in + received, bytes - received, MSG_DONTWAIT);
      if (n == 0 || (n < 0 && errno != EAGAIN)) return false;
      if (n > 0) received += static_cast<size_t>(n);
    }
  }
  return true;
}

// The echo side: writes back what it reads, as it reads it. With
// share_bytes > 0 a plain parameter server instead, doing the arithmetic a
// server must do and nothing else: the bytes of each step are the
// gradient of a share of that many bytes, and each whole float read is
// applied to the share's values (value -= rate * gradient) and the new
// value written back in its place, as it is read. (Less than pstrain's
// server does: no sum of the workers' gradients, no wait for them, no
// check.)
void Echo(int fd, int64_t share_bytes = 0) {
  std::vector<char> buffer(1 << 20);
  std::vector<float> values(share_bytes / 4, 0.5f);
  int64_t at = 0;      // the float of the share the buffer starts at
  size_t carried = 0;  // bytes of a float split between two reads
  while (true) {
    const ssize_t got = recv(fd, buffer.data() + carried, buffer.size() - carried, 0);
    if (got <= 0) return;
    const size_t have = carried + static_cast<size_t>(got);
    const size_t ready = share_bytes > 0 ? have / 4 * 4 : have;
    if (share_bytes > 0) {
      auto* g = reinterpret_cast<float*>(buffer.data());
      for (int64_t i = 0, n = static_cast<int64_t>(ready / 4); i < n;) {
        // Up to the share's end, then from its start (the next step).
        const int64_t run = std::min<int64_t>(n - i, static_cast<int64_t>(values.size()) - at);
        float* __restrict v = values.data() + at;
        float* __restrict grad = g + i;
        for (int64_t k = 0; k < run; ++k) grad[k] = v[k] -= 0.01f * grad[k];
        i += run;
        at = (at + run) % static_cast<int64_t>(values.size());
      }
    }
    for (size_t done = 0; done < ready;) {
      const ssize_t n = send(fd, buffer.data() + done, ready - done, MSG_NOSIGNAL);
      if (n <= 0) return;
      done += static_cast<size_t>(n);
    }
    carried = have - ready;
    std::memmove(buffer.data(), buffer.data() + ready, carried);
  }
}

// A listening socket of `family` (AF_INET: loopback TCP on a free port;
// AF_UNIX: an abstract Unix socket) and how to reach it; fd -1 on failure.
struct Listener {
  int fd = -1;
  sockaddr_storage address{};
  socklen_t address_len = 0;
};

Listener Listen(int family, int backlog, int index) {
  Listener l;
  l.fd = socket(family, SOCK_STREAM, 0);
  if (family == AF_INET) {
    auto* in = reinterpret_cast<sockaddr_in*>(&l.address);
    in->sin_family = AF_INET;
    in->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    l.address_len = sizeof(sockaddr_in);
  } else {
    auto* un = reinterpret_cast<sockaddr_un*>(&l.address);
    un->sun_family = AF_UNIX;
    const std::string name = absl::StrCat("pstrain-bench-", getpid(), "-", index);
    std::memcpy(un->sun_path + 1, name.data(), name.size());  // abstract: sun_path[0] is 0
    l.address_len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  }
  auto* address = reinterpret_cast<sockaddr*>(&l.address);
  if (l.fd < 0 || bind(l.fd, address, l.address_len) != 0 || listen(l.fd, backlog) != 0 ||
      (family == AF_INET && getsockname(l.fd, address, &l.address_len) != 0)) {
    if (l.fd >= 0) close(l.fd);
    l.fd = -1;
  }
  return l;
}

}  // namespace

absl::StatusOr<double> RunTimedSteps(
    int workers, int warm_steps, absl::Duration duration,
    const std::function<absl::StatusOr<BenchStep>(int worker)>& make_step, int64_t* timed_steps) {
  absl::Time start;  // when the last worker is warm: the timed part begins
  std::atomic<int64_t> last_step{std::numeric_limits<int64_t>::max()};
  std::barrier warm(workers + 1, [&start]() noexcept { start = absl::Now(); });
  std::vector<absl::Status> status(workers);
  std::vector<std::thread> threads;
  for (int w = 0; w < workers; ++w) {
    threads.emplace_back([&, w] {
      absl::StatusOr<BenchStep> step = make_step(w);
      if (!step.ok()) {
        status[w] = step.status();
        warm.arrive_and_drop();
        return;
      }
      for (int64_t s = 0; s < warm_steps && status[w].ok(); ++s) status[w] = (*step)(s);
      warm.arrive_and_wait();
      for (int64_t s = warm_steps; s <= last_step && status[w].ok(); ++s) {
        status[w] = (*step)(s);
        if (w == 0 && last_step == std::numeric_limits<int64_t>::max() &&
            absl::Now() - start >= duration) {
          last_step = s + 1;
        }
      }
    });
  }
  warm.arrive_and_wait();
  for (std::thread& t : threads) t.join();
  const double seconds = SecondsSince(start);
  for (const absl::Status& s : status) PSTRAIN_RETURN_IF_ERROR(s);
  *timed_steps = last_step - warm_steps + 1;
  return seconds;
}

absl::StatusOr<double> RawSocketRate(int family, const std::vector<int64_t>& share_bytes,
                                     int workers, absl::Duration duration, bool plain_server) {
  const int servers = static_cast<int>(share_bytes.size());
  std::vector<Listener> listeners;
  for (int s = 0; s < servers; ++s) {
    listeners.push_back(Listen(family, workers, s));
    if (listeners.back().fd < 0) {
      const std::string error = std::strerror(errno);
      for (const Listener& l : listeners) {
        if (l.fd >= 0) close(l.fd);
      }
      return absl::InternalError(absl::StrCat("listener: ", error));
    }
  }
  std::vector<std::thread> echoes;
  for (int s = 0; s < servers; ++s) {
    for (int w = 0; w < workers; ++w) {
      echoes.emplace_back([fd = listeners[s].fd, share = plain_server ? share_bytes[s] : 0] {
        const int conn = accept(fd, nullptr, nullptr);
        if (conn < 0) return;
        Echo(conn, share);
        close(conn);
      });
    }
  }
  absl::Time start;  // when the last client is warm: the timed part begins
  std::atomic<bool> failed{false};
  std::atomic<int64_t> echoed_bytes{0};
  std::atomic<uint32_t> scanned{0};  // the scans' results, so that they are made
  std::barrier warm(servers * workers + 1, [&start]() noexcept { start = absl::Now(); });
  std::vector<std::thread> clients;
  for (int w = 0; w < workers; ++w) {
    for (int s = 0; s < servers; ++s) {
      clients.emplace_back([&, s, bytes = share_bytes[s]] {
        const int fd = socket(family, SOCK_STREAM, 0);
        std::vector<char> out(bytes, 1), in(bytes);
        bool ok = fd >= 0 && connect(fd, reinterpret_cast<const sockaddr*>(&listeners[s].address),
                                     listeners[s].address_len) == 0;
        ok = ok && SendAndReceive(fd, out.data(), in.data(), bytes);
        warm.arrive_and_wait();
        int64_t done = 0;
        uint32_t max_bits = 0;
        while (ok && absl::Now() - start < duration) {
          if (plain_server) {
            max_bits = std::max(max_bits, kernels::MaxMagnitudeBits(out.data(), 4, bytes / 4));
          }
          ok = SendAndReceive(fd, out.data(), in.data(), bytes);
          done += ok;
        }
        scanned.fetch_or(max_bits, std::memory_order_relaxed);
        echoed_bytes += done * bytes;
        if (!ok) failed = true;
        if (fd >= 0) close(fd);
      });
    }
  }
  warm.arrive_and_wait();
  for (std::thread& t : clients) t.join();
  const double seconds = SecondsSince(start);
  // Wakes echo threads still in accept (a client that never connected).
  for (const Listener& l : listeners) shutdown(l.fd, SHUT_RDWR);
  for (std::thread& t : echoes) t.join();
  for (const Listener& l : listeners) close(l.fd);
  if (failed) return absl::InternalError("a plain socket connection failed");
  return 2.0 * static_cast<double>(echoed_bytes) / seconds;
}

namespace {

// The same pattern by memcpy: per step each worker copies each server's
// share of its gradient to a buffer of that server's and the values back,
// for `duration`. Returns bytes moved per second.
double MemcpyRate(const std::vector<int64_t>& share_bytes, int workers, absl::Duration duration) {
  int64_t total = 0;
  for (int64_t b : share_bytes) total += b;
  absl::Time start;  // when the last worker is warm: the timed part begins
  std::atomic<int64_t> moved{0};
  std::barrier warm(workers + 1, [&start]() noexcept { start = absl::Now(); });
  std::vector<std::thread> threads;
  for (int w = 0; w < workers; ++w) {
    threads.emplace_back([&] {
      std::vector<char> grad(total, 1), params(total), server(total);
      std::memcpy(server.data(), grad.data(), total);  // first touch, untimed
      std::memcpy(params.data(), server.data(), total);
      warm.arrive_and_wait();
      int64_t steps = 0;
      while (absl::Now() - start < duration) {
        int64_t offset = 0;
        for (int64_t bytes : share_bytes) {
          std::memcpy(server.data() + offset, grad.data() + offset, bytes);
          std::memcpy(params.data() + offset, server.data() + offset, bytes);
          offset += bytes;
        }
        ++steps;
      }
      moved += 2 * steps * total;
    });
  }
  warm.arrive_and_wait();
  for (std::thread& t : threads) t.join();
  return static_cast<double>(moved) / SecondsSince(start);
}

}  // namespace

absl::StatusOr<std::unique_ptr<ServerProcess>> ServerProcess::Start(const v1::JobSpec& spec,
                                                                     int64_t floats,
                                                                     int64_t chunk_bytes,
                                                                     bool echo, int table_dim) {
  char dir[] = "/tmp/pstrain-bench-servers.XXXXXX";
  if (mkdtemp(dir) == nullptr) return absl::InternalError("cannot make a directory");
  auto p = std::unique_ptr<ServerProcess>(new ServerProcess(dir));
  SpawnOptions spawn;
  spawn.argv = {"/proc/self/exe",
                "transport_servers",
                absl::StrCat("--serve_floats=", floats),
                absl::StrCat("--serve_servers=", spec.num_servers()),
                absl::StrCat("--serve_workers=", spec.num_workers()),
                absl::StrCat("--chunk_bytes=", chunk_bytes),
                absl::StrCat("--serve_address_file=", p->address_file()),
                absl::StrCat("--serve_echo=", echo),
                absl::StrCat("--serve_table_dim=", table_dim)};
  spawn.log_path = p->dir_ + "/servers.log";
  PSTRAIN_ASSIGN_OR_RETURN(p->pid_, Spawn(spawn));
  const absl::Time give_up = absl::Now() + absl::Seconds(60);
  while (true) {
    if (absl::StatusOr<std::string> text = ReadFile(p->address_file()); text.ok()) {
      p->addresses_ = absl::StrSplit(*text, '\n', absl::SkipEmpty());
      return p;
    }
    if (TryReap(p->pid_).has_value() || absl::Now() > give_up) {
      p->pid_ = -1;
      return absl::InternalError(
          absl::StrCat("the servers did not start; see ", p->dir_, "/servers.log"));
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
}

ServerProcess::~ServerProcess() {
  if (pid_ > 0) StopProcess(pid_, absl::Seconds(5));
  std::filesystem::remove_all(dir_);
}

namespace {

// How a configuration's workers reach its servers: over TCP (pstrain's
// direct connections, or gRPC's streams), over the servers' same-machine
// sockets, or through shared memory.
enum class Way { kDirectTcp, kGrpcTcp, kUnix, kShm };

const char* NameOf(Way way) {
  switch (way) {
    case Way::kDirectTcp:
      return "tcp";
    case Way::kGrpcTcp:
      return "grpc-tcp";
    case Way::kUnix:
      return "unix";
    case Way::kShm:
      return "shm";
  }
  return "?";
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
  std::printf("channels per server: %d, window: %d (or %lld bytes), chunk: %lld bytes, %s per "
              "configuration\n",
              grpc.channels_per_server, grpc.window, static_cast<long long>(grpc.window_bytes),
              static_cast<long long>(options.chunk_bytes),
              absl::FormatDuration(options.duration).c_str());
  Table table("transport", {"model_MiB", "workers", "servers", "transport", "steps",
                            "pstrain_MiB/s", "baseline_MiB/s", "baseline", "ratio", "busy",
                            "baseline_busy"});
  for (int mib : options.model_mib) {
    for (const auto& [workers, servers] : options.shapes) {
      const v1::JobSpec spec = JobOfSize(static_cast<int64_t>(mib * kMiB / 4), servers, workers,
                                         options.chunk_bytes);
      const v1::PartitionPlan plan = PlanOf(spec);
      std::vector<int64_t> shares;
      for (int64_t floats : ServerLoads(plan)) shares.push_back(4 * floats);
      // pstrain over TCP (its direct connections, and gRPC's) against a
      // plain TCP socket pair; over its same-machine socket against a plain
      // Unix socket pair; through shared memory against memcpy.
      for (const Way way : {Way::kDirectTcp, Way::kGrpcTcp, Way::kUnix, Way::kShm}) {
        if (!absl::c_linear_search(options.transports, NameOf(way))) continue;
        absl::StatusOr<std::unique_ptr<ServerProcess>> server_process =
            ServerProcess::Start(spec, static_cast<int64_t>(mib * kMiB / 4), options.chunk_bytes);
        if (!server_process.ok()) {
          LOG(ERROR) << "transport: " << server_process.status();
          return 1;
        }
        worker::GrpcTransportOptions transport = grpc;
        transport.same_machine_sockets = way == Way::kUnix;
        transport.shared_memory = way == Way::kShm;
        transport.direct_tcp = way == Way::kDirectTcp;
        int64_t steps = 0;
        const MachineBusy ours_meter;
        absl::StatusOr<double> ours = PstrainRate(
            spec, plan, (*server_process)->addresses(), transport, options.duration, &steps);
        const double ours_busy = ours_meter.Share();
        server_process->reset();
        const MachineBusy plain_meter;
        absl::StatusOr<double> plain =
            way == Way::kShm ? MemcpyRate(shares, workers, options.duration)
                             : RawSocketRate(way == Way::kUnix ? AF_UNIX : AF_INET, shares,
                                             workers, options.duration);
        const double plain_busy = plain_meter.Share();
        // A row of this configuration: pstrain against `baseline` bytes/s,
        // with the share of the machine each kept busy.
        auto add_row = [&](double baseline, const char* baseline_name, double baseline_busy) {
          table.Add(Table::Row()
                        .Number(4.0 * plan.total_floats() / kMiB, 1)
                        .Int(workers)
                        .Int(servers)
                        .Text(NameOf(way))
                        .Int(steps)
                        .Number(*ours / kMiB, 0)
                        .Number(baseline / kMiB, 0)
                        .Text(baseline_name)
                        .Number(*ours / baseline, 3)
                        .Number(ours_busy, 2)
                        .Number(baseline_busy, 2));
        };
        if (way == Way::kDirectTcp && ours.ok()) {
          // And against a plain parameter server making the same exchanges
          // with the arithmetic they need.
          const MachineBusy meter;
          absl::StatusOr<double> plain_server =
              RawSocketRate(AF_INET, shares, workers, options.duration, /*plain_server=*/true);
          const double plain_server_busy = meter.Share();
          if (!plain_server.ok()) {
            LOG(ERROR) << "transport: plain parameter server: " << plain_server.status();
            return 1;
          }
          add_row(*plain_server, "tcp+sgd", plain_server_busy);
        }
        if (way == Way::kGrpcTcp && ours.ok()) {
          // And against gRPC alone making the same exchanges.
          absl::StatusOr<std::unique_ptr<ServerProcess>> echo = ServerProcess::Start(
              spec, static_cast<int64_t>(mib * kMiB / 4), options.chunk_bytes, /*echo=*/true);
          int64_t echo_steps = 0;
          const MachineBusy meter;
          absl::StatusOr<double> grpc_only =
              echo.ok() ? GrpcEchoRate((*echo)->addresses(), shares, workers,
                                       options.chunk_bytes, options.duration, &echo_steps)
                        : echo.status();
          if (!grpc_only.ok()) {
            LOG(ERROR) << "transport: plain gRPC: " << grpc_only.status();
            return 1;
          }
          add_row(*grpc_only, "grpc", meter.Share());
        }
        if (!ours.ok() || !plain.ok()) {
          LOG(ERROR) << "transport " << mib << " MiB, " << workers << " workers, " << servers
                     << " servers: " << (ours.ok() ? plain.status() : ours.status());
          return 1;
        }
        add_row(*plain, way == Way::kShm ? "memcpy" : way == Way::kUnix ? "unix" : "tcp",
                plain_busy);
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

int RunTransportServers(const TransportServersOptions& options) {
  std::unique_ptr<LocalServers> servers;
  std::unique_ptr<GrpcEchoServers> echoes;
  absl::Status started;
  if (options.echo) {
    absl::StatusOr<std::unique_ptr<GrpcEchoServers>> e = GrpcEchoServers::Start(options.servers);
    if (e.ok()) echoes = *std::move(e);
    started = e.status();
  } else {
    const v1::JobSpec spec =
        options.table_dim > 0
            ? SparseJobOf(options.workers, options.servers, options.table_dim)
            : JobOfSize(options.floats, options.servers, options.workers, options.chunk_bytes);
    absl::StatusOr<std::unique_ptr<LocalServers>> l =
        LocalServers::Start("bench", spec, PlanOf(spec));
    if (l.ok()) servers = *std::move(l);
    started = l.status();
  }
  if (!started.ok()) {
    LOG(ERROR) << "transport_servers: " << started;
    return 1;
  }
  const std::vector<std::string>& addresses =
      servers != nullptr ? servers->addresses() : echoes->addresses();
  absl::Notification stop;
  TerminationSignals signals([&stop](int) { stop.Notify(); });
  if (absl::Status s = WriteFileAtomically(options.address_file,
                                           absl::StrJoin(addresses, "\n") + "\n");
      !s.ok()) {
    LOG(ERROR) << "transport_servers: " << s;
    return 1;
  }
  stop.WaitForNotification();
  return 0;
}

}  // namespace pstrain::bench
