#include "common/table_file.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/file_format.h"
#include "common/status.h"

namespace pstrain {
namespace {

constexpr char kMagic[4] = {'P', 'S', 'T', 'B'};
constexpr uint32_t kFormatVersion = 1;
constexpr size_t kHeadBytes = 20;
constexpr size_t kFlushBytes = 1 << 20;

}  // namespace

absl::StatusOr<std::unique_ptr<TableFileWriter>> TableFileWriter::Create(FileSystem* fs,
                                                                         const std::string& path,
                                                                         int dim, int64_t rows) {
  if (dim < 1 || rows < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("table file ", path, ": dim ", dim, " and ", rows, " rows"));
  }
  PSTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> file,
                           fs->OpenForAppend(path + ".tmp", /*truncate=*/true));
  std::unique_ptr<TableFileWriter> w(new TableFileWriter(fs, path, dim, rows, std::move(file)));
  std::string& head = w->out_.buffer();
  head.assign(kMagic, sizeof(kMagic));
  PutU32(head, kFormatVersion);
  PutU32(head, static_cast<uint32_t>(dim));
  PutU64(head, static_cast<uint64_t>(rows));
  return w;
}

TableFileWriter::~TableFileWriter() {
  if (finished_) return;
  file_.reset();
  fs_->Remove(path_ + ".tmp").IgnoreError();
}

absl::Status TableFileWriter::Append(uint64_t key, absl::Span<const float> values) {
  if (written_ >= rows_ || static_cast<int64_t>(values.size()) != dim_ ||
      (written_ > 0 && key <= last_key_)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "table file ", path_, ": row ", written_, " (key ", key, ", ", values.size(),
        " values) does not follow: ", rows_, " rows of ", dim_, " values in ascending keys"));
  }
  std::string& b = out_.buffer();
  PutU64(b, key);
  b.append(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(float));
  ++written_;
  last_key_ = key;
  return out_.Flush(kFlushBytes);
}

absl::Status TableFileWriter::Finish() {
  if (written_ != rows_) {
    return absl::InvalidArgumentError(
        absl::StrCat("table file ", path_, ": ", written_, " rows of ", rows_));
  }
  PSTRAIN_RETURN_IF_ERROR(out_.Flush());
  std::string trailer;
  PutU32(trailer, out_.crc());
  PSTRAIN_RETURN_IF_ERROR(file_->Append(trailer));
  PSTRAIN_RETURN_IF_ERROR(file_->Sync());
  PSTRAIN_RETURN_IF_ERROR(file_->Close());
  PSTRAIN_RETURN_IF_ERROR(fs_->Rename(path_ + ".tmp", path_));
  finished_ = true;
  return absl::OkStatus();
}

const float* TableFile::Find(uint64_t key) const {
  const auto it = std::lower_bound(keys.begin(), keys.end(), key);
  if (it == keys.end() || *it != key) return nullptr;
  return values.data() + (it - keys.begin()) * static_cast<int64_t>(dim);
}

absl::StatusOr<TableFile> ReadTableFile(FileSystem* fs, const std::string& path) {
  absl::StatusOr<std::string> read = fs->ReadFile(path);
  if (!read.ok()) {
    if (read.status().code() == absl::StatusCode::kNotFound) return read.status();
    return absl::DataLossError(absl::StrCat("table file ", path, ": ", read.status().message()));
  }
  const std::string& bytes = *read;
  auto damaged = [&](absl::string_view why) {
    return absl::DataLossError(absl::StrCat("table file ", path, " is damaged: ", why));
  };
  if (bytes.size() < kHeadBytes + 4 || std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) != 0) {
    return damaged(bytes.size() < kHeadBytes + 4 ? "too short" : "not a table file (bad magic)");
  }
  const uint32_t stored = GetU32(bytes, bytes.size() - 4);
  if (stored != Crc32(bytes.data(), bytes.size() - 4)) return damaged("CRC-32 mismatch");
  if (GetU32(bytes, 4) != kFormatVersion) {
    return damaged(absl::StrCat("format version ", GetU32(bytes, 4)));
  }
  TableFile table;
  table.dim = static_cast<int>(GetU32(bytes, 8));
  const uint64_t rows = GetU64(bytes, 12);
  const uint64_t row_bytes = 8 + 4 * uint64_t{static_cast<uint32_t>(table.dim)};
  const uint64_t body = bytes.size() - 4 - kHeadBytes;
  if (table.dim < 1 || rows > body / row_bytes || rows * row_bytes != body) {
    return damaged(absl::StrCat(rows, " rows of dim ", table.dim, " in ", body, " bytes"));
  }
  table.keys.resize(rows);
  table.values.resize(rows * table.dim);
  size_t at = kHeadBytes;
  for (uint64_t r = 0; r < rows; ++r) {
    table.keys[r] = GetU64(bytes, at);
    if (r > 0 && table.keys[r] <= table.keys[r - 1]) return damaged("keys out of order");
    std::memcpy(table.values.data() + r * table.dim, bytes.data() + at + 8, 4 * table.dim);
    at += row_bytes;
  }
  return table;
}

}  // namespace pstrain
