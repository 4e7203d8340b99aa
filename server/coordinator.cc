#include "server/coordinator.h"

#include <sys/stat.h>

#include <algorithm>
#include <fstream>
#include <limits>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "common/files.h"
#include "common/job_spec.h"
#include "common/model_file.h"
#include "common/partition.h"
#include "common/rpc.h"
#include "common/status.h"
#include "glog/logging.h"
#include "pstrain/v1/control.grpc.pb.h"
#include "pstrain/v1/membership.grpc.pb.h"
#include "server/job_log.h"
#include "server/shard_store.h"
#include "server/watch_queue.h"

namespace pstrain::server {
namespace {

constexpr size_t kModelPieceBytes = 1 << 20;
// Lost nodes stay listed this long, then are forgotten.
constexpr absl::Duration kForgetLostNodesAfter = absl::Minutes(10);
// Watchers of one job at the same time.
constexpr size_t kMaxWatchersPerJob = 256;

int64_t NowMs() { return absl::ToUnixMillis(absl::Now()); }

bool IsTerminal(v1::JobState s) {
  return s == v1::JOB_STATE_SUCCEEDED || s == v1::JOB_STATE_FAILED ||
         s == v1::JOB_STATE_CANCELLED;
}

std::string StateName(v1::JobState s) {
  std::string name = v1::JobState_Name(s);
  return absl::AsciiStrToLower(name.substr(std::string("JOB_STATE_").size()));
}

std::string RolePrefix(v1::NodeRole role) {
  return role == v1::NODE_ROLE_SERVER ? "server-" : "worker-";
}

// Node ids are the role and 8 hex digits: "worker-3f9a2c1b".
bool IsNodeIdOfRole(const std::string& id, v1::NodeRole role) {
  const std::string prefix = RolePrefix(role);
  if (!absl::StartsWith(id, prefix) || id.size() != prefix.size() + 8) return false;
  return std::all_of(id.begin() + prefix.size(), id.end(),
                     [](char c) { return absl::ascii_isxdigit(c) && !absl::ascii_isupper(c); });
}

// Empty, or host:port of letters, digits and . - _ [ ] : — what a scrape
// target may be (and safe to write into the targets file as it is).
bool IsHostPort(const std::string& s) {
  if (s.empty()) return true;
  if (s.size() > 255 || s.rfind(':') == std::string::npos) return false;
  return std::all_of(s.begin(), s.end(), [](char c) {
    return absl::ascii_isalnum(c) || c == '.' || c == '-' || c == '_' || c == '[' || c == ']' ||
           c == ':';
  });
}

std::string MegaBytes(int64_t bytes) { return absl::StrFormat("%.1f MB", bytes / 1e6); }

struct Node {
  v1::Node info;
  absl::Time last_heartbeat;
};

struct JobRecord {
  v1::Job job;
  v1::PartitionPlan plan;  // once scheduled
  std::vector<std::shared_ptr<WatchQueue>> watchers;
  std::optional<CoordinatorMetrics::Job> metrics;  // once running, if measured
};

class CoordinatorImpl;

// Receives worker 0's model file (UploadModel).
class ModelUpload final : public grpc::ServerReadReactor<v1::UploadModelRequest> {
 public:
  explicit ModelUpload(CoordinatorImpl* coordinator) : coordinator_(coordinator) {
    StartRead(&request_);
  }
  void OnReadDone(bool ok) override;
  void OnDone() override;

 private:
  CoordinatorImpl* const coordinator_;
  v1::UploadModelRequest request_;
  std::string node_id_, job_id_, data_;
  bool first_ = true;
  bool began_ = false;  // the coordinator counts this upload as the job's one
  int64_t limit_ = 0;
};

// Where a model file is: on disk, or in memory without a state directory.
struct ModelSource {
  std::string path;
  std::shared_ptr<const std::string> bytes;
};

// Sends a model file in pieces (ExportModel), reading as it goes.
class ModelExport final : public grpc::ServerWriteReactor<v1::ModelFileChunk> {
 public:
  explicit ModelExport(absl::StatusOr<ModelSource> source) {
    if (!source.ok()) {
      Finish(ToGrpcStatus(source.status()));
      return;
    }
    source_ = std::move(*source);
    if (source_.bytes == nullptr) {
      file_.open(source_.path, std::ios::binary);
      if (!file_) {
        Finish(grpc::Status(grpc::StatusCode::INTERNAL, "cannot read the model file"));
        return;
      }
    }
    Next();
  }
  void OnWriteDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status::CANCELLED);
      return;
    }
    Next();
  }
  void OnDone() override { delete this; }

 private:
  void Next() {
    std::string piece(kModelPieceBytes, '\0');
    size_t n;
    if (source_.bytes != nullptr) {
      n = std::min(kModelPieceBytes, source_.bytes->size() - sent_);
      piece.assign(*source_.bytes, sent_, n);
    } else {
      file_.read(piece.data(), static_cast<std::streamsize>(piece.size()));
      n = static_cast<size_t>(file_.gcount());
      if (file_.bad()) {
        Finish(grpc::Status(grpc::StatusCode::INTERNAL, "cannot read the model file"));
        return;
      }
      piece.resize(n);
    }
    if (n == 0) {
      Finish(grpc::Status::OK);
      return;
    }
    sent_ += n;
    piece_.set_data(std::move(piece));
    StartWrite(&piece_);
  }

  ModelSource source_;
  std::ifstream file_;
  size_t sent_ = 0;
  v1::ModelFileChunk piece_;
};

class CoordinatorImpl final : public Coordinator,
                              public v1::Control::CallbackService,
                              public v1::Membership::CallbackService {
 public:
  explicit CoordinatorImpl(Options options)
      : options_(std::move(options)), rng_(std::random_device{}()) {}
  ~CoordinatorImpl() override { Shutdown(absl::Seconds(1)); }

  absl::Status Start() {
    if (!options_.state_dir.empty()) {
      std::vector<v1::Job> jobs;
      PSTRAIN_ASSIGN_OR_RETURN(log_, JobLog::Open(options_.state_dir, &jobs));
      const std::string models = ModelsDir();
      if (mkdir(models.c_str(), 0755) != 0 && errno != EEXIST) {
        return absl::InternalError(absl::StrCat("cannot create ", models));
      }
      absl::MutexLock lock(&mu_);
      Recover(std::move(jobs));
    }
    grpc::ServerBuilder builder;
    ConfigureServerBuilder(builder, options_.rpc);
    int port = 0;
    builder.AddListeningPort(options_.listen_address, grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(static_cast<v1::Control::CallbackService*>(this));
    builder.RegisterService(static_cast<v1::Membership::CallbackService*>(this));
    server_ = builder.BuildAndStart();
    if (server_ == nullptr || port == 0) {
      return absl::UnavailableError(absl::StrCat("cannot listen on ", options_.listen_address));
    }
    address_ = absl::StrCat(options_.listen_address.substr(0, options_.listen_address.rfind(':')),
                            ":", port);
    {
      absl::MutexLock lock(&mu_);
      WriteTargets();
    }
    lease_thread_ = std::thread([this] { LeaseLoop(); });
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
    if (server_ != nullptr) server_->Shutdown(absl::ToChronoTime(absl::Now() + grace));
    if (lease_thread_.joinable()) lease_thread_.join();
  }

  // ---- Control ----

  grpc::ServerUnaryReactor* SubmitJob(grpc::CallbackServerContext* ctx,
                                      const v1::SubmitJobRequest* request,
                                      v1::SubmitJobResponse* response) override {
    return Reply(ctx, Submit(*request, response));
  }

  grpc::ServerUnaryReactor* GetJob(grpc::CallbackServerContext* ctx,
                                   const v1::GetJobRequest* request, v1::Job* response) override {
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(request->job_id());
    if (it == jobs_.end()) return Reply(ctx, UnknownJob(request->job_id()));
    *response = it->second.job;
    return Reply(ctx, absl::OkStatus());
  }

  grpc::ServerUnaryReactor* ListJobs(grpc::CallbackServerContext* ctx,
                                     const v1::ListJobsRequest* request,
                                     v1::ListJobsResponse* response) override {
    return Reply(ctx, List(*request, response));
  }

  grpc::ServerUnaryReactor* CancelJob(grpc::CallbackServerContext* ctx,
                                      const v1::CancelJobRequest* request,
                                      v1::Job* response) override {
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(request->job_id());
    if (it == jobs_.end()) return Reply(ctx, UnknownJob(request->job_id()));
    if (!IsTerminal(it->second.job.state())) {
      SetState(it->second, v1::JOB_STATE_CANCELLED, "cancelled by request");
      Schedule();
    }
    *response = it->second.job;
    return Reply(ctx, absl::OkStatus());
  }

  grpc::ServerWriteReactor<v1::JobEvent>* WatchJob(grpc::CallbackServerContext* ctx,
                                                   const v1::WatchJobRequest* request) override {
    auto* watch = new JobWatch(options_.max_queued_events);
    const std::shared_ptr<WatchQueue> queue = watch->queue();
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(request->job_id());
    if (shut_down_) {
      queue->End(grpc::Status(grpc::StatusCode::UNAVAILABLE, "coordinator shutting down"));
    } else if (it == jobs_.end()) {
      queue->End(ToGrpcStatus(UnknownJob(request->job_id())));
    } else {
      JobRecord& record = it->second;
      v1::JobEvent snapshot;
      snapshot.set_time_ms(NowMs());
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
    absl::MutexLock lock(&mu_);
    const std::map<std::string, int64_t> reserved = ReservedBytes();
    for (const auto& [id, node] : nodes_) {
      v1::Node* out = response->add_nodes();
      *out = node.info;
      if (auto it = reserved.find(id); it != reserved.end()) out->set_reserved_bytes(it->second);
    }
    return Reply(ctx, absl::OkStatus());
  }

  grpc::ServerWriteReactor<v1::ModelFileChunk>* ExportModel(
      grpc::CallbackServerContext*, const v1::ExportModelRequest* request) override {
    return new ModelExport(FindModel(request->job_id()));
  }

  // ---- Membership ----

  grpc::ServerUnaryReactor* Register(grpc::CallbackServerContext* ctx,
                                     const v1::RegisterRequest* request,
                                     v1::RegisterResponse* response) override {
    return Reply(ctx, RegisterNode(*request, response));
  }

  grpc::ServerUnaryReactor* Heartbeat(grpc::CallbackServerContext* ctx,
                                      const v1::HeartbeatRequest* request,
                                      v1::HeartbeatResponse* response) override {
    absl::MutexLock lock(&mu_);
    return Reply(ctx, HeartbeatNode(*request, response));
  }

  grpc::ServerUnaryReactor* ReportProgress(grpc::CallbackServerContext* ctx,
                                           const v1::ReportProgressRequest* request,
                                           v1::ReportProgressResponse* response) override {
    absl::MutexLock lock(&mu_);
    return Reply(ctx, Progress(*request, response));
  }

  grpc::ServerReadReactor<v1::UploadModelRequest>* UploadModel(
      grpc::CallbackServerContext*, v1::UploadModelResponse*) override {
    return new ModelUpload(this);
  }

  // Starts worker 0's upload of a running job's model; returns the largest
  // file accepted. One upload per job at a time.
  absl::StatusOr<int64_t> BeginUpload(const std::string& node_id, const std::string& job_id) {
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
    if (!uploading_.insert(job_id).second) {
      return absl::AlreadyExistsError(absl::StrCat("a model of ", job_id, " is being uploaded"));
    }
    return kernels::NumParams(ModelShapeOf(job.spec())) * 4 + 64 * 1024;
  }

  void EndUpload(const std::string& job_id) {
    absl::MutexLock lock(&mu_);
    uploading_.erase(job_id);
  }

  // Keeps an upload as the job's model file. The file is checked and
  // written without holding the lock.
  absl::Status StoreModel(const std::string& job_id, std::string bytes) {
    PSTRAIN_ASSIGN_OR_RETURN(ModelFile file, DecodeModelFile(bytes));
    int64_t expected_floats;
    {
      absl::MutexLock lock(&mu_);
      auto it = jobs_.find(job_id);
      if (it == jobs_.end()) return UnknownJob(job_id);
      expected_floats = kernels::NumParams(ModelShapeOf(it->second.job.spec()));
    }
    if (file.header.job_id() != job_id || file.header.total_floats() != expected_floats) {
      return absl::InvalidArgumentError("the model file does not belong to this job");
    }
    std::shared_ptr<const std::string> in_memory;
    if (!options_.state_dir.empty()) {
      PSTRAIN_RETURN_IF_ERROR(WriteFileAtomically(ModelPath(job_id), bytes));
    } else {
      in_memory = std::make_shared<const std::string>(std::move(bytes));
    }
    absl::MutexLock lock(&mu_);
    JobRecord& record = jobs_.at(job_id);
    if (record.job.state() != v1::JOB_STATE_RUNNING) {
      return absl::FailedPreconditionError(absl::StrCat(job_id, " is not running"));
    }
    if (in_memory != nullptr) models_[job_id] = std::move(in_memory);
    record.job.set_has_model(true);
    Persist(record);
    return absl::OkStatus();
  }

 private:
  grpc::ServerUnaryReactor* Reply(grpc::CallbackServerContext* ctx, const absl::Status& status) {
    auto* reactor = ctx->DefaultReactor();
    reactor->Finish(ToGrpcStatus(status));
    return reactor;
  }

  static absl::Status UnknownJob(const std::string& id) {
    return absl::NotFoundError(absl::StrCat("job_id: no job '", id, "'"));
  }

  std::string ModelsDir() const { return options_.state_dir + "/models"; }
  std::string ModelPath(const std::string& job_id) const {
    return absl::StrCat(ModelsDir(), "/", job_id, ".pstm");
  }

  absl::StatusOr<ModelSource> FindModel(const std::string& job_id) {
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(job_id);
    if (it == jobs_.end()) return UnknownJob(job_id);
    const v1::Job& job = it->second.job;
    if (job.state() != v1::JOB_STATE_SUCCEEDED || !job.has_model()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "job ", job_id, " has no model to export (it is ", StateName(job.state()),
          job.state() == v1::JOB_STATE_SUCCEEDED ? ", without a model file)" : ")"));
    }
    if (options_.state_dir.empty()) return ModelSource{"", models_.at(job_id)};
    return ModelSource{ModelPath(job_id), nullptr};
  }

  // Writes the job's snapshot to the log. A change that cannot be made
  // durable stops the coordinator: going on would acknowledge what a restart
  // forgets.
  void Persist(const JobRecord& record) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (log_ == nullptr) return;
    absl::Status status = AppendToLog(record.job);
    if (!status.ok()) {
      LOG(FATAL) << "cannot record job " << record.job.id() << " in the job log: " << status;
    }
    MaybeCompact();
  }

  absl::Status AppendToLog(const v1::Job& job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (log_ == nullptr) return absl::OkStatus();
    const absl::Time start = absl::Now();
    absl::Status status = log_->Append(job);
    if (options_.metrics != nullptr) {
      options_.metrics->log_append_seconds->Observe(absl::ToDoubleSeconds(absl::Now() - start));
    }
    return status;
  }

  // The Prometheus file_sd targets: the coordinator and every live node.
  void WriteTargets() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (options_.prometheus_sd_file.empty()) return;
    auto group = [](const std::string& address, const std::string& role, const std::string& node) {
      return absl::StrFormat(
          "  {\"targets\": [\"%s\"], \"labels\": {\"role\": \"%s\", \"node\": \"%s\"}}",
          address, role, node);
    };
    std::vector<std::string> groups;
    if (!options_.metrics_address.empty()) {
      groups.push_back(group(options_.metrics_address, "coordinator", "coordinator"));
    }
    for (const auto& [id, node] : nodes_) {
      if (node.info.state() != v1::NODE_STATE_ALIVE || node.info.metrics_address().empty()) continue;
      groups.push_back(group(node.info.metrics_address(), NodeRoleLabel(node.info.role()), id));
    }
    const std::string text = absl::StrCat("[\n", absl::StrJoin(groups, ",\n"), "\n]\n");
    if (text == targets_written_) return;
    if (absl::Status s = WriteFileAtomically(options_.prometheus_sd_file, text); !s.ok()) {
      LOG(ERROR) << "cannot write the Prometheus targets: " << s;
      return;
    }
    targets_written_ = text;
  }

  // Refreshes the gauges of jobs and nodes by state.
  void UpdateGauges() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    CoordinatorMetrics* m = options_.metrics;
    if (m == nullptr) return;
    std::map<v1::JobState, int> jobs;
    for (const auto& [id, record] : jobs_) ++jobs[record.job.state()];
    for (auto& [state, gauge] : m->jobs_by_state) gauge->Set(jobs[state]);
    std::map<std::pair<v1::NodeRole, v1::NodeState>, int> nodes;
    for (const auto& [id, node] : nodes_) ++nodes[{node.info.role(), node.info.state()}];
    for (auto& [key, gauge] : m->nodes_by_role_state) gauge->Set(nodes[key]);
    m->expiring.Sweep();
  }

  // Rewrites the log as one record per job once it has grown.
  void MaybeCompact() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (log_ == nullptr || log_->appended() <= 1000 + 2 * static_cast<int64_t>(jobs_.size())) {
      return;
    }
    std::vector<const v1::Job*> all;
    for (const std::string& id : order_) all.push_back(&jobs_.at(id).job);
    if (absl::Status s = log_->Compact(all); !s.ok()) LOG(ERROR) << "compaction: " << s;
  }

  // Rebuilds the tables from the log: pending jobs queue again, running jobs
  // wait for their nodes to come back (for one lease).
  void Recover(std::vector<v1::Job> jobs) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (v1::Job& job : jobs) {
      int64_t number = 0;
      if (absl::SimpleAtoi(job.id().substr(job.id().rfind('-') + 1), &number)) {
        job_counter_ = std::max(job_counter_, number);
      }
      const std::string id = job.id();
      JobRecord& record = jobs_[id];
      record.job = std::move(job);
      order_.push_back(id);
      if (record.job.state() == v1::JOB_STATE_PENDING) pending_.push_back(id);
      if (record.job.state() != v1::JOB_STATE_RUNNING) continue;
      running_.push_back(id);
      if (options_.metrics != nullptr) record.metrics = options_.metrics->BindJob(id);
      absl::StatusOr<v1::PartitionPlan> plan = PlanFor(record.job.spec());
      if (plan.ok()) record.plan = std::move(*plan);
      for (int s = 0; s < record.job.server_nodes_size(); ++s) {
        Await(record.job.server_nodes(s), v1::NODE_ROLE_SERVER,
              s < record.job.server_addresses_size() ? record.job.server_addresses(s) : "");
      }
      for (int w = 0; w < record.job.worker_nodes_size(); ++w) {
        if (!record.job.workers(w).finished()) {
          Await(record.job.worker_nodes(w), v1::NODE_ROLE_WORKER, "");
        }
      }
    }
    LOG(INFO) << "recovered " << jobs_.size() << " jobs (" << pending_.size() << " pending, "
              << running_.size() << " running) from " << options_.state_dir;
  }

  void Await(const std::string& id, v1::NodeRole role, const std::string& address)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    Node& node = nodes_[id];
    node.info.set_id(id);
    node.info.set_role(role);
    node.info.set_address(address);
    node.info.set_state(v1::NODE_STATE_AWAITED);
    node.last_heartbeat = absl::Now();
  }

  static absl::StatusOr<v1::PartitionPlan> PlanFor(const v1::JobSpec& spec) {
    return ComputePartitionPlan(kernels::ModelTensors(ModelShapeOf(spec)), spec.chunk_bytes(),
                                spec.num_servers());
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
    absl::MutexLock lock(&mu_);
    if (shut_down_) return absl::UnavailableError("coordinator shutting down");
    const std::string id = absl::StrFormat("job-%06d", job_counter_ + 1);
    JobRecord record;
    record.job.set_id(id);
    *record.job.mutable_spec() = std::move(spec);
    record.job.set_state(v1::JOB_STATE_PENDING);
    record.job.set_create_time_ms(NowMs());
    const int64_t total = TotalSteps(record.job.spec());
    const int64_t per_epoch = StepsPerEpoch(record.job.spec());
    record.job.mutable_progress()->set_total_steps(total);
    record.job.mutable_progress()->set_total_epochs(
        static_cast<int32_t>((total + per_epoch - 1) / per_epoch));
    // Acknowledged only once durable. In the tables first, so that a
    // compaction triggered by this append keeps it.
    JobRecord& stored = jobs_.emplace(id, std::move(record)).first->second;
    order_.push_back(id);
    if (absl::Status s = AppendToLog(stored.job); !s.ok()) {
      jobs_.erase(id);
      order_.pop_back();
      return absl::UnavailableError(absl::StrCat("cannot record the job: ", s.message()));
    }
    MaybeCompact();
    ++job_counter_;
    pending_.push_back(id);
    if (options_.metrics != nullptr) options_.metrics->jobs_submitted->Increment();
    LOG(INFO) << "job " << id << " submitted";
    Schedule();
    response->set_job_id(id);
    return absl::OkStatus();
  }

  // Pages are newest first; a token is the position in submission order
  // where the next page starts (going back), which new jobs do not shift.
  absl::Status List(const v1::ListJobsRequest& request, v1::ListJobsResponse* response) {
    const int page_size = request.page_size() > 0 ? std::min(request.page_size(), 1000) : 50;
    const std::set<int> states(request.states().begin(), request.states().end());
    absl::MutexLock lock(&mu_);
    int64_t next = static_cast<int64_t>(order_.size()) - 1;
    if (!request.page_token().empty() &&
        (!absl::SimpleAtoi(request.page_token(), &next) || next < -1 ||
         next >= static_cast<int64_t>(order_.size()))) {
      return absl::InvalidArgumentError("page_token: not a token from a previous response");
    }
    for (; next >= 0 && response->jobs_size() < page_size; --next) {
      const v1::Job& job = jobs_.at(order_[next]).job;
      if (states.empty() || states.contains(job.state())) *response->add_jobs() = job;
    }
    if (next >= 0) response->set_next_page_token(absl::StrCat(next));
    return absl::OkStatus();
  }

  absl::Status RegisterNode(const v1::RegisterRequest& request, v1::RegisterResponse* response) {
    if (request.role() != v1::NODE_ROLE_SERVER && request.role() != v1::NODE_ROLE_WORKER) {
      return absl::InvalidArgumentError("role: must be server or worker");
    }
    if (request.role() == v1::NODE_ROLE_SERVER && request.address().empty()) {
      return absl::InvalidArgumentError("address: a server must give its address");
    }
    if (request.max_memory_bytes() < 0) {
      return absl::InvalidArgumentError("max_memory_bytes: must be >= 0");
    }
    if (!IsHostPort(request.metrics_address())) {
      return absl::InvalidArgumentError("metrics_address: not a host:port");
    }
    absl::MutexLock lock(&mu_);
    // A node that had an id keeps it, unless a live node of another process
    // holds it.
    std::string id = request.node_id();
    bool reuse = IsNodeIdOfRole(id, request.role());
    if (reuse) {
      auto it = nodes_.find(id);
      reuse = it == nodes_.end() || it->second.info.state() != v1::NODE_STATE_ALIVE ||
              (it->second.info.pid() == request.pid() &&
               it->second.info.hostname() == request.hostname());
    }
    while (!reuse && (id.empty() || nodes_.contains(id))) {
      id = absl::StrFormat("%s%08x", RolePrefix(request.role()),
                           static_cast<uint32_t>(rng_()));
    }
    Node& node = nodes_[id];
    node.info.set_id(id);
    node.info.set_role(request.role());
    node.info.set_address(request.address());
    node.info.set_hostname(request.hostname());
    node.info.set_pid(request.pid());
    node.info.set_max_memory_bytes(request.max_memory_bytes());
    node.info.set_metrics_address(request.metrics_address());
    node.info.set_state(v1::NODE_STATE_ALIVE);
    node.info.set_last_heartbeat_ms(NowMs());
    node.last_heartbeat = absl::Now();
    LOG(INFO) << "node " << id << " registered (" << request.address() << ", pid "
              << request.pid() << ")";
    response->set_node_id(id);
    response->set_lease_ms(absl::ToInt64Milliseconds(options_.lease));
    response->set_heartbeat_interval_ms(absl::ToInt64Milliseconds(options_.heartbeat_interval));
    Schedule();
    WriteTargets();
    UpdateGauges();
    return absl::OkStatus();
  }

  absl::Status HeartbeatNode(const v1::HeartbeatRequest& request,
                             v1::HeartbeatResponse* response) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = nodes_.find(request.node_id());
    // An awaited node registers again, so that its details are known.
    if (it == nodes_.end() || it->second.info.state() == v1::NODE_STATE_AWAITED) {
      return absl::NotFoundError(absl::StrCat("unknown node '", request.node_id(), "'"));
    }
    Node& node = it->second;
    node.last_heartbeat = absl::Now();
    node.info.set_last_heartbeat_ms(NowMs());
    node.info.mutable_jobs()->Assign(request.held_jobs().begin(), request.held_jobs().end());
    if (node.info.state() == v1::NODE_STATE_LOST) {
      LOG(INFO) << "node " << node.info.id() << " is back";
      node.info.set_state(v1::NODE_STATE_ALIVE);
      Schedule();
      WriteTargets();
    }
    const std::set<std::string> held(request.held_jobs().begin(), request.held_jobs().end());
    for (const std::string& id : running_) {
      const JobRecord& record = jobs_.at(id);
      const v1::Job& job = record.job;
      if (node.info.role() == v1::NODE_ROLE_SERVER) {
        for (int s = 0; s < job.server_nodes_size(); ++s) {
          if (job.server_nodes(s) != node.info.id()) continue;
          v1::ServerAssignment* a = response->add_server_jobs();
          a->set_job_id(id);
          a->set_server_index(s);
          if (!held.contains(id)) {
            *a->mutable_spec() = job.spec();
            *a->mutable_plan() = record.plan;
          }
        }
      } else {
        for (int w = 0; w < job.worker_nodes_size(); ++w) {
          if (job.worker_nodes(w) != node.info.id() || job.workers(w).finished()) continue;
          v1::WorkerAssignment* a = response->add_worker_jobs();
          a->set_job_id(id);
          a->set_worker_index(w);
          if (!held.contains(id)) {
            *a->mutable_spec() = job.spec();
            *a->mutable_plan() = record.plan;
            *a->mutable_server_addresses() = job.server_addresses();
          }
        }
      }
    }
    return absl::OkStatus();
  }

  absl::Status Progress(const v1::ReportProgressRequest& r, v1::ReportProgressResponse* response)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = jobs_.find(r.job_id());
    if (it == jobs_.end()) return UnknownJob(r.job_id());
    JobRecord& record = it->second;
    v1::Job& job = record.job;
    if (job.state() != v1::JOB_STATE_RUNNING) {
      response->set_job_active(false);
      return absl::OkStatus();
    }
    if (r.worker() >= static_cast<uint32_t>(job.worker_nodes_size()) ||
        job.worker_nodes(r.worker()) != r.node_id()) {
      return absl::InvalidArgumentError(absl::StrCat("worker: node '", r.node_id(),
                                                     "' is not worker ", r.worker(), " of ",
                                                     r.job_id()));
    }
    response->set_job_active(true);
    if (!r.error().empty()) {
      SetState(record, v1::JOB_STATE_FAILED, absl::StrCat("worker ", r.worker(), ": ", r.error()));
      response->set_job_active(false);
      Schedule();
      return absl::OkStatus();
    }
    v1::WorkerStatus& worker = *job.mutable_workers(r.worker());
    // Progress sent before the final report may arrive after it.
    if (worker.finished()) return absl::OkStatus();
    worker.set_step(std::max(worker.step(), r.step()));
    worker.set_loss(r.loss());
    if (r.seconds() > 0) worker.set_samples_per_second(r.samples() / r.seconds());

    // The job's progress: the slowest worker's step, the mean of the
    // workers' latest losses and their summed throughput.
    v1::Progress& p = *job.mutable_progress();
    int64_t min_step = std::numeric_limits<int64_t>::max();
    double loss_sum = 0, rate = 0;
    int reported = 0;
    for (const v1::WorkerStatus& w : job.workers()) {
      min_step = std::min(min_step, w.step());
      if (w.step() > 0) {
        loss_sum += w.loss();
        ++reported;
      }
      if (!w.finished()) rate += w.samples_per_second();
    }
    p.set_step(min_step);
    if (record.metrics.has_value()) record.metrics->steps->Set(static_cast<double>(min_step));
    p.set_epoch(static_cast<int32_t>(
        std::min<int64_t>(min_step, std::max<int64_t>(p.total_steps() - 1, 0)) /
        StepsPerEpoch(job.spec())));
    p.set_loss(reported > 0 ? static_cast<float>(loss_sum / reported) : 0.0f);
    if (!r.finished()) p.set_samples_per_second(rate);
    v1::JobEvent event;
    event.set_time_ms(NowMs());
    *event.mutable_progress() = p;
    Publish(record, event);

    if (r.evaluated()) {
      if (record.metrics.has_value()) record.metrics->accuracy->Set(r.test_accuracy());
      job.mutable_result()->set_test_accuracy(r.test_accuracy());
      job.mutable_result()->set_test_loss(r.test_loss());
      v1::JobEvent eval;
      eval.set_time_ms(NowMs());
      eval.mutable_evaluation()->set_step(r.step());
      eval.mutable_evaluation()->set_test_accuracy(r.test_accuracy());
      eval.mutable_evaluation()->set_test_loss(r.test_loss());
      Publish(record, eval);
    }
    if (r.finished()) {
      worker.set_finished(true);
      worker.set_train_seconds(r.train_seconds());
      *worker.mutable_step_times() = r.step_times();
      if (std::all_of(job.workers().begin(), job.workers().end(),
                      [](const v1::WorkerStatus& w) { return w.finished(); })) {
        Complete(record);
      } else {
        Persist(record);
      }
    }
    return absl::OkStatus();
  }

  void Complete(JobRecord& record) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    v1::Job& job = record.job;
    v1::JobResult& result = *job.mutable_result();
    double seconds = 0, loss = 0;
    v1::StepTimes& times = *result.mutable_step_times();
    times.Clear();
    const double n = job.workers_size();
    for (const v1::WorkerStatus& w : job.workers()) {
      seconds = std::max(seconds, w.train_seconds());
      loss += w.loss();
      times.set_compute_seconds(times.compute_seconds() + w.step_times().compute_seconds() / n);
      times.set_reduce_seconds(times.reduce_seconds() + w.step_times().reduce_seconds() / n);
      times.set_push_seconds(times.push_seconds() + w.step_times().push_seconds() / n);
      times.set_wait_seconds(times.wait_seconds() + w.step_times().wait_seconds() / n);
      times.set_pull_seconds(times.pull_seconds() + w.step_times().pull_seconds() / n);
    }
    const int64_t steps = TotalSteps(job.spec());
    result.set_steps(steps);
    result.set_train_seconds(seconds);
    const double samples =
        static_cast<double>(steps) * job.spec().num_workers() * job.spec().batch_size();
    result.set_samples_per_second(seconds > 0 ? samples / seconds : 0);
    result.set_final_loss(static_cast<float>(loss / job.workers_size()));
    job.mutable_progress()->set_samples_per_second(result.samples_per_second());
    v1::JobEvent event;
    event.set_time_ms(NowMs());
    *event.mutable_completed() = result;
    Publish(record, event);
    SetState(record, v1::JOB_STATE_SUCCEEDED, "");
    Schedule();
  }

  void Publish(JobRecord& record, const v1::JobEvent& event, bool last = false)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::erase_if(record.watchers, [](const auto& w) { return w->Gone(); });
    for (auto& w : record.watchers) w->Publish(event, last);
  }

  // Changes the state durably and tells the watchers.
  void SetState(JobRecord& record, v1::JobState state, const std::string& reason)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    v1::Job& job = record.job;
    const v1::JobState old = job.state();
    job.set_state(state);
    job.set_reason(reason);
    if (state == v1::JOB_STATE_RUNNING) job.set_start_time_ms(NowMs());
    if (IsTerminal(state)) job.set_end_time_ms(NowMs());
    if (old == v1::JOB_STATE_PENDING) std::erase(pending_, job.id());
    if (old == v1::JOB_STATE_RUNNING) std::erase(running_, job.id());
    if (state == v1::JOB_STATE_RUNNING) running_.push_back(job.id());
    Persist(record);
    if (CoordinatorMetrics* m = options_.metrics; m != nullptr) {
      if (state == v1::JOB_STATE_RUNNING && !record.metrics.has_value()) {
        record.metrics = m->BindJob(job.id());
      }
      if (IsTerminal(state)) {
        if (record.metrics.has_value()) record.metrics->running->Set(0);
        record.metrics.reset();  // the series expire after the grace period
        m->ended_by_state[state]->Increment();
        m->expiring.JobEnded(job.id());
      }
    }
    UpdateGauges();
    LOG(INFO) << "job " << job.id() << " " << StateName(old) << " -> " << StateName(state)
              << (reason.empty() ? "" : ": ") << reason;
    v1::JobEvent event;
    event.set_time_ms(NowMs());
    event.mutable_state()->set_state(state);
    event.mutable_state()->set_reason(reason);
    Publish(record, event, IsTerminal(state));
    if (IsTerminal(state)) record.watchers.clear();
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

  // Starts every pending job, oldest first, for which enough live nodes are
  // free: a worker runs one job at a time; a server holds several jobs as
  // long as their state fits in its max_memory_bytes.
  void Schedule() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (pending_.empty()) return;
    std::set<std::string> busy;
    for (const std::string& id : running_) {
      const v1::Job& job = jobs_.at(id).job;
      busy.insert(job.worker_nodes().begin(), job.worker_nodes().end());
    }
    std::map<std::string, int64_t> reserved = ReservedBytes();
    const std::vector<std::string> pending = pending_;
    for (const std::string& id : pending) {
      JobRecord& record = jobs_.at(id);
      v1::Job& job = record.job;
      const v1::JobSpec& spec = job.spec();
      std::vector<const Node*> workers, servers;
      for (const auto& [node_id, node] : nodes_) {
        if (node.info.state() != v1::NODE_STATE_ALIVE) continue;
        if (node.info.role() == v1::NODE_ROLE_WORKER && !busy.contains(node_id)) {
          workers.push_back(&node);
        } else if (node.info.role() == v1::NODE_ROLE_SERVER) {
          servers.push_back(&node);
        }
      }
      if (static_cast<int>(workers.size()) < spec.num_workers()) {
        job.set_reason(absl::StrCat("waiting for ", spec.num_workers(), " free workers (",
                                    workers.size(), " free)"));
        continue;
      }
      if (static_cast<int>(servers.size()) < spec.num_servers()) {
        job.set_reason(absl::StrCat("waiting for ", spec.num_servers(), " servers (",
                                    servers.size(), " alive)"));
        continue;
      }
      if (record.plan.chunks_size() == 0) {
        absl::StatusOr<v1::PartitionPlan> plan = PlanFor(spec);
        if (!plan.ok()) {
          SetState(record, v1::JOB_STATE_FAILED, std::string(plan.status().message()));
          continue;
        }
        record.plan = std::move(*plan);
      }
      // The largest shard first, each on the server with the most room.
      std::vector<int> order(spec.num_servers());
      std::vector<int64_t> need(spec.num_servers());
      for (int s = 0; s < spec.num_servers(); ++s) {
        order[s] = s;
        need[s] = ShardStore::BytesNeeded(spec, record.plan, s);
      }
      std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return need[a] > need[b]; });
      auto room = [&](const Node* n) {
        return n->info.max_memory_bytes() == 0 ? std::numeric_limits<int64_t>::max()
                                               : n->info.max_memory_bytes() - reserved[n->info.id()];
      };
      std::vector<const Node*> chosen(spec.num_servers(), nullptr);
      std::set<const Node*> taken;
      bool fits = true;
      for (int s : order) {
        const Node* best = nullptr;
        for (const Node* n : servers) {
          if (taken.contains(n) || room(n) < need[s]) continue;
          if (best == nullptr || room(n) > room(best)) best = n;
        }
        if (best == nullptr) {
          fits = false;
          job.set_reason(absl::StrCat("waiting for room: a shard needs ", MegaBytes(need[s]),
                                      " on a server"));
          break;
        }
        chosen[s] = best;
        taken.insert(best);
      }
      if (!fits) continue;
      job.clear_server_nodes();
      job.clear_server_addresses();
      job.clear_worker_nodes();
      job.clear_workers();
      for (int s = 0; s < spec.num_servers(); ++s) {
        job.add_server_nodes(chosen[s]->info.id());
        job.add_server_addresses(chosen[s]->info.address());
        reserved[chosen[s]->info.id()] += need[s];
      }
      for (int w = 0; w < spec.num_workers(); ++w) {
        job.add_worker_nodes(workers[w]->info.id());
        busy.insert(workers[w]->info.id());
        v1::WorkerStatus* status = job.add_workers();
        status->set_worker(w);
        status->set_node_id(workers[w]->info.id());
      }
      SetState(record, v1::JOB_STATE_RUNNING, "");
    }
  }

  // Whether a running job still depends on the node: any of its servers, a
  // worker that has not finished.
  static bool NeedsNode(const v1::Job& job, const std::string& id) {
    const auto& servers = job.server_nodes();
    if (std::find(servers.begin(), servers.end(), id) != servers.end()) return true;
    for (int w = 0; w < job.worker_nodes_size(); ++w) {
      if (job.worker_nodes(w) == id && !job.workers(w).finished()) return true;
    }
    return false;
  }

  void LeaseLoop() {
    const absl::Duration tick = std::max(absl::Milliseconds(100), options_.lease / 20);
    absl::MutexLock lock(&mu_);
    while (!mu_.AwaitWithTimeout(absl::Condition(&shut_down_), tick)) {
      const absl::Time now = absl::Now();
      for (auto& [id, node] : nodes_) {
        if (node.info.state() == v1::NODE_STATE_LOST || now - node.last_heartbeat <= options_.lease) {
          continue;
        }
        const std::string why =
            node.info.state() == v1::NODE_STATE_AWAITED
                ? absl::StrCat("node ", id, " did not come back within ",
                               absl::FormatDuration(options_.lease), " of a coordinator restart")
                : absl::StrCat("node ", id, " lost: no heartbeat for ",
                               absl::FormatDuration(now - node.last_heartbeat));
        node.info.set_state(v1::NODE_STATE_LOST);
        node.info.clear_jobs();
        LOG(WARNING) << why;
        lost_since_[id] = now;
        const std::vector<std::string> running = running_;
        for (const std::string& job_id : running) {
          JobRecord& record = jobs_.at(job_id);
          if (NeedsNode(record.job, id)) SetState(record, v1::JOB_STATE_FAILED, why);
        }
      }
      WriteTargets();
      UpdateGauges();
      // Forget nodes lost long ago.
      for (auto it = lost_since_.begin(); it != lost_since_.end();) {
        auto node = nodes_.find(it->first);
        if (node == nodes_.end() || node->second.info.state() != v1::NODE_STATE_LOST) {
          it = lost_since_.erase(it);
        } else if (now - it->second > kForgetLostNodesAfter) {
          nodes_.erase(node);
          it = lost_since_.erase(it);
        } else {
          ++it;
        }
      }
      Schedule();
    }
  }

  const Options options_;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
  std::thread lease_thread_;

  absl::Mutex mu_;
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
  std::unique_ptr<JobLog> log_ ABSL_GUARDED_BY(mu_);
  std::mt19937_64 rng_ ABSL_GUARDED_BY(mu_);
  int64_t job_counter_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<std::string, Node> nodes_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, absl::Time> lost_since_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, JobRecord> jobs_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> order_ ABSL_GUARDED_BY(mu_);    // by submission
  std::vector<std::string> pending_ ABSL_GUARDED_BY(mu_);  // oldest first
  std::vector<std::string> running_ ABSL_GUARDED_BY(mu_);
  // Model files, without a state directory.
  std::map<std::string, std::shared_ptr<const std::string>> models_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> uploading_ ABSL_GUARDED_BY(mu_);
  std::string targets_written_ ABSL_GUARDED_BY(mu_);
};

void ModelUpload::OnReadDone(bool ok) {
  if (!ok) {  // the client is done sending
    Finish(ToGrpcStatus(began_ ? coordinator_->StoreModel(job_id_, std::move(data_))
                               : absl::InvalidArgumentError("empty upload")));
    return;
  }
  if (first_) {
    first_ = false;
    node_id_ = request_.node_id();
    job_id_ = request_.job_id();
    absl::StatusOr<int64_t> limit = coordinator_->BeginUpload(node_id_, job_id_);
    if (!limit.ok()) {
      Finish(ToGrpcStatus(limit.status()));
      return;
    }
    began_ = true;
    limit_ = *limit;
  }
  if (static_cast<int64_t>(data_.size() + request_.data().size()) > limit_) {
    Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "model file larger than the model"));
    return;
  }
  data_ += request_.data();
  StartRead(&request_);
}

void ModelUpload::OnDone() {
  if (began_) coordinator_->EndUpload(job_id_);
  delete this;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Coordinator>> Coordinator::Create(Options options) {
  auto coordinator = std::make_unique<CoordinatorImpl>(std::move(options));
  PSTRAIN_RETURN_IF_ERROR(coordinator->Start());
  return coordinator;
}

}  // namespace pstrain::server
