// The client library's files (include/pstrain/client.h): model files and
// export directories.
#include "pstrain/client.h"

#include <filesystem>

#include "common/export_dir.h"
#include "common/job_spec.h"
#include "common/model_file.h"
#include "common/status.h"

namespace pstrain {

namespace {

std::vector<ModelTensor> TensorsOf(const ModelFile& file) {
  const v1::ModelSpec& model = file.header.spec().model();
  std::vector<ModelTensor> tensors;
  for (int t = 0; t < file.header.tensors_size(); ++t) {
    const v1::TensorInfo& info = file.header.tensors(t);
    ModelTensor& tensor = tensors.emplace_back();
    tensor.spec.name = info.name();
    tensor.spec.shape.assign(info.shape().begin(), info.shape().end());
    if (info.buffer() && t < model.tensors_size()) {
      tensor.spec.buffer = true;
      tensor.spec.dtype = TensorDTypeName(model.tensors(t));
    }
    tensor.values.assign(file.params.begin() + info.offset(),
                         file.params.begin() + info.offset() + info.size());
  }
  return tensors;
}

}  // namespace

absl::StatusOr<std::vector<ModelTensor>> ReadModel(const std::string& path) {
  PSTRAIN_ASSIGN_OR_RETURN(ModelFile file, ReadModelFile(path));
  return TensorsOf(file);
}

absl::StatusOr<ModelExport> ReadExport(const std::string& path) {
  ModelExport out;
  if (!std::filesystem::is_directory(path)) {
    PSTRAIN_ASSIGN_OR_RETURN(out.tensors, ReadModel(path));
    return out;
  }
  PSTRAIN_ASSIGN_OR_RETURN(TableExport exported, ReadTableExport(PosixFileSystem(), path));
  out.tensors = TensorsOf(exported.model);
  const v1::JobSpec& spec = exported.model.header.spec();
  for (int t = 0; t < spec.tables_size(); ++t) {
    TableFile& file = exported.tables[t];
    out.tables.push_back({.name = spec.tables(t).name(),
                          .dim = file.dim,
                          .keys = std::move(file.keys),
                          .rows = std::move(file.values)});
  }
  return out;
}

}  // namespace pstrain
