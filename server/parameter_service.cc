#include "server/parameter_service.h"

#include <utility>

#include "common/chunk_codec.h"
#include "server/grpc_streams.h"
#include "server/in_process_sessions.h"

namespace pstrain::server {

ParameterService::ParameterService(ShardStore* store, const WorkerRoster* roster,
                                   ClientLimits limits)
    : store_(store), roster_(roster), load_(limits), direct_({store, roster, &load_}) {}

ParameterService::~ParameterService() { StopDirectConnections(); }

void ParameterService::SetHello(const v1::HelloReply& hello) {
  absl::MutexLock lock(&hello_mu_);
  hello_ = hello.SerializeAsString();
  instance_ = hello.instance();
}

absl::Status ParameterService::ServeSharedMemory(const std::string& name, uint64_t instance,
                                                 const ShmOptions& options) {
  return direct_.ServeSharedMemory(name, instance, options);
}

absl::StatusOr<int> ParameterService::ServeDirectTcp(const std::string& host, uint64_t instance,
                                                     const ShmOptions& options) {
  return direct_.ServeDirectTcp(host, instance, options);
}

void ParameterService::StopDirectConnections() { direct_.Stop(); }

grpc::ServerGenericBidiReactor* ParameterService::CreateReactor(
    grpc::GenericCallbackServerContext* ctx) {
  std::string hello;
  if (ctx->method() == kHelloMethod) {
    absl::MutexLock lock(&hello_mu_);
    hello = hello_;
  }
  return NewParameterReactor(ctx, {store_, roster_, &load_}, hello);
}

uint64_t ParameterService::instance() const {
  absl::MutexLock lock(&hello_mu_);
  return instance_;
}

std::unique_ptr<InProcessService::Session> ParameterService::OpenSession() {
  return OpenInProcessSession({store_, roster_, &load_});
}

}  // namespace pstrain::server
