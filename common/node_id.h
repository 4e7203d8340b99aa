// Node ids: what names a server or worker in the cluster.
#ifndef PSTRAIN_COMMON_NODE_ID_H_
#define PSTRAIN_COMMON_NODE_ID_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace pstrain {

// Whether `id` may name a node: 1 to 63 characters of [a-z0-9.-], starting
// and ending with a letter or digit (a DNS label, as pod names are).
bool IsValidNodeId(const std::string& id);

// The node id a daemon runs under: `flag` (--node_id) if set, else the
// environment's PSTRAIN_NODE_ID (so that a Kubernetes manifest can set it
// from the pod name), else empty (the node names itself). INVALID_ARGUMENT
// for an id that IsValidNodeId refuses.
absl::StatusOr<std::string> NodeIdFromFlagOrEnvironment(const std::string& flag);

// `text` (the value of the flag named `flag`) with each "{node_id}" replaced
// by `node_id`, so that one manifest serves every pod of a StatefulSet.
// INVALID_ARGUMENT naming the flag if it has one and the node has no id.
absl::StatusOr<std::string> ExpandNodeId(const std::string& flag, const std::string& text,
                                         const std::string& node_id);

// A random number that tells one process apart from every other (never 0):
// a node's incarnation, a server's Hello instance.
uint64_t RandomProcessToken();

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_NODE_ID_H_
