#include "common/cpu_budget.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/cpu_affinity.h"

namespace pstrain {
namespace {

// The first line of a small file, or nullopt.
std::optional<std::string> FirstLine(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  if (!in || !std::getline(in, line)) return std::nullopt;
  return line;
}

// One level's quota in CPUs: v2's "QUOTA PERIOD" ("max PERIOD": none), v1's
// two files (-1: none).
std::optional<double> LevelQuota(const std::string& dir, bool v2) {
  double quota = 0, period = 0;
  if (v2) {
    std::optional<std::string> line = FirstLine(dir + "/cpu.max");
    if (!line.has_value()) return std::nullopt;
    const std::vector<absl::string_view> words =
        absl::StrSplit(*line, ' ', absl::SkipWhitespace());
    if (words.size() != 2 || !absl::SimpleAtod(words[0], &quota) ||
        !absl::SimpleAtod(words[1], &period)) {
      return std::nullopt;  // "max" or unreadable: no quota
    }
  } else {
    std::optional<std::string> q = FirstLine(dir + "/cpu.cfs_quota_us");
    std::optional<std::string> p = FirstLine(dir + "/cpu.cfs_period_us");
    if (!q.has_value() || !p.has_value() ||
        !absl::SimpleAtod(absl::StripAsciiWhitespace(*q), &quota) ||
        !absl::SimpleAtod(absl::StripAsciiWhitespace(*p), &period)) {
      return std::nullopt;
    }
  }
  if (quota <= 0 || period <= 0) return std::nullopt;
  return quota / period;
}

// A cgroup mount: where the hierarchy's `root` is mounted.
struct CgroupMount {
  bool v2 = false;
  std::string root;
  std::string mount_point;
};

// The mounts of cgroup v2 and of v1's cpu controller.
std::vector<CgroupMount> CpuMounts(const std::string& mountinfo) {
  std::vector<CgroupMount> mounts;
  std::ifstream in(mountinfo);
  std::string line;
  while (std::getline(in, line)) {
    // ID PARENT MAJ:MIN ROOT MOUNT_POINT OPTIONS [OPTIONAL...] - TYPE SOURCE SUPER_OPTIONS
    const std::vector<std::string> fields = absl::StrSplit(line, ' ', absl::SkipEmpty());
    size_t dash = 0;
    while (dash < fields.size() && fields[dash] != "-") ++dash;
    if (dash < 5 || dash + 3 >= fields.size()) continue;
    const std::string& type = fields[dash + 1];
    CgroupMount mount{.root = fields[3], .mount_point = fields[4]};
    if (type == "cgroup2") {
      mount.v2 = true;
    } else if (type == "cgroup") {
      const std::vector<absl::string_view> options = absl::StrSplit(fields[dash + 3], ',');
      if (std::find(options.begin(), options.end(), "cpu") == options.end()) continue;
    } else {
      continue;
    }
    mounts.push_back(std::move(mount));
  }
  return mounts;
}

// The process's cgroup path in v2's hierarchy (`v2`) or v1's cpu one.
std::optional<std::string> CgroupPath(const std::string& cgroup_file, bool v2) {
  std::ifstream in(cgroup_file);
  std::string line;
  while (std::getline(in, line)) {
    // HIERARCHY:CONTROLLERS:PATH
    const std::vector<std::string> parts = absl::StrSplit(line, absl::MaxSplits(':', 2));
    if (parts.size() != 3) continue;
    if (v2 && parts[0] == "0" && parts[1].empty()) return parts[2];
    if (!v2) {
      const std::vector<absl::string_view> controllers = absl::StrSplit(parts[1], ',');
      if (std::find(controllers.begin(), controllers.end(), "cpu") != controllers.end()) {
        return parts[2];
      }
    }
  }
  return std::nullopt;
}

}  // namespace

std::optional<double> CgroupCpuQuota(const CgroupFiles& files) {
  std::optional<double> smallest;
  for (const CgroupMount& mount : CpuMounts(files.mountinfo)) {
    std::optional<std::string> path = CgroupPath(files.cgroup, mount.v2);
    if (!path.has_value()) continue;
    // The part of the path below the mount's root (a container sees its
    // own cgroup as the root).
    std::string below = *path;
    if (mount.root != "/") {
      if (!absl::StartsWith(below, mount.root)) continue;
      below = below.substr(mount.root.size());
    }
    std::string dir = files.root_prefix + mount.mount_point;
    std::vector<std::string> levels = {dir};
    for (absl::string_view part : absl::StrSplit(below, '/', absl::SkipEmpty())) {
      absl::StrAppend(&dir, "/", part);
      levels.push_back(dir);
    }
    for (const std::string& level : levels) {
      if (std::optional<double> q = LevelQuota(level, mount.v2); q.has_value()) {
        smallest = smallest.has_value() ? std::min(*smallest, *q) : *q;
      }
    }
  }
  return smallest;
}

CpuBudget BudgetOf(const std::vector<int>& allowed, std::optional<double> quota) {
  CpuBudget budget;
  const int affinity = std::max<int>(1, static_cast<int>(allowed.size()));
  budget.cpus = affinity;
  std::string quota_text = "no cgroup CPU quota";
  if (quota.has_value()) {
    quota_text = absl::StrFormat("cgroup CPU quota %.2f", *quota);
    budget.cpus = std::max(1, std::min(affinity, static_cast<int>(std::floor(*quota + 1e-9))));
  }
  budget.why = absl::StrCat(budget.cpus, budget.cpus == 1 ? " CPU" : " CPUs", " (affinity ",
                            allowed.empty() ? "unknown" : FormatCpuList(allowed), ", ",
                            quota_text, ")");
  return budget;
}

CpuBudget ProcessCpuBudget() { return BudgetOf(AllowedCpus(), CgroupCpuQuota()); }

ThreadChoice ThreadsFor(const CpuBudget& budget, int sharing_processes, int devices) {
  const int sharing = std::max(1, sharing_processes);
  const int each = std::max(1, devices);
  ThreadChoice choice;
  choice.threads = std::max(1, budget.cpus / (sharing * each));
  choice.why = budget.why;
  if (sharing > 1) absl::StrAppend(&choice.why, " shared by ", sharing, " processes");
  if (each > 1) absl::StrAppend(&choice.why, ", ", each, " devices a process");
  return choice;
}

std::optional<std::string> ThreadVariableSet() {
  for (const char* name : kThreadVariables) {
    if (const char* value = std::getenv(name); value != nullptr && *value != '\0') {
      return absl::StrCat(name, "=", value);
    }
  }
  return std::nullopt;
}

}  // namespace pstrain
