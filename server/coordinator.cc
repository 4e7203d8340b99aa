// The coordinator drives its parts (coordinator.h lists them): it recovers
// the state directory, serves the control and membership services on one
// gRPC server, and runs the control loop.
#include "server/coordinator.h"

#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/rpc.h"
#include "common/status.h"
#include "grpcpp/health_check_service_interface.h"
#include "server/control_loop.h"
#include "server/control_service.h"
#include "server/coordinator_state.h"
#include "server/membership_service.h"

namespace pstrain::server {
namespace {

class CoordinatorImpl final : public Coordinator {
 public:
  explicit CoordinatorImpl(Options options)
      : options_(std::move(options)),
        access_(options_.auth_tokens),
        state_(options_),
        loop_(&state_),
        control_(&state_, &access_),
        membership_(&state_, &loop_, &access_) {}
  ~CoordinatorImpl() override { Shutdown(absl::Seconds(1)); }

  absl::Status Start() {
    PSTRAIN_RETURN_IF_ERROR(state_.Recover());
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
    builder.RegisterService(&control_);
    builder.RegisterService(&membership_);
    server_ = builder.BuildAndStart();
    if (server_ == nullptr || port == 0) {
      return absl::UnavailableError(absl::StrCat("cannot listen on ", options_.listen_address));
    }
    PSTRAIN_ASSIGN_OR_RETURN(
        address_, AdvertisedAddress(options_.listen_address, options_.advertise_address, port));
    loop_.Start();
    return absl::OkStatus();
  }

  std::string address() const override { return address_; }

  void Shutdown(absl::Duration grace) override {
    {
      absl::MutexLock lock(&state_.mu);
      if (state_.shut_down) return;
      state_.shut_down = true;
      state_.jobs.EndWatches(
          grpc::Status(grpc::StatusCode::UNAVAILABLE, "coordinator shutting down"));
    }
    if (server_ != nullptr) {
      if (grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService()) {
        health->Shutdown();  // NOT_SERVING from now on
      }
      server_->Shutdown(absl::ToChronoTime(absl::Now() + grace));
    }
    loop_.Stop();
  }

 private:
  const Options options_;
  const AccessPolicy access_;
  CoordinatorState state_;
  ControlLoop loop_;
  ControlService control_;
  MembershipService membership_;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Coordinator>> Coordinator::Create(Options options) {
  auto coordinator = std::make_unique<CoordinatorImpl>(std::move(options));
  PSTRAIN_RETURN_IF_ERROR(coordinator->Start());
  return coordinator;
}

}  // namespace pstrain::server
