#include "common/dataset.h"

#include <zlib.h>

#include <cerrno>
#include <cstring>
#include <numeric>
#include <sys/stat.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/files.h"
#include "common/random.h"
#include "common/status.h"

namespace pstrain {
namespace {

absl::StatusOr<std::string> ReadGzip(const std::string& path) {
  struct stat st;
  if (stat(path.c_str(), &st) != 0) {
    return absl::NotFoundError(absl::StrCat(path, ": ", std::strerror(errno)));
  }
  gzFile f = gzopen(path.c_str(), "rb");
  if (f == nullptr) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  std::string data;
  char buf[1 << 16];
  int n;
  while ((n = gzread(f, buf, sizeof(buf))) > 0) data.append(buf, n);
  int err = Z_OK;
  const char* msg = gzerror(f, &err);
  // gzread reports a stream cut short as Z_BUF_ERROR, a corrupt one as Z_DATA_ERROR.
  const bool failed = n < 0 || (err != Z_OK && err != Z_STREAM_END);
  std::string error = failed ? std::string(msg) : "";
  gzclose(f);
  if (failed) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": corrupt or truncated gzip: ", error));
  }
  return data;
}

uint32_t BigEndian32(const std::string& s, size_t at) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data() + at);
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | p[3];
}

// Validates an IDX file of `dims` dimensions and returns its dimensions.
absl::StatusOr<std::vector<uint32_t>> IdxDims(const std::string& path, const std::string& data,
                                              uint32_t magic, int dims) {
  const size_t header = 4 + 4 * static_cast<size_t>(dims);
  if (data.size() < header) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": truncated: ", data.size(), " bytes, no complete IDX header"));
  }
  if (BigEndian32(data, 0) != magic) {
    return absl::InvalidArgumentError(absl::StrFormat("%s: wrong magic 0x%08x, expected 0x%08x",
                                                      path, BigEndian32(data, 0), magic));
  }
  std::vector<uint32_t> shape;
  uint64_t expected = header;
  uint64_t count = 1;
  for (int i = 0; i < dims; ++i) {
    shape.push_back(BigEndian32(data, 4 + 4 * i));
    count *= shape.back();
  }
  expected += count;
  if (data.size() != expected) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ",
                                                   data.size() < expected ? "truncated" : "too long",
                                                   ": ", data.size(), " bytes, expected ",
                                                   expected));
  }
  return shape;
}

}  // namespace

void Dataset::Gather(const int64_t* indices, int n, float* x, int32_t* y) const {
  constexpr float kScale = 1.0f / 255.0f;
  for (int i = 0; i < n; ++i) {
    const uint8_t* src = pixels.data() + indices[i] * input_dim;
    float* dst = x + static_cast<size_t>(i) * input_dim;
    for (int j = 0; j < input_dim; ++j) dst[j] = src[j] * kScale;
    y[i] = labels[indices[i]];
  }
}

absl::StatusOr<Dataset> LoadIdx(const std::string& images_path, const std::string& labels_path,
                                int num_classes) {
  absl::StatusOr<std::string> images = ReadGzip(images_path);
  if (!images.ok()) return images.status();
  absl::StatusOr<std::string> labels = ReadGzip(labels_path);
  if (!labels.ok()) return labels.status();
  absl::StatusOr<std::vector<uint32_t>> image_dims = IdxDims(images_path, *images, 0x803, 3);
  if (!image_dims.ok()) return image_dims.status();
  absl::StatusOr<std::vector<uint32_t>> label_dims = IdxDims(labels_path, *labels, 0x801, 1);
  if (!label_dims.ok()) return label_dims.status();
  if ((*image_dims)[0] != (*label_dims)[0]) {
    return absl::InvalidArgumentError(absl::StrCat(images_path, " has ", (*image_dims)[0],
                                                   " images but ", labels_path, " has ",
                                                   (*label_dims)[0], " labels"));
  }
  Dataset d;
  d.num_samples = (*image_dims)[0];
  d.input_dim = static_cast<int>((*image_dims)[1] * (*image_dims)[2]);
  d.num_classes = num_classes;
  d.pixels.assign(images->begin() + 16, images->end());
  d.labels.resize(d.num_samples);
  for (int64_t i = 0; i < d.num_samples; ++i) {
    const int label = static_cast<unsigned char>((*labels)[8 + i]);
    if (label >= num_classes) {
      return absl::InvalidArgumentError(
          absl::StrCat(labels_path, ": label ", label, " of sample ", i, " is not below ",
                       num_classes));
    }
    d.labels[i] = label;
  }
  return d;
}

absl::StatusOr<Dataset> LoadFashionMnist(const std::string& dir, bool train) {
  const std::string prefix = absl::StrCat(dir, "/", train ? "train" : "t10k");
  return LoadIdx(prefix + "-images-idx3-ubyte.gz", prefix + "-labels-idx1-ubyte.gz", 10);
}

absl::StatusOr<std::shared_ptr<const Dataset>> DatasetCache::FashionMnist(const std::string& dir,
                                                                         bool train) {
  PSTRAIN_RETURN_IF_ERROR(CheckPathWithin("data.dir", dir, "--data_root", root_));
  // Loading under the lock: concurrent callers wait for one load, not two.
  absl::MutexLock lock(&mu_);
  auto it = loaded_.find({dir, train});
  if (it != loaded_.end()) return it->second;
  absl::StatusOr<Dataset> data = LoadFashionMnist(dir, train);
  if (!data.ok()) return data.status();
  auto shared = std::make_shared<const Dataset>(std::move(*data));
  loaded_[{dir, train}] = shared;
  return shared;
}

std::vector<int64_t> EpochOrder(uint64_t seed, int64_t epoch, int64_t n) {
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  uint64_t state = seed * 0x2545f4914f6cdd1dULL + static_cast<uint64_t>(epoch) + 1;
  // Fisher-Yates with a rejection-free multiply-shift draw: identical on every
  // platform, unlike std::uniform_int_distribution.
  for (int64_t i = n - 1; i > 0; --i) {
    const uint64_t r = SplitMix64(state);
    const int64_t j = static_cast<int64_t>(BelowN(r, static_cast<uint64_t>(i + 1)));
    std::swap(order[i], order[j]);
  }
  return order;
}

}  // namespace pstrain
