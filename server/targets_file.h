// The Prometheus file_sd targets file: the /metrics address of the
// coordinator and of every live node, with role and node labels.
#ifndef PSTRAIN_SERVER_TARGETS_FILE_H_
#define PSTRAIN_SERVER_TARGETS_FILE_H_

#include <string>

#include "common/file_system.h"
#include "server/node_registry.h"

namespace pstrain::server {

// The file's contents for the coordinator's own /metrics address (empty:
// not listed) and the live nodes of `registry`.
std::string TargetsText(const std::string& coordinator_metrics_address,
                        const NodeRegistry& registry);

// Writes the file when its contents change. Not thread-safe; call it
// without holding locks that RPCs take (it syncs the disk).
class TargetsFile {
 public:
  TargetsFile(FileSystem* fs, std::string path) : fs_(fs), path_(std::move(path)) {}
  void Write(const std::string& text);

 private:
  FileSystem* const fs_;
  const std::string path_;
  std::string written_;
};

}  // namespace pstrain::server

#endif  // PSTRAIN_SERVER_TARGETS_FILE_H_
