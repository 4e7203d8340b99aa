#include "server/coordinator.h"

#include <algorithm>
#include <deque>
#include <map>
#include <set>
#include <thread>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "common/job_spec.h"
#include "common/partition.h"
#include "common/rpc.h"
#include "common/status.h"
#include "glog/logging.h"
#include "pstrain/v1/control.grpc.pb.h"
#include "pstrain/v1/membership.grpc.pb.h"

namespace pstrain::server {
namespace {

int64_t NowMs() { return absl::ToUnixMillis(absl::Now()); }

bool IsTerminal(v1::JobState s) {
  return s == v1::JOB_STATE_SUCCEEDED || s == v1::JOB_STATE_FAILED ||
         s == v1::JOB_STATE_CANCELLED;
}

std::string StateName(v1::JobState s) {
  std::string name = v1::JobState_Name(s);
  return absl::AsciiStrToLower(name.substr(std::string("JOB_STATE_").size()));
}

class JobWatch;

// The queue of one WatchJob stream, shared between the reactor and the job
// record that publishes to it; outlives the reactor.
class WatchQueue {
 public:
  explicit WatchQueue(JobWatch* reactor, size_t max_queued)
      : reactor_(reactor), max_queued_(max_queued) {}

  // Queues an event; `last` ends the stream once it is written.
  void Publish(const v1::JobEvent& event, bool last);
  // Ends the stream with `status` after the events already queued.
  void End(const grpc::Status& status);
  void WriteDone(bool ok);
  void Detach() {
    absl::MutexLock lock(&mu_);
    reactor_ = nullptr;
  }
  bool Gone() const {
    absl::MutexLock lock(&mu_);
    return reactor_ == nullptr || ended_;
  }

 private:
  // Starts the next write or the finish, outside the lock.
  void Next();
  // Drops the events not yet written; the one being written stays until its
  // write completes.
  void DropQueued() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    queue_.erase(writing_ ? queue_.begin() + 1 : queue_.begin(), queue_.end());
  }

  mutable absl::Mutex mu_;
  JobWatch* reactor_ ABSL_GUARDED_BY(mu_);
  const size_t max_queued_;
  std::deque<v1::JobEvent> queue_ ABSL_GUARDED_BY(mu_);
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool ended_ ABSL_GUARDED_BY(mu_) = false;  // no more events accepted
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  grpc::Status status_ ABSL_GUARDED_BY(mu_);
};

class JobWatch final : public grpc::ServerWriteReactor<v1::JobEvent> {
 public:
  explicit JobWatch(size_t max_queued) : queue_(std::make_shared<WatchQueue>(this, max_queued)) {}
  std::shared_ptr<WatchQueue> queue() { return queue_; }
  void OnWriteDone(bool ok) override { queue_->WriteDone(ok); }
  void OnCancel() override { queue_->End(grpc::Status::CANCELLED); }
  void OnDone() override {
    queue_->Detach();
    delete this;
  }

 private:
  std::shared_ptr<WatchQueue> queue_;
};

void WatchQueue::Publish(const v1::JobEvent& event, bool last) {
  {
    absl::MutexLock lock(&mu_);
    if (ended_ || reactor_ == nullptr) return;
    // A watcher that falls far behind loses progress events, never state.
    if (queue_.size() >= max_queued_ && event.has_progress()) return;
    queue_.push_back(event);
    if (last) {
      ended_ = true;
      status_ = grpc::Status::OK;
    }
  }
  Next();
}

void WatchQueue::End(const grpc::Status& status) {
  {
    absl::MutexLock lock(&mu_);
    if (ended_) return;
    ended_ = true;
    status_ = status;
    if (!status.ok()) DropQueued();
  }
  Next();
}

void WatchQueue::WriteDone(bool ok) {
  {
    absl::MutexLock lock(&mu_);
    writing_ = false;
    queue_.pop_front();
    if (!ok) {
      ended_ = true;
      status_ = grpc::Status::CANCELLED;
      DropQueued();
    }
  }
  Next();
}

void WatchQueue::Next() {
  JobWatch* reactor;
  const v1::JobEvent* event = nullptr;
  grpc::Status status;
  {
    absl::MutexLock lock(&mu_);
    if (writing_ || finished_ || reactor_ == nullptr) return;
    reactor = reactor_;
    if (!queue_.empty()) {
      writing_ = true;
      event = &queue_.front();
    } else if (ended_) {
      finished_ = true;
      status = status_;
    } else {
      return;
    }
  }
  // Neither call can lead to OnDone before it returns.
  if (event != nullptr) {
    reactor->StartWrite(event);
  } else {
    reactor->Finish(status);
  }
}

struct Node {
  std::string id;
  v1::NodeRole role = v1::NODE_ROLE_UNSPECIFIED;
  std::string address;
  std::string hostname;
  int pid = 0;
  absl::Time last_heartbeat;
  bool lost = false;
};

struct WorkerRun {
  int64_t step = 0;
  float loss = 0;
  bool reported = false;
  double samples_per_second = 0;
  bool finished = false;
  double train_seconds = 0;
};

struct JobRecord {
  v1::Job job;
  v1::PartitionPlan plan;
  std::vector<std::string> server_addresses;
  std::vector<WorkerRun> runs;
  std::vector<std::shared_ptr<WatchQueue>> watchers;
};

class CoordinatorImpl final : public Coordinator,
                              public v1::Control::CallbackService,
                              public v1::Membership::CallbackService {
 public:
  explicit CoordinatorImpl(Options options) : options_(std::move(options)) {}
  ~CoordinatorImpl() override { Shutdown(absl::Seconds(1)); }

  absl::Status Start() {
    grpc::ServerBuilder builder;
    ConfigureServerBuilder(builder);
    int port = 0;
    builder.AddListeningPort(options_.listen_address, grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(static_cast<v1::Control::CallbackService*>(this));
    builder.RegisterService(static_cast<v1::Membership::CallbackService*>(this));
    server_ = builder.BuildAndStart();
    if (server_ == nullptr || port == 0) {
      return absl::UnavailableError(absl::StrCat("cannot listen on ", options_.listen_address));
    }
    const std::string host = options_.listen_address.substr(0, options_.listen_address.rfind(':'));
    address_ = absl::StrCat(host, ":", port);
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
    auto* reactor = ctx->DefaultReactor();
    reactor->Finish(ToGrpcStatus(Submit(*request, response)));
    return reactor;
  }

  grpc::ServerUnaryReactor* GetJob(grpc::CallbackServerContext* ctx,
                                   const v1::GetJobRequest* request, v1::Job* response) override {
    auto* reactor = ctx->DefaultReactor();
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(request->job_id());
    if (it == jobs_.end()) {
      reactor->Finish(ToGrpcStatus(UnknownJob(request->job_id())));
    } else {
      *response = it->second.job;
      reactor->Finish(grpc::Status::OK);
    }
    return reactor;
  }

  grpc::ServerUnaryReactor* ListJobs(grpc::CallbackServerContext* ctx,
                                     const v1::ListJobsRequest* request,
                                     v1::ListJobsResponse* response) override {
    auto* reactor = ctx->DefaultReactor();
    reactor->Finish(ToGrpcStatus(List(*request, response)));
    return reactor;
  }

  grpc::ServerUnaryReactor* CancelJob(grpc::CallbackServerContext* ctx,
                                      const v1::CancelJobRequest* request,
                                      v1::Job* response) override {
    auto* reactor = ctx->DefaultReactor();
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(request->job_id());
    if (it == jobs_.end()) {
      reactor->Finish(ToGrpcStatus(UnknownJob(request->job_id())));
      return reactor;
    }
    if (!IsTerminal(it->second.job.state())) {
      SetState(it->second, v1::JOB_STATE_CANCELLED, "cancelled by request");
      Schedule();
    }
    *response = it->second.job;
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }

  grpc::ServerWriteReactor<v1::JobEvent>* WatchJob(grpc::CallbackServerContext* ctx,
                                                   const v1::WatchJobRequest* request) override {
    auto* watch = new JobWatch(options_.max_queued_events);
    std::shared_ptr<WatchQueue> queue = watch->queue();
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
        record.watchers.push_back(queue);
      }
    }
    return watch;
  }

  // ---- Membership ----

  grpc::ServerUnaryReactor* Register(grpc::CallbackServerContext* ctx,
                                     const v1::RegisterRequest* request,
                                     v1::RegisterResponse* response) override {
    auto* reactor = ctx->DefaultReactor();
    if (request->role() != v1::NODE_ROLE_SERVER && request->role() != v1::NODE_ROLE_WORKER) {
      reactor->Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                   "role: must be server or worker"));
      return reactor;
    }
    if (request->role() == v1::NODE_ROLE_SERVER && request->address().empty()) {
      reactor->Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                   "address: a server must give its address"));
      return reactor;
    }
    absl::MutexLock lock(&mu_);
    Node node;
    node.id = absl::StrFormat("%s-%d", request->role() == v1::NODE_ROLE_SERVER ? "server" : "worker",
                              ++node_counter_);
    node.role = request->role();
    node.address = request->address();
    node.hostname = request->hostname();
    node.pid = request->pid();
    node.last_heartbeat = absl::Now();
    LOG(INFO) << "node " << node.id << " registered (" << node.address << ", pid " << node.pid
              << ")";
    response->set_node_id(node.id);
    response->set_lease_ms(absl::ToInt64Milliseconds(options_.lease));
    response->set_heartbeat_interval_ms(absl::ToInt64Milliseconds(options_.heartbeat_interval));
    nodes_.emplace(node.id, std::move(node));
    Schedule();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }

  grpc::ServerUnaryReactor* Heartbeat(grpc::CallbackServerContext* ctx,
                                      const v1::HeartbeatRequest* request,
                                      v1::HeartbeatResponse* response) override {
    auto* reactor = ctx->DefaultReactor();
    absl::MutexLock lock(&mu_);
    auto it = nodes_.find(request->node_id());
    if (it == nodes_.end()) {
      reactor->Finish(grpc::Status(grpc::StatusCode::NOT_FOUND,
                                   absl::StrCat("unknown node '", request->node_id(), "'")));
      return reactor;
    }
    Node& node = it->second;
    node.last_heartbeat = absl::Now();
    if (node.lost) {
      LOG(INFO) << "node " << node.id << " is back";
      node.lost = false;
      Schedule();
    }
    const std::set<std::string> held(request->held_jobs().begin(), request->held_jobs().end());
    for (const std::string& id : running_) {
      const JobRecord& record = jobs_.at(id);
      const v1::Job& job = record.job;
      if (node.role == v1::NODE_ROLE_SERVER) {
        for (int s = 0; s < job.server_nodes_size(); ++s) {
          if (job.server_nodes(s) != node.id) continue;
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
          if (job.worker_nodes(w) != node.id || record.runs[w].finished) continue;
          v1::WorkerAssignment* a = response->add_worker_jobs();
          a->set_job_id(id);
          a->set_worker_index(w);
          if (!held.contains(id)) {
            *a->mutable_spec() = job.spec();
            *a->mutable_plan() = record.plan;
            for (const std::string& address : record.server_addresses) {
              a->add_server_addresses(address);
            }
          }
        }
      }
    }
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }

  grpc::ServerUnaryReactor* ReportProgress(grpc::CallbackServerContext* ctx,
                                           const v1::ReportProgressRequest* request,
                                           v1::ReportProgressResponse* response) override {
    auto* reactor = ctx->DefaultReactor();
    absl::MutexLock lock(&mu_);
    reactor->Finish(ToGrpcStatus(Progress(*request, response)));
    return reactor;
  }

 private:
  static absl::Status UnknownJob(const std::string& id) {
    return absl::NotFoundError(absl::StrCat("job_id: no job '", id, "'"));
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
    const std::string id = absl::StrFormat("job-%06d", ++job_counter_);
    JobRecord& record = jobs_[id];
    record.job.set_id(id);
    *record.job.mutable_spec() = std::move(spec);
    record.job.set_state(v1::JOB_STATE_PENDING);
    record.job.set_create_time_ms(NowMs());
    record.job.mutable_progress()->set_total_steps(TotalSteps(record.job.spec()));
    record.job.mutable_progress()->set_total_epochs(static_cast<int32_t>(
        (TotalSteps(record.job.spec()) + StepsPerEpoch(record.job.spec()) - 1) /
        StepsPerEpoch(record.job.spec())));
    order_.push_back(id);
    pending_.push_back(id);
    LOG(INFO) << "job " << id << " submitted";
    Schedule();
    response->set_job_id(id);
    return absl::OkStatus();
  }

  absl::Status List(const v1::ListJobsRequest& request, v1::ListJobsResponse* response) {
    const int page_size = request.page_size() > 0 ? std::min(request.page_size(), 1000) : 50;
    size_t start = 0;  // index from the newest
    if (!request.page_token().empty() && !absl::SimpleAtoi(request.page_token(), &start)) {
      return absl::InvalidArgumentError("page_token: not a token from a previous response");
    }
    const std::set<int> states(request.states().begin(), request.states().end());
    absl::MutexLock lock(&mu_);
    size_t i = start;
    for (; i < order_.size() && response->jobs_size() < page_size; ++i) {
      const v1::Job& job = jobs_.at(order_[order_.size() - 1 - i]).job;
      if (states.empty() || states.contains(job.state())) *response->add_jobs() = job;
    }
    if (i < order_.size()) response->set_next_page_token(absl::StrCat(i));
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
    WorkerRun& run = record.runs[r.worker()];
    // Progress sent before the final report may arrive after it.
    if (run.finished) return absl::OkStatus();
    run.step = std::max(run.step, r.step());
    run.loss = r.loss();
    run.reported = true;
    if (r.seconds() > 0) run.samples_per_second = r.samples() / r.seconds();

    v1::WorkerStatus& status = *job.mutable_workers(r.worker());
    status.set_step(run.step);
    status.set_loss(run.loss);
    status.set_finished(r.finished());

    // The job's progress: the slowest worker's step, the workers' mean loss
    // and their summed throughput.
    v1::Progress& p = *job.mutable_progress();
    int64_t min_step = INT64_MAX;
    double loss_sum = 0, rate = 0;
    int reported = 0;
    for (const WorkerRun& w : record.runs) {
      min_step = std::min(min_step, w.step);
      if (w.reported) {
        loss_sum += w.loss;
        ++reported;
      }
      if (!w.finished) rate += w.samples_per_second;
    }
    p.set_step(min_step);
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
      run.finished = true;
      run.train_seconds = r.train_seconds();
      if (std::all_of(record.runs.begin(), record.runs.end(),
                      [](const WorkerRun& w) { return w.finished; })) {
        Complete(record);
      }
    }
    return absl::OkStatus();
  }

  void Complete(JobRecord& record) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    v1::Job& job = record.job;
    v1::JobResult& result = *job.mutable_result();
    double seconds = 0, loss = 0;
    for (const WorkerRun& w : record.runs) {
      seconds = std::max(seconds, w.train_seconds);
      loss += w.loss;
    }
    const int64_t steps = TotalSteps(job.spec());
    result.set_steps(steps);
    result.set_train_seconds(seconds);
    const double samples =
        static_cast<double>(steps) * job.spec().num_workers() * job.spec().batch_size();
    result.set_samples_per_second(seconds > 0 ? samples / seconds : 0);
    result.set_final_loss(static_cast<float>(loss / record.runs.size()));
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
    LOG(INFO) << "job " << job.id() << " " << StateName(old) << " -> " << StateName(state)
              << (reason.empty() ? "" : ": ") << reason;
    v1::JobEvent event;
    event.set_time_ms(NowMs());
    event.mutable_state()->set_state(state);
    event.mutable_state()->set_reason(reason);
    Publish(record, event, IsTerminal(state));
    if (IsTerminal(state)) record.watchers.clear();
  }

  // Starts every pending job, oldest first, for which enough live nodes are
  // free: a worker runs one job at a time; servers may hold several.
  void Schedule() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (pending_.empty()) return;
    std::set<std::string> busy;
    std::map<std::string, int> server_load;
    for (const std::string& id : running_) {
      const v1::Job& job = jobs_.at(id).job;
      busy.insert(job.worker_nodes().begin(), job.worker_nodes().end());
      for (const std::string& s : job.server_nodes()) ++server_load[s];
    }
    const std::vector<std::string> pending = pending_;
    for (const std::string& id : pending) {
      JobRecord& record = jobs_.at(id);
      const v1::JobSpec& spec = record.job.spec();
      std::vector<const Node*> workers, servers;
      for (const auto& [node_id, node] : nodes_) {
        if (node.lost) continue;
        if (node.role == v1::NODE_ROLE_WORKER && !busy.contains(node_id)) {
          workers.push_back(&node);
        } else if (node.role == v1::NODE_ROLE_SERVER) {
          servers.push_back(&node);
        }
      }
      if (static_cast<int>(workers.size()) < spec.num_workers() ||
          static_cast<int>(servers.size()) < spec.num_servers()) {
        continue;
      }
      std::stable_sort(servers.begin(), servers.end(), [&](const Node* a, const Node* b) {
        return server_load[a->id] < server_load[b->id];
      });
      absl::StatusOr<v1::PartitionPlan> plan = ComputePartitionPlan(
          kernels::ModelTensors(ModelShapeOf(spec)), spec.chunk_bytes(), spec.num_servers());
      if (!plan.ok()) {
        SetState(record, v1::JOB_STATE_FAILED, std::string(plan.status().message()));
        continue;
      }
      record.plan = std::move(*plan);
      v1::Job& job = record.job;
      for (int s = 0; s < spec.num_servers(); ++s) {
        job.add_server_nodes(servers[s]->id);
        record.server_addresses.push_back(servers[s]->address);
        ++server_load[servers[s]->id];
      }
      record.runs.assign(spec.num_workers(), WorkerRun{});
      for (int w = 0; w < spec.num_workers(); ++w) {
        job.add_worker_nodes(workers[w]->id);
        busy.insert(workers[w]->id);
        v1::WorkerStatus* status = job.add_workers();
        status->set_worker(w);
        status->set_node_id(workers[w]->id);
      }
      SetState(record, v1::JOB_STATE_RUNNING, "");
    }
  }

  void LeaseLoop() {
    const absl::Duration tick = std::max(absl::Milliseconds(100), options_.lease / 20);
    absl::MutexLock lock(&mu_);
    while (!mu_.AwaitWithTimeout(absl::Condition(&shut_down_), tick)) {
      const absl::Time now = absl::Now();
      for (auto& [id, node] : nodes_) {
        if (node.lost || now - node.last_heartbeat <= options_.lease) continue;
        node.lost = true;
        const std::string why = absl::StrCat("node ", id, " lost: no heartbeat for ",
                                             absl::FormatDuration(now - node.last_heartbeat));
        LOG(WARNING) << why;
        const std::vector<std::string> running = running_;
        for (const std::string& job_id : running) {
          JobRecord& record = jobs_.at(job_id);
          const auto& s = record.job.server_nodes();
          const auto& w = record.job.worker_nodes();
          if (std::find(s.begin(), s.end(), id) != s.end() ||
              std::find(w.begin(), w.end(), id) != w.end()) {
            SetState(record, v1::JOB_STATE_FAILED, why);
          }
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
  int64_t job_counter_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t node_counter_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<std::string, Node> nodes_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, JobRecord> jobs_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> order_ ABSL_GUARDED_BY(mu_);    // by submission
  std::vector<std::string> pending_ ABSL_GUARDED_BY(mu_);  // oldest first
  std::vector<std::string> running_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

absl::StatusOr<std::unique_ptr<Coordinator>> Coordinator::Create(Options options) {
  auto coordinator = std::make_unique<CoordinatorImpl>(std::move(options));
  PSTRAIN_RETURN_IF_ERROR(coordinator->Start());
  return coordinator;
}

}  // namespace pstrain::server
