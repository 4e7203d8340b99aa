// A job's export directory (docs/sparse-tables.md, "Export"), as
// server/table_export.h writes it from the servers' checkpoints and
// pstrain-local --eval, the client library and pstrain.torch read it:
//
//   DIR/model.pstrain      the dense part: the job's model file
//   DIR/tables/NAME.rows   every row of table NAME, by key (table_file.h)
//   DIR/export.json        what the directory holds; written last
#ifndef PSTRAIN_COMMON_EXPORT_DIR_H_
#define PSTRAIN_COMMON_EXPORT_DIR_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/file_system.h"
#include "common/model_file.h"
#include "common/table_file.h"

namespace pstrain {

// The files of an export directory.
inline constexpr char kExportModelFile[] = "model.pstrain";
inline constexpr char kExportManifest[] = "export.json";
std::string ExportTablePath(const std::string& dir, const std::string& table);

// An export read back: the dense part, and each table of its spec in table
// order.
struct TableExport {
  ModelFile model;
  std::vector<TableFile> tables;
};
// INVALID_ARGUMENT or DATA_LOSS naming the file at fault, also for tables
// that do not match the model file's spec.
absl::StatusOr<TableExport> ReadTableExport(FileSystem* fs, const std::string& dir);

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_EXPORT_DIR_H_
