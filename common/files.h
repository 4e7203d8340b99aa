// Small file helpers on the machine's file system (file_system.h has the
// seam that durable state goes through).
#ifndef PSTRAIN_COMMON_FILES_H_
#define PSTRAIN_COMMON_FILES_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace pstrain {

// Writes `contents` to a temporary file beside `path`, fsyncs it, renames it
// over `path` and fsyncs the directory: readers see the old or the new
// contents, never a part, and the new contents survive a machine crash.
absl::Status WriteFileAtomically(const std::string& path, absl::string_view contents);

// The whole file; NOT_FOUND if it does not exist.
absl::StatusOr<std::string> ReadFile(const std::string& path);

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_FILES_H_
