// deploy/k8s as a reviewer reads it: each overlay rendered by every kubectl
// at hand (Debian's 1.20, whose kustomize v2 is the strictest, and the
// machine's own), every workload with probes, requests and limits, a
// non-root read-only security context and a Service that selects it, the
// names and ports deploy/prometheus/prometheus.yml expects, and every
// container's command line accepted by the real binary's flag parser.
#include <unistd.h>

#include <set>

#include "absl/algorithm/container.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/files.h"
#include "gtest/gtest.h"
#include "tests/deploy/manifests.h"
#include "tests/integration/integration_util.h"
#include "tests/test_util.h"

namespace pstrain::testing {
namespace {

const std::string kSource = PSTRAIN_SOURCE_DIR;

// $PSTRAIN_KUBECTL (colon-separated), else Debian's kubectl 1.20 that
// deploy/build.sh puts in build/tools, and the kubectl on PATH.
std::vector<std::string> Kubectls() {
  if (const char* env = std::getenv("PSTRAIN_KUBECTL"); env != nullptr && *env != '\0') {
    return absl::StrSplit(env, ':', absl::SkipEmpty());
  }
  std::vector<std::string> found;
  const std::string debian = BinDir() + "/../tools/kubectl-1.20";
  if (access(debian.c_str(), X_OK) == 0) found.push_back(debian);
  for (absl::string_view dir : absl::StrSplit(std::getenv("PATH") ? std::getenv("PATH") : "", ':')) {
    const std::string path = absl::StrCat(dir, "/kubectl");
    if (!dir.empty() && access(path.c_str(), X_OK) == 0) {
      found.push_back(path);
      break;
    }
  }
  return found;
}

class ManifestsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    kubectls_ = Kubectls();
    if (kubectls_.empty()) {
      GTEST_SKIP() << "no kubectl (deploy/build.sh fetches Debian's into build/tools)";
    }
  }

  // The overlay rendered by `kubectl kustomize`; fails the test if it does not render.
  std::vector<YAML::Node> Render(const std::string& kubectl, const std::string& overlay) {
    ProcessResult r = RunProcess({kubectl, "kustomize", kSource + "/deploy/k8s/" + overlay});
    EXPECT_EQ(r.exit_code(), 0) << kubectl << " kustomize " << overlay << ": " << r.err;
    absl::StatusOr<std::vector<YAML::Node>> docs = ParseDocuments(r.out);
    PSTRAIN_EXPECT_OK(docs);
    return docs.ok() ? *docs : std::vector<YAML::Node>{};
  }

  std::vector<std::string> kubectls_;
};

TEST_F(ManifestsTest, EveryOverlayRendersWithEveryKubectlAndPassesReview) {
  for (const std::string& kubectl : kubectls_) {
    std::set<std::string> names_by_overlay[2];
    int o = 0;
    for (const char* overlay : {"overlays/cpu", "overlays/gpu"}) {
      SCOPED_TRACE(absl::StrCat(kubectl, " kustomize ", overlay));
      const std::vector<YAML::Node> docs = Render(kubectl, overlay);
      ASSERT_FALSE(docs.empty());
      const std::vector<std::string> problems = ReviewProblems(docs);
      EXPECT_TRUE(problems.empty()) << absl::StrJoin(problems, "\n");
      for (const YAML::Node& doc : docs) {
        names_by_overlay[o].insert(absl::StrCat(Str(doc["kind"]), "/", Str(At(doc, {"metadata", "name"}))));
        if (Str(doc["kind"]) != "Namespace") {
          EXPECT_EQ(Str(At(doc, {"metadata", "namespace"})), "pstrain") << Str(At(doc, {"metadata", "name"}));
        }
      }
      ++o;

      // What deploy/prometheus/prometheus.yml expects: headless Services
      // pstrain-{coordinator,server,worker} with metrics on 9100.
      for (const char* role : {"coordinator", "server", "worker"}) {
        const YAML::Node service = Find(docs, "Service", absl::StrCat("pstrain-", role));
        ASSERT_TRUE(service) << role;
        EXPECT_EQ(Str(At(service, {"spec", "clusterIP"})), "None") << role;
        bool metrics = false;
        for (const YAML::Node& port : At(service, {"spec", "ports"})) {
          metrics = metrics || (Str(port["name"]) == "metrics" && Str(port["port"]) == "9100");
        }
        EXPECT_TRUE(metrics) << role;
      }
      // Kubeflow-style roles: one coordinator, recreated; servers and workers
      // with stable names (their node ids) behind their headless Services.
      const YAML::Node coordinator = Find(docs, "Deployment", "pstrain-coordinator");
      ASSERT_TRUE(coordinator);
      EXPECT_EQ(Str(At(coordinator, {"spec", "replicas"})), "1");
      EXPECT_EQ(Str(At(coordinator, {"spec", "strategy", "type"})), "Recreate");
      for (const char* role : {"server", "worker"}) {
        const YAML::Node set = Find(docs, "StatefulSet", absl::StrCat("pstrain-", role));
        ASSERT_TRUE(set) << role;
        EXPECT_EQ(Str(At(set, {"spec", "serviceName"})), absl::StrCat("pstrain-", role));
        const YAML::Node env = At(PodTemplate(set), {"spec", "containers", "0", "env", "0"});
        EXPECT_EQ(Str(env["name"]), "PSTRAIN_NODE_ID") << role;
        EXPECT_EQ(Str(At(env, {"valueFrom", "fieldRef", "fieldPath"})), "metadata.name") << role;
      }
      // Every server mounts the one ReadWriteMany checkpoint volume where the
      // coordinator sends jobs' checkpoints.
      const YAML::Node claim = Find(docs, "PersistentVolumeClaim", "pstrain-checkpoints");
      ASSERT_TRUE(claim);
      EXPECT_EQ(Str(At(claim, {"spec", "accessModes", "0"})), "ReadWriteMany");
      const YAML::Node server = PodTemplate(Find(docs, "StatefulSet", "pstrain-server"));
      EXPECT_EQ(Str(At(server, {"spec", "containers", "0", "volumeMounts", "0", "mountPath"})),
                "/var/lib/pstrain/checkpoints");
      bool default_dir = false;
      for (const YAML::Node& a : At(PodTemplate(coordinator), {"spec", "containers", "0", "args"})) {
        default_dir = default_dir ||
                      Str(a) == "--default_checkpoint_dir=/var/lib/pstrain/checkpoints";
      }
      EXPECT_TRUE(default_dir);

      const YAML::Node worker =
          At(PodTemplate(Find(docs, "StatefulSet", "pstrain-worker")), {"spec", "containers", "0"});
      const bool gpu = absl::EndsWith(overlay, "gpu");
      EXPECT_EQ(static_cast<bool>(At(worker, {"resources", "limits", "nvidia.com/gpu"})), gpu);
      EXPECT_EQ(Str(worker["image"]), gpu ? "pstrain-gpu:latest" : "pstrain:latest");
      std::vector<std::string> args;
      for (const YAML::Node& a : worker["args"]) args.push_back(Str(a));
      EXPECT_EQ(absl::c_linear_search(args, "--devices=cuda:0"), gpu) << absl::StrJoin(args, " ");
    }
    EXPECT_EQ(names_by_overlay[0], names_by_overlay[1]) << kubectl;
  }
}

TEST_F(ManifestsTest, EveryContainerCommandLineIsAcceptedByItsBinary) {
  // The probes call roles of the image's entry point.
  absl::StatusOr<std::string> entry_point = ReadFile(kSource + "/deploy/docker/pstrain");
  PSTRAIN_ASSERT_OK(entry_point);
  for (const char* overlay : {"overlays/cpu", "overlays/gpu"}) {
    const std::vector<YAML::Node> docs = Render(kubectls_[0], overlay);
    for (const YAML::Node& doc : docs) {
      const YAML::Node pod = PodTemplate(doc);
      if (!pod) continue;
      for (const YAML::Node& c : At(pod, {"spec", "containers"})) {
        for (const char* probe : {"livenessProbe", "readinessProbe"}) {
          if (!c[probe]) continue;
          EXPECT_EQ(Str(At(c, {probe, "exec", "command", "0"})), "pstrain");
          const std::string role = Str(At(c, {probe, "exec", "command", "1"}));
          EXPECT_TRUE(absl::StrContains(*entry_point, "  " + role + ")")) << role;
        }
      }
    }
    int checked = 0;
    for (const ContainerCommand& cmd : ContainerCommands(docs)) {
      SCOPED_TRACE(absl::StrCat(overlay, " ", cmd.workload, " ", cmd.container));
      absl::StatusOr<std::vector<std::string>> argv = CheckFlagsCommand(cmd.args, BinDir());
      PSTRAIN_ASSERT_OK(argv);
      std::vector<std::string> with_env = {"/usr/bin/env"};
      for (const auto& [name, value] : cmd.env) with_env.push_back(name + "=" + value);
      with_env.insert(with_env.end(), argv->begin(), argv->end());
      ProcessResult r = RunProcess(with_env);
      EXPECT_EQ(r.exit_code(), 0) << absl::StrJoin(with_env, " ") << "\n" << r.err;
      EXPECT_EQ(r.out, "flags ok\n");
      ++checked;
    }
    EXPECT_EQ(checked, 4) << "coordinator, servers, workers, submit";
  }
}

TEST_F(ManifestsTest, TheExampleJobIsTheRepositorysOwn) {
  const std::vector<YAML::Node> docs = Render(kubectls_[0], "overlays/cpu");
  const YAML::Node config = Find(docs, "ConfigMap", "pstrain-example-job");
  ASSERT_TRUE(config);
  absl::StatusOr<std::string> example = ReadFile(kSource + "/examples/fashion_mlp.yaml");
  PSTRAIN_ASSERT_OK(example);
  EXPECT_EQ(Str(At(config, {"data", "fashion_mlp.yaml"})), *example)
      << "deploy/k8s/base/example-job.yaml must hold examples/fashion_mlp.yaml as it is";
  const YAML::Node submit = PodTemplate(Find(docs, "Job", "pstrain-submit-example"))["spec"];
  EXPECT_EQ(Str(At(submit, {"containers", "0", "volumeMounts", "0", "mountPath"})), "/etc/pstrain/jobs");
  EXPECT_EQ(Str(At(submit, {"volumes", "0", "configMap", "name"})), "pstrain-example-job");
  const YAML::Node args = At(submit, {"containers", "0", "args"});
  ASSERT_TRUE(args.IsSequence());
  EXPECT_EQ(Str(args[args.size() - 1]), "/etc/pstrain/jobs/fashion_mlp.yaml");
}

// The review is not a rubber stamp: each rule catches its fault.
TEST(ManifestReviewTest, EachRuleCatchesItsFault) {
  const std::string good = R"(
kind: Service
metadata: {name: s}
spec: {selector: {app: a}}
---
kind: Deployment
metadata: {name: d}
spec:
  selector: {matchLabels: {app: a}}
  template:
    metadata:
      labels: {app: a}
      annotations: {prometheus.io/scrape: "true"}
    spec:
      securityContext: {runAsNonRoot: true, runAsUser: 10001}
      containers:
        - name: c
          image: pstrain:latest
          args: [server, --tls_ca=/etc/pstrain/tls/ca.crt]
          livenessProbe: {exec: {command: [pstrain, health]}}
          readinessProbe: {exec: {command: [pstrain, ready]}}
          resources:
            requests: {cpu: 1, memory: 1Gi}
            limits: {cpu: 1, memory: 1Gi}
          securityContext:
            allowPrivilegeEscalation: false
            readOnlyRootFilesystem: true
            capabilities: {drop: [ALL]}
)";
  absl::StatusOr<std::vector<YAML::Node>> docs = ParseDocuments(good);
  PSTRAIN_ASSERT_OK(docs);
  EXPECT_TRUE(ReviewProblems(*docs).empty()) << absl::StrJoin(ReviewProblems(*docs), "\n");
  const std::vector<std::pair<std::string, std::string>> faults = {
      {"livenessProbe: {exec: {command: [pstrain, health]}}", "no livenessProbe"},
      {"readinessProbe: {exec: {command: [pstrain, ready]}}", "no readinessProbe"},
      {"limits: {cpu: 1, memory: 1Gi}", "no cpu in resources.limits"},
      {"runAsNonRoot: true, ", "may run as root"},
      {"readOnlyRootFilesystem: true", "writable root file system"},
      {"allowPrivilegeEscalation: false", "may escalate"},
      {"spec: {selector: {app: a}}", "no Service selects"},
      {"annotations: {prometheus.io/scrape: \"true\"}", "no prometheus.io/scrape"},
      {", --tls_ca=/etc/pstrain/tls/ca.crt", "no TLS"},
  };
  for (const auto& [remove, expected] : faults) {
    std::string text = good;
    text.replace(text.find(remove), remove.size(), "");
    absl::StatusOr<std::vector<YAML::Node>> bad = ParseDocuments(text);
    PSTRAIN_ASSERT_OK(bad) << text;
    const std::string problems = absl::StrJoin(ReviewProblems(*bad), "\n");
    EXPECT_TRUE(absl::StrContains(problems, expected)) << "without '" << remove << "': " << problems;
  }
}

TEST_F(ManifestsTest, TheRewriteForPodmanKeepsEveryPodAndNamesPodsForServices) {
  std::vector<YAML::Node> docs = Render(kubectls_[0], "overlays/cpu");
  absl::StatusOr<std::vector<YAML::Node>> secret = ParseDocuments(R"(
kind: Secret
metadata: {name: tls}
data: {ca.crt: aGVsbG8=}
)");
  PSTRAIN_ASSERT_OK(secret);
  docs.push_back((*secret)[0]);
  absl::StatusOr<std::string> text = ForPodmanKubePlay(docs);
  PSTRAIN_ASSERT_OK(text);
  absl::StatusOr<std::vector<YAML::Node>> played = ParseDocuments(*text);
  PSTRAIN_ASSERT_OK(played);
  const std::vector<std::string> names = Names(*played);
  const std::set<std::string> got(names.begin(), names.end());
  const std::set<std::string> want = {
      "ConfigMap/pstrain-example-job",      "ConfigMap/tls",
      "Deployment/pstrain-coordinator",     "Pod/pstrain-server-0",
      "Pod/pstrain-server-1",               "Pod/pstrain-worker-0",
      "Pod/pstrain-worker-1",               "Pod/pstrain-submit-example",
      "PersistentVolumeClaim/pstrain-checkpoints",
      "PersistentVolumeClaim/pstrain-coordinator-state"};
  EXPECT_EQ(got, want) << *text;
  EXPECT_EQ(Str(At(Find(*played, "ConfigMap", "tls"), {"data", "ca.crt"})), "hello");
  const std::string server_args =
      absl::StrJoin(ContainerCommands({Find(*played, "Pod", "pstrain-server-1")})[0].args, " ");
  EXPECT_TRUE(absl::StrContains(server_args, "--coordinator=pstrain-coordinator-pod-0:50050"))
      << server_args;
  EXPECT_TRUE(absl::StrContains(server_args, "--advertise_address={node_id}:50051"))
      << server_args;
  EXPECT_FALSE(At(Find(*played, "Pod", "pstrain-server-0"), {"spec", "containers", "0", "ports"}))
      << "kube play would publish the port on the host";
}

}  // namespace
}  // namespace pstrain::testing
