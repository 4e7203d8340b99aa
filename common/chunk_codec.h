// Chunk frames on the wire: [fixed32 LE n][n bytes ChunkHeader][payload].
// See proto/pstrain/v1/parameters.proto.
//
// The data path does not copy payloads: a sent payload is a slice pointing
// at the tensor's own memory (EncodeFrameShared), and a received one is
// read straight from the slices gRPC received it in (Frame::ReadValues,
// Frame::AddValues), wherever those slices split it. The copies that remain
// possible (EncodeFrame, Frame::CopyPayloadTo) are counted:
// CopiedPayloadBytes() stays 0 on the hot path, which tests check.
#ifndef PSTRAIN_COMMON_CHUNK_CODEC_H_
#define PSTRAIN_COMMON_CHUNK_CODEC_H_

#include <cstddef>
#include <cstdint>
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
inline constexpr char kHelloMethod[] = "/pstrain.v1.Parameters/Hello";

// The parameter service's streaming methods.
enum class ParameterMethod { kPush, kPull, kPushPull };

// The parameter service over a direct connection
// (common/direct_connection.h): streams as gRPC's, each opened by the client
// with its method, carrying request frames one way and reply frames the
// other, and ended by the server with a status.
enum DirectParameterMessage : uint8_t {
  kDirectOpen = 1,     // client: opens `stream`, flags = its ParameterMethod
  kDirectRequest = 2,  // client: a request frame; flags kDirectLast: the stream's last
  kDirectCancel = 3,   // client: the stream is abandoned; no reply will be read
  kDirectReply = 4,    // server: a reply frame
  kDirectDone = 5,     // server: the stream's end: [fixed32 LE code][message]
};
inline constexpr uint8_t kDirectLast = 1;

// Bytes per value of a payload dtype; 0 for an unknown one.
size_t DTypeBytes(v1::DType dtype);

// Payload bytes copied by EncodeFrame and Frame::CopyPayloadTo in this
// process so far.
int64_t CopiedPayloadBytes();

// Builds a frame whose payload is header.num_elements() values of
// header.dtype() copied from `payload` (nullptr when there are none).
// Counted in CopiedPayloadBytes.
grpc::ByteBuffer EncodeFrame(const v1::ChunkHeader& header, const void* payload);

// Like EncodeFrame, but the payload slice points at `payload` without a copy
// and holds a reference to `owner` (whose memory holds the payload) until
// gRPC drops the slice. The payload must not change while any frame built
// from it is alive.
grpc::ByteBuffer EncodeFrameShared(const v1::ChunkHeader& header, const void* payload,
                                   std::shared_ptr<const void> owner);

// A received frame: the header, parsed, and the payload left in the
// received slices (a value may be split between two slices at any byte).
// Copies share the slices.
class Frame {
 public:
  // INVALID_ARGUMENT on a frame that is truncated, has an unparsable
  // header, an unknown dtype, or a payload whose length disagrees with the
  // header.
  static absl::StatusOr<Frame> Parse(const grpc::ByteBuffer& buffer);

  const v1::ChunkHeader& header() const { return header_; }
  size_t payload_bytes() const { return payload_bytes_; }

  // Values [first, first + count) of the payload, as floats: written to
  // dst[0, count), or added to it. first + count <= num_elements.
  void ReadValues(int64_t first, int64_t count, float* dst) const;
  void AddValues(int64_t first, int64_t count, float* dst) const;

  // The largest magnitude of the payload's values (0 for none); infinity
  // if one is NaN or infinite.
  float MaxAbs() const;

  // Copies the raw payload (payload_bytes() bytes) to dst. Counted in
  // CopiedPayloadBytes: tools, tests, and sparse frames (whose keys and rows
  // the server decodes into arrays of its own).
  void CopyPayloadTo(void* dst) const;

  // The same frame with its payload copied to memory of its own: for a
  // frame parsed from memory it may not keep (a borrowed message).
  Frame OwnedCopy() const;
  // Forgets the payload and keeps the header: for a borrowed frame whose
  // values have been used. ReadValues, AddValues and MaxAbs must not be
  // called after.
  void DropPayload();

 private:
  void CopyPayload(void* dst) const;
  template <typename Sink>
  void ForEachRun(int64_t first, int64_t count, Sink&& sink) const;

  v1::ChunkHeader header_;
  std::vector<grpc::Slice> slices_;
  // Where each slice starts, counted in payload bytes (negative for bytes
  // before the payload): ascending, one entry per slice.
  std::vector<int64_t> slice_start_;
  size_t payload_bytes_ = 0;
};

// The largest magnitude of `count` values of `dtype` at `values` (0 for
// none); infinity if one is NaN or infinite. Frame::MaxAbs for memory.
float MaxAbsOf(v1::DType dtype, const void* values, int64_t count);

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_CHUNK_CODEC_H_
