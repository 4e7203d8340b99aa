#include "common/node_id.h"

#include <algorithm>
#include <cstdlib>
#include <random>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"

namespace pstrain {

bool IsValidNodeId(const std::string& id) {
  if (id.empty() || id.size() > 63) return false;
  auto alnum = [](char c) { return absl::ascii_isdigit(c) || absl::ascii_islower(c); };
  if (!alnum(id.front()) || !alnum(id.back())) return false;
  return std::all_of(id.begin(), id.end(),
                     [&](char c) { return alnum(c) || c == '-' || c == '.'; });
}

absl::StatusOr<std::string> NodeIdFromFlagOrEnvironment(const std::string& flag) {
  std::string id = flag;
  const char* from = "--node_id";
  if (id.empty()) {
    const char* env = std::getenv("PSTRAIN_NODE_ID");
    if (env == nullptr || *env == '\0') return std::string();
    id = env;
    from = "PSTRAIN_NODE_ID";
  }
  if (!IsValidNodeId(id)) {
    return absl::InvalidArgumentError(absl::StrCat(
        from, ": '", id.substr(0, 80),
        "' is not a node id (1-63 of a-z, 0-9, '-' and '.', starting and ending alphanumeric)"));
  }
  return id;
}

absl::StatusOr<std::string> ExpandNodeId(const std::string& flag, const std::string& text,
                                         const std::string& node_id) {
  constexpr absl::string_view kPlaceholder = "{node_id}";
  if (!absl::StrContains(text, kPlaceholder)) return text;
  if (node_id.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        flag, " '", text, "' has {node_id} but the node has no id (--node_id, $PSTRAIN_NODE_ID)"));
  }
  return absl::StrReplaceAll(text, {{kPlaceholder, node_id}});
}

uint64_t RandomProcessToken() {
  std::random_device entropy;
  uint64_t n = 0;
  while (n == 0) n = (uint64_t{entropy()} << 32) | entropy();
  return n;
}

}  // namespace pstrain
