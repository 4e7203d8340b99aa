#include "common/model_file.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/file_format.h"
#include "common/files.h"
#include "common/job_spec.h"
#include "common/status.h"

namespace pstrain {
namespace {

constexpr char kMagic[4] = {'P', 'S', 'T', 'M'};
constexpr uint32_t kVersion = 1;

absl::Status Invalid(absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("model file: ", what));
}

}  // namespace

std::string EncodeModelFile(const std::string& job_id, const v1::JobSpec& spec,
                            const std::vector<float>& params) {
  v1::ModelFileHeader header;
  header.set_job_id(job_id);
  *header.mutable_spec() = spec;
  for (const kernels::TensorDesc& t : JobTensors(spec)) {
    v1::TensorInfo* info = header.add_tensors();
    info->set_name(t.name);
    for (int64_t d : t.shape) info->add_shape(d);
    info->set_offset(t.offset);
    info->set_size(t.size);
    info->set_buffer(t.buffer);
  }
  header.set_total_floats(static_cast<int64_t>(params.size()));
  header.set_payload_crc32(Crc32(params.data(), params.size() * sizeof(float)));
  const std::string header_bytes = header.SerializeAsString();
  std::string out(kMagic, 4);
  PutU32(out, kVersion);
  PutU32(out, static_cast<uint32_t>(header_bytes.size()));
  out += header_bytes;
  out.append(reinterpret_cast<const char*>(params.data()), params.size() * sizeof(float));
  return out;
}

absl::StatusOr<ModelFile> DecodeModelFile(absl::string_view bytes) {
  if (bytes.size() < 12) return Invalid("truncated before the header");
  if (std::memcmp(bytes.data(), kMagic, 4) != 0) return Invalid("not a pstrain model file");
  if (GetU32(bytes, 4) != kVersion) {
    return Invalid(absl::StrCat("unsupported format version ", GetU32(bytes, 4)));
  }
  const uint32_t header_len = GetU32(bytes, 8);
  if (header_len > bytes.size() - 12) return Invalid("truncated header");
  if (header_len > (1u << 30)) return Invalid("header larger than 1 GiB");
  ModelFile file;
  if (!file.header.ParseFromArray(bytes.data() + 12, static_cast<int>(header_len))) {
    return Invalid("unparsable header");
  }
  absl::StatusOr<v1::JobSpec> spec = NormalizeJobSpec(file.header.spec());
  if (!spec.ok()) return Invalid(absl::StrCat("bad spec: ", spec.status().message()));
  const std::vector<kernels::TensorDesc> tensors = JobTensors(*spec);
  if (file.header.tensors_size() != static_cast<int>(tensors.size())) {
    return Invalid("the tensors do not match the model spec");
  }
  int64_t total = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const v1::TensorInfo& info = file.header.tensors(i);
    if (info.offset() != tensors[i].offset || info.size() != tensors[i].size) {
      return Invalid(absl::StrCat("tensor ", info.name(), " does not match the model spec"));
    }
    total += tensors[i].size;
  }
  if (file.header.total_floats() != total) return Invalid("total_floats does not match the model");
  const size_t payload = bytes.size() - 12 - header_len;
  if (payload != static_cast<size_t>(total) * sizeof(float)) {
    return Invalid(absl::StrCat("payload of ", payload, " bytes, expected ", total * 4));
  }
  const char* values = bytes.data() + 12 + header_len;
  if (Crc32(values, payload) != file.header.payload_crc32()) return Invalid("checksum mismatch");
  file.params.resize(total);
  std::memcpy(file.params.data(), values, payload);
  return file;
}

absl::StatusOr<ModelFile> ReadModelFile(const std::string& path) {
  PSTRAIN_ASSIGN_OR_RETURN(std::string bytes, ReadFile(path));
  absl::StatusOr<ModelFile> file = DecodeModelFile(bytes);
  if (!file.ok()) {
    return absl::Status(file.status().code(), absl::StrCat(path, ": ", file.status().message()));
  }
  return file;
}

}  // namespace pstrain
