#include "tests/deploy/manifests.h"


#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"

namespace pstrain::testing {
namespace {

// What a lookup finds where there is nothing: false as a condition (a
// default YAML::Node is a defined null, true).
YAML::Node Missing() { return YAML::Node(YAML::NodeType::Undefined); }

std::string NameOf(const YAML::Node& doc) {
  return absl::StrCat(Str(doc["kind"]), "/", Str(At(doc, {"metadata", "name"})));
}

bool IsWorkload(const YAML::Node& doc) {
  const std::string kind = Str(doc["kind"]);
  return kind == "Deployment" || kind == "StatefulSet" || kind == "Job";
}

// Whether every label of `selector` is in `labels` with the same value.
bool Selects(const YAML::Node& selector, const YAML::Node& labels) {
  if (!selector || !selector.IsMap() || selector.size() == 0) return false;
  for (const auto& entry : selector) {
    if (Str(labels[entry.first.as<std::string>()]) != Str(entry.second)) return false;
  }
  return true;
}

// The first pod's name: NAME-0 for a StatefulSet, what kube play and a
// Deployment's ReplicaSet would call it otherwise does not matter here.
std::string FirstPodName(const YAML::Node& doc) {
  return Str(doc["kind"]) == "StatefulSet" ? Str(At(doc, {"metadata", "name"})) + "-0"
                                           : Str(At(doc, {"metadata", "name"}));
}

}  // namespace

YAML::Node At(const YAML::Node& node, std::initializer_list<std::string_view> path) {
  YAML::Node at;
  at.reset(node);  // rebinds: `=` would overwrite what `at` refers to
  for (std::string_view key : path) {
    const YAML::Node current = at;  // const: operator[] must not add keys
    size_t index = 0;
    YAML::Node next;
    if (!current) return Missing();
    if (current.IsSequence() && absl::SimpleAtoi(std::string(key), &index)) {
      if (index >= current.size()) return Missing();
      next.reset(current[index]);
    } else if (current.IsMap()) {
      const YAML::Node value = current[std::string(key)];
      if (!value) return Missing();
      next.reset(value);
    } else {
      return Missing();
    }
    at.reset(next);
  }
  return at;
}

std::string Str(const YAML::Node& node) {
  return node && node.IsScalar() ? node.as<std::string>() : "";
}

absl::StatusOr<std::vector<YAML::Node>> ParseDocuments(const std::string& text) {
  std::vector<YAML::Node> docs;
  try {
    for (YAML::Node& doc : YAML::LoadAll(text)) {
      if (doc && doc.IsMap()) docs.push_back(doc);
    }
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("not YAML: ", e.what()));
  }
  return docs;
}

std::vector<std::string> Names(const std::vector<YAML::Node>& docs) {
  std::vector<std::string> names;
  for (const YAML::Node& doc : docs) names.push_back(NameOf(doc));
  return names;
}

YAML::Node Find(const std::vector<YAML::Node>& docs, const std::string& kind,
                const std::string& name) {
  for (const YAML::Node& doc : docs) {
    if (Str(doc["kind"]) == kind && Str(At(doc, {"metadata", "name"})) == name) return doc;
  }
  return Missing();
}

YAML::Node PodTemplate(const YAML::Node& doc) {
  if (Str(doc["kind"]) == "Pod") return doc;
  if (!IsWorkload(doc)) return Missing();
  return At(doc, {"spec", "template"});
}

std::vector<ContainerCommand> ContainerCommands(const std::vector<YAML::Node>& docs) {
  std::vector<ContainerCommand> commands;
  for (const YAML::Node& doc : docs) {
    const YAML::Node pod = PodTemplate(doc);
    if (!pod) continue;
    for (const YAML::Node& c : At(pod, {"spec", "containers"})) {
      ContainerCommand& cmd = commands.emplace_back();
      cmd.workload = NameOf(doc);
      cmd.container = Str(c["name"]);
      for (const YAML::Node& a : c["args"]) cmd.args.push_back(Str(a));
      for (const YAML::Node& e : c["env"]) {
        std::string value = Str(e["value"]);
        if (Str(At(e, {"valueFrom", "fieldRef", "fieldPath"})) == "metadata.name") {
          value = FirstPodName(doc);
        }
        cmd.env.emplace_back(Str(e["name"]), value);
      }
    }
  }
  return commands;
}

absl::StatusOr<std::vector<std::string>> CheckFlagsCommand(const std::vector<std::string>& args,
                                                           const std::string& bin_dir) {
  if (args.empty()) return absl::InvalidArgumentError("no role");
  const std::string& role = args[0];
  std::vector<std::string> argv;
  if (role == "coordinator" || role == "server" || role == "worker") {
    // What the entry point adds before the container's own flags.
    argv = {absl::StrCat(bin_dir, "/pstrain-", role), "--metrics_host=0.0.0.0",
            "--metrics_port=9100"};
  } else if (role == "psctl") {
    argv = {bin_dir + "/psctl"};
  } else if (role == "local") {
    argv = {bin_dir + "/pstrain-local"};
  } else {
    return absl::InvalidArgumentError(absl::StrCat("the image has no role '", role, "'"));
  }
  argv.push_back("--check_flags");
  argv.insert(argv.end(), args.begin() + 1, args.end());
  return argv;
}

std::vector<std::string> ReviewProblems(const std::vector<YAML::Node>& docs) {
  std::vector<std::string> problems;
  auto problem = [&](const YAML::Node& doc, const std::string& what) {
    problems.push_back(absl::StrCat(NameOf(doc), ": ", what));
  };
  for (const YAML::Node& doc : docs) {
    if (!IsWorkload(doc)) continue;
    const YAML::Node pod = PodTemplate(doc);
    const bool long_running = Str(doc["kind"]) != "Job";
    const YAML::Node pod_security = At(pod, {"spec", "securityContext"});
    if (Str(pod_security["runAsNonRoot"]) != "true") problem(doc, "pod may run as root");
    if (pod_security["runAsUser"] && pod_security["runAsUser"].as<int>() == 0) {
      problem(doc, "pod runs as uid 0");
    }
    if (!Selects(At(doc, {"spec", "selector", "matchLabels"}), At(pod, {"metadata", "labels"})) &&
        Str(doc["kind"]) != "Job") {
      problem(doc, "its selector does not match its pod labels");
    }
    if (long_running) {
      bool served = false;
      for (const YAML::Node& other : docs) {
        if (Str(other["kind"]) == "Service" &&
            Selects(At(other, {"spec", "selector"}), At(pod, {"metadata", "labels"}))) {
          served = true;
        }
      }
      if (!served) problem(doc, "no Service selects its pods");
      if (Str(At(pod, {"metadata", "annotations", "prometheus.io/scrape"})) != "true") {
        problem(doc, "no prometheus.io/scrape annotation");
      }
    }
    const YAML::Node containers = At(pod, {"spec", "containers"});
    if (!containers || containers.size() == 0) problem(doc, "no containers");
    for (const YAML::Node& c : containers) {
      const std::string name = Str(c["name"]);
      for (const char* kind : {"requests", "limits"}) {
        for (const char* resource : {"cpu", "memory"}) {
          if (!At(c, {"resources", kind, resource})) {
            problem(doc, absl::StrCat(name, ": no ", resource, " in resources.", kind));
          }
        }
      }
      const YAML::Node security = c["securityContext"];
      if (Str(security["allowPrivilegeEscalation"]) != "false") {
        problem(doc, name + ": may escalate privileges");
      }
      if (Str(security["readOnlyRootFilesystem"]) != "true") {
        problem(doc, name + ": writable root file system");
      }
      bool drops_all = false;
      for (const YAML::Node& cap : At(security, {"capabilities", "drop"})) {
        drops_all = drops_all || Str(cap) == "ALL";
      }
      if (!drops_all) problem(doc, name + ": keeps its capabilities");
      if (long_running) {
        for (const char* probe : {"livenessProbe", "readinessProbe"}) {
          if (!c[probe]) problem(doc, absl::StrCat(name, ": no ", probe));
        }
      }
      if (!c["image"]) problem(doc, name + ": no image");
      // Every pstrain process speaks TLS, its certificate from a volume.
      const YAML::Node args = c["args"];
      const std::string role = args && args.size() > 0 ? Str(args[0]) : "";
      if (role == "coordinator" || role == "server" || role == "worker" || role == "psctl") {
        bool tls = false;
        for (const YAML::Node& a : args) tls = tls || absl::StartsWith(Str(a), "--tls_ca=");
        if (!tls) problem(doc, name + ": no TLS (--tls_ca)");
      }
    }
  }
  return problems;
}

absl::StatusOr<std::string> ForPodmanKubePlay(const std::vector<YAML::Node>& docs) {
  // Service address -> the pod behind it, in container arguments.
  const std::vector<std::pair<std::string, std::string>> addresses = {
      {"pstrain-coordinator:", "pstrain-coordinator-pod-0:"},
      {"{node_id}.pstrain-server:", "{node_id}:"}};
  auto rewrite_pod_spec = [&](YAML::Node spec) {
    for (YAML::Node c : spec["containers"]) {
      c.remove("ports");
      if (!c["args"]) continue;
      YAML::Node args(YAML::NodeType::Sequence);
      for (const YAML::Node& a : c["args"]) args.push_back(absl::StrReplaceAll(Str(a), addresses));
      c["args"] = args;
    }
    for (YAML::Node v : spec["volumes"]) {
      if (!v["secret"]) continue;
      YAML::Node config_map;
      config_map["name"] = Str(At(v, {"secret", "secretName"}));
      v.remove("secret");
      v["configMap"] = config_map;
    }
  };
  auto pod_of = [&](const std::string& name, const YAML::Node& template_) {
    YAML::Node pod;
    pod["apiVersion"] = "v1";
    pod["kind"] = "Pod";
    pod["metadata"]["name"] = name;
    if (At(template_, {"metadata", "labels"})) {
      pod["metadata"]["labels"] = YAML::Clone(At(template_, {"metadata", "labels"}));
    }
    if (At(template_, {"metadata", "annotations"})) {
      pod["metadata"]["annotations"] = YAML::Clone(At(template_, {"metadata", "annotations"}));
    }
    pod["spec"] = YAML::Clone(template_["spec"]);
    rewrite_pod_spec(pod["spec"]);
    return pod;
  };
  YAML::Emitter out;
  auto emit = [&](const YAML::Node& doc) { out << YAML::BeginDoc << doc; };
  for (const YAML::Node& doc : docs) {
    const std::string kind = Str(doc["kind"]);
    const std::string name = Str(At(doc, {"metadata", "name"}));
    if (kind == "Namespace" || kind == "Service" || kind == "ServiceMonitor") continue;
    if (kind == "StatefulSet") {
      const int replicas = At(doc, {"spec", "replicas"}) ? At(doc, {"spec", "replicas"}).as<int>() : 1;
      for (int i = 0; i < replicas; ++i) {
        emit(pod_of(absl::StrCat(name, "-", i), At(doc, {"spec", "template"})));
      }
    } else if (kind == "Job") {
      emit(pod_of(name, At(doc, {"spec", "template"})));
    } else if (kind == "Deployment") {
      YAML::Node copy = YAML::Clone(doc);
      rewrite_pod_spec(At(copy, {"spec", "template", "spec"}));
      emit(copy);
    } else if (kind == "Secret") {
      YAML::Node config_map;
      config_map["apiVersion"] = "v1";
      config_map["kind"] = "ConfigMap";
      config_map["metadata"]["name"] = name;
      for (const auto& entry : doc["data"]) {
        std::string decoded;
        if (!absl::Base64Unescape(Str(entry.second), &decoded)) {
          return absl::InvalidArgumentError(absl::StrCat(NameOf(doc), ": data is not base64"));
        }
        config_map["data"][entry.first.as<std::string>()] = decoded;
      }
      for (const auto& entry : doc["stringData"]) {
        config_map["data"][entry.first.as<std::string>()] = Str(entry.second);
      }
      emit(config_map);
    } else if (kind == "ConfigMap" || kind == "PersistentVolumeClaim" || kind == "Pod") {
      emit(doc);
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat(NameOf(doc), ": podman kube play cannot run a ", kind));
    }
  }
  if (!out.good()) return absl::InternalError(out.GetLastError());
  return std::string(out.c_str()) + "\n";
}

}  // namespace pstrain::testing
