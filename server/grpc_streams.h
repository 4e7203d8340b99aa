// The gRPC carrier of the parameter service: a callback reactor per
// stream on gRPC's generic API, raw chunk frames in and out, no thread held
// while a push waits for its step's barrier, and back-pressure on a client
// that sends without reading.
#ifndef PSTRAIN_SERVER_GRPC_STREAMS_H_
#define PSTRAIN_SERVER_GRPC_STREAMS_H_

#include <string>

#include "grpcpp/generic/async_generic_service.h"
#include "server/parameter_streams.h"

namespace pstrain::server {

// The reactor for a call of the parameter service: Hello answered with
// `hello` (a serialized HelloReply); a stream of Push, Pull or PushPull,
// counted against its client's budget (the node of its certificate, whose
// frames are checked against the roster, or in plaintext its host); any
// other method UNIMPLEMENTED. Deletes itself when done.
grpc::ServerGenericBidiReactor* NewParameterReactor(grpc::GenericCallbackServerContext* ctx,
                                                    const StreamContext& context,
                                                    const std::string& hello);

}  // namespace pstrain::server

#endif  // PSTRAIN_SERVER_GRPC_STREAMS_H_
