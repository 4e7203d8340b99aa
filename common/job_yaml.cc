#include "common/job_yaml.h"

#include <yaml-cpp/yaml.h>

#include <fstream>
#include <set>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/enum_names.h"
#include "common/job_spec.h"
#include "common/status.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/message.h"
#include "google/protobuf/reflection.h"

namespace pstrain {

absl::Status FieldError(const std::string& path, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(path, ": ", what));
}

namespace {

using google::protobuf::EnumDescriptor;
using google::protobuf::EnumValueDescriptor;
using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;

std::string Join(const std::string& path, const std::string& key) {
  return path.empty() ? key : absl::StrCat(path, ".", key);
}

absl::StatusOr<const EnumValueDescriptor*> ParseEnum(const EnumDescriptor* e,
                                                     const std::string& text,
                                                     const std::string& path) {
  absl::StatusOr<const EnumValueDescriptor*> value = EnumValueOf(e, text);
  if (!value.ok()) return FieldError(path, value.status().message());
  return value;
}

absl::Status SetScalar(const YAML::Node& node, const FieldDescriptor* field,
                       const std::string& path, Message* msg) {
  if (!node.IsScalar()) return FieldError(path, "expected a single value");
  const std::string text = node.Scalar();
  const Reflection* r = msg->GetReflection();
  const bool repeated = field->is_repeated();
  auto bad = [&](absl::string_view type) {
    return FieldError(path, absl::StrCat("expected ", type, ", got '", text, "'"));
  };
  switch (field->cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32: {
      int32_t v;
      if (!absl::SimpleAtoi(text, &v)) return bad("an integer");
      repeated ? r->AddInt32(msg, field, v) : r->SetInt32(msg, field, v);
      break;
    }
    case FieldDescriptor::CPPTYPE_INT64: {
      int64_t v;
      if (!absl::SimpleAtoi(text, &v)) return bad("an integer");
      repeated ? r->AddInt64(msg, field, v) : r->SetInt64(msg, field, v);
      break;
    }
    case FieldDescriptor::CPPTYPE_UINT32: {
      uint32_t v;
      if (!absl::SimpleAtoi(text, &v)) return bad("a non-negative integer");
      repeated ? r->AddUInt32(msg, field, v) : r->SetUInt32(msg, field, v);
      break;
    }
    case FieldDescriptor::CPPTYPE_UINT64: {
      uint64_t v;
      if (!absl::SimpleAtoi(text, &v)) return bad("a non-negative integer");
      repeated ? r->AddUInt64(msg, field, v) : r->SetUInt64(msg, field, v);
      break;
    }
    case FieldDescriptor::CPPTYPE_FLOAT: {
      float v;
      if (!absl::SimpleAtof(text, &v) || !std::isfinite(v)) return bad("a finite number");
      repeated ? r->AddFloat(msg, field, v) : r->SetFloat(msg, field, v);
      break;
    }
    case FieldDescriptor::CPPTYPE_DOUBLE: {
      double v;
      if (!absl::SimpleAtod(text, &v) || !std::isfinite(v)) return bad("a finite number");
      repeated ? r->AddDouble(msg, field, v) : r->SetDouble(msg, field, v);
      break;
    }
    case FieldDescriptor::CPPTYPE_BOOL: {
      bool v;
      if (!absl::SimpleAtob(text, &v)) return bad("true or false");
      repeated ? r->AddBool(msg, field, v) : r->SetBool(msg, field, v);
      break;
    }
    case FieldDescriptor::CPPTYPE_STRING:
      repeated ? r->AddString(msg, field, text) : r->SetString(msg, field, text);
      break;
    case FieldDescriptor::CPPTYPE_ENUM: {
      PSTRAIN_ASSIGN_OR_RETURN(const EnumValueDescriptor* v,
                               ParseEnum(field->enum_type(), text, path));
      repeated ? r->AddEnum(msg, field, v) : r->SetEnum(msg, field, v);
      break;
    }
    case FieldDescriptor::CPPTYPE_MESSAGE:
      return FieldError(path, "internal: message field treated as scalar");
  }
  return absl::OkStatus();
}

absl::Status FillMessage(const YAML::Node& node, const std::string& path, Message* msg);

absl::Status SetField(const YAML::Node& value, const FieldDescriptor* field,
                      const std::string& path, Message* msg) {
  const Reflection* r = msg->GetReflection();
  if (field->is_repeated()) {
    if (!value.IsSequence()) return FieldError(path, "expected a list");
    for (size_t i = 0; i < value.size(); ++i) {
      const std::string item_path = absl::StrCat(path, "[", i, "]");
      if (field->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) {
        PSTRAIN_RETURN_IF_ERROR(FillMessage(value[i], item_path, r->AddMessage(msg, field)));
      } else {
        PSTRAIN_RETURN_IF_ERROR(SetScalar(value[i], field, item_path, msg));
      }
    }
    return absl::OkStatus();
  }
  if (field->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) {
    return FillMessage(value, path, r->MutableMessage(msg, field));
  }
  return SetScalar(value, field, path, msg);
}

absl::Status FillMessage(const YAML::Node& node, const std::string& path, Message* msg) {
  if (!node.IsMap()) {
    return FieldError(path.empty() ? "job spec" : path, "expected a mapping of fields");
  }
  std::set<std::string> seen;
  for (auto it = node.begin(); it != node.end(); ++it) {
    if (!it->first.IsScalar()) return FieldError(path.empty() ? "job spec" : path, "bad key");
    const std::string key = it->first.Scalar();
    const std::string key_path = Join(path, key);
    if (!seen.insert(key).second) return FieldError(key_path, "duplicate key");
    const FieldDescriptor* field = msg->GetDescriptor()->FindFieldByName(key);
    if (field == nullptr) return FieldError(key_path, "unknown field");
    if (!it->second.IsDefined() || it->second.IsNull()) {
      return FieldError(key_path, "has no value");
    }
    PSTRAIN_RETURN_IF_ERROR(SetField(it->second, field, key_path, msg));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<v1::JobSpec> ParseJobSpecYaml(absl::string_view yaml) {
  if (yaml.size() > kMaxJobFileBytes) {
    return absl::InvalidArgumentError(absl::StrCat("job spec: ", yaml.size(),
                                                   " bytes; a job file has at most ",
                                                   kMaxJobFileBytes));
  }
  YAML::Node root;
  try {
    root = YAML::Load(std::string(yaml));
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("job spec: YAML error at line ",
                                                   e.mark.line + 1, ", column ",
                                                   e.mark.column + 1, ": ", e.msg));
  }
  if (!root.IsDefined() || root.IsNull()) {
    return absl::InvalidArgumentError("job spec: empty document");
  }
  v1::JobSpec spec;
  try {
    PSTRAIN_RETURN_IF_ERROR(FillMessage(root, "", &spec));
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("job spec: ", e.what()));
  }
  return spec;
}

absl::StatusOr<v1::JobSpec> LoadJobSpecFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read job file ", path));
  std::stringstream text;
  text << in.rdbuf();
  return ParseJobSpecYaml(text.str());
}

}  // namespace pstrain
