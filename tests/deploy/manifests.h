// The Kubernetes manifests of deploy/k8s as a reviewer reads them: rendered
// by kubectl kustomize, checked for what every workload must have, and
// rewritten into what `podman kube play` (podman 4.3) can run.
#ifndef PSTRAIN_TESTS_DEPLOY_MANIFESTS_H_
#define PSTRAIN_TESTS_DEPLOY_MANIFESTS_H_

#include <initializer_list>
#include <string>
#include <string_view>
#include <vector>

#include <yaml-cpp/yaml.h>

#include "absl/status/statusor.h"

namespace pstrain::testing {

// node[path[0]][path[1]]...: a map's key, or a sequence's index given as
// digits; an undefined node (false as a condition) where the path leads nowhere (yaml-cpp throws if one
// goes on from a missing key). The node found is the document's own, not a
// copy.
YAML::Node At(const YAML::Node& node, std::initializer_list<std::string_view> path);

// A scalar's text; empty for anything else.
std::string Str(const YAML::Node& node);

// The documents of a multi-document YAML text; INVALID_ARGUMENT if it does
// not parse. Empty documents are left out.
absl::StatusOr<std::vector<YAML::Node>> ParseDocuments(const std::string& text);

// The documents' "Kind/name"s, in order.
std::vector<std::string> Names(const std::vector<YAML::Node>& docs);

// The first document of `kind` named `name`; an undefined node if none.
YAML::Node Find(const std::vector<YAML::Node>& docs, const std::string& kind,
                const std::string& name);

// The pod template of a Deployment, StatefulSet or Job, a Pod itself; a
// undefined node for other kinds.
YAML::Node PodTemplate(const YAML::Node& doc);

// One container of a workload: where it is, its command line as the image's
// entry point receives it, and its environment with field references
// resolved for the workload's first pod.
struct ContainerCommand {
  std::string workload;  // "StatefulSet/pstrain-server"
  std::string container;
  std::vector<std::string> args;  // e.g. {"server", "--coordinator=..."}
  std::vector<std::pair<std::string, std::string>> env;
};
std::vector<ContainerCommand> ContainerCommands(const std::vector<YAML::Node>& docs);

// What deploy/docker/pstrain runs for `args` (role first), with
// --check_flags added: the binary under `bin_dir` and its arguments.
// INVALID_ARGUMENT for a role the entry point does not have.
absl::StatusOr<std::vector<std::string>> CheckFlagsCommand(const std::vector<std::string>& args,
                                                           const std::string& bin_dir);

// What a reviewer asks of every workload (Deployment, StatefulSet, Job):
// resource requests and limits for cpu and memory, a non-root pod and
// containers that cannot escalate and have a read-only root file system;
// for the long-running ones, liveness and readiness probes and a Service
// whose selector matches the pod labels. One line per problem; empty if
// none.
std::vector<std::string> ReviewProblems(const std::vector<YAML::Node>& docs);

// The rendered manifests as podman 4.3's `kube play` can run them, one
// rewrite for each of its limits (each listed in docs/deploy.md, "Tested
// with podman"):
//  - a StatefulSet of N replicas becomes N Pods NAME-0 .. NAME-(N-1) (kube
//    play skips StatefulSets), each with the template's labels and spec;
//  - a Job becomes a Pod of its template (kube play has no Jobs);
//  - Services, the Namespace and ServiceMonitors are left out (kube play
//    skips Services and resolves only pod names);
//  - in container arguments, a Service address becomes the pod behind it:
//    "pstrain-coordinator:" -> "pstrain-coordinator-pod-0:" (the name
//    kube play gives a Deployment's pod), "{node_id}.pstrain-server:" ->
//    "{node_id}:" (a server pod's own name);
//  - containers lose their `ports` (kube play publishes each on the host,
//    where the pods' like ports collide; pods reach each other anyway);
//  - a Secret becomes a ConfigMap of the same data, and a secret volume a
//    configMap volume (kube play panics on `secret:` volumes).
// Readiness probes stay in the text; kube play drops them.
absl::StatusOr<std::string> ForPodmanKubePlay(const std::vector<YAML::Node>& docs);

}  // namespace pstrain::testing

#endif  // PSTRAIN_TESTS_DEPLOY_MANIFESTS_H_
