#include "common/files.h"

#include <climits>
#include <cstdlib>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/file_system.h"

namespace pstrain {

absl::Status WriteFileAtomically(const std::string& path, absl::string_view contents) {
  return PosixFileSystem()->WriteFileAtomically(path, contents);
}

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  return PosixFileSystem()->ReadFile(path);
}

absl::Status CheckPathWithin(absl::string_view field, const std::string& path,
                             absl::string_view root_flag, const std::string& root) {
  if (root.empty()) return absl::OkStatus();
  char resolved[PATH_MAX];
  if (realpath(root.c_str(), resolved) == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(root_flag, " ", root, " does not exist on this machine"));
  }
  const std::string real_root = resolved;
  const auto outside = [&] {
    return absl::InvalidArgumentError(absl::StrCat(field, ": ", path.substr(0, 200),
                                                   " is outside this node's ", root_flag, " ",
                                                   root));
  };
  if (path.empty() || path.front() != '/') return outside();
  // The deepest part of the path that exists, resolved; what follows it
  // must not climb back out.
  std::string existing = path, rest;
  while (realpath(existing.c_str(), resolved) == nullptr) {
    const size_t slash = existing.rfind('/');
    if (slash == std::string::npos || slash == 0) return outside();
    rest = existing.substr(slash) + rest;
    existing = existing.substr(0, slash);
  }
  for (absl::string_view part : absl::StrSplit(rest, '/')) {
    if (part == "..") return outside();
  }
  const std::string real_path = std::string(resolved) + rest;
  if (real_path == real_root || real_root == "/" ||
      absl::StartsWith(real_path, real_root + "/")) {
    return absl::OkStatus();
  }
  return outside();
}

}  // namespace pstrain
