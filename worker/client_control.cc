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

namespace {

// The row optimizer of a table a model brings: the job's optimizer's twin.
absl::StatusOr<v1::TableOptimizer> RowTwinOf(const v1::OptimizerSpec& o, const std::string& table) {
  const char* missing = o.momentum() != 0       ? "momentum"
                        : o.weight_decay() != 0 ? "weight_decay"
                        : (o.schedule().type() > v1::SCHEDULE_TYPE_CONSTANT ||
                           o.schedule().warmup_steps() > 0)
                            ? "a schedule"
                            : nullptr;
  if (missing != nullptr || o.type() == v1::OPTIMIZER_TYPE_UNSPECIFIED) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tables: the model's table ", table, " takes the job's optimizer for its rows, and ",
        missing != nullptr ? absl::StrCat("rows have no ", missing)
                           : std::string("the job names none"),
        ": declare the table in the job file's tables, with its optimizer"));
  }
  v1::TableOptimizer t;
  t.set_learning_rate(o.learning_rate());
  switch (o.type()) {
    case v1::OPTIMIZER_TYPE_ADAGRAD:
      t.set_type(v1::TABLE_OPTIMIZER_TYPE_ADAGRAD);
      t.set_initial_accumulator(0);  // the dense Adagrad's (and torch's)
      if (o.has_epsilon()) t.set_epsilon(o.epsilon());
      break;
    case v1::OPTIMIZER_TYPE_ADAM:
      t.set_type(v1::TABLE_OPTIMIZER_TYPE_ADAM);
      if (o.has_beta1()) t.set_beta1(o.beta1());
      if (o.has_beta2()) t.set_beta2(o.beta2());
      if (o.has_epsilon()) t.set_epsilon(o.epsilon());
      break;
    default:
      t.set_type(v1::TABLE_OPTIMIZER_TYPE_SGD);
  }
  return t;
}

// The job's tables with those the model brings.
absl::Status AddTables(const std::vector<TableDeclaration>& tables, v1::JobSpec& spec) {
  for (const TableDeclaration& d : tables) {
    v1::EmbeddingTableSpec* t = nullptr;
    for (v1::EmbeddingTableSpec& declared : *spec.mutable_tables()) {
      if (declared.name() == d.name) t = &declared;
    }
    if (t == nullptr) {
      t = spec.add_tables();
      t->set_name(d.name);
      t->set_dim(d.dim);
      PSTRAIN_ASSIGN_OR_RETURN(*t->mutable_optimizer(), RowTwinOf(spec.optimizer(), d.name));
    } else if (t->dim() != d.dim) {
      return absl::InvalidArgumentError(absl::StrCat("tables: ", d.name, " has dim ", t->dim(),
                                                     " in the job file, ", d.dim,
                                                     " in the model"));
    }
    t->set_initial_rows(d.initial_rows);
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::string> SubmitJob(const ConnectOptions& connect, const std::string& job_yaml,
                                      const std::vector<TensorSpec>& tensors,
                                      const std::string& request_id,
                                      const std::vector<TableDeclaration>& tables) {
  PSTRAIN_RETURN_IF_ERROR(CheckConnect(connect));
  PSTRAIN_ASSIGN_OR_RETURN(v1::JobSpec spec, ParseJobSpecYaml(job_yaml));
  v1::ModelSpec& model = *spec.mutable_model();
  PSTRAIN_RETURN_IF_ERROR(MakeModelExternal(model));
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
  PSTRAIN_RETURN_IF_ERROR(AddTables(tables, spec));
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
