// Prometheus metrics shared by every pstrain process: the /metrics endpoint,
// process CPU and memory, RPC counts and latencies (client and server, by
// method and status code), and per-job series that expire after a job ends.
//
// Each component declares its own metrics once, in a table (below,
// "Declaring a component's metrics once"), from which its struct, built at
// start-up from the registry it is given, follows (server/server_metrics.h,
// worker/worker_metrics.h, server/coordinator_metrics.h); the names follow
// Prometheus conventions (pstrain_ prefix, base units, _total counters) and
// labels stay bounded: job_id, role, node, method, code, phase, state, table.
#ifndef PSTRAIN_COMMON_METRICS_H_
#define PSTRAIN_COMMON_METRICS_H_

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/support/client_interceptor.h"
#include "grpcpp/support/server_interceptor.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace pstrain {

// Runs `build`, turning the exception prometheus-cpp throws on a bad name or
// label into INVALID_ARGUMENT.
absl::Status BuildMetrics(const std::function<void()>& build);

// ---- Declaring a component's metrics once ----
//
// A component lists its metrics in one X-macro table, a line each:
//
//   #define PSTRAIN_FOO_METRICS(JOB_COUNTER, JOB_GAUGE, JOB_HISTOGRAM, COUNTER, GAUGE,
//                               HISTOGRAM, FAMILY_COUNTER, FAMILY_GAUGE)
//     JOB_COUNTER(steps, "pstrain_foo_steps_total", "Steps done.")
//     COUNTER(restarts, "pstrain_foo_restarts_total", "Restarts.")
//     ...
// (each line ending in a backslash).
//
// JOB_*: a family whose series are labelled by job_id and bound for each
// job (Job struct: one series per entry); COUNTER, GAUGE, HISTOGRAM: one
// series without labels; FAMILY_*: a family whose series the component
// binds itself (other labels). Histograms take a fourth argument, their
// buckets. From the table follow, by the macros below: the component's
// fields (PSTRAIN_METRIC_FIELDS), its Job struct's
// (PSTRAIN_JOB_METRIC_FIELDS), the registration of everything
// (PSTRAIN_REGISTER_METRICS, in a BuildMetrics with `m` the component and
// `r` the registry), and the binding and removal of a job's series
// (PSTRAIN_BIND_JOB_METRICS with `j` the Job and `labels` its labels;
// PSTRAIN_REMOVE_JOB_METRICS). A metric's name and help are written once.
#define PSTRAIN_METRIC_NONE(field, name, help)
#define PSTRAIN_METRIC_NONE4(field, name, help, buckets)

#define PSTRAIN_METRIC_FAMILY_COUNTER(field, name, help) \
  prometheus::Family<prometheus::Counter>* field = nullptr;
#define PSTRAIN_METRIC_FAMILY_GAUGE(field, name, help) \
  prometheus::Family<prometheus::Gauge>* field = nullptr;
#define PSTRAIN_METRIC_FAMILY_HISTOGRAM(field, name, help, buckets) \
  prometheus::Family<prometheus::Histogram>* field = nullptr;
#define PSTRAIN_METRIC_COUNTER(field, name, help) prometheus::Counter* field = nullptr;
#define PSTRAIN_METRIC_GAUGE(field, name, help) prometheus::Gauge* field = nullptr;
#define PSTRAIN_METRIC_HISTOGRAM(field, name, help, buckets) \
  prometheus::Histogram* field = nullptr;
#define PSTRAIN_METRIC_FIELDS(TABLE)                                                       \
  TABLE(PSTRAIN_METRIC_FAMILY_COUNTER, PSTRAIN_METRIC_FAMILY_GAUGE,                         \
        PSTRAIN_METRIC_FAMILY_HISTOGRAM, PSTRAIN_METRIC_COUNTER, PSTRAIN_METRIC_GAUGE,      \
        PSTRAIN_METRIC_HISTOGRAM, PSTRAIN_METRIC_FAMILY_COUNTER, PSTRAIN_METRIC_FAMILY_GAUGE)
#define PSTRAIN_JOB_METRIC_FIELDS(TABLE)                                                   \
  TABLE(PSTRAIN_METRIC_COUNTER, PSTRAIN_METRIC_GAUGE, PSTRAIN_METRIC_HISTOGRAM,             \
        PSTRAIN_METRIC_NONE, PSTRAIN_METRIC_NONE, PSTRAIN_METRIC_NONE4, PSTRAIN_METRIC_NONE, \
        PSTRAIN_METRIC_NONE)

#define PSTRAIN_REGISTER_FAMILY(kind, field, name, help) \
  m->field = &prometheus::Build##kind().Name(name).Help(help).Register(r);
#define PSTRAIN_REGISTER_FAMILY_COUNTER(field, name, help) \
  PSTRAIN_REGISTER_FAMILY(Counter, field, name, help)
#define PSTRAIN_REGISTER_FAMILY_GAUGE(field, name, help) \
  PSTRAIN_REGISTER_FAMILY(Gauge, field, name, help)
#define PSTRAIN_REGISTER_FAMILY_HISTOGRAM(field, name, help, buckets) \
  PSTRAIN_REGISTER_FAMILY(Histogram, field, name, help)
#define PSTRAIN_REGISTER_COUNTER(field, name, help) \
  m->field = &prometheus::BuildCounter().Name(name).Help(help).Register(r).Add({});
#define PSTRAIN_REGISTER_GAUGE(field, name, help) \
  m->field = &prometheus::BuildGauge().Name(name).Help(help).Register(r).Add({});
#define PSTRAIN_REGISTER_HISTOGRAM(field, name, help, buckets) \
  m->field = &prometheus::BuildHistogram().Name(name).Help(help).Register(r).Add({}, buckets);
#define PSTRAIN_REGISTER_METRICS(TABLE)                                                     \
  TABLE(PSTRAIN_REGISTER_FAMILY_COUNTER, PSTRAIN_REGISTER_FAMILY_GAUGE,                      \
        PSTRAIN_REGISTER_FAMILY_HISTOGRAM, PSTRAIN_REGISTER_COUNTER, PSTRAIN_REGISTER_GAUGE, \
        PSTRAIN_REGISTER_HISTOGRAM, PSTRAIN_REGISTER_FAMILY_COUNTER,                         \
        PSTRAIN_REGISTER_FAMILY_GAUGE)

#define PSTRAIN_BIND_JOB_SERIES(field, name, help) j.field = &field->Add(labels);
#define PSTRAIN_BIND_JOB_HISTOGRAM(field, name, help, buckets) \
  j.field = &field->Add(labels, buckets);
#define PSTRAIN_BIND_JOB_METRICS(TABLE)                                                       \
  TABLE(PSTRAIN_BIND_JOB_SERIES, PSTRAIN_BIND_JOB_SERIES, PSTRAIN_BIND_JOB_HISTOGRAM,          \
        PSTRAIN_METRIC_NONE, PSTRAIN_METRIC_NONE, PSTRAIN_METRIC_NONE4, PSTRAIN_METRIC_NONE,   \
        PSTRAIN_METRIC_NONE)
#define PSTRAIN_REMOVE_JOB_SERIES(field, name, help) field->Remove(j.field);
#define PSTRAIN_REMOVE_JOB_HISTOGRAM(field, name, help, buckets) field->Remove(j.field);
#define PSTRAIN_REMOVE_JOB_METRICS(TABLE)                                                     \
  TABLE(PSTRAIN_REMOVE_JOB_SERIES, PSTRAIN_REMOVE_JOB_SERIES, PSTRAIN_REMOVE_JOB_HISTOGRAM,    \
        PSTRAIN_METRIC_NONE, PSTRAIN_METRIC_NONE, PSTRAIN_METRIC_NONE4, PSTRAIN_METRIC_NONE,   \
        PSTRAIN_METRIC_NONE)

// Histogram buckets for durations from 10 µs to about a minute.
prometheus::Histogram::BucketBoundaries LatencyBuckets();
// Histogram buckets for small counts: 0, 1, 2, 4, ..., 256.
prometheus::Histogram::BucketBoundaries CountBuckets();

// RPC latency by method and status code, on both sides of every call:
//   pstrain_rpc_server_seconds{method,code}  (histogram; _count is the count)
//   pstrain_rpc_client_seconds{method,code}
class RpcMetrics {
 public:
  static absl::StatusOr<std::unique_ptr<RpcMetrics>> Create(prometheus::Registry& registry);

  // `method` is labelled as is if it is one of pstrain's, else "unknown":
  // a client chooses what it calls, and labels must stay bounded.
  void Observe(bool server, const std::string& method, grpc::StatusCode code, double seconds);

  // Interceptor factories to install on servers and channels.
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>>
  ServerInterceptors();
  std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>>
  ClientInterceptors();

 private:
  RpcMetrics() = default;

  prometheus::Family<prometheus::Histogram>* server_ = nullptr;
  prometheus::Family<prometheus::Histogram>* client_ = nullptr;
  absl::Mutex mu_;
  // Each (side, method, code) is added to its family once, then looked up.
  std::map<std::tuple<bool, std::string, int>, prometheus::Histogram*> bound_
      ABSL_GUARDED_BY(mu_);
};

// The metrics endpoint of a process: a registry, served on /metrics in the
// Prometheus text format, with the process and RPC metrics already in it,
// and the process's health for probes: /healthz answers 200 while the
// process lives (this server's thread answers), /readyz 200 once the
// process is ready (SetReadiness) and 503 with the reason before.
//
// The HTTP side is a small server of our own rather than prometheus-cpp's
// civetweb-based Exposer: Debian's civetweb gives its threads fixed 100 KB
// stacks, from which glibc takes the static TLS of every loaded library, and
// OpenBLAS (60 KB) plus glog (30 KB) leave too little: a worker's exposer
// thread crashes on its first printf. One thread here serves scrapes one at
// a time (they are rare), with timeouts, and stops with the object.
class MetricsServer {
 public:
  // Serves on `bind_address` ("127.0.0.1:0" picks a free port). A wildcard
  // host (0.0.0.0, ::, empty) is advertised as the machine's host name.
  // UNAVAILABLE if it cannot listen.
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Create(const std::string& bind_address);
  // The exposition text, as served on /metrics.
  std::string Scrape() const;
  // What /readyz reports: OK, or why the process is not ready (the 503's
  // body). Until it is set, the process is starting: not ready. Clear it
  // (nullptr: not ready) before what it refers to is destroyed.
  void SetReadiness(std::function<absl::Status()> readiness);
  absl::Status Readiness() const;
  // A registry with the process and RPC metrics, not served (tests).
  static absl::StatusOr<std::unique_ptr<MetricsServer>> CreateUnserved();
  ~MetricsServer();

  prometheus::Registry& registry() { return *registry_; }
  const std::shared_ptr<prometheus::Registry>& shared_registry() const { return registry_; }
  RpcMetrics& rpc() { return *rpc_; }
  // host:port to scrape, or empty if not served.
  const std::string& address() const { return address_; }

 private:
  MetricsServer() = default;
  absl::Status Init();
  void Serve();
  void HandleConnection(int fd);

  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<RpcMetrics> rpc_;
  std::string address_;
  mutable absl::Mutex readiness_mu_;
  std::function<absl::Status()> readiness_ ABSL_GUARDED_BY(readiness_mu_);
  int listen_fd_ = -1;
  std::atomic<bool> stopping_{false};
  std::thread thread_;
};

// Per-job series that outlive their job by a grace period, so that the last
// values are scraped, and then leave the families, so that label sets do not
// grow forever. Each binding of a job's series (Add) is matched by one
// JobEnded; the grace period starts when the last binding has ended, and a
// new binding before it is over cancels it. Thread-safe.
class ExpiringSeries {
 public:
  explicit ExpiringSeries(absl::Duration grace) : grace_(grace) {}

  // One binding of `job_id`'s series; `remove` runs when they expire.
  void Add(const std::string& job_id, std::function<void()> remove);
  // Another series of a bound job, removed with the others.
  void AddRemoval(const std::string& job_id, std::function<void()> remove);
  // Ends one binding.
  void JobEnded(const std::string& job_id);
  // Removes what is due; call periodically.
  void Sweep();

 private:
  struct Entry {
    int bindings = 0;
    std::vector<std::function<void()>> removals;
    absl::Time due = absl::InfiniteFuture();
  };
  const absl::Duration grace_;
  absl::Mutex mu_;
  std::map<std::string, Entry> jobs_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_METRICS_H_
