// The client library's files (include/pstrain/client.h): model files.
#include "pstrain/client.h"

#include "common/job_spec.h"
#include "common/model_file.h"
#include "common/status.h"

namespace pstrain {

absl::StatusOr<std::vector<ModelTensor>> ReadModel(const std::string& path) {
  PSTRAIN_ASSIGN_OR_RETURN(ModelFile file, ReadModelFile(path));
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

}  // namespace pstrain
