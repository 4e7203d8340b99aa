#include "server/targets_file.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "glog/logging.h"
#include "server/coordinator_metrics.h"

namespace pstrain::server {

std::string TargetsText(const std::string& coordinator_metrics_address,
                        const NodeRegistry& registry) {
  auto group = [](const std::string& address, const std::string& role, const std::string& node) {
    return absl::StrFormat(
        "  {\"targets\": [\"%s\"], \"labels\": {\"role\": \"%s\", \"node\": \"%s\"}}", address,
        role, node);
  };
  std::vector<std::string> groups;
  if (!coordinator_metrics_address.empty()) {
    groups.push_back(group(coordinator_metrics_address, "coordinator", "coordinator"));
  }
  for (const auto& [id, node] : registry.nodes()) {
    if (node.info.state() != v1::NODE_STATE_ALIVE || node.info.metrics_address().empty()) continue;
    groups.push_back(group(node.info.metrics_address(), EnumName(node.info.role()), id));
  }
  return absl::StrCat("[\n", absl::StrJoin(groups, ",\n"), "\n]\n");
}

void TargetsFile::Write(const std::string& text) {
  if (path_.empty() || text == written_) return;
  if (absl::Status s = fs_->WriteFileAtomically(path_, text); !s.ok()) {
    LOG(ERROR) << "cannot write the Prometheus targets: " << s;
    return;
  }
  written_ = text;
}

}  // namespace pstrain::server
