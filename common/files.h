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

// OK if `path` (absolute; it or its last components may not exist yet) lies
// in the directory `root` once symbolic links and ".." are resolved, or if
// `root` is empty (no confinement). INVALID_ARGUMENT naming `field` and
// `root_flag` otherwise, or when root does not exist.
absl::Status CheckPathWithin(absl::string_view field, const std::string& path,
                             absl::string_view root_flag, const std::string& root);

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_FILES_H_
