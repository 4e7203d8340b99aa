#include "common/script_metrics.h"

#include <cmath>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace pstrain {
namespace {

bool ValidName(const std::string& name) {
  if (name.empty() || name.size() > 64 || absl::ascii_isdigit(name[0])) return false;
  for (const char c : name) {
    if (!absl::ascii_isalnum(c) && c != '_') return false;
  }
  return true;
}

}  // namespace

absl::Status CheckScriptMetrics(const google::protobuf::Map<std::string, double>& metrics) {
  if (metrics.size() > static_cast<size_t>(kMaxScriptMetrics)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "metrics: ", metrics.size(), " names, at most ", kMaxScriptMetrics, " are kept"));
  }
  for (const auto& [name, value] : metrics) {
    if (!ValidName(name)) {
      return absl::InvalidArgumentError(
          absl::StrCat("metrics: the name '", absl::CHexEscape(name.substr(0, 80)),
                       "' is not 1-64 of letters, digits and '_' starting with a letter or '_'"));
    }
    if (!std::isfinite(value)) {
      return absl::InvalidArgumentError(
          absl::StrCat("metrics: ", name, " is ", value, ", not a finite number"));
    }
  }
  return absl::OkStatus();
}

}  // namespace pstrain
