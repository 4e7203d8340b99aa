// Membership (pstrain.v1.Membership): how servers and workers join and stay
// in the cluster. Register takes a node id (node_registry.h); Heartbeat
// keeps its lease, carries what a server holds (its checkpoints, failed
// loads, errors) and answers with the node's assignments, the jobs it must
// hold or run at their generation; ReportProgress turns a worker's reports
// into its job's progress and result; Session keeps a stream open for as
// long as the node's process lives; UploadModel takes worker 0's final
// model. Every call is checked against the access policy (a node's
// certificate names its id).
#ifndef PSTRAIN_SERVER_MEMBERSHIP_SERVICE_H_
#define PSTRAIN_SERVER_MEMBERSHIP_SERVICE_H_

#include "pstrain/v1/membership.grpc.pb.h"
#include "server/access.h"
#include "server/control_loop.h"
#include "server/coordinator_state.h"
#include "server/model_store.h"
#include "server/node_session.h"

namespace pstrain::server {

class MembershipService final : public v1::Membership::CallbackService,
                                public ModelUploadHandler,
                                public NodeSession::Owner {
 public:
  // All must outlive the service.
  MembershipService(CoordinatorState* state, ControlLoop* loop, const AccessPolicy* access)
      : state_(*state), loop_(*loop), access_(*access) {}

  grpc::ServerUnaryReactor* Register(grpc::CallbackServerContext* ctx,
                                     const v1::RegisterRequest* request,
                                     v1::RegisterResponse* response) override;
  grpc::ServerUnaryReactor* Heartbeat(grpc::CallbackServerContext* ctx,
                                      const v1::HeartbeatRequest* request,
                                      v1::HeartbeatResponse* response) override;
  grpc::ServerUnaryReactor* ReportProgress(grpc::CallbackServerContext* ctx,
                                           const v1::ReportProgressRequest* request,
                                           v1::ReportProgressResponse* response) override;
  grpc::ServerReadReactor<v1::UploadModelRequest>* UploadModel(
      grpc::CallbackServerContext* ctx, v1::UploadModelResponse* response) override;
  grpc::ServerWriteReactor<v1::SessionEvent>* Session(grpc::CallbackServerContext* ctx,
                                                      const v1::SessionRequest* request) override;

  // ModelUploadHandler: worker 0's model, one upload per job at a time.
  absl::StatusOr<Upload> BeginUpload(const std::string& node_id, const std::string& job_id,
                                     std::function<void()> cancel) override;
  absl::Status FinishUpload(const std::string& job_id, uint64_t upload,
                            std::string bytes) override;
  void EndUpload(const std::string& job_id, uint64_t upload) override;

  // NodeSession::Owner.
  void SessionClosed(NodeSession* session) override;
  void SessionDone(NodeSession* session) override;

 private:
  // Keeps a server's reports of its jobs' checkpoints, failed loads and
  // errors for the control loop; true if there is news for it.
  bool RecordHeld(const v1::HeartbeatRequest& request) ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_.mu);
  // The jobs a node must hold (servers) or run (workers) now, at their
  // generation; spec and plan for those it does not hold at it yet, within
  // the reply's budget (a job left out comes in a later heartbeat).
  void Assignments(const v1::HeartbeatRequest& request, v1::HeartbeatResponse* response)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_.mu);
  // A worker's report, on `txn`: its progress, its checkpoint states, its
  // failure; the job's result once every worker has finished. `active`:
  // whether the worker should go on.
  absl::Status Progress(Txn& txn, const v1::ReportProgressRequest& r, bool* active)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_.mu);

  CoordinatorState& state_;
  ControlLoop& loop_;
  const AccessPolicy& access_;
};

}  // namespace pstrain::server

#endif  // PSTRAIN_SERVER_MEMBERSHIP_SERVICE_H_
