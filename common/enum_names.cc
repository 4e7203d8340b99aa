#include "common/enum_names.h"

#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

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

absl::StatusOr<const google::protobuf::EnumValueDescriptor*> EnumValueOf(
    const google::protobuf::EnumDescriptor* e, absl::string_view text) {
  const std::string upper = absl::AsciiStrToUpper(text);
  const std::string prefix = EnumPrefix(e);
  std::vector<std::string> names;
  for (int i = 0; i < e->value_count(); ++i) {
    const google::protobuf::EnumValueDescriptor* v = e->value(i);
    if (v->number() == 0) continue;
    if (upper == v->name() || prefix + upper == v->name()) return v;
    names.push_back(EnumName(v));
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown value '", text, "' (expected one of: ",
                                                 absl::StrJoin(names, ", "), ")"));
}

}  // namespace pstrain
