// The one name of a proto enum value that pstrain shows and reads (job
// files, psctl, logs, metric labels): the value's name without its enum's
// prefix, in lowercase. Every enum of proto/pstrain/v1 names its 0 value
// PREFIX_UNSPECIFIED.
#ifndef PSTRAIN_COMMON_ENUM_NAMES_H_
#define PSTRAIN_COMMON_ENUM_NAMES_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/generated_enum_reflection.h"

namespace pstrain {

// "MODE_SYNC": "sync", "JOB_STATE_SUCCEEDED": "succeeded".
std::string EnumName(const google::protobuf::EnumValueDescriptor* value);
// The same by number; "unknown(N)" for a number the enum does not have.
std::string EnumName(const google::protobuf::EnumDescriptor* e, int number);
template <typename E>
std::string EnumName(E value) {
  return EnumName(google::protobuf::GetEnumDescriptor<E>(), static_cast<int>(value));
}

// The prefix of an enum's value names ("MODEL_TYPE_").
std::string EnumPrefix(const google::protobuf::EnumDescriptor* e);

// The value `text` names, in any case, with or without the prefix ("sync",
// "MODE_SYNC"); never the 0 value. INVALID_ARGUMENT listing the names
// otherwise.
absl::StatusOr<const google::protobuf::EnumValueDescriptor*> EnumValueOf(
    const google::protobuf::EnumDescriptor* e, absl::string_view text);

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_ENUM_NAMES_H_
