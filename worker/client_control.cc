#include "worker/client_control.h"

#include <functional>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/clock.h"
#include "common/job_spec.h"
#include "common/rpc.h"
#include "common/status.h"
#include "pstrain/v1/control.grpc.pb.h"

namespace pstrain {
namespace {

std::unique_ptr<v1::Control::Stub> ControlStub(const ConnectOptions& c,
                                               const TransportSecurity* security) {
  return v1::Control::NewStub(MakeChannel(
      c.coordinator, {.security = security, .peer_roles = {PeerRole::kCoordinator}}));
}

// Calls `call` with a fresh context until it succeeds, fails other than
// UNAVAILABLE, or connect.timeout runs out.
absl::Status CallControl(const ConnectOptions& c,
                         const std::function<grpc::Status(grpc::ClientContext&)>& call) {
  const absl::Time give_up = MonotonicNow() + c.timeout;
  while (true) {
    grpc::ClientContext context;
    SetTimeout(context, std::max(give_up - MonotonicNow(), absl::Milliseconds(1)));
    AddBearerToken(context, c.token);
    const grpc::Status status = call(context);
    if (status.error_code() != grpc::StatusCode::UNAVAILABLE || MonotonicNow() >= give_up) {
      return FromGrpcStatus(status);
    }
    absl::SleepFor(absl::Milliseconds(200));
  }
}

}  // namespace

absl::Status CheckConnect(const ConnectOptions& c) {
  if (c.coordinator.empty()) return absl::InvalidArgumentError("coordinator: required (host:port)");
  if (c.timeout <= absl::ZeroDuration()) return absl::InvalidArgumentError("timeout: must be > 0");
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<TransportSecurity>> LoadSecurity(const ConnectOptions& c) {
  const TlsFiles files{.cert = c.cert_file, .key = c.key_file, .ca = c.ca_file};
  if (files.empty()) return std::unique_ptr<TransportSecurity>();
  return TransportSecurity::Load(files);
}

absl::Status CheckJobIsExternal(const ConnectOptions& c, const TransportSecurity* security,
                                const std::string& job_id) {
  const std::unique_ptr<v1::Control::Stub> stub = ControlStub(c, security);
  v1::GetJobRequest request;
  request.set_job_id(job_id);
  v1::Job job;
  PSTRAIN_RETURN_IF_ERROR(CallControl(c, [&](grpc::ClientContext& context) {
    return stub->GetJob(&context, request, &job);
  }));
  if (job.spec().model().type() != v1::MODEL_TYPE_EXTERNAL) {
    return absl::InvalidArgumentError(absl::StrCat(
        "job_id: job ", job_id, " trains a built-in model (",
        EnumName(job.spec().model().type()), "): pool workers run it, not the client"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> SubmitJob(const ConnectOptions& connect, const std::string& job_yaml,
                                      const std::vector<TensorSpec>& tensors,
                                      const std::string& request_id) {
  PSTRAIN_RETURN_IF_ERROR(CheckConnect(connect));
  PSTRAIN_ASSIGN_OR_RETURN(v1::JobSpec spec, ParseJobSpecYaml(job_yaml));
  v1::ModelSpec& model = *spec.mutable_model();
  if (model.type() != v1::MODEL_TYPE_UNSPECIFIED && model.type() != v1::MODEL_TYPE_EXTERNAL) {
    return absl::InvalidArgumentError(
        "model.type: a job submitted with its tensors has an external model");
  }
  if (model.tensors_size() != 0) {
    return absl::InvalidArgumentError("model.tensors: given by the tensors argument");
  }
  model.set_type(v1::MODEL_TYPE_EXTERNAL);
  for (const TensorSpec& t : tensors) {
    v1::ExternalTensor* e = model.add_tensors();
    e->set_name(t.name);
    for (int64_t d : t.shape) e->add_shape(d);
    e->set_buffer(t.buffer);
    absl::StatusOr<v1::TensorDType> dtype = TensorDTypeOf(t.dtype);
    if (!dtype.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "model.tensors[", model.tensors_size() - 1, "].dtype: ", dtype.status().message()));
    }
    e->set_dtype(*dtype);
  }
  // Checked here first: the error names the field either way.
  PSTRAIN_RETURN_IF_ERROR(NormalizeJobSpec(spec).status());
  PSTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<TransportSecurity> security, LoadSecurity(connect));
  const std::unique_ptr<v1::Control::Stub> stub = ControlStub(connect, security.get());
  v1::SubmitJobRequest request;
  *request.mutable_spec() = spec;
  std::random_device random;
  request.set_request_id(request_id.empty() ? absl::StrFormat("client-%08x%08x%08x", random(),
                                                              random(), random())
                                            : request_id);
  v1::SubmitJobResponse response;
  PSTRAIN_RETURN_IF_ERROR(CallControl(connect, [&](grpc::ClientContext& context) {
    return stub->SubmitJob(&context, request, &response);
  }));
  return response.job_id();
}

}  // namespace pstrain
