#include "common/files.h"

#include "common/file_system.h"

namespace pstrain {

absl::Status WriteFileAtomically(const std::string& path, absl::string_view contents) {
  return PosixFileSystem()->WriteFileAtomically(path, contents);
}

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  return PosixFileSystem()->ReadFile(path);
}

}  // namespace pstrain
