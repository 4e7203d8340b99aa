#include "common/sparse_frames.h"

#include <algorithm>
#include <cstring>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/random.h"

namespace pstrain {
namespace {

void PutWord(std::string& out, uint32_t word) {
  char bytes[4];
  for (int i = 0; i < 4; ++i) bytes[i] = static_cast<char>((word >> (8 * i)) & 0xff);
  out.append(bytes, 4);
}

uint32_t GetWord(const uint8_t* p) {
  return uint32_t{p[0]} | (uint32_t{p[1]} << 8) | (uint32_t{p[2]} << 16) | (uint32_t{p[3]} << 24);
}

absl::Status Bad(const v1::ChunkHeader& header, absl::string_view what) {
  return absl::InvalidArgumentError(
      absl::StrCat(header.kind() == v1::FRAME_KIND_SPARSE_PUSH   ? "sparse push"
                   : header.kind() == v1::FRAME_KIND_SPARSE_INIT ? "sparse init"
                                                                 : "sparse pull",
                   " of worker ", header.worker(), " step ", header.step(), ": ", what));
}

}  // namespace

uint32_t RowServer(uint32_t table, uint64_t key, uint32_t num_servers) {
  return static_cast<uint32_t>(
      BelowN(Mix64(key ^ Mix64(0x5ca77e5ULL + table)), num_servers == 0 ? 1 : num_servers));
}

std::string EncodeSparsePayload(const std::vector<SparseSection>& sections, bool with_grads,
                                int64_t* num_keys) {
  std::string out;
  int64_t keys = 0;
  for (const SparseSection& s : sections) {
    PutWord(out, s.table);
    PutWord(out, static_cast<uint32_t>(s.keys.size()));
    for (uint64_t key : s.keys) {
      PutWord(out, static_cast<uint32_t>(key));
      PutWord(out, static_cast<uint32_t>(key >> 32));
    }
    if (with_grads) {
      for (uint32_t count : s.counts) PutWord(out, count);
      for (float g : s.grads) {
        uint32_t word;
        std::memcpy(&word, &g, 4);
        PutWord(out, word);
      }
    }
    keys += static_cast<int64_t>(s.keys.size());
  }
  if (num_keys != nullptr) *num_keys = keys;
  return out;
}

absl::StatusOr<std::vector<SparseSection>> DecodeSparseFrame(const Frame& frame,
                                                             absl::Span<const int> dims,
                                                             uint32_t server,
                                                             uint32_t num_servers) {
  const v1::ChunkHeader& h = frame.header();
  // A SPARSE_INIT carries its rows as a push carries its gradients.
  const bool push =
      h.kind() == v1::FRAME_KIND_SPARSE_PUSH || h.kind() == v1::FRAME_KIND_SPARSE_INIT;
  if (h.num_elements() > 0 && h.dtype() != v1::DTYPE_FP32) return Bad(h, "dtype must be fp32");
  if (h.num_keys() > kMaxSparseFrameKeys) {
    return Bad(h, absl::StrCat(h.num_keys(), " keys; at most ", kMaxSparseFrameKeys));
  }
  std::vector<uint8_t> bytes(frame.payload_bytes());
  frame.CopyPayloadTo(bytes.data());
  const size_t words = bytes.size() / 4;
  size_t at = 0;  // in words
  auto word = [&](size_t i) { return GetWord(bytes.data() + 4 * i); };
  std::vector<SparseSection> sections;
  int64_t keys_seen = 0;
  while (at < words) {
    if (words - at < 2) return Bad(h, "the payload ends inside a section's head");
    SparseSection s;
    s.table = word(at);
    const uint32_t n = word(at + 1);
    at += 2;
    if (s.table >= dims.size()) {
      return Bad(h, absl::StrCat("table ", s.table, " is not one of the job's ", dims.size()));
    }
    if (!sections.empty() && s.table <= sections.back().table) {
      return Bad(h, absl::StrCat("table ", s.table, " after table ", sections.back().table,
                                 ": tables must ascend, each once"));
    }
    if (n == 0) return Bad(h, absl::StrCat("table ", s.table, ": an empty section"));
    keys_seen += n;
    if (keys_seen > static_cast<int64_t>(h.num_keys())) {
      return Bad(h, absl::StrCat("more keys than the header's ", h.num_keys()));
    }
    const uint64_t dim = static_cast<uint64_t>(dims[s.table]);
    const uint64_t length = push ? uint64_t{n} * (3 + dim) : uint64_t{n} * 2;
    if (length > words - at) {
      return Bad(h, absl::StrCat("table ", s.table, ": ", n, " keys of dim ", dim, " need ", length,
                                 " words; ", words - at, " are left"));
    }
    s.keys.resize(n);
    absl::flat_hash_set<uint64_t> distinct;
    distinct.reserve(n);
    for (uint32_t i = 0; i < n; ++i) {
      const uint64_t key = uint64_t{word(at + 2 * i)} | (uint64_t{word(at + 2 * i + 1)} << 32);
      if (!distinct.insert(key).second) {
        return Bad(h, absl::StrCat("table ", s.table, ": key ", key, " twice"));
      }
      if (RowServer(s.table, key, num_servers) != server) {
        return Bad(h, absl::StrCat("table ", s.table, ": key ", key, " belongs to server ",
                                   RowServer(s.table, key, num_servers), ", not ", server));
      }
      s.keys[i] = key;
    }
    at += 2 * uint64_t{n};
    if (push) {
      s.counts.resize(n);
      for (uint32_t i = 0; i < n; ++i) {
        s.counts[i] = word(at + i);
        if (s.counts[i] < 1 || s.counts[i] > kMaxKeyCount) {
          return Bad(h, absl::StrCat("table ", s.table, ": key ", s.keys[i], " counted ",
                                     s.counts[i], " times; a count is in [1, ", kMaxKeyCount, "]"));
        }
      }
      at += n;
      s.grads.resize(n * dim);
      std::memcpy(s.grads.data(), bytes.data() + 4 * at, 4 * n * dim);
      at += n * dim;
    }
    sections.push_back(std::move(s));
  }
  if (keys_seen != static_cast<int64_t>(h.num_keys())) {
    return Bad(h, absl::StrCat(keys_seen, " keys, the header says ", h.num_keys()));
  }
  return sections;
}

}  // namespace pstrain
