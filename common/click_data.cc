#include "common/click_data.h"

#include <sys/stat.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "common/dataset.h"
#include "common/random.h"

namespace pstrain {
namespace {

// A window of the files' order (shuffle_window 0 or 1) is this long.
constexpr int64_t kUnshuffledWindow = 65536;
constexpr int64_t kMaxShuffleWindow = int64_t{1} << 24;
constexpr size_t kReadChunk = size_t{1} << 20;

// Shortens `batch` to its first n samples.
void Truncate(ClickBatch& batch, int64_t n) {
  batch.labels.resize(n);
  batch.dense.resize(n * batch.layout.dense);
  batch.bag_starts.resize(n * batch.layout.fields + 1);
  batch.keys.resize(batch.bag_starts.back());
}

// "column 3 (integer feature 2)": 1-based, as a user counts them.
std::string ColumnName(const ClickLayout& layout, int column) {
  if (column == 0) return "column 1 (label)";
  if (column <= layout.dense)
    return absl::StrCat("column ", column + 1, " (integer feature ", column, ")");
  return absl::StrCat("column ", column + 1, " (categorical feature ", column - layout.dense, ")");
}

absl::Status ParseKeys(absl::string_view text, std::vector<uint64_t>& keys) {
  if (text.empty()) return absl::OkStatus();
  size_t begin = 0;
  while (true) {
    const size_t comma = text.find(',', begin);
    const absl::string_view token = text.substr(
        begin, comma == absl::string_view::npos ? absl::string_view::npos : comma - begin);
    uint64_t key = 0;
    const auto [end, error] = std::from_chars(token.data(), token.data() + token.size(), key, 16);
    if (token.empty() || token.size() > 16 || error != std::errc() ||
        end != token.data() + token.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("\"", token, "\" is not a token of 1 to 16 hex digits"));
    }
    keys.push_back(key);
    if (comma == absl::string_view::npos) return absl::OkStatus();
    begin = comma + 1;
  }
}

}  // namespace

void ClickBatch::Clear() { Truncate(*this, 0); }

void ClickBatch::AppendSample(const ClickBatch& other, int64_t s) {
  labels.push_back(other.labels[s]);
  const auto dense_begin = other.dense.begin() + s * layout.dense;
  dense.insert(dense.end(), dense_begin, dense_begin + layout.dense);
  for (int f = 0; f < layout.fields; ++f) {
    const int64_t bag = s * layout.fields + f;
    keys.insert(keys.end(), other.keys.begin() + other.bag_starts[bag],
                other.keys.begin() + other.bag_starts[bag + 1]);
    bag_starts.push_back(static_cast<int64_t>(keys.size()));
  }
}

float DenseFeatureValue(int64_t x) {
  return static_cast<float>(std::log1p(static_cast<double>(std::max<int64_t>(x, 0))));
}

absl::Status ParseClickLine(absl::string_view line, ClickBatch& batch) {
  const ClickLayout& layout = batch.layout;
  if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
  const int64_t before = batch.size();
  const int columns = 1 + layout.dense + layout.fields;
  size_t begin = 0;
  for (int column = 0; column < columns; ++column) {
    const size_t tab = line.find('\t', begin);
    const bool last = column + 1 == columns;
    if (last != (tab == absl::string_view::npos)) {
      Truncate(batch, before);
      const int64_t found = 1 + std::count(line.begin(), line.end(), '\t');
      return absl::InvalidArgumentError(
          absl::StrCat(found, " tab-separated columns, expected ", columns, " (a label, ",
                       layout.dense, " integer and ", layout.fields, " categorical features)"));
    }
    const absl::string_view text = line.substr(begin, last ? absl::string_view::npos : tab - begin);
    begin = tab + 1;
    absl::Status status;
    if (column == 0) {
      if (text == "0" || text == "1") {
        batch.labels.push_back(text == "1" ? 1.0f : 0.0f);
      } else {
        status = absl::InvalidArgumentError(absl::StrCat("\"", text, "\" is not 0 or 1"));
      }
    } else if (column <= layout.dense) {
      int64_t value = 0;
      const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
      if (!text.empty() && (error != std::errc() || end != text.data() + text.size())) {
        status = absl::InvalidArgumentError(absl::StrCat("\"", text, "\" is not a 64-bit integer"));
      } else {
        batch.dense.push_back(DenseFeatureValue(value));
      }
    } else {
      status = ParseKeys(text, batch.keys);
      batch.bag_starts.push_back(static_cast<int64_t>(batch.keys.size()));
    }
    if (!status.ok()) {
      Truncate(batch, before);
      return absl::InvalidArgumentError(
          absl::StrCat(ColumnName(layout, column), ": ", status.message()));
    }
  }
  return absl::OkStatus();
}

// Lines of one plain or gzip file.
class ClickStream::LineReader {
 public:
  static absl::StatusOr<std::unique_ptr<LineReader>> Open(const std::string& path) {
    struct stat st;
    if (stat(path.c_str(), &st) != 0) {
      return absl::NotFoundError(absl::StrCat(path, ": ", std::strerror(errno)));
    }
    if (S_ISDIR(st.st_mode)) return absl::InvalidArgumentError(path + ": is a directory");
    gzFile file = gzopen(path.c_str(), "rb");
    if (file == nullptr) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
    gzbuffer(file, 1 << 18);
    return std::unique_ptr<LineReader>(new LineReader(path, file));
  }
  ~LineReader() { gzclose(file_); }

  // Appends the next line and a '\n' to `text`; false at the file's end.
  absl::StatusOr<bool> Next(std::string& text) {
    while (true) {
      const size_t newline = buffer_.find('\n', begin_);
      if (newline != std::string::npos || (eof_ && begin_ < buffer_.size())) {
        const size_t end = newline == std::string::npos ? buffer_.size() : newline;
        if (end - begin_ > kMaxClickLineBytes) return TooLong();
        text.append(buffer_, begin_, end - begin_);
        text.push_back('\n');
        begin_ = newline == std::string::npos ? buffer_.size() : newline + 1;
        ++line_number_;
        return true;
      }
      if (eof_) return false;
      if (buffer_.size() - begin_ > kMaxClickLineBytes) return TooLong();
      buffer_.erase(0, begin_);
      begin_ = 0;
      const size_t had = buffer_.size();
      buffer_.resize(had + kReadChunk);
      const int n = gzread(file_, buffer_.data() + had, kReadChunk);
      buffer_.resize(had + std::max(n, 0));
      if (n <= 0) {
        int error = Z_OK;
        const char* message = gzerror(file_, &error);
        // A stream cut short reads as Z_BUF_ERROR, a corrupt one as Z_DATA_ERROR.
        if (n < 0 || (error != Z_OK && error != Z_STREAM_END)) {
          return absl::InvalidArgumentError(
              absl::StrCat(path_, ": corrupt or truncated gzip: ", message));
        }
        eof_ = true;
      }
    }
  }

  const std::string& path() const { return path_; }
  // Of the last line Next returned, from 1.
  int64_t line_number() const { return line_number_; }

 private:
  LineReader(std::string path, gzFile file) : path_(std::move(path)), file_(file) {}
  absl::Status TooLong() const {
    return absl::InvalidArgumentError(absl::StrCat(
        path_, ":", line_number_ + 1, ": line longer than ", kMaxClickLineBytes, " bytes"));
  }

  const std::string path_;
  gzFile file_;
  std::string buffer_;
  size_t begin_ = 0;
  bool eof_ = false;
  int64_t line_number_ = 0;
};

struct ClickStream::Window {
  int64_t first_position = 0;
  std::string path;
  int64_t first_line = 0;           // in its file, from 1
  std::string text;                 // the lines, each ending in '\n'
  std::vector<size_t> line_starts;  // and text.size() at the end
  std::vector<int64_t> order;       // position - first_position -> line

  int64_t end_position() const { return first_position + static_cast<int64_t>(order.size()); }
};

ClickStream::ClickStream(ClickStreamOptions options) : options_(std::move(options)) {}
ClickStream::~ClickStream() = default;

absl::StatusOr<std::unique_ptr<ClickStream>> ClickStream::Open(ClickStreamOptions options) {
  if (options.files.empty()) return absl::InvalidArgumentError("no data files");
  if (options.shuffle_window < 0 || options.shuffle_window > kMaxShuffleWindow) {
    return absl::InvalidArgumentError(absl::StrCat("shuffle_window ", options.shuffle_window,
                                                   " is outside [0, ", kMaxShuffleWindow, "]"));
  }
  for (const std::string& path : options.files) {
    struct stat st;
    if (stat(path.c_str(), &st) != 0) {
      return absl::NotFoundError(absl::StrCat(path, ": ", std::strerror(errno)));
    }
  }
  return std::unique_ptr<ClickStream>(new ClickStream(std::move(options)));
}

absl::StatusOr<bool> ClickStream::LoadWindow() {
  const bool shuffled = options_.shuffle_window > 1;
  const int64_t lines = shuffled ? options_.shuffle_window : kUnshuffledWindow;
  while (true) {
    if (reader_ == nullptr) {
      if (next_file_ == options_.files.size()) return false;
      absl::StatusOr<std::unique_ptr<LineReader>> reader =
          LineReader::Open(options_.files[next_file_++]);
      if (!reader.ok()) return reader.status();
      reader_ = std::move(*reader);
    }
    Window window;
    window.path = reader_->path();
    window.first_line = reader_->line_number() + 1;
    while (static_cast<int64_t>(window.line_starts.size()) < lines) {
      const size_t start = window.text.size();
      absl::StatusOr<bool> more = reader_->Next(window.text);
      if (!more.ok()) return more.status();
      if (!*more) break;
      window.line_starts.push_back(start);
    }
    const int64_t n = static_cast<int64_t>(window.line_starts.size());
    if (n < lines) reader_.reset();
    if (n == 0) continue;
    window.line_starts.push_back(window.text.size());
    if (shuffled) {
      window.order = EpochOrder(Mix64(options_.seed) + static_cast<uint64_t>(windows_loaded_),
                                options_.epoch, n);
    } else {
      window.order.resize(n);
      for (int64_t i = 0; i < n; ++i) window.order[i] = i;
    }
    window.first_position = loaded_end_;
    loaded_end_ += n;
    ++windows_loaded_;
    windows_.push_back(std::move(window));
    return true;
  }
}

absl::StatusOr<int64_t> ClickStream::Available(int64_t end) {
  while (loaded_end_ < end && !ended_) {
    absl::StatusOr<bool> loaded = LoadWindow();
    if (!loaded.ok()) return loaded.status();
    ended_ = !*loaded;
  }
  return std::min(end, loaded_end_);
}

absl::Status ClickStream::Read(int64_t from, int64_t count, ClickBatch& batch) {
  if (from < 0 || count < 0) {
    return absl::InvalidArgumentError(absl::StrCat("positions [", from, ", +", count, ")"));
  }
  if (from < read_from_) {
    return absl::FailedPreconditionError(
        absl::StrCat("position ", from, " lies before ", read_from_, ", already read"));
  }
  absl::StatusOr<int64_t> available = Available(from + count);
  if (!available.ok()) return available.status();
  if (*available < from + count) {
    return absl::OutOfRangeError(
        absl::StrCat("the epoch has ", loaded_end_, " samples, fewer than ", from + count));
  }
  read_from_ = from;
  while (!windows_.empty() && windows_.front().end_position() <= from) windows_.pop_front();
  const int64_t before = batch.size();
  auto window = windows_.begin();
  for (int64_t p = from; p < from + count; ++p) {
    while (window->end_position() <= p) ++window;
    const int64_t line = window->order[p - window->first_position];
    const size_t start = window->line_starts[line];
    const absl::string_view text(window->text.data() + start,
                                 window->line_starts[line + 1] - start - 1);
    absl::Status status = ParseClickLine(text, batch);
    if (!status.ok()) {
      Truncate(batch, before);
      return absl::InvalidArgumentError(
          absl::StrCat(window->path, ":", window->first_line + line, ": ", status.message()));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<ClickBatch> ReadClickFiles(const std::vector<std::string>& files, ClickLayout layout,
                                          int64_t limit) {
  absl::StatusOr<std::unique_ptr<ClickStream>> stream =
      ClickStream::Open({.files = files, .layout = layout, .shuffle_window = 0});
  if (!stream.ok()) return stream.status();
  ClickBatch batch;
  batch.layout = layout;
  const int64_t end = limit > 0 ? limit : std::numeric_limits<int64_t>::max();
  for (int64_t from = 0; from < end;) {
    absl::StatusOr<int64_t> available =
        (*stream)->Available(std::min(end - from, kUnshuffledWindow) + from);
    if (!available.ok()) return available.status();
    if (*available == from) break;
    absl::Status read = (*stream)->Read(from, *available - from, batch);
    if (!read.ok()) return read;
    from = *available;
  }
  return batch;
}

}  // namespace pstrain
