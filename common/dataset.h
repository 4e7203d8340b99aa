// Datasets: the gzipped IDX files of Fashion-MNIST, and the exact sharding
// of every epoch across workers.
#ifndef PSTRAIN_COMMON_DATASET_H_
#define PSTRAIN_COMMON_DATASET_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace pstrain {

// Images as bytes (0..255) and their labels; immutable once loaded.
struct Dataset {
  int64_t num_samples = 0;
  int input_dim = 0;  // rows * cols
  int num_classes = 0;
  std::vector<uint8_t> pixels;  // num_samples * input_dim
  std::vector<int32_t> labels;  // num_samples

  // Writes samples indices[0..n) as floats in [0, 1] to x (n * input_dim)
  // and their labels to y.
  void Gather(const int64_t* indices, int n, float* x, int32_t* y) const;
};

// Reads a gzipped IDX image file (magic 0x803) and label file (0x801).
// INVALID_ARGUMENT naming the file on a wrong magic, truncated data, a
// count mismatch or a corrupt gzip stream; NOT_FOUND if a file is missing.
absl::StatusOr<Dataset> LoadIdx(const std::string& images_path,
                                const std::string& labels_path, int num_classes);

// The Fashion-MNIST training (60,000) or test (10,000) set in `dir`.
absl::StatusOr<Dataset> LoadFashionMnist(const std::string& dir, bool train);

// Loads each (dir, train/test) once per process and shares it. Thread-safe.
class DatasetCache {
 public:
  // `root`: the directory data must come from (a worker's --data_root);
  // empty: anywhere.
  explicit DatasetCache(std::string root = "") : root_(std::move(root)) {}

  // The directory data must come from; empty: anywhere.
  const std::string& root() const { return root_; }

  // INVALID_ARGUMENT naming data.dir for a `dir` outside the root.
  absl::StatusOr<std::shared_ptr<const Dataset>> FashionMnist(const std::string& dir, bool train);

 private:
  const std::string root_;
  absl::Mutex mu_;
  std::map<std::pair<std::string, bool>, std::shared_ptr<const Dataset>> loaded_
      ABSL_GUARDED_BY(mu_);
};

// The order of the training set in `epoch`: a permutation of [0, n) that
// depends only on (seed, epoch, n). Global batch t of the epoch is
// order[t*W*b, (t+1)*W*b) and worker w takes its slice w of b samples.
std::vector<int64_t> EpochOrder(uint64_t seed, int64_t epoch, int64_t n);

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_DATASET_H_
