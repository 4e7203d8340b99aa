#include "common/export_dir.h"

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace pstrain {

std::string ExportTablePath(const std::string& dir, const std::string& table) {
  return absl::StrCat(dir, "/tables/", table, ".rows");
}

absl::StatusOr<TableExport> ReadTableExport(FileSystem* fs, const std::string& dir) {
  if (!fs->Exists(absl::StrCat(dir, "/", kExportManifest))) {
    return absl::InvalidArgumentError(
        absl::StrCat(dir, " is not a finished export: it has no ", kExportManifest));
  }
  TableExport e;
  PSTRAIN_ASSIGN_OR_RETURN(e.model, ReadModelFile(absl::StrCat(dir, "/", kExportModelFile)));
  const v1::JobSpec& spec = e.model.header.spec();
  for (const v1::EmbeddingTableSpec& table : spec.tables()) {
    const std::string path = ExportTablePath(dir, table.name());
    PSTRAIN_ASSIGN_OR_RETURN(TableFile file, ReadTableFile(fs, path));
    if (file.dim != table.dim()) {
      return absl::InvalidArgumentError(absl::StrCat(path, " has rows of ", file.dim,
                                                     " values; table ", table.name(),
                                                     " of the model file has dim ", table.dim()));
    }
    e.tables.push_back(std::move(file));
  }
  return e;
}

}  // namespace pstrain
