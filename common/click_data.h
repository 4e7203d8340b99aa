// Click logs in Criteo's layout, the batch form a click model reads, and the
// order in which a job's workers read a stream of them.
//
// A line is a label, `dense` integer features and `fields` categorical
// features, separated by tabs (Criteo's own files: 13 and 26):
//   label      0 or 1
//   integer    a decimal integer, possibly negative, or empty; the model
//              reads log(1 + max(x, 0)) and 0 for an empty one
//   category   a token of 1 to 16 hex digits (a 64-bit key), empty (no
//              token), or several tokens separated by commas: the
//              multi-valued extension, which the model pools
// A trailing '\r' is ignored. Files are plain or gzip (told apart by their
// first bytes), and a list of files reads as one stream.
#ifndef PSTRAIN_COMMON_CLICK_DATA_H_
#define PSTRAIN_COMMON_CLICK_DATA_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace pstrain {

// The columns of a line.
struct ClickLayout {
  int dense = 13;
  int fields = 26;
  bool operator==(const ClickLayout&) const = default;
};

// Lines no longer than this are read; a longer one is refused.
inline constexpr size_t kMaxClickLineBytes = size_t{1} << 20;

// Samples in columns. Sample s's dense features are dense[s * layout.dense
// ...], and its bag of keys in field f is keys[bag_starts[s * layout.fields
// + f] .. bag_starts[s * layout.fields + f + 1]).
struct ClickBatch {
  ClickLayout layout;
  std::vector<float> labels;
  std::vector<float> dense;
  std::vector<int64_t> bag_starts = {0};
  std::vector<uint64_t> keys;

  int64_t size() const { return static_cast<int64_t>(labels.size()); }
  void Clear();
  // Appends sample s of `other` (of the same layout).
  void AppendSample(const ClickBatch& other, int64_t s);
  bool operator==(const ClickBatch&) const = default;
};

// What the model reads for an integer feature x: log(1 + max(x, 0)).
float DenseFeatureValue(int64_t x);

// Parses one line (without its '\n') into a sample appended to `batch`.
// INVALID_ARGUMENT saying which column is wrong and why; `batch` is then
// unchanged.
absl::Status ParseClickLine(absl::string_view line, ClickBatch& batch);

// The samples of an epoch, read from text files, in the order that every
// worker of a job agrees on.
//
// The order: the files are read one after another; each file is cut into
// windows of `shuffle_window` lines (its last window may be shorter), and
// the lines of the epoch's k-th window (counted over all files) come in the
// order of a permutation drawn from (seed, epoch, k) alone. Positions count
// the samples of this order from 0. A job's global batch t of G samples is
// positions [t*G, (t+1)*G); worker w of W with b = G/W samples takes
// [t*G + w*b, t*G + (w+1)*b) — so W workers of b read exactly what one
// process of W*b reads, and every worker reads (and skips) the whole
// stream. An epoch ends at the first global batch the stream cannot fill.
struct ClickStreamOptions {
  std::vector<std::string> files;
  ClickLayout layout;
  uint64_t seed = 0;
  int64_t epoch = 0;
  int64_t shuffle_window = 65536;  // 1: the files' order
};

class ClickStream {
 public:
  // NOT_FOUND naming a missing file; INVALID_ARGUMENT for no files or a
  // window outside [1, 2^24].
  static absl::StatusOr<std::unique_ptr<ClickStream>> Open(ClickStreamOptions options);
  ~ClickStream();

  // How many of positions [0, end) the epoch has: `end`, or fewer where
  // the stream ends before. Reads ahead as needed. INVALID_ARGUMENT naming
  // the file for a corrupt gzip stream or a line too long.
  absl::StatusOr<int64_t> Available(int64_t end);

  // Appends the samples at positions [from, from + count) to `batch`.
  // `from` may not go below that of an earlier call (the stream forgets
  // what lies before it); OUT_OF_RANGE if the epoch has fewer samples;
  // INVALID_ARGUMENT naming the file and line of a line that does not
  // parse (nothing is appended then).
  absl::Status Read(int64_t from, int64_t count, ClickBatch& batch);

 private:
  struct Window;
  class LineReader;
  explicit ClickStream(ClickStreamOptions options);
  // Loads the next window; false at the stream's end.
  absl::StatusOr<bool> LoadWindow();

  const ClickStreamOptions options_;
  size_t next_file_ = 0;
  std::unique_ptr<LineReader> reader_;
  int64_t windows_loaded_ = 0;
  int64_t loaded_end_ = 0;  // positions before it are (or were) loaded
  int64_t read_from_ = 0;   // positions before it are forgotten
  bool ended_ = false;
  std::deque<Window> windows_;
};

// Every sample of `files` in their order, at most `limit` (0: all).
absl::StatusOr<ClickBatch> ReadClickFiles(const std::vector<std::string>& files,
                                          ClickLayout layout, int64_t limit = 0);

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_CLICK_DATA_H_
