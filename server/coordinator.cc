#include "server/coordinator.h"

#include <algorithm>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "common/clock.h"
#include "common/job_spec.h"
#include "common/model_file.h"
#include "common/partition.h"
#include "common/rpc.h"
#include "common/status.h"
#include "glog/logging.h"
#include "grpcpp/health_check_service_interface.h"
#include "pstrain/v1/control.grpc.pb.h"
#include "pstrain/v1/membership.grpc.pb.h"
#include "server/access.h"
#include "server/job_progress.h"
#include "server/job_store.h"
#include "server/model_store.h"
#include "server/node_registry.h"
#include "server/recovery.h"
#include "server/scheduler.h"
#include "server/shard_store.h"
#include "server/targets_file.h"
#include "server/watch_queue.h"

namespace pstrain::server {
namespace {

// Watchers of one job at the same time.
constexpr size_t kMaxWatchersPerJob = 256;
// The most of a node's error message (a worker's failure, a server's) that
// goes into a job's reason.
constexpr size_t kMaxErrorBytes = 1000;

int64_t WallMs() { return absl::ToUnixMillis(absl::Now()); }

bool IsTerminal(v1::JobState s) {
  return s == v1::JOB_STATE_SUCCEEDED || s == v1::JOB_STATE_FAILED ||
         s == v1::JOB_STATE_CANCELLED;
}

absl::Status UnknownJob(const std::string& id) {
  return absl::NotFoundError(absl::StrCat("job_id: no job '", id, "'"));
}

absl::StatusOr<v1::PartitionPlan> PlanFor(const v1::JobSpec& spec) {
  return ComputePartitionPlan(JobTensors(spec), spec.chunk_bytes(),
                              spec.num_servers());
}

// Whether a worker may be given job `job_id`: a pool worker takes any job
// of a built-in model; a worker that joined a job (the client library) that
// job alone, whose model is external.
bool WorksOn(const v1::Node& worker, const std::string& job_id, const v1::JobSpec& spec) {
  if (spec.model().type() == v1::MODEL_TYPE_EXTERNAL) return worker.join_job() == job_id;
  return worker.join_job().empty();
}

v1::JobEvent Event() {
  v1::JobEvent event;
  event.set_time_ms(WallMs());
  return event;
}

// A job as the coordinator holds it. `job` changes only through a
// committed Txn (below); the rest is in memory only.
struct JobRecord {
  v1::Job job;
  v1::PartitionPlan plan;
  std::vector<std::shared_ptr<WatchQueue>> watchers;
  std::optional<CoordinatorMetrics::Job> metrics;  // while running, if measured
  // What the nodes reported of the running job's checkpoints, and servers
  // that could not load the current generation (by server index).
  CheckpointReports reports;
  std::map<int, std::string> load_failures;
  // Servers that say the job cannot go on (HeldJob.error), by index.
  std::map<int, std::string> server_errors;
};

// One change to the jobs: decided on copies of the jobs it touches (reads
// see the copies), then made durable, then installed. A job changed only
// through MutableVolatile (progress, a pending job's reason) is installed
// without being written.
class Txn {
 public:
  explicit Txn(const std::map<std::string, JobRecord>* live) : live_(live) {}

  const v1::Job& Get(const std::string& id) const {
    if (auto it = changed_.find(id); it != changed_.end()) return it->second.job;
    return live_->at(id).job;
  }
  v1::Job* Mutable(const std::string& id) {
    Change& c = Touch(id);
    c.durable = true;
    return &c.job;
  }
  v1::Job* MutableVolatile(const std::string& id) { return &Touch(id).job; }
  void Add(v1::Job job, v1::PartitionPlan plan) {
    const std::string id = job.id();
    Change& c = changed_[id];
    c.job = std::move(job);
    c.plan = std::move(plan);
    c.added = true;
    c.durable = true;
    added_.push_back(id);
  }
  void Publish(const std::string& id, v1::JobEvent event) {
    events_.emplace_back(id, std::move(event));
  }

  // The ids of every job this change sees (Get them): the live ones in
  // `order`, then the added ones.
  std::vector<std::string> Ids(const std::vector<std::string>& order) const {
    std::vector<std::string> ids = order;
    ids.insert(ids.end(), added_.begin(), added_.end());
    return ids;
  }

  bool empty() const { return changed_.empty() && events_.empty(); }
  std::vector<const v1::Job*> Durable() const {
    std::vector<const v1::Job*> jobs;
    for (const auto& [id, c] : changed_) {
      if (c.durable) jobs.push_back(&c.job);
    }
    return jobs;
  }

  struct Change {
    v1::Job job;
    v1::PartitionPlan plan;  // added jobs
    bool added = false;
    bool durable = false;
  };
  std::map<std::string, Change>& changes() { return changed_; }
  const std::vector<std::string>& added() const { return added_; }
  std::vector<std::pair<std::string, v1::JobEvent>>& events() { return events_; }

 private:
  Change& Touch(const std::string& id) {
    auto [it, inserted] = changed_.try_emplace(id);
    if (inserted) it->second.job = live_->at(id).job;
    return it->second;
  }

  const std::map<std::string, JobRecord>* const live_;
  std::map<std::string, Change> changed_;
  std::vector<std::string> added_;
  std::vector<std::pair<std::string, v1::JobEvent>> events_;
};

class CoordinatorImpl;

// A node's Session stream, open for as long as its process lives. gRPC is
// called outside the lock (a reaction may run on the calling thread), and
// never Finish while a write is in flight: that write's completion
// finishes instead.
class NodeSession final : public grpc::ServerWriteReactor<v1::SessionEvent> {
 public:
  NodeSession(CoordinatorImpl* coordinator, const v1::SessionRequest& request)
      : coordinator_(coordinator),
        node_id_(request.node_id()),
        incarnation_(request.incarnation()) {}
  const std::string& node_id() const { return node_id_; }
  uint64_t incarnation() const { return incarnation_; }

  // Asks the node to heartbeat now. Thread-safe; nudges that come while
  // one is being written are folded into one more.
  void Nudge() ABSL_LOCKS_EXCLUDED(mu_) {
    {
      absl::MutexLock lock(&mu_);
      if (finish_.has_value()) return;
      if (writing_) {
        again_ = true;
        return;
      }
      writing_ = true;
    }
    StartWrite(&event_);
  }
  // Ends the stream with `status` (once the write in flight, if any, is done).
  void End(const grpc::Status& status) ABSL_LOCKS_EXCLUDED(mu_) {
    {
      absl::MutexLock lock(&mu_);
      if (finish_.has_value()) return;
      finish_ = status;
      if (writing_) return;
    }
    Finish(status);
  }
  void OnWriteDone(bool ok) override {
    std::optional<grpc::Status> finish;
    bool write_again = false;
    {
      absl::MutexLock lock(&mu_);
      writing_ = false;
      if (!ok && !finish_.has_value()) finish_ = grpc::Status::CANCELLED;
      if (finish_.has_value()) {
        finish = finish_;
      } else if (again_) {
        again_ = false;
        writing_ = write_again = true;
      }
    }
    if (finish.has_value()) {
      Finish(*finish);
    } else if (write_again) {
      StartWrite(&event_);
    }
  }
  void OnCancel() override;  // the node's process went away (or the coordinator stops)
  void OnDone() override;

 private:
  CoordinatorImpl* const coordinator_;
  const std::string node_id_;
  const uint64_t incarnation_;
  const v1::SessionEvent event_;
  absl::Mutex mu_;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool again_ ABSL_GUARDED_BY(mu_) = false;
  std::optional<grpc::Status> finish_ ABSL_GUARDED_BY(mu_);  // set once ending
};

class CoordinatorImpl final : public Coordinator,
                              public v1::Control::CallbackService,
                              public v1::Membership::CallbackService,
                              public ModelUploadHandler {
 public:
  explicit CoordinatorImpl(Options options)
      : options_(std::move(options)),
        access_(options_.auth_tokens),
        fs_(options_.fs != nullptr ? options_.fs : PosixFileSystem()),
        clock_(options_.clock != nullptr ? options_.clock : MonotonicClock()),
        rng_(std::random_device{}()),
        registry_({.lease = options_.lease,
                   .max_lost_nodes = options_.limits.lost_nodes,
                   .max_registrations_per_minute = options_.limits.registrations_per_minute},
                  clock_,
                  [this]() ABSL_NO_THREAD_SAFETY_ANALYSIS { return static_cast<uint32_t>(rng_()); }),
        // Without a state directory the numbers start again at every
        // start: a random part keeps the ids of one process from naming
        // the jobs of another, which nodes may still hold.
        job_id_prefix_(options_.state_dir.empty()
                           ? absl::StrFormat("job-%08x-", std::random_device{}())
                           : "job-"),
        models_(fs_, options_.state_dir.empty() ? "" : options_.state_dir + "/models"),
        targets_(fs_, options_.prometheus_sd_file) {}
  ~CoordinatorImpl() override { Shutdown(absl::Seconds(1)); }

  absl::Status Start() {
    if (!options_.state_dir.empty()) {
      std::vector<v1::Job> jobs;
      PSTRAIN_ASSIGN_OR_RETURN(store_, JobStore::Open(fs_, options_.state_dir, &jobs));
      PSTRAIN_RETURN_IF_ERROR(models_.Init());
      absl::MutexLock write_lock(&write_mu_);
      absl::MutexLock lock(&mu_);
      Recover(std::move(jobs));
    }
    // A bad advertise address is refused before anything is bound.
    PSTRAIN_RETURN_IF_ERROR(
        AdvertisedAddress(options_.listen_address, options_.advertise_address, 1).status());
    grpc::ServerBuilder builder;
    ConfigureServerBuilder(builder, options_.rpc);
    builder.SetMaxReceiveMessageSize(options_.limits.request_bytes);
    int port = 0;
    PSTRAIN_ASSIGN_OR_RETURN(
        std::shared_ptr<grpc::ServerCredentials> credentials,
        ListenCredentials(options_.security, options_.listen_address, options_.insecure));
    builder.AddListeningPort(options_.listen_address, credentials, &port);
    builder.RegisterService(static_cast<v1::Control::CallbackService*>(this));
    builder.RegisterService(static_cast<v1::Membership::CallbackService*>(this));
    server_ = builder.BuildAndStart();
    if (server_ == nullptr || port == 0) {
      return absl::UnavailableError(absl::StrCat("cannot listen on ", options_.listen_address));
    }
    PSTRAIN_ASSIGN_OR_RETURN(
        address_, AdvertisedAddress(options_.listen_address, options_.advertise_address, port));
    WriteTargets();
    control_thread_ = std::thread([this] { ControlLoop(); });
    return absl::OkStatus();
  }

  std::string address() const override { return address_; }

  void Shutdown(absl::Duration grace) override {
    {
      absl::MutexLock lock(&mu_);
      if (shut_down_) return;
      shut_down_ = true;
      for (auto& [id, record] : jobs_) {
        for (auto& w : record.watchers) {
          w->End(grpc::Status(grpc::StatusCode::UNAVAILABLE, "coordinator shutting down"));
        }
      }
    }
    if (server_ != nullptr) {
      if (grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService()) {
        health->Shutdown();  // NOT_SERVING from now on
      }
      server_->Shutdown(absl::ToChronoTime(absl::Now() + grace));
    }
    WakeControlLoop();
    if (control_thread_.joinable()) control_thread_.join();
  }

  // ---- Control ----

  grpc::ServerUnaryReactor* SubmitJob(grpc::CallbackServerContext* ctx,
                                      const v1::SubmitJobRequest* request,
                                      v1::SubmitJobResponse* response) override {
    if (absl::Status s = access_.CheckUser(*ctx, UserRole::kOperator, "submit a job"); !s.ok()) {
      return Reply(ctx, s);
    }
    return Reply(ctx, Submit(*request, response));
  }

  grpc::ServerUnaryReactor* GetJob(grpc::CallbackServerContext* ctx,
                                   const v1::GetJobRequest* request, v1::Job* response) override {
    if (absl::Status s = access_.CheckUser(*ctx, UserRole::kViewer, "get a job"); !s.ok()) {
      return Reply(ctx, s);
    }
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(request->job_id());
    if (it == jobs_.end()) return Reply(ctx, UnknownJob(request->job_id()));
    *response = it->second.job;
    return Reply(ctx, absl::OkStatus());
  }

  grpc::ServerUnaryReactor* ListJobs(grpc::CallbackServerContext* ctx,
                                     const v1::ListJobsRequest* request,
                                     v1::ListJobsResponse* response) override {
    if (absl::Status s = access_.CheckUser(*ctx, UserRole::kViewer, "list jobs"); !s.ok()) {
      return Reply(ctx, s);
    }
    return Reply(ctx, List(*request, response));
  }

  grpc::ServerUnaryReactor* CancelJob(grpc::CallbackServerContext* ctx,
                                      const v1::CancelJobRequest* request,
                                      v1::Job* response) override {
    if (absl::Status s = access_.CheckUser(*ctx, UserRole::kOperator, "cancel a job"); !s.ok()) {
      return Reply(ctx, s);
    }
    const std::string& id = request->job_id();
    absl::Status status = Commit([&](Txn& txn) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      if (!jobs_.contains(id)) return UnknownJob(id);
      if (!IsTerminal(txn.Get(id).state())) {
        SetState(txn, id, v1::JOB_STATE_CANCELLED, "cancelled by request");
        Schedule(txn);
      }
      return absl::OkStatus();
    });
    if (status.ok()) {
      absl::MutexLock lock(&mu_);
      *response = jobs_.at(id).job;
    }
    return Reply(ctx, status);
  }

  grpc::ServerWriteReactor<v1::JobEvent>* WatchJob(grpc::CallbackServerContext* ctx,
                                                   const v1::WatchJobRequest* request) override {
    auto* watch = new JobWatch(options_.max_queued_events);
    const std::shared_ptr<WatchQueue> queue = watch->queue();
    const absl::Status allowed = access_.CheckUser(*ctx, UserRole::kViewer, "watch a job");
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(request->job_id());
    if (!allowed.ok()) {
      queue->End(ToGrpcStatus(allowed));
    } else if (shut_down_) {
      queue->End(grpc::Status(grpc::StatusCode::UNAVAILABLE, "coordinator shutting down"));
    } else if (it == jobs_.end()) {
      queue->End(ToGrpcStatus(UnknownJob(request->job_id())));
    } else {
      JobRecord& record = it->second;
      v1::JobEvent snapshot = Event();
      *snapshot.mutable_snapshot() = record.job;
      queue->Publish(snapshot, IsTerminal(record.job.state()));
      if (!IsTerminal(record.job.state())) {
        std::erase_if(record.watchers, [](const auto& w) { return w->Gone(); });
        if (record.watchers.size() >= kMaxWatchersPerJob) {
          queue->End(grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                                  absl::StrCat(kMaxWatchersPerJob, " watchers already follow ",
                                               request->job_id())));
        } else {
          record.watchers.push_back(queue);
        }
      }
    }
    return watch;
  }

  grpc::ServerUnaryReactor* ListNodes(grpc::CallbackServerContext* ctx,
                                      const v1::ListNodesRequest*,
                                      v1::ListNodesResponse* response) override {
    if (absl::Status s = access_.CheckUser(*ctx, UserRole::kViewer, "list nodes"); !s.ok()) {
      return Reply(ctx, s);
    }
    absl::MutexLock lock(&mu_);
    const std::map<std::string, int64_t> reserved = ReservedBytes();
    for (const auto& [id, node] : registry_.nodes()) {
      v1::Node* out = response->add_nodes();
      *out = node.info;
      if (auto it = reserved.find(id); it != reserved.end()) out->set_reserved_bytes(it->second);
    }
    return Reply(ctx, absl::OkStatus());
  }

  grpc::ServerWriteReactor<v1::ModelFileChunk>* ExportModel(
      grpc::CallbackServerContext* ctx, const v1::ExportModelRequest* request) override {
    if (absl::Status s = access_.CheckUser(*ctx, UserRole::kOperator, "export a model");
        !s.ok()) {
      return NewModelExport(fs_, s);
    }
    return NewModelExport(fs_, FindModel(request->job_id()));
  }

  grpc::ServerUnaryReactor* CheckpointJob(grpc::CallbackServerContext* ctx,
                                          const v1::CheckpointJobRequest* request,
                                          v1::CheckpointJobResponse* response) override {
    if (absl::Status s = access_.CheckUser(*ctx, UserRole::kOperator, "checkpoint a job");
        !s.ok()) {
      return Reply(ctx, s);
    }
    const std::string& id = request->job_id();
    int64_t step = 0;
    absl::Status status = Commit([&](Txn& txn) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      if (!jobs_.contains(id)) return UnknownJob(id);
      const v1::Job& job = txn.Get(id);
      if (job.state() != v1::JOB_STATE_RUNNING) {
        return absl::FailedPreconditionError(
            absl::StrCat("job ", id, " is not running (it is ", JobStateLabel(job.state()), ")"));
      }
      if (job.spec().checkpoint().dir().empty()) {
        return absl::FailedPreconditionError(absl::StrCat("job ", id, " has no checkpoint.dir"));
      }
      if (job.spec().mode() != v1::MODE_SYNC) {
        return absl::FailedPreconditionError(absl::StrCat(
            "job ", id, " is ", ModeName(job.spec().mode()),
            ": it checkpoints every checkpoint.every_steps steps only"));
      }
      // A step that no chunk has reached when the nodes hear of it: the
      // furthest worker's step plus what the job does in a few seconds.
      int64_t furthest = 0;
      for (const v1::WorkerStatus& w : job.workers()) furthest = std::max(furthest, w.step());
      const double steps_per_second =
          job.progress().samples_per_second() /
          static_cast<double>(std::max<int64_t>(1, GlobalBatch(job.spec())));
      step = furthest + 20 + static_cast<int64_t>(steps_per_second * 3);
      if (step >= job.progress().total_steps()) {
        return absl::FailedPreconditionError(
            absl::StrCat("job ", id, " ends before a checkpoint could be taken"));
      }
      txn.Mutable(id)->set_checkpoint_request_step(step);
      return absl::OkStatus();
    });
    if (status.ok()) {
      response->set_step(step);
      absl::MutexLock lock(&mu_);
      NudgeNodesOf(jobs_.at(id).job);
    }
    return Reply(ctx, status);
  }

  // ---- Membership ----

  grpc::ServerUnaryReactor* Register(grpc::CallbackServerContext* ctx,
                                     const v1::RegisterRequest* request,
                                     v1::RegisterResponse* response) override {
    if (absl::Status s = access_.CheckNode(*ctx, request->node_id(), request->role()); !s.ok()) {
      return Reply(ctx, s);
    }
    // Over TLS a node that names no id gets its certificate's.
    v1::RegisterRequest checked = *request;
    if (checked.node_id().empty()) checked.set_node_id(AccessPolicy::CertifiedNodeId(*ctx));
    absl::StatusOr<NodeRegistry::Registration> registered;
    {
      absl::MutexLock lock(&mu_);
      registered = registry_.Register(checked);
      UpdateGauges();
    }
    if (!registered.ok()) return Reply(ctx, registered.status());
    response->set_node_id(registered->node_id);
    response->set_lease_ms(absl::ToInt64Milliseconds(options_.lease));
    response->set_heartbeat_interval_ms(absl::ToInt64Milliseconds(options_.heartbeat_interval));
    // The new node may let a pending job start. Scheduling is durable, so
    // it waits for the disk, but holds nothing that reads need.
    if (absl::Status s = Commit([&](Txn& txn) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          Schedule(txn);
          return absl::OkStatus();
        });
        !s.ok()) {
      LOG(WARNING) << "scheduling after a registration: " << s;  // the control loop retries
    }
    WakeControlLoop();
    return Reply(ctx, absl::OkStatus());
  }

  grpc::ServerUnaryReactor* Heartbeat(grpc::CallbackServerContext* ctx,
                                      const v1::HeartbeatRequest* request,
                                      v1::HeartbeatResponse* response) override {
    if (absl::Status s = access_.CheckNode(*ctx, request->node_id(), v1::NODE_ROLE_UNSPECIFIED);
        !s.ok()) {
      return Reply(ctx, s);
    }
    absl::MutexLock lock(&mu_);
    const NodeRegistry::Node* before = registry_.Find(request->node_id());
    const bool was_lost = before != nullptr && before->info.state() == v1::NODE_STATE_LOST;
    if (absl::Status s = registry_.Heartbeat(*request); !s.ok()) return Reply(ctx, s);
    if (RecordHeld(*request) || was_lost) WakeControlLoop();
    Assignments(*request, response);
    return Reply(ctx, absl::OkStatus());
  }

  grpc::ServerUnaryReactor* ReportProgress(grpc::CallbackServerContext* ctx,
                                           const v1::ReportProgressRequest* request,
                                           v1::ReportProgressResponse* response) override {
    if (absl::Status s = access_.CheckNode(*ctx, request->node_id(), v1::NODE_ROLE_WORKER);
        !s.ok()) {
      return Reply(ctx, s);
    }
    bool active = false;
    absl::Status status = Commit([&](Txn& txn) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return Progress(txn, *request, &active);
    });
    response->set_job_active(active);
    return Reply(ctx, status);
  }

  grpc::ServerReadReactor<v1::UploadModelRequest>* UploadModel(
      grpc::CallbackServerContext* ctx, v1::UploadModelResponse*) override {
    return NewModelUpload(ctx, this, AccessPolicy::CertifiedNodeId(*ctx));
  }

  grpc::ServerWriteReactor<v1::SessionEvent>* Session(grpc::CallbackServerContext* ctx,
                                                      const v1::SessionRequest* request) override {
    auto* session = new NodeSession(this, *request);
    absl::Status refused =
        access_.CheckNode(*ctx, request->node_id(), v1::NODE_ROLE_UNSPECIFIED);
    if (refused.ok()) {
      absl::MutexLock lock(&mu_);
      const NodeRegistry::Node* node = registry_.Find(request->node_id());
      if (shut_down_) {
        refused = absl::UnavailableError("coordinator shutting down");
      } else if (node == nullptr || node->info.state() == v1::NODE_STATE_AWAITED) {
        refused = absl::NotFoundError(absl::StrCat("unknown node '", request->node_id(), "'"));
      } else if (!registry_.SessionOpened(request->node_id(), request->incarnation())) {
        refused = absl::FailedPreconditionError(
            absl::StrCat("node ", request->node_id(), " is held by another process"));
      } else {
        sessions_[request->node_id()] = session;
      }
    }
    if (!refused.ok()) session->End(ToGrpcStatus(refused));
    return session;
  }

  // The session's stream was cancelled: its process is gone, or going.
  void SessionClosed(NodeSession* session) ABSL_LOCKS_EXCLUDED(mu_) {
    {
      absl::MutexLock lock(&mu_);
      registry_.SessionClosed(session->node_id(), session->incarnation());
    }
    WakeControlLoop();
  }
  void SessionDone(NodeSession* session) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    auto it = sessions_.find(session->node_id());
    if (it != sessions_.end() && it->second == session) sessions_.erase(it);
  }

  // ---- ModelUploadHandler: worker 0's model, one upload per job at a time ----

  absl::StatusOr<Upload> BeginUpload(const std::string& node_id, const std::string& job_id,
                                     std::function<void()> cancel) override {
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(job_id);
    if (it == jobs_.end()) return UnknownJob(job_id);
    const v1::Job& job = it->second.job;
    if (job.state() != v1::JOB_STATE_RUNNING) {
      return absl::FailedPreconditionError(absl::StrCat(job_id, " is not running"));
    }
    if (job.worker_nodes_size() == 0 || job.worker_nodes(0) != node_id) {
      return absl::PermissionDeniedError(
          absl::StrCat("node '", node_id, "' is not worker 0 of ", job_id));
    }
    const Upload upload = {.id = ++last_upload_id_,
                           .max_bytes = NumParamsOf(job.spec()) * 4 +
                                        64 * 1024};
    if (!uploading_.emplace(job_id, OpenUpload{upload.id, clock_->Now(), std::move(cancel)})
             .second) {
      return absl::AlreadyExistsError(absl::StrCat("a model of ", job_id, " is being uploaded"));
    }
    return upload;
  }

  void EndUpload(const std::string& job_id, uint64_t upload) override {
    absl::MutexLock lock(&mu_);
    if (auto it = uploading_.find(job_id); it != uploading_.end() && it->second.id == upload) {
      uploading_.erase(it);
    }
  }

  // Checks the file and writes it without holding the lock, then records
  // that the job has a model.
  absl::Status FinishUpload(const std::string& job_id, uint64_t upload,
                            std::string bytes) override {
    PSTRAIN_ASSIGN_OR_RETURN(ModelFile file, DecodeModelFile(bytes));
    int64_t expected_floats;
    {
      absl::MutexLock lock(&mu_);
      if (auto it = uploading_.find(job_id); it == uploading_.end() || it->second.id != upload) {
        return absl::CancelledError("the upload took too long and was cancelled");
      }
      auto it = jobs_.find(job_id);
      if (it == jobs_.end()) return UnknownJob(job_id);
      expected_floats = NumParamsOf(it->second.job.spec());
    }
    if (file.header.job_id() != job_id || file.header.total_floats() != expected_floats) {
      return absl::InvalidArgumentError("the model file does not belong to this job");
    }
    if (absl::Status s = models_.Put(job_id, std::move(bytes)); !s.ok()) {
      return absl::UnavailableError(absl::StrCat("cannot keep the model file: ", s.message()));
    }
    return Commit([&](Txn& txn) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      if (txn.Get(job_id).state() != v1::JOB_STATE_RUNNING) {
        return absl::FailedPreconditionError(absl::StrCat(job_id, " is not running"));
      }
      txn.Mutable(job_id)->set_has_model(true);
      return absl::OkStatus();
    });
  }

 private:
  grpc::ServerUnaryReactor* Reply(grpc::CallbackServerContext* ctx, const absl::Status& status) {
    auto* reactor = ctx->DefaultReactor();
    reactor->Finish(ToGrpcStatus(status));
    return reactor;
  }

  absl::StatusOr<ModelStore::Source> FindModel(const std::string& job_id) {
    {
      absl::MutexLock lock(&mu_);
      auto it = jobs_.find(job_id);
      if (it == jobs_.end()) return UnknownJob(job_id);
      const v1::Job& job = it->second.job;
      if (job.state() != v1::JOB_STATE_SUCCEEDED || !job.has_model()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "job ", job_id, " has no model to export (it is ", JobStateLabel(job.state()),
            job.state() == v1::JOB_STATE_SUCCEEDED ? ", without a model file)" : ")"));
      }
    }
    return models_.Find(job_id);
  }

  // ---- Writing: decide, make durable, install ----

  // Runs `decide` on a new Txn under mu_; if it succeeds, writes the jobs it
  // changed durably (with mu_ released), then installs the change. Writes
  // are serialized (write_mu_), so no other change interleaves: what was
  // decided still holds when it is installed. On error nothing changed:
  // decide's own error, INVALID_ARGUMENT for a record too large to keep, or
  // UNAVAILABLE when the disk refuses.
  absl::Status Commit(absl::FunctionRef<absl::Status(Txn&)> decide)
      ABSL_LOCKS_EXCLUDED(mu_, write_mu_) {
    absl::MutexLock write_lock(&write_mu_);
    Txn txn(&jobs_);
    {
      absl::MutexLock lock(&mu_);
      if (shut_down_) return absl::UnavailableError("coordinator shutting down");
      PSTRAIN_RETURN_IF_ERROR(decide(txn));
    }
    if (txn.empty()) return absl::OkStatus();
    const std::vector<const v1::Job*> durable = txn.Durable();
    if (store_ != nullptr && !durable.empty()) {
      const absl::Time start = MonotonicNow();
      absl::Status s = store_->Write(durable);
      if (options_.metrics != nullptr) {
        options_.metrics->log_append_seconds->Observe(absl::ToDoubleSeconds(MonotonicNow() - start));
      }
      if (!s.ok()) {
        LOG(ERROR) << "cannot record a change of job " << durable.front()->id() << ": " << s;
        if (s.code() == absl::StatusCode::kInvalidArgument) return s;
        return absl::UnavailableError(absl::StrCat("cannot record the change: ", s.message()));
      }
    }
    absl::MutexLock lock(&mu_);
    Install(txn);
    return absl::OkStatus();
  }

  void Install(Txn& txn) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::vector<std::pair<std::string, v1::JobState>> transitions;  // id, old state
    for (const std::string& id : txn.added()) {
      Txn::Change& c = txn.changes().at(id);
      JobRecord& record = jobs_[id];
      record.job = std::move(c.job);
      record.plan = std::move(c.plan);
      order_.push_back(id);
      job_counter_ = std::max(job_counter_, JobNumber(id));
      if (!record.job.request_id().empty()) request_ids_[record.job.request_id()] = id;
      if (options_.metrics != nullptr) options_.metrics->jobs_submitted->Increment();
      LOG(INFO) << "job " << id << " submitted";
      transitions.emplace_back(id, v1::JOB_STATE_UNSPECIFIED);
    }
    for (auto& [id, c] : txn.changes()) {
      if (c.added) continue;
      JobRecord& record = jobs_.at(id);
      const v1::JobState old = record.job.state();
      const int64_t old_generation = record.job.generation();
      record.job = std::move(c.job);
      if (record.job.state() != old || record.job.generation() != old_generation) {
        transitions.emplace_back(id, old);
      }
    }
    for (auto& [id, event] : txn.events()) Publish(jobs_.at(id), event, false);
    for (const auto& [id, old] : transitions) OnStateChange(id, old);
    // The nodes of a job that changed state heartbeat now to learn it.
    for (const auto& [id, old] : transitions) NudgeNodesOf(jobs_.at(id).job);
    UpdateGauges();
  }

  void NudgeNodesOf(const v1::Job& job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::set<std::string> nodes(job.server_nodes().begin(), job.server_nodes().end());
    nodes.insert(job.worker_nodes().begin(), job.worker_nodes().end());
    for (const std::string& node : nodes) {
      if (auto it = sessions_.find(node); it != sessions_.end()) it->second->Nudge();
    }
  }

  // Keeps the lists, metrics and watchers in step with a job's new state
  // (or generation).
  void OnStateChange(const std::string& id, v1::JobState old) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    JobRecord& record = jobs_.at(id);
    const v1::JobState state = record.job.state();
    auto generation_gauges = [&] {
      if (!record.metrics.has_value()) return;
      record.metrics->generation->Set(static_cast<double>(record.job.generation()));
      record.metrics->recoveries->Set(record.job.recoveries());
    };
    if (state == old) {  // a new generation
      generation_gauges();
      v1::JobEvent event = Event();
      *event.mutable_recovery() = record.job.history(record.job.history_size() - 1);
      Publish(record, event, false);
      return;
    }
    if (old == v1::JOB_STATE_PENDING) std::erase(pending_, id);
    if (old == v1::JOB_STATE_RUNNING) std::erase(running_, id);
    if (state == v1::JOB_STATE_PENDING) pending_.push_back(id);
    if (state == v1::JOB_STATE_RUNNING) running_.push_back(id);
    if (CoordinatorMetrics* m = options_.metrics; m != nullptr) {
      if (state == v1::JOB_STATE_RUNNING && !record.metrics.has_value()) {
        record.metrics = m->BindJob(id);
      }
      generation_gauges();
      if (IsTerminal(state)) {
        if (record.metrics.has_value()) {
          record.metrics->running->Set(0);
          if (record.job.result().test_accuracy() > 0) {
            record.metrics->accuracy->Set(record.job.result().test_accuracy());
          }
        }
        record.metrics.reset();  // the series expire after the grace period
        m->ended_by_state[state]->Increment();
        m->expiring.JobEnded(id);
      }
    }
    if (old == v1::JOB_STATE_UNSPECIFIED) return;  // submitted: no event yet
    const std::string& reason = record.job.reason();
    LOG(INFO) << "job " << id << " " << JobStateLabel(old) << " -> " << JobStateLabel(state)
              << (reason.empty() ? "" : ": ") << reason;
    v1::JobEvent event = Event();
    event.mutable_state()->set_state(state);
    event.mutable_state()->set_reason(reason);
    Publish(record, event, IsTerminal(state));
    if (IsTerminal(state)) record.watchers.clear();
  }

  void Publish(JobRecord& record, const v1::JobEvent& event, bool last)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::erase_if(record.watchers, [](const auto& w) { return w->Gone(); });
    for (auto& w : record.watchers) w->Publish(event, last);
  }

  // ---- Decisions (on a Txn, under mu_) ----

  static void SetState(Txn& txn, const std::string& id, v1::JobState state,
                       const std::string& reason) {
    v1::Job& job = *txn.Mutable(id);
    job.set_state(state);
    job.set_reason(reason);
    if (state == v1::JOB_STATE_RUNNING) job.set_start_time_ms(WallMs());
    if (IsTerminal(state)) job.set_end_time_ms(WallMs());
  }

  absl::Status Submit(const v1::SubmitJobRequest& request, v1::SubmitJobResponse* response) {
    v1::JobSpec spec;
    switch (request.spec_source_case()) {
      case v1::SubmitJobRequest::kSpec:
        spec = request.spec();
        break;
      case v1::SubmitJobRequest::kSpecYaml: {
        PSTRAIN_ASSIGN_OR_RETURN(spec, ParseJobSpecYaml(request.spec_yaml()));
        break;
      }
      default:
        return absl::InvalidArgumentError("spec: missing (give spec or spec_yaml)");
    }
    PSTRAIN_ASSIGN_OR_RETURN(spec, NormalizeJobSpec(std::move(spec)));
    if (spec.checkpoint().dir().empty() && !options_.default_checkpoint_dir.empty()) {
      spec.mutable_checkpoint()->set_dir(options_.default_checkpoint_dir);
    }
    absl::StatusOr<v1::PartitionPlan> plan = PlanFor(spec);
    if (!plan.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("chunk_bytes: ", plan.status().message()));
    }
    const std::string& request_id = request.request_id();
    if (request_id.size() > 128 || !std::all_of(request_id.begin(), request_id.end(), [](char c) {
          return c > ' ' && c < 0x7f;
        })) {
      return absl::InvalidArgumentError(
          "request_id: must be 1 to 128 printable ASCII characters without spaces");
    }
    std::string id;
    PSTRAIN_RETURN_IF_ERROR(Commit([&](Txn& txn) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      if (auto it = request_ids_.find(request_id); !request_id.empty() && it != request_ids_.end()) {
        // A retry: the job it made, unless this is another job under the same id.
        if (jobs_.at(it->second).job.spec().SerializeAsString() != spec.SerializeAsString()) {
          return absl::AlreadyExistsError(absl::StrCat("request_id '", request_id,
                                                       "' made ", it->second,
                                                       ", whose spec differs"));
        }
        id = it->second;
        return absl::OkStatus();
      }
      if (static_cast<int64_t>(pending_.size()) >= options_.limits.queued_jobs) {
        return absl::ResourceExhaustedError(absl::StrCat(
            pending_.size(), " jobs are queued, the most this coordinator holds "
            "(--max_queued_jobs); submit again once some have started"));
      }
      id = absl::StrFormat("%s%06d", job_id_prefix_, job_counter_ + 1);
      v1::Job job;
      job.set_id(id);
      job.set_request_id(request_id);
      *job.mutable_spec() = spec;
      job.set_state(v1::JOB_STATE_PENDING);
      job.set_create_time_ms(WallMs());
      const int64_t total = TotalSteps(spec);
      const int64_t per_epoch = StepsPerEpoch(spec);
      job.mutable_progress()->set_total_steps(total);
      job.mutable_progress()->set_total_epochs(
          static_cast<int32_t>((total + per_epoch - 1) / per_epoch));
      txn.Add(std::move(job), *plan);
      Schedule(txn);
      return absl::OkStatus();
    }));
    response->set_job_id(id);
    return absl::OkStatus();
  }

  // Pages are newest first; a token is the number of the job where the next
  // page starts (going back): new jobs do not shift it, and it still works
  // if that job was forgotten in between.
  absl::Status List(const v1::ListJobsRequest& request, v1::ListJobsResponse* response) {
    const int page_size = request.page_size() > 0 ? std::min(request.page_size(), 1000) : 50;
    const std::set<int> states(request.states().begin(), request.states().end());
    absl::MutexLock lock(&mu_);
    int64_t next = static_cast<int64_t>(order_.size()) - 1;
    if (!request.page_token().empty()) {
      int64_t number = 0;
      if (!absl::SimpleAtoi(request.page_token(), &number) || number < 1) {
        return absl::InvalidArgumentError("page_token: not a token from a previous response");
      }
      // Job numbers grow along order_.
      next = std::upper_bound(order_.begin(), order_.end(), number,
                              [](int64_t n, const std::string& id) { return n < JobNumber(id); }) -
             order_.begin() - 1;
    }
    for (; next >= 0 && response->jobs_size() < page_size; --next) {
      const v1::Job& job = jobs_.at(order_[next]).job;
      if (states.empty() || states.contains(job.state())) *response->add_jobs() = job;
    }
    if (next >= 0) response->set_next_page_token(absl::StrCat(JobNumber(order_[next])));
    return absl::OkStatus();
  }

  // A server's reports of its jobs' checkpoints and failed loads, kept for
  // the control loop; true if there is news for it.
  bool RecordHeld(const v1::HeartbeatRequest& request) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    bool news = false;
    for (const v1::HeldJob& held : request.held()) {
      auto it = jobs_.find(held.job_id());
      if (it == jobs_.end() || it->second.job.state() != v1::JOB_STATE_RUNNING) continue;
      JobRecord& record = it->second;
      const v1::Job& job = record.job;
      for (int s = 0; s < job.server_nodes_size(); ++s) {
        if (job.server_nodes(s) != request.node_id() ||
            job.server_incarnations(s) != request.incarnation()) {
          continue;
        }
        if (record.reports.by_server.size() < static_cast<size_t>(job.server_nodes_size())) {
          record.reports.by_server.resize(job.server_nodes_size());
        }
        std::vector<v1::CheckpointRecord> written(held.checkpoints().begin(),
                                                  held.checkpoints().end());
        if (written.size() != record.reports.by_server[s].size()) news = true;
        record.reports.by_server[s] = std::move(written);
        if (!held.load_error().empty() && held.generation() == job.generation() &&
            !record.load_failures.contains(s)) {
          record.load_failures[s] = held.load_error();
          news = true;
        }
        if (!held.error().empty() && held.generation() == job.generation() &&
            !record.server_errors.contains(s)) {
          record.server_errors[s] = held.error().substr(0, kMaxErrorBytes);
          news = true;
        }
      }
    }
    return news;
  }

  // The jobs a node must hold (servers) or run (workers) now, at their
  // generation; spec and plan for those it does not hold at it yet.
  void Assignments(const v1::HeartbeatRequest& request, v1::HeartbeatResponse* response)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const NodeRegistry::Node& node = *registry_.Find(request.node_id());
    std::map<std::string, int64_t> held;
    for (const v1::HeldJob& h : request.held()) held[h.job_id()] = h.generation();
    // Specs and plans of jobs new to the node, within the reply's budget:
    // a job left out now comes in a later heartbeat.
    int64_t new_job_bytes = 0;
    auto fits = [&](const v1::JobSpec& spec, const v1::PartitionPlan& plan) {
      const int64_t bytes = static_cast<int64_t>(spec.ByteSizeLong() + plan.ByteSizeLong());
      if (new_job_bytes > 0 && new_job_bytes + bytes > options_.limits.heartbeat_reply_bytes) {
        return false;
      }
      new_job_bytes += bytes;
      return true;
    };
    for (const std::string& id : running_) {
      const JobRecord& record = jobs_.at(id);
      const v1::Job& job = record.job;
      auto h = held.find(id);
      const bool has_it = h != held.end() && h->second == job.generation();
      if (node.info.role() == v1::NODE_ROLE_SERVER) {
        for (int s = 0; s < job.server_nodes_size(); ++s) {
          if (job.server_nodes(s) != node.info.id()) continue;
          if (!has_it && !fits(job.spec(), record.plan)) continue;
          v1::ServerAssignment* a = response->add_server_jobs();
          a->set_job_id(id);
          a->set_server_index(s);
          a->set_generation(job.generation());
          a->set_num_workers(job.worker_nodes_size());
          *a->mutable_worker_nodes() = job.worker_nodes();
          const std::optional<v1::CheckpointRecord> from = ResumeCheckpoint(job);
          if (KeepsValues(job, s)) {
            a->set_keep_values(true);
          } else if (from.has_value()) {
            a->set_restore_step(from->step());
            a->set_restore_generation(from->generation());
          } else if (job.spec().mode() != v1::MODE_SYNC && job.generation() > 1) {
            a->set_restore_step(-1);  // async: the server's own newest checkpoint
          }
          *a->mutable_retained_checkpoints() = job.checkpoints();
          a->set_checkpoint_request_step(job.checkpoint_request_step());
          if (!has_it) {
            *a->mutable_spec() = job.spec();
            *a->mutable_plan() = record.plan;
          }
        }
      } else {
        for (int w = 0; w < job.worker_nodes_size(); ++w) {
          if (job.worker_nodes(w) != node.info.id() || job.workers(w).finished()) continue;
          if (!has_it && !fits(job.spec(), record.plan)) continue;
          v1::WorkerAssignment* a = response->add_worker_jobs();
          a->set_job_id(id);
          a->set_worker_index(w);
          a->set_generation(job.generation());
          a->set_num_workers(job.worker_nodes_size());
          a->set_resume_step(job.spec().mode() == v1::MODE_SYNC ? job.resume_step()
                                                                 : job.workers(w).step());
          a->set_checkpoint_request_step(job.checkpoint_request_step());
          if (!has_it) {
            *a->mutable_spec() = job.spec();
            *a->mutable_plan() = record.plan;
            *a->mutable_server_addresses() = job.server_addresses();
            *a->mutable_resume_state() = ResumeStateOf(job, w);
          }
        }
      }
    }
  }

  absl::Status Progress(Txn& txn, const v1::ReportProgressRequest& r, bool* active)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!jobs_.contains(r.job_id())) return UnknownJob(r.job_id());
    const v1::Job& job = txn.Get(r.job_id());
    if (job.state() != v1::JOB_STATE_RUNNING) return absl::OkStatus();  // not active
    if (r.worker() >= static_cast<uint32_t>(job.worker_nodes_size()) ||
        job.worker_nodes(r.worker()) != r.node_id()) {
      return absl::InvalidArgumentError(absl::StrCat("worker: node '", r.node_id(),
                                                     "' is not worker ", r.worker(), " of ",
                                                     r.job_id()));
    }
    if (job.worker_incarnations(r.worker()) != r.incarnation()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "incarnation: this process of node ", r.node_id(), " does not run ", r.job_id()));
    }
    // A generation that is over: nothing of it counts any more.
    if (r.generation() != job.generation()) return absl::OkStatus();
    JobRecord& record = jobs_.at(r.job_id());
    for (const v1::WorkerResumeState& state : r.checkpoint_states()) {
      if (state.worker() != r.worker() || state.generation() != job.generation()) continue;
      auto& states = record.reports.states[{state.step(), state.generation()}];
      if (states.emplace(state.worker(), state).second) WakeControlLoop();
    }
    if (!r.error().empty()) {
      SetState(txn, r.job_id(), v1::JOB_STATE_FAILED,
               absl::StrCat("worker ", r.worker(), ": ", r.error().substr(0, kMaxErrorBytes)));
      Schedule(txn);
      return absl::OkStatus();
    }
    *active = true;
    if (job.workers(r.worker()).finished()) return absl::OkStatus();
    v1::Job& changed = r.finished() ? *txn.Mutable(r.job_id()) : *txn.MutableVolatile(r.job_id());
    ApplyProgressReport(r, &changed);
    if (record.metrics.has_value()) {
      record.metrics->steps->Set(static_cast<double>(changed.progress().step()));
      if (r.evaluated()) {
        record.metrics->accuracy->Set(r.test_accuracy());
        record.metrics->test_loss->Set(r.test_loss());
      }
    }
    v1::JobEvent event = Event();
    *event.mutable_progress() = changed.progress();
    txn.Publish(r.job_id(), event);
    if (r.evaluated()) {
      v1::JobEvent eval = Event();
      *eval.mutable_evaluation() = changed.last_evaluation();
      txn.Publish(r.job_id(), eval);
    }
    if (r.finished() && AllWorkersFinished(changed)) {
      *changed.mutable_result() = CompletedResult(changed);
      changed.mutable_progress()->set_samples_per_second(changed.result().samples_per_second());
      v1::JobEvent completed = Event();
      *completed.mutable_completed() = changed.result();
      txn.Publish(r.job_id(), completed);
      SetState(txn, r.job_id(), v1::JOB_STATE_SUCCEEDED, changed.reason());  // early stopping's
      Schedule(txn);
    }
    return absl::OkStatus();
  }

  // Bytes that running jobs need on each server node.
  std::map<std::string, int64_t> ReservedBytes() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::map<std::string, int64_t> reserved;
    for (const std::string& id : running_) {
      const JobRecord& record = jobs_.at(id);
      for (int s = 0; s < record.job.server_nodes_size(); ++s) {
        reserved[record.job.server_nodes(s)] +=
            ShardStore::BytesNeeded(record.job.spec(), record.plan, s);
      }
    }
    return reserved;
  }

  const v1::PartitionPlan& PlanOf(Txn& txn, const std::string& id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = jobs_.find(id);
    return it != jobs_.end() ? it->second.plan : txn.changes().at(id).plan;
  }

  // Starts every pending job, oldest first, that the live nodes can take.
  void Schedule(Txn& txn) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::set<std::string> busy;
    std::map<std::string, int64_t> reserved;
    std::vector<std::string> pending;
    for (const std::string& id : txn.Ids(order_)) {
      const v1::Job& job = txn.Get(id);
      if (job.state() == v1::JOB_STATE_PENDING) pending.push_back(id);
      if (job.state() != v1::JOB_STATE_RUNNING) continue;
      busy.insert(job.worker_nodes().begin(), job.worker_nodes().end());
      for (int s = 0; s < job.server_nodes_size(); ++s) {
        reserved[job.server_nodes(s)] += ShardStore::BytesNeeded(job.spec(), PlanOf(txn, id), s);
      }
    }
    for (const std::string& id : pending) {
      const v1::JobSpec& spec = txn.Get(id).spec();
      const v1::PartitionPlan& plan = PlanOf(txn, id);
      ClusterState cluster;
      cluster.reserved = reserved;
      for (const auto& [node_id, node] : registry_.nodes()) {
        if (node.info.state() != v1::NODE_STATE_ALIVE) continue;
        if (node.info.role() == v1::NODE_ROLE_SERVER) {
          if (node.info.colocated_with().empty()) {
            cluster.servers.push_back(&node.info);
          } else {
            cluster.colocated_servers[node.info.colocated_with()] = &node.info;
          }
        }
        if (node.info.role() == v1::NODE_ROLE_WORKER && !busy.contains(node_id) &&
            WorksOn(node.info, id, spec)) {
          cluster.free_workers.push_back(&node.info);
        }
      }
      std::vector<int64_t> need(spec.num_servers());
      for (int s = 0; s < spec.num_servers(); ++s) need[s] = ShardStore::BytesNeeded(spec, plan, s);
      absl::StatusOr<Placement> placement = PlaceJob(spec, need, cluster, WorkerBytesNeeded(spec));
      if (!placement.ok()) {
        if (txn.Get(id).reason() != placement.status().message()) {
          txn.MutableVolatile(id)->set_reason(std::string(placement.status().message()));
        }
        continue;
      }
      v1::Job& job = *txn.Mutable(id);
      job.clear_server_nodes();
      job.clear_server_addresses();
      job.clear_server_incarnations();
      job.clear_worker_nodes();
      job.clear_worker_incarnations();
      job.clear_workers();
      for (int s = 0; s < spec.num_servers(); ++s) {
        const v1::Node& node = *placement->servers[s];
        job.add_server_nodes(node.id());
        job.add_server_addresses(node.address());
        job.add_server_incarnations(node.incarnation());
        reserved[node.id()] += need[s];
      }
      for (int w = 0; w < spec.num_workers(); ++w) {
        const v1::Node& node = *placement->workers[w];
        job.add_worker_nodes(node.id());
        job.add_worker_incarnations(node.incarnation());
        busy.insert(node.id());
        v1::WorkerStatus* status = job.add_workers();
        status->set_worker(w);
        status->set_node_id(node.id());
      }
      StartGeneration(&job, "placed", WallMs());
      SetState(txn, id, v1::JOB_STATE_RUNNING, "");
    }
  }

  // ---- Recovery (on a Txn, under mu_) ----

  // How long the node has been silent; infinite if it is unknown.
  absl::Duration Silent(const NodeRegistry::Node* node) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return node == nullptr ? absl::InfiniteDuration() : clock_->Now() - node->last_heard;
  }

  // Nodes not free to take a job's slot: the workers of running jobs; for
  // a job's server slot, its own servers too.
  std::set<std::string> BusyWorkers(Txn& txn) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::set<std::string> busy;
    for (const std::string& id : txn.Ids(order_)) {
      const v1::Job& job = txn.Get(id);
      if (job.state() == v1::JOB_STATE_RUNNING) {
        busy.insert(job.worker_nodes().begin(), job.worker_nodes().end());
      }
    }
    return busy;
  }

  // The live server in worker `worker_id`'s process; null if none.
  const NodeRegistry::Node* ColocatedServerOf(const std::string& worker_id) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (const auto& [id, node] : registry_.nodes()) {
      if (node.info.role() == v1::NODE_ROLE_SERVER && node.info.state() == v1::NODE_STATE_ALIVE &&
          node.info.colocated_with() == worker_id) {
        return &node;
      }
    }
    return nullptr;
  }

  // A live server of its own that holds no part of `job` and has `need`
  // bytes of room. None for a colocated job: its servers are its workers'.
  const NodeRegistry::Node* SpareServer(Txn& txn, const v1::Job& job, int64_t need)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (job.spec().colocated_servers()) return nullptr;
    std::map<std::string, int64_t> reserved;
    for (const std::string& id : txn.Ids(order_)) {
      const v1::Job& other = txn.Get(id);
      if (other.state() != v1::JOB_STATE_RUNNING) continue;
      for (int s = 0; s < other.server_nodes_size(); ++s) {
        reserved[other.server_nodes(s)] +=
            ShardStore::BytesNeeded(other.spec(), PlanOf(txn, id), s);
      }
    }
    const std::set<std::string> own(job.server_nodes().begin(), job.server_nodes().end());
    const NodeRegistry::Node* best = nullptr;
    for (const auto& [id, node] : registry_.nodes()) {
      if (node.info.role() != v1::NODE_ROLE_SERVER || node.info.state() != v1::NODE_STATE_ALIVE ||
          !node.info.colocated_with().empty() || own.contains(id) ||
          RoomOn(node.info, reserved) < need) {
        continue;
      }
      if (best == nullptr || RoomOn(node.info, reserved) > RoomOn(best->info, reserved)) {
        best = &node;
      }
    }
    return best;
  }

  // Looks at every running job's nodes and acts by the job's policy: a
  // node whose id a new process took, or a lost node that is replaced,
  // starts a new generation (from the latest complete checkpoint); a lost
  // worker of an elastic job is left out of the next one, and an idle
  // worker joins it; a server that could not load its checkpoint drops that
  // checkpoint for an older one; a lost node that is not replaced in time,
  // or a lost worker under on_worker_loss: fail, fails the job.
  void RecoverJobs(Txn& txn) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    bool ended = false;
    std::set<std::string> taken;  // nodes given to a job in this pass
    for (const std::string& id : std::vector<std::string>(running_)) {
      const v1::Job& current = txn.Get(id);
      if (current.state() != v1::JOB_STATE_RUNNING) continue;
      JobRecord& record = jobs_.at(id);
      const v1::RecoverySpec& policy = current.spec().recovery();
      const absl::Duration replace_after = absl::Seconds(policy.replace_after_seconds());
      const absl::Duration wait_timeout = absl::Seconds(policy.wait_timeout_seconds());
      v1::Job next = current;
      std::vector<std::string> why;  // of a new generation
      std::optional<std::string> failure;
      if (!record.server_errors.empty()) {
        const auto& [s, error] = *record.server_errors.begin();
        failure = absl::StrCat("server ", s, ": ", error);
      }

      // A server that could not load this generation's checkpoint.
      for (const auto& [s, error] : record.load_failures) {
        why.push_back(absl::StrCat("server ", s, " could not load step ", current.resume_step(),
                                   ": ", error));
      }
      if (!record.load_failures.empty()) {
        if (std::optional<v1::CheckpointRecord> from = ResumeCheckpoint(current)) {
          DropCheckpoint(&next, from->step(), from->generation());
        } else {
          failure = why.front();  // nothing older to go back to
        }
      }

      for (int s = 0; s < next.server_nodes_size() && !failure; ++s) {
        const NodeRegistry::Node* node = registry_.Find(next.server_nodes(s));
        const std::string slot = absl::StrCat("server ", s, " (node ", next.server_nodes(s), ")");
        if (node != nullptr && node->info.state() == v1::NODE_STATE_ALIVE) {
          if (node->incarnation != next.server_incarnations(s)) {
            why.push_back(absl::StrCat(slot, " was restarted"));
            next.set_server_incarnations(s, node->incarnation);
            next.set_server_addresses(s, node->info.address());
          }
          continue;
        }
        if (node != nullptr && node->info.state() == v1::NODE_STATE_AWAITED) continue;
        const absl::Duration silent = Silent(node);
        if (silent < replace_after) continue;
        const NodeRegistry::Node* spare = SpareServer(
            txn, next, ShardStore::BytesNeeded(next.spec(), PlanOf(txn, id), s));
        if (spare != nullptr && !taken.contains(spare->info.id())) {
          why.push_back(absl::StrCat(slot, " lost; ", spare->info.id(), " takes its place"));
          taken.insert(spare->info.id());
          next.set_server_nodes(s, spare->info.id());
          next.set_server_addresses(s, spare->info.address());
          next.set_server_incarnations(s, spare->incarnation);
        } else if (silent >= wait_timeout) {
          failure = absl::StrCat(slot, " lost and not replaced within ",
                                 absl::FormatDuration(wait_timeout), " (no free server with room)");
        }
      }

      const std::set<std::string> busy = BusyWorkers(txn);
      const int64_t worker_need = WorkerBytesNeeded(next.spec());
      const bool colocated = next.spec().colocated_servers();
      // An idle worker to take a lost one's place; a colocated job's also
      // has a server of its own, which takes the same place among the
      // job's servers.
      auto idle_worker = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) -> const NodeRegistry::Node* {
        for (const auto& [node_id, node] : registry_.nodes()) {
          if (node.info.role() == v1::NODE_ROLE_WORKER &&
              node.info.state() == v1::NODE_STATE_ALIVE && !busy.contains(node_id) &&
              WorksOn(node.info, id, next.spec()) &&
              !taken.contains(node_id) && RoomOn(node.info, {}) >= worker_need &&
              (!colocated || ColocatedServerOf(node_id) != nullptr)) {
            return &node;
          }
        }
        return nullptr;
      };
      std::vector<int> dropped;  // elastic
      for (int w = 0; w < next.worker_nodes_size() && !failure; ++w) {
        const NodeRegistry::Node* node = registry_.Find(next.worker_nodes(w));
        const std::string slot = absl::StrCat("worker ", w, " (node ", next.worker_nodes(w), ")");
        if (node != nullptr && node->info.state() == v1::NODE_STATE_ALIVE) {
          if (node->incarnation != next.worker_incarnations(w)) {
            why.push_back(absl::StrCat(slot, " was restarted"));
            next.set_worker_incarnations(w, node->incarnation);
          }
          continue;
        }
        if (next.workers(w).finished() ||
            (node != nullptr && node->info.state() == v1::NODE_STATE_AWAITED)) {
          continue;
        }
        const std::string lost =
            node != nullptr && !node->lost_reason.empty() ? node->lost_reason : slot + " lost";
        const absl::Duration silent = Silent(node);
        switch (policy.on_worker_loss()) {
          case v1::WORKER_LOSS_POLICY_FAIL:
            failure = absl::StrCat(slot, ": ", lost);
            break;
          case v1::WORKER_LOSS_POLICY_ELASTIC:
            if (next.worker_nodes_size() - static_cast<int>(dropped.size()) > 1) {
              dropped.push_back(w);
              why.push_back(absl::StrCat(slot, " lost; the job goes on without it"));
              break;
            }
            [[fallthrough]];  // the last worker: wait for one to take its place
          default:
            if (silent < replace_after) break;
            if (const NodeRegistry::Node* idle = idle_worker()) {
              why.push_back(absl::StrCat(slot, " lost; ", idle->info.id(), " takes its place"));
              taken.insert(idle->info.id());
              next.set_worker_nodes(w, idle->info.id());
              next.set_worker_incarnations(w, idle->incarnation);
              if (colocated) {
                const NodeRegistry::Node* server = ColocatedServerOf(idle->info.id());
                next.set_server_nodes(w, server->info.id());
                next.set_server_addresses(w, server->info.address());
                next.set_server_incarnations(w, server->incarnation);
              }
            } else if (silent >= wait_timeout) {
              failure = absl::StrCat(slot, " lost and not replaced within ",
                                     absl::FormatDuration(wait_timeout), " (no idle worker)");
            }
        }
      }
      if (!dropped.empty()) {
        v1::Job kept = next;
        kept.clear_worker_nodes();
        kept.clear_worker_incarnations();
        for (int w = 0; w < next.worker_nodes_size(); ++w) {
          if (std::find(dropped.begin(), dropped.end(), w) != dropped.end()) continue;
          kept.add_worker_nodes(next.worker_nodes(w));
          kept.add_worker_incarnations(next.worker_incarnations(w));
        }
        next = std::move(kept);
      }
      if (!failure && policy.on_worker_loss() == v1::WORKER_LOSS_POLICY_ELASTIC) {
        while (next.worker_nodes_size() < next.spec().num_workers()) {
          const NodeRegistry::Node* idle = idle_worker();
          if (idle == nullptr) break;
          why.push_back(absl::StrCat(idle->info.id(), " joins"));
          taken.insert(idle->info.id());
          next.add_worker_nodes(idle->info.id());
          next.add_worker_incarnations(idle->incarnation);
        }
      }

      // A colocated job's process holds a worker and a server: the next
      // generation starts once both are back (alive, and both new or both
      // not), not twice.
      auto alive = [&](const std::string& node_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        const NodeRegistry::Node* node = registry_.Find(node_id);
        return node != nullptr && node->info.state() == v1::NODE_STATE_ALIVE;
      };
      bool whole = true;
      for (int s = 0; colocated && s < next.server_nodes_size(); ++s) {
        const bool server_new = next.server_incarnations(s) != current.server_incarnations(s);
        const bool worker_new = s < next.worker_nodes_size() &&
                                next.worker_incarnations(s) != current.worker_incarnations(s);
        whole = whole && alive(next.server_nodes(s)) && s < next.worker_nodes_size() &&
                alive(next.worker_nodes(s)) && server_new == worker_new;
      }
      if (failure.has_value()) {
        SetState(txn, id, v1::JOB_STATE_FAILED, *failure);
        ended = true;
      } else if (!why.empty() && whole) {
        const std::string reason = absl::StrJoin(why, "; ");
        LOG(WARNING) << "job " << id << ": " << reason << ": generation "
                     << next.generation() + 1 << " starts";
        StartGeneration(&next, reason, WallMs());
        LOG(INFO) << "job " << id << " generation " << next.generation() << " starts at step "
                  << next.resume_step() << " with " << next.worker_nodes_size() << " worker(s)";
        *txn.Mutable(id) = std::move(next);
        record.load_failures.clear();
      }
    }
    if (ended) Schedule(txn);
  }

  // Records every running job's newly complete checkpoint.
  void CompleteCheckpoints(Txn& txn) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (const std::string& id : running_) {
      const v1::Job& job = txn.Get(id);
      if (job.state() != v1::JOB_STATE_RUNNING) continue;
      JobRecord& record = jobs_.at(id);
      std::optional<v1::CheckpointRecord> complete = NewlyComplete(job, record.reports);
      if (!complete.has_value()) continue;
      complete->set_time_ms(WallMs());
      VLOG(1) << "job " << id << ": checkpoint of step " << complete->step() << " complete";
      RecordCheckpoint(txn.Mutable(id), *complete, record.reports);
      // The states of steps up to it are no longer needed.
      std::erase_if(record.reports.states,
                    [&](const auto& e) { return e.first.first <= complete->step(); });
      if (record.metrics.has_value()) {
        record.metrics->last_checkpoint->Set(static_cast<double>(complete->step()));
      }
    }
  }

  // ---- The control loop: leases, scheduling, the targets file ----

  void WakeControlLoop() ABSL_LOCKS_EXCLUDED(wake_mu_) {
    {
      absl::MutexLock lock(&wake_mu_);
      wake_ = true;
    }
    wake_cv_.NotifyAll();
  }

  void ControlLoop() {
    const absl::Duration tick = std::max(absl::Milliseconds(100), options_.lease / 20);
    while (true) {
      {
        absl::MutexLock lock(&wake_mu_);
        wake_cv_.AwaitWithTimeout(
            wake_mu_, [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(wake_mu_) { return wake_; }, tick);
        wake_ = false;
      }
      {
        absl::MutexLock lock(&mu_);
        if (shut_down_) return;
      }
      absl::Status s = Commit([&](Txn& txn) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        registry_.ExpireLeases();
        registry_.ForgetLongLost();
        RecoverJobs(txn);
        CompleteCheckpoints(txn);
        Schedule(txn);
        return absl::OkStatus();
      });
      if (!s.ok()) {
        LOG_EVERY_N(WARNING, 20) << "control loop: " << s;
      }
      WriteTargets();
      absl::MutexLock write_lock(&write_mu_);
      absl::MutexLock lock(&mu_);
      ForgetOldFinished();
      CancelStalledUploads();
      UpdateGauges();
    }
  }

  // Forgets the oldest finished jobs beyond limits.finished_jobs: their
  // records, request ids and model files.
  void ForgetOldFinished() ABSL_EXCLUSIVE_LOCKS_REQUIRED(write_mu_, mu_) {
    if (static_cast<int64_t>(jobs_.size()) <= options_.limits.finished_jobs) return;
    int64_t finished = std::count_if(jobs_.begin(), jobs_.end(), [](const auto& entry) {
      return IsTerminal(entry.second.job.state());
    });
    if (finished <= options_.limits.finished_jobs) return;
    std::vector<std::string> kept;
    for (const std::string& id : order_) {
      auto it = jobs_.find(id);
      if (finished <= options_.limits.finished_jobs || !IsTerminal(it->second.job.state())) {
        kept.push_back(id);
        continue;
      }
      --finished;
      if (const std::string& request_id = it->second.job.request_id(); !request_id.empty()) {
        request_ids_.erase(request_id);
      }
      if (store_ != nullptr) store_->Forget(id);
      models_.Remove(id);
      jobs_.erase(it);
    }
    order_ = std::move(kept);
  }

  // Cancels the model uploads open longer than limits.upload_timeout.
  void CancelStalledUploads() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const absl::Time now = clock_->Now();
    std::erase_if(uploading_, [&](auto& entry) {
      const auto& [job_id, upload] = entry;
      if (now - upload.began < options_.limits.upload_timeout) return false;
      LOG(WARNING) << "job " << job_id << ": the model upload did not end within "
                   << absl::FormatDuration(options_.limits.upload_timeout) << "; cancelled";
      upload.cancel();  // the call ends; a new upload may begin at once
      return true;
    });
  }

  // The targets file is written without the lock: it syncs the disk.
  void WriteTargets() ABSL_LOCKS_EXCLUDED(mu_) {
    if (options_.prometheus_sd_file.empty()) return;
    std::string text;
    {
      absl::MutexLock lock(&mu_);
      text = TargetsText(options_.metrics_address, registry_);
    }
    targets_.Write(text);
  }

  // Refreshes the gauges of jobs and nodes by state.
  void UpdateGauges() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    CoordinatorMetrics* m = options_.metrics;
    if (m == nullptr) return;
    std::map<v1::JobState, int> jobs;
    for (const auto& [id, record] : jobs_) ++jobs[record.job.state()];
    for (auto& [state, gauge] : m->jobs_by_state) gauge->Set(jobs[state]);
    std::map<std::pair<v1::NodeRole, v1::NodeState>, int> nodes;
    for (const auto& [id, node] : registry_.nodes()) ++nodes[{node.info.role(), node.info.state()}];
    for (auto& [key, gauge] : m->nodes_by_role_state) gauge->Set(nodes[key]);
    m->expiring.Sweep();
  }

  static int64_t JobNumber(const std::string& id) {
    int64_t number = 0;
    return absl::SimpleAtoi(id.substr(id.rfind('-') + 1), &number) ? number : 0;
  }

  // Rebuilds the tables from the job store: pending jobs queue again,
  // running jobs wait for their nodes to come back (for one lease).
  void Recover(std::vector<v1::Job> jobs) ABSL_EXCLUSIVE_LOCKS_REQUIRED(write_mu_, mu_) {
    for (v1::Job& job : jobs) {
      job_counter_ = std::max(job_counter_, JobNumber(job.id()));
      const std::string id = job.id();
      JobRecord& record = jobs_[id];
      record.job = std::move(job);
      order_.push_back(id);
      if (!record.job.request_id().empty()) request_ids_[record.job.request_id()] = id;
      if (absl::StatusOr<v1::PartitionPlan> plan = PlanFor(record.job.spec()); plan.ok()) {
        record.plan = std::move(*plan);
      }
      if (record.job.state() == v1::JOB_STATE_PENDING) pending_.push_back(id);
      if (record.job.state() != v1::JOB_STATE_RUNNING) continue;
      running_.push_back(id);
      if (options_.metrics != nullptr) record.metrics = options_.metrics->BindJob(id);
      const v1::Job& j = record.job;
      for (int s = 0; s < j.server_nodes_size(); ++s) {
        registry_.Await(j.server_nodes(s), v1::NODE_ROLE_SERVER,
                        s < j.server_addresses_size() ? j.server_addresses(s) : "",
                        s < j.server_incarnations_size() ? j.server_incarnations(s) : 0);
      }
      for (int w = 0; w < j.worker_nodes_size(); ++w) {
        if (!j.workers(w).finished()) {
          registry_.Await(j.worker_nodes(w), v1::NODE_ROLE_WORKER, "",
                          w < j.worker_incarnations_size() ? j.worker_incarnations(w) : 0);
        }
      }
    }
    // Jobs forgotten before a crash that the log still had come back here,
    // and are forgotten again.
    write_mu_.AssertHeld();
    ForgetOldFinished();
    LOG(INFO) << "recovered " << jobs_.size() << " jobs (" << pending_.size() << " pending, "
              << running_.size() << " running) from " << options_.state_dir;
  }

  const Options options_;
  const AccessPolicy access_;
  FileSystem* const fs_;
  const Clock* const clock_;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
  std::thread control_thread_;
  std::unique_ptr<JobStore> store_;  // null without a state directory; used under write_mu_

  // Serializes durable changes (Commit); taken before mu_.
  absl::Mutex write_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  absl::Mutex mu_;
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
  std::mt19937_64 rng_ ABSL_GUARDED_BY(mu_);
  NodeRegistry registry_ ABSL_GUARDED_BY(mu_);
  const std::string job_id_prefix_;  // then the job's number
  int64_t job_counter_ ABSL_GUARDED_BY(mu_) = 0;
  // SubmitJobRequest.request_id -> the job it made.
  std::map<std::string, std::string> request_ids_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, JobRecord> jobs_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> order_ ABSL_GUARDED_BY(mu_);    // by submission
  std::vector<std::string> pending_ ABSL_GUARDED_BY(mu_);  // oldest first
  std::vector<std::string> running_ ABSL_GUARDED_BY(mu_);
  struct OpenUpload {
    uint64_t id = 0;
    absl::Time began;  // by clock_
    std::function<void()> cancel;
  };
  std::map<std::string, OpenUpload> uploading_ ABSL_GUARDED_BY(mu_);  // by job
  uint64_t last_upload_id_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<std::string, NodeSession*> sessions_ ABSL_GUARDED_BY(mu_);  // open, by node
  ModelStore models_;
  TargetsFile targets_;  // written by one thread at a time (Start, then the control loop)

  absl::Mutex wake_mu_;
  bool wake_ ABSL_GUARDED_BY(wake_mu_) = false;
  MonotonicCondVar wake_cv_;  // wake_ set
};

void NodeSession::OnCancel() {
  coordinator_->SessionClosed(this);
  End(grpc::Status::CANCELLED);
}

void NodeSession::OnDone() {
  coordinator_->SessionDone(this);
  delete this;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Coordinator>> Coordinator::Create(Options options) {
  auto coordinator = std::make_unique<CoordinatorImpl>(std::move(options));
  PSTRAIN_RETURN_IF_ERROR(coordinator->Start());
  return coordinator;
}

}  // namespace pstrain::server
