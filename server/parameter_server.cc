#include "server/parameter_server.h"

#include <set>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/membership_client.h"
#include "common/rpc.h"
#include "common/status.h"
#include "glog/logging.h"
#include "server/parameter_service.h"

namespace pstrain::server {
namespace {

class ParameterServerImpl final : public ParameterServer {
 public:
  explicit ParameterServerImpl(Options options)
      : options_(std::move(options)), store_(options_.store), service_(&store_) {}
  ~ParameterServerImpl() override { Shutdown(absl::Seconds(1)); }

  absl::Status Start() {
    // A bad advertise address is refused before anything is bound.
    PSTRAIN_RETURN_IF_ERROR(
        AdvertisedAddress(options_.listen_address, options_.advertise_address, 1).status());
    grpc::ServerBuilder builder;
    ConfigureServerBuilder(builder, options_.rpc);
    int port = 0;
    builder.AddListeningPort(options_.listen_address, grpc::InsecureServerCredentials(), &port);
    builder.RegisterCallbackGenericService(&service_);
    server_ = builder.BuildAndStart();
    if (server_ == nullptr || port == 0) {
      return absl::UnavailableError(absl::StrCat("cannot listen on ", options_.listen_address));
    }
    PSTRAIN_ASSIGN_OR_RETURN(
        address_, AdvertisedAddress(options_.listen_address, options_.advertise_address, port));
    LOG(INFO) << "parameter server listening on " << address_;
    if (!options_.coordinator_address.empty()) {
      MembershipClient::Options m;
      m.coordinator_address = options_.coordinator_address;
      m.role = v1::NODE_ROLE_SERVER;
      m.node_id = options_.node_id;
      m.address = address_;
      m.max_memory_bytes = options_.store.max_memory_bytes;
      m.metrics_address = options_.metrics_address;
      m.rpc = options_.rpc;
      m.coordinator_loss_timeout = options_.coordinator_loss_timeout;
      MembershipClient::Callbacks callbacks;
      callbacks.held_jobs = [this] {
        std::vector<v1::HeldJob> held;
        for (const std::string& id : store_.JobIds()) held.emplace_back().set_job_id(id);
        return held;
      };
      callbacks.on_heartbeat = [this](const v1::HeartbeatResponse& r) { Reconcile(r); };
      callbacks.on_coordinator_lost = [this] { RequestStop(); };
      callbacks.on_fenced = [this](const absl::Status&) {
        fenced_ = true;
        RequestStop();
      };
      membership_ = std::make_unique<MembershipClient>(std::move(m), std::move(callbacks));
      membership_->Start();
    }
    return absl::OkStatus();
  }

  std::string address() const override { return address_; }
  ShardStore& store() override { return store_; }

  void RequestStop() override {
    absl::MutexLock lock(&stop_mu_);
    stop_requested_ = true;
  }
  void Wait() override {
    absl::MutexLock lock(&stop_mu_);
    stop_mu_.Await(absl::Condition(&stop_requested_));
  }
  bool fenced() const override { return fenced_; }

  void Shutdown(absl::Duration grace) override {
    if (shut_down_.exchange(true)) return;
    RequestStop();
    if (membership_ != nullptr) membership_->Stop();
    store_.Shutdown();
    if (server_ != nullptr) server_->Shutdown(absl::ToChronoTime(absl::Now() + grace));
    LOG(INFO) << "parameter server " << address_ << " stopped";
  }

 private:
  // Holds exactly the jobs the coordinator lists. Releases first, so that
  // memory just freed can hold a new job.
  void Reconcile(const v1::HeartbeatResponse& response) {
    if (ServerMetrics* m = options_.store.metrics; m != nullptr) {
      m->open_waits->Set(static_cast<double>(store_.OpenWaits()));
      m->expiring.Sweep();
    }
    std::set<std::string> wanted;
    for (const v1::ServerAssignment& a : response.server_jobs()) wanted.insert(a.job_id());
    const std::vector<std::string> held = store_.JobIds();
    for (const std::string& id : held) {
      if (!wanted.contains(id)) {
        LOG(INFO) << "releasing job " << id;
        store_.RemoveJob(id);
      }
    }
    const std::set<std::string> held_set(held.begin(), held.end());
    for (const v1::ServerAssignment& a : response.server_jobs()) {
      if (held_set.contains(a.job_id()) || !a.has_spec()) continue;
      absl::Status status = store_.AddJob(a);
      if (status.ok()) {
        LOG(INFO) << "holding job " << a.job_id() << " as server " << a.server_index();
      } else {
        LOG(ERROR) << "cannot hold job " << a.job_id() << ": " << status;
      }
    }
  }

  const Options options_;
  ShardStore store_;
  ParameterService service_;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
  std::unique_ptr<MembershipClient> membership_;
  absl::Mutex stop_mu_;
  bool stop_requested_ ABSL_GUARDED_BY(stop_mu_) = false;
  std::atomic<bool> shut_down_{false};
  std::atomic<bool> fenced_{false};
};

}  // namespace

absl::StatusOr<std::unique_ptr<ParameterServer>> ParameterServer::Create(Options options) {
  auto server = std::make_unique<ParameterServerImpl>(std::move(options));
  if (absl::Status s = server->Start(); !s.ok()) return s;
  return server;
}

}  // namespace pstrain::server
