// The control API (pstrain.v1.Control): submit, get, list, cancel and watch
// jobs, list nodes, export a model, ask for a checkpoint. Users call it,
// psctl above all; every call is checked against the access policy first
// (a viewer's token reads, an operator's changes). Changes go through the
// state's Commit: a submitted or cancelled job is durable before the call
// returns.
#ifndef PSTRAIN_SERVER_CONTROL_SERVICE_H_
#define PSTRAIN_SERVER_CONTROL_SERVICE_H_

#include "pstrain/v1/control.grpc.pb.h"
#include "server/access.h"
#include "server/coordinator_state.h"

namespace pstrain::server {

class ControlService final : public v1::Control::CallbackService {
 public:
  // Both must outlive the service.
  ControlService(CoordinatorState* state, const AccessPolicy* access)
      : state_(*state), access_(*access) {}

  grpc::ServerUnaryReactor* SubmitJob(grpc::CallbackServerContext* ctx,
                                      const v1::SubmitJobRequest* request,
                                      v1::SubmitJobResponse* response) override;
  grpc::ServerUnaryReactor* GetJob(grpc::CallbackServerContext* ctx,
                                   const v1::GetJobRequest* request, v1::Job* response) override;
  grpc::ServerUnaryReactor* ListJobs(grpc::CallbackServerContext* ctx,
                                     const v1::ListJobsRequest* request,
                                     v1::ListJobsResponse* response) override;
  grpc::ServerUnaryReactor* CancelJob(grpc::CallbackServerContext* ctx,
                                      const v1::CancelJobRequest* request,
                                      v1::Job* response) override;
  grpc::ServerWriteReactor<v1::JobEvent>* WatchJob(grpc::CallbackServerContext* ctx,
                                                   const v1::WatchJobRequest* request) override;
  grpc::ServerUnaryReactor* ListNodes(grpc::CallbackServerContext* ctx,
                                      const v1::ListNodesRequest* request,
                                      v1::ListNodesResponse* response) override;
  grpc::ServerWriteReactor<v1::ModelFileChunk>* ExportModel(
      grpc::CallbackServerContext* ctx, const v1::ExportModelRequest* request) override;
  grpc::ServerUnaryReactor* CheckpointJob(grpc::CallbackServerContext* ctx,
                                          const v1::CheckpointJobRequest* request,
                                          v1::CheckpointJobResponse* response) override;

 private:
  // Validates the spec, makes it a pending job (or finds the job a retry
  // with the same request id made) and schedules.
  absl::Status Submit(const v1::SubmitJobRequest& request, v1::SubmitJobResponse* response);
  // The model file of a succeeded job; FAILED_PRECONDITION if it has none.
  absl::StatusOr<ModelStore::Source> FindModel(const std::string& job_id);

  CoordinatorState& state_;
  const AccessPolicy& access_;
};

// Finishes a unary call with `status`.
grpc::ServerUnaryReactor* Reply(grpc::CallbackServerContext* ctx, const absl::Status& status);

}  // namespace pstrain::server

#endif  // PSTRAIN_SERVER_CONTROL_SERVICE_H_
