#include "common/enum_names.h"

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace pstrain {

std::string EnumPrefix(const google::protobuf::EnumDescriptor* e) {
  const std::string& zero = e->FindValueByNumber(0)->name();
  return zero.substr(0, zero.size() - std::string("UNSPECIFIED").size());
}

std::string EnumName(const google::protobuf::EnumValueDescriptor* value) {
  return absl::AsciiStrToLower(value->name().substr(EnumPrefix(value->type()).size()));
}

std::string EnumName(const google::protobuf::EnumDescriptor* e, int number) {
  const google::protobuf::EnumValueDescriptor* v = e->FindValueByNumber(number);
  return v == nullptr ? absl::StrCat("unknown(", number, ")") : EnumName(v);
}

}  // namespace pstrain
