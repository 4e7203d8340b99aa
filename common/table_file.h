// An embedding table as an export holds it (docs/sparse-tables.md,
// "Export"): every row by key, in one file. Layout (integers little-endian):
//
//   "PSTB" | u32 format version (1) | u32 dim | u64 rows |
//   rows × (u64 key | dim fp32 values), keys strictly ascending |
//   u32 CRC-32 of every byte before it
//
// Written row by row (a table need not fit in memory twice) to a temporary
// name, synced and renamed, as checkpoints are.
#ifndef PSTRAIN_COMMON_TABLE_FILE_H_
#define PSTRAIN_COMMON_TABLE_FILE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/file_format.h"
#include "common/file_system.h"

namespace pstrain {

class TableFileWriter {
 public:
  // A file of `rows` rows of `dim` floats at `path`.
  static absl::StatusOr<std::unique_ptr<TableFileWriter>> Create(FileSystem* fs,
                                                                 const std::string& path, int dim,
                                                                 int64_t rows);
  ~TableFileWriter();  // a file not finished is removed

  // The next row: INVALID_ARGUMENT for a key not above the last one, values
  // of another size or a row beyond `rows`.
  absl::Status Append(uint64_t key, absl::Span<const float> values);
  // Checks that every row came, and puts the file in place.
  absl::Status Finish();

 private:
  TableFileWriter(FileSystem* fs, std::string path, int dim, int64_t rows,
                  std::unique_ptr<WritableFile> file)
      : fs_(fs),
        path_(std::move(path)),
        dim_(dim),
        rows_(rows),
        file_(std::move(file)),
        out_(file_.get()) {}

  FileSystem* const fs_;
  const std::string path_;
  const int dim_;
  const int64_t rows_;
  std::unique_ptr<WritableFile> file_;
  ChecksummedWriter out_;
  int64_t written_ = 0;
  uint64_t last_key_ = 0;
  bool finished_ = false;
};

struct TableFile {
  int dim = 0;
  std::vector<uint64_t> keys;  // ascending
  std::vector<float> values;   // dim floats a key

  // The row of `key` (dim floats), or null.
  const float* Find(uint64_t key) const;
};

// Reads and checks a table file: NOT_FOUND if it is missing, DATA_LOSS
// naming the file and what is wrong with it otherwise.
absl::StatusOr<TableFile> ReadTableFile(FileSystem* fs, const std::string& path);

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_TABLE_FILE_H_
