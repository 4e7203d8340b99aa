// The chunk decoder: a frame as gRPC hands it over, in slices cut anywhere
// (a value may straddle two). Frame::Parse accepts it or says why not; an
// accepted frame's values read the same whole, in pieces and added to
// zeros, and MaxAbs agrees with them.
//
// Input: one byte n, then n bytes that say where the slices are cut, then
// the frame.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#include "absl/status/statusor.h"
#include "common/chunk_codec.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const size_t cuts = std::min<size_t>(data[0] % 8, size - 1);
  const uint8_t* frame = data + 1 + cuts;
  const size_t frame_size = size - 1 - cuts;
  std::vector<size_t> at = {0, frame_size};
  for (size_t i = 0; i < cuts; ++i) at.push_back(frame_size == 0 ? 0 : data[1 + i] % frame_size);
  std::sort(at.begin(), at.end());
  std::vector<grpc::Slice> slices;
  for (size_t i = 0; i + 1 < at.size(); ++i) {
    if (at[i + 1] > at[i]) slices.emplace_back(frame + at[i], at[i + 1] - at[i]);
  }
  const grpc::ByteBuffer buffer(slices.data(), slices.size());

  absl::StatusOr<pstrain::Frame> parsed = pstrain::Frame::Parse(buffer);
  if (!parsed.ok()) return 0;
  const int64_t n = parsed->header().num_elements();
  if (parsed->payload_bytes() != n * pstrain::DTypeBytes(parsed->header().dtype())) abort();

  std::vector<float> whole(n), pieces(n), added(n, 0.0f);
  parsed->ReadValues(0, n, whole.data());
  const int64_t half = n / 2;
  parsed->ReadValues(0, half, pieces.data());
  parsed->ReadValues(half, n - half, pieces.data() + half);
  parsed->AddValues(0, n, added.data());
  float max_abs = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    if (std::memcmp(&whole[i], &pieces[i], sizeof(float)) != 0) abort();
    max_abs = std::isfinite(whole[i]) ? std::max(max_abs, std::fabs(whole[i]))
                                      : std::numeric_limits<float>::infinity();
    if (std::isfinite(whole[i]) && added[i] != whole[i] + 0.0f) abort();
  }
  if (parsed->MaxAbs() != max_abs) abort();
  return 0;
}
