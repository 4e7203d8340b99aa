#include "server/parameter_server.h"

#include <unistd.h>

#include <map>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/membership_client.h"
#include "common/node_id.h"
#include "common/rpc.h"
#include "common/status.h"
#include "common/tls.h"
#include "glog/logging.h"
#include "grpcpp/health_check_service_interface.h"
#include "pstrain/v1/parameters.grpc.pb.h"
#include "server/parameter_service.h"

namespace pstrain::server {
namespace {

class ParameterServerImpl final : public ParameterServer {
 public:
  explicit ParameterServerImpl(Options options)
      : options_(std::move(options)), store_(options_.store), service_(&store_, &roster_, options_.client_limits) {}

  ~ParameterServerImpl() override { Shutdown(absl::Seconds(1)); }

  absl::Status Start() {
    // A bad advertise address is refused before anything is bound.
    PSTRAIN_RETURN_IF_ERROR(
        AdvertisedAddress(options_.listen_address, options_.advertise_address, 1).status());
    grpc::ServerBuilder builder;
    ConfigureServerBuilder(builder, options_.rpc);
    int port = 0;
    PSTRAIN_ASSIGN_OR_RETURN(
        std::shared_ptr<grpc::ServerCredentials> credentials,
        ListenCredentials(options_.security, options_.listen_address, options_.insecure));
    builder.AddListeningPort(options_.listen_address, credentials, &port);
    v1::HelloReply hello;
    hello.set_instance(RandomProcessToken());
    int local_port = 0;
    if (options_.local_socket && options_.security == nullptr) {
      // Abstract: no file to clean up, gone with the process, and only
      // reachable from the server's network namespace.
      hello.set_local_address(absl::StrCat("unix-abstract:pstrain-server-", getpid(), "-",
                                           absl::Hex(hello.instance())));
      builder.AddListeningPort(hello.local_address(), grpc::InsecureServerCredentials(),
                               &local_port);
    }
    builder.RegisterCallbackGenericService(&service_);
    server_ = builder.BuildAndStart();
    if (server_ == nullptr || port == 0) {
      return absl::UnavailableError(absl::StrCat("cannot listen on ", options_.listen_address));
    }
    if (!hello.local_address().empty() && local_port == 0) {
      LOG(WARNING) << "cannot listen on " << hello.local_address() << ": TCP only";
      hello.clear_local_address();
    }
    if (options_.shared_memory && options_.security == nullptr) {
      const std::string name =
          absl::StrCat("pstrain-shm-", getpid(), "-", absl::Hex(hello.instance()));
      if (absl::Status s = service_.ServeSharedMemory(name, hello.instance(), options_.shm);
          s.ok()) {
        hello.set_shm_address(name);
      } else {
        LOG(WARNING) << "no shared-memory connections: " << s;
      }
    }
    if (options_.direct_tcp && options_.security == nullptr) {
      absl::StatusOr<int> direct_port = service_.ServeDirectTcp(
          SocketHost(options_.listen_address), hello.instance(), options_.shm);
      if (direct_port.ok()) {
        hello.set_direct_tcp_port(*direct_port);
        direct_tcp_port_ = *direct_port;
      } else {
        LOG(WARNING) << "no direct TCP connections: " << direct_port.status();
      }
    }
    service_.SetHello(hello);
    PSTRAIN_ASSIGN_OR_RETURN(
        address_, AdvertisedAddress(options_.listen_address, options_.advertise_address, port));
    LOG(INFO) << "parameter server listening on " << address_;
    if (!options_.coordinator_address.empty()) {
      // Not serving until registered: the coordinator would not send work.
      SetHealth(false);
      MembershipClient::Options m;
      m.coordinator_address = options_.coordinator_address;
      m.role = v1::NODE_ROLE_SERVER;
      m.node_id = options_.node_id;
      m.colocated_with = options_.colocated_with;
      m.checkpoint_root = options_.store.checkpoint_root;
      m.address = address_;
      m.max_memory_bytes = options_.store.max_memory_bytes;
      m.metrics_address = options_.metrics_address;
      m.rpc = options_.rpc;
      m.security = options_.security;
      m.coordinator_loss_timeout = options_.coordinator_loss_timeout;
      MembershipClient::Callbacks callbacks;
      callbacks.held_jobs = [this] {
        std::vector<v1::HeldJob> held = store_.Held();
        absl::MutexLock lock(&load_mu_);
        for (const auto& [id, failed] : load_errors_) held.push_back(failed);
        return held;
      };
      callbacks.on_heartbeat = [this](const v1::HeartbeatResponse& r) {
        if (!serving_.exchange(true)) SetHealth(true);
        Reconcile(r);
      };
      callbacks.on_coordinator_lost = [this] { RequestStop(); };
      callbacks.on_fenced = [this](const absl::Status&) {
        fenced_ = true;
        RequestStop();
      };
      membership_ = std::make_unique<MembershipClient>(std::move(m), std::move(callbacks));
      membership_->Start();
    } else {
      serving_ = true;
      SetHealth(true);
    }
    return absl::OkStatus();
  }

  std::string address() const override { return address_; }
  ShardStore& store() override { return store_; }
  InProcessService& in_process() override { return service_; }
  int direct_tcp_port() const override { return direct_tcp_port_; }

  void RequestStop() override {
    absl::MutexLock lock(&stop_mu_);
    stop_requested_ = true;
  }
  void Wait() override {
    absl::MutexLock lock(&stop_mu_);
    stop_mu_.Await(absl::Condition(&stop_requested_));
  }
  bool fenced() const override { return fenced_; }

  absl::Status Readiness() const override {
    if (shut_down_) return absl::UnavailableError("shutting down");
    if (fenced_) return absl::UnavailableError("fenced: another process holds the node's id");
    if (!serving_ || (membership_ != nullptr && !membership_->registered())) {
      return absl::UnavailableError(absl::StrCat("not registered with the coordinator at ",
                                                 options_.coordinator_address, " yet"));
    }
    return absl::OkStatus();
  }

  void Shutdown(absl::Duration grace) override {
    if (shut_down_.exchange(true)) return;
    RequestStop();
    if (server_ != nullptr && server_->GetHealthCheckService() != nullptr) {
      server_->GetHealthCheckService()->Shutdown();  // NOT_SERVING from now on
    }
    if (membership_ != nullptr) membership_->Stop();
    store_.Shutdown();
    service_.StopDirectConnections();
    if (server_ != nullptr) server_->Shutdown(absl::ToChronoTime(absl::Now() + grace));
    LOG(INFO) << "parameter server " << address_ << " stopped";
  }

 private:
  // The server as a whole ("") and its one service, which the health
  // service does not see by itself (it is served as a generic service).
  void SetHealth(bool serving) {
    if (grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService()) {
      health->SetServingStatus("", serving);
      health->SetServingStatus(v1::Parameters::service_full_name(), serving);
    }
  }

  // Holds exactly the jobs the coordinator lists, each at the generation it
  // lists. Releases first, so that memory just freed can hold a new job.
  void Reconcile(const v1::HeartbeatResponse& response) {
    if (ServerMetrics* m = options_.store.metrics; m != nullptr) {
      m->open_waits->Set(static_cast<double>(store_.OpenWaits()));
      m->expiring.Sweep();
    }
    std::map<std::string, const v1::ServerAssignment*> wanted;
    for (const v1::ServerAssignment& a : response.server_jobs()) wanted[a.job_id()] = &a;
    std::map<std::string, int64_t> held;  // job -> generation
    for (const v1::HeldJob& h : store_.Held()) held[h.job_id()] = h.generation();
    for (const auto& [id, generation] : held) {
      if (!wanted.contains(id)) {
        LOG(INFO) << "releasing job " << id;
        store_.RemoveJob(id);
        roster_.Remove(id);
      }
    }
    for (const auto& [id, a] : wanted) {
      // Before the job loads: its workers' frames are checked from the first.
      roster_.Set(id, a->generation(), {a->worker_nodes().begin(), a->worker_nodes().end()});
      std::vector<v1::CheckpointRecord> retained(a->retained_checkpoints().begin(),
                                                 a->retained_checkpoints().end());
      auto it = held.find(id);
      if (it != held.end() && it->second == a->generation()) {
        store_.SetCheckpointPlan(id, a->checkpoint_request_step(), std::move(retained));
        continue;
      }
      if (it != held.end() && a->keep_values()) {
        LOG(INFO) << "job " << id << " goes on at generation " << a->generation()
                  << " with the values held";
        if (absl::Status s = store_.KeepAtGeneration(id, a->generation()); !s.ok()) {
          LOG(ERROR) << "job " << id << ": " << s;
        }
        store_.SetCheckpointPlan(id, a->checkpoint_request_step(), std::move(retained));
        continue;
      }
      if (!a->has_spec()) continue;  // it comes once the coordinator sees the job is not held
      {
        absl::MutexLock lock(&load_mu_);
        auto failed = load_errors_.find(id);
        if (failed != load_errors_.end() && failed->second.generation() == a->generation()) {
          continue;  // reported; the coordinator starts another generation
        }
        load_errors_.erase(id);
      }
      if (it != held.end()) {
        LOG(INFO) << "job " << id << ": generation " << it->second << " is over, loading "
                  << a->generation();
        store_.RemoveJob(id);
      }
      absl::Status status = store_.AddJob(*a);
      if (status.ok()) {
        LOG(INFO) << "holding job " << id << " as server " << a->server_index()
                  << " at generation " << a->generation();
      } else {
        LOG(ERROR) << "cannot hold job " << id << " at generation " << a->generation() << ": "
                   << status;
        v1::HeldJob failed;
        failed.set_job_id(id);
        failed.set_generation(a->generation());
        failed.set_load_error(std::string(status.message()));
        failed.set_load_step(a->restore_step());
        absl::MutexLock lock(&load_mu_);
        load_errors_[id] = std::move(failed);
      }
    }
    absl::MutexLock lock(&load_mu_);
    std::erase_if(load_errors_, [&](const auto& e) { return !wanted.contains(e.first); });
  }

  const Options options_;
  ShardStore store_;
  WorkerRoster roster_;
  ParameterService service_;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
  int direct_tcp_port_ = 0;
  std::unique_ptr<MembershipClient> membership_;
  absl::Mutex stop_mu_;
  bool stop_requested_ ABSL_GUARDED_BY(stop_mu_) = false;
  std::atomic<bool> shut_down_{false};
  std::atomic<bool> fenced_{false};
  std::atomic<bool> serving_{false};  // the health service says SERVING
  // Jobs that could not be loaded at the generation assigned, with why.
  absl::Mutex load_mu_;
  std::map<std::string, v1::HeldJob> load_errors_ ABSL_GUARDED_BY(load_mu_);
};

}  // namespace

absl::StatusOr<std::unique_ptr<ParameterServer>> ParameterServer::Create(Options options) {
  auto server = std::make_unique<ParameterServerImpl>(std::move(options));
  if (absl::Status s = server->Start(); !s.ok()) return s;
  return server;
}

}  // namespace pstrain::server
