#include "common/chunk_codec.h"

#include <cstring>
#include <numeric>

#include "gtest/gtest.h"

namespace pstrain {
namespace {

v1::ChunkHeader Header(uint32_t n) {
  v1::ChunkHeader h;
  h.set_kind(v1::FRAME_KIND_PUSH);
  h.set_job_id("job-1");
  h.set_worker(3);
  h.set_step(17);
  h.set_chunk(5);
  h.set_dtype(v1::DTYPE_F32);
  h.set_num_elements(n);
  return h;
}

// The bytes of a frame as gRPC would put them on the wire.
std::string Flatten(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(buffer.Dump(&slices).ok());
  std::string bytes;
  for (const grpc::Slice& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return bytes;
}

// Re-slices `bytes` at the given cut points.
grpc::ByteBuffer Cut(const std::string& bytes, const std::vector<size_t>& cuts) {
  std::vector<grpc::Slice> slices;
  size_t begin = 0;
  for (size_t cut : cuts) {
    slices.emplace_back(bytes.data() + begin, cut - begin);
    begin = cut;
  }
  slices.emplace_back(bytes.data() + begin, bytes.size() - begin);
  return grpc::ByteBuffer(slices.data(), slices.size());
}

TEST(ChunkCodecTest, RoundTripSplitAtEveryByte) {
  std::vector<float> values(9);
  std::iota(values.begin(), values.end(), -3.25f);
  const std::string bytes = Flatten(EncodeFrame(Header(values.size()), values.data()));
  for (size_t a = 1; a < bytes.size(); ++a) {
    for (size_t b = a; b < bytes.size(); b += 3) {
      std::vector<size_t> cuts = {a};
      if (b > a) cuts.push_back(b);
      absl::StatusOr<Frame> frame = Frame::Parse(Cut(bytes, cuts));
      ASSERT_TRUE(frame.ok()) << frame.status() << " cuts " << a << "," << b;
      EXPECT_EQ(frame->header().step(), 17);
      std::vector<float> out(values.size(), 0.0f);
      frame->CopyPayloadTo(out.data());
      ASSERT_EQ(out, values) << "cuts " << a << "," << b;
    }
  }
}

TEST(ChunkCodecTest, SharedPayloadIsNotCopiedAndKeepsItsOwnerAlive) {
  auto owner = std::make_shared<std::vector<float>>(1000, 1.5f);
  std::weak_ptr<std::vector<float>> weak = owner;
  grpc::ByteBuffer buffer = EncodeFrameShared(Header(1000), owner->data(), owner);
  std::vector<grpc::Slice> slices;
  ASSERT_TRUE(buffer.Dump(&slices).ok());
  ASSERT_EQ(slices.size(), 2u);
  EXPECT_EQ(static_cast<const void*>(slices[1].begin()), static_cast<const void*>(owner->data()));
  slices.clear();
  owner.reset();
  EXPECT_FALSE(weak.expired()) << "the frame must keep the payload alive";
  buffer.Clear();
  EXPECT_TRUE(weak.expired());
}

TEST(ChunkCodecTest, RejectsMalformedFrames) {
  std::vector<float> values(4, 1.0f);
  const std::string bytes = Flatten(EncodeFrame(Header(4), values.data()));
  // Truncated anywhere: the length prefix, the header or the payload.
  for (size_t n = 0; n < bytes.size(); ++n) {
    grpc::Slice slice(bytes.data(), n);
    EXPECT_FALSE(Frame::Parse(grpc::ByteBuffer(&slice, 1)).ok()) << n;
  }
  // One byte too many.
  std::string longer = bytes + "x";
  grpc::Slice slice(longer.data(), longer.size());
  EXPECT_FALSE(Frame::Parse(grpc::ByteBuffer(&slice, 1)).ok());
  // A length prefix beyond the buffer.
  std::string huge = bytes;
  huge[3] = '\x7f';
  grpc::Slice huge_slice(huge.data(), huge.size());
  EXPECT_FALSE(Frame::Parse(grpc::ByteBuffer(&huge_slice, 1)).ok());
}

}  // namespace
}  // namespace pstrain
