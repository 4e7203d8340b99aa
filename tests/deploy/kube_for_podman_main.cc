// pstrain-kube-for-podman: rendered Kubernetes manifests (stdin) as podman
// 4.3's `kube play` can run them (stdout); the rewrites are listed in
// tests/deploy/manifests.h. Used by deploy/test/containers.sh.
#include <iostream>
#include <iterator>
#include <string>

#include "tests/deploy/manifests.h"

int main() {
  const std::string text((std::istreambuf_iterator<char>(std::cin)),
                         std::istreambuf_iterator<char>());
  absl::StatusOr<std::vector<YAML::Node>> docs = pstrain::testing::ParseDocuments(text);
  absl::StatusOr<std::string> playable =
      docs.ok() ? pstrain::testing::ForPodmanKubePlay(*docs) : docs.status();
  if (!playable.ok()) {
    std::cerr << "pstrain-kube-for-podman: " << playable.status().message() << "\n";
    return 2;
  }
  std::cout << *playable;
  return 0;
}
