// Chunk frames on the wire: [fixed32 LE n][n bytes ChunkHeader][payload].
// See proto/pstrain/v1/parameters.proto.
#ifndef PSTRAIN_COMMON_CHUNK_CODEC_H_
#define PSTRAIN_COMMON_CHUNK_CODEC_H_

#include <cstddef>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"
#include "pstrain/v1/parameters.pb.h"

namespace pstrain {

// The parameter service's methods (gRPC generic API).
inline constexpr char kPushMethod[] = "/pstrain.v1.Parameters/Push";
inline constexpr char kPullMethod[] = "/pstrain.v1.Parameters/Pull";
inline constexpr char kPushPullMethod[] = "/pstrain.v1.Parameters/PushPull";

// Builds a frame whose payload is header.num_elements() floats copied from
// `values` (nullptr when num_elements is 0).
grpc::ByteBuffer EncodeFrame(const v1::ChunkHeader& header, const float* values);

// Like EncodeFrame, but the payload slice points at `values` without a copy
// and holds a reference to `owner` (whose memory holds the values) until
// gRPC drops the slice. The caller does not change the values until the
// call that sends the frame has finished.
grpc::ByteBuffer EncodeFrameShared(const v1::ChunkHeader& header, const float* values,
                                   std::shared_ptr<const void> owner);

// A received frame: the header, parsed, and the payload left in the
// received slices (a value may be split between two slices at any byte).
class Frame {
 public:
  // INVALID_ARGUMENT on a frame that is truncated, has an unparsable
  // header, or a payload whose length disagrees with the header.
  static absl::StatusOr<Frame> Parse(const grpc::ByteBuffer& buffer);

  const v1::ChunkHeader& header() const { return header_; }
  size_t payload_bytes() const { return payload_bytes_; }

  // Copies the payload (payload_bytes() bytes) to dst.
  void CopyPayloadTo(void* dst) const;

 private:
  v1::ChunkHeader header_;
  std::vector<grpc::Slice> slices_;
  size_t payload_slice_ = 0;   // slice where the payload starts
  size_t payload_offset_ = 0;  // byte in that slice
  size_t payload_bytes_ = 0;
};

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_CHUNK_CODEC_H_
