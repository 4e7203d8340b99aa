// The parameter service (proto/pstrain/v1/parameters.proto) on gRPC's
// generic callback API: raw chunk frames in, raw chunk frames out, and no
// thread held while a push waits for its step's barrier.
#ifndef PSTRAIN_SERVER_PARAMETER_SERVICE_H_
#define PSTRAIN_SERVER_PARAMETER_SERVICE_H_

#include "common/chunk_codec.h"
#include "grpcpp/generic/async_generic_service.h"
#include "server/shard_store.h"

namespace pstrain::server {

// Register with ServerBuilder::RegisterCallbackGenericService. The store
// must outlive the gRPC server. A stream ends OK once the client has
// half-closed and every request has been answered; a bad frame ends it with
// INVALID_ARGUMENT (NOT_FOUND for a job not held) and the message.
class ParameterService final : public grpc::CallbackGenericService {
 public:
  explicit ParameterService(ShardStore* store) : store_(store) {}

  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext* ctx) override;

 private:
  ShardStore* const store_;
};

}  // namespace pstrain::server

#endif  // PSTRAIN_SERVER_PARAMETER_SERVICE_H_
