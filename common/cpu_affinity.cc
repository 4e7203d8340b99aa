#include "common/cpu_affinity.h"

#include <dirent.h>
#include <sched.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <set>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/status.h"

namespace pstrain {
namespace {

constexpr int kMaxCpus = CPU_SETSIZE;  // 1024

absl::StatusOr<int> ParseCpu(absl::string_view text, absl::string_view list) {
  int cpu = -1;
  if (!absl::SimpleAtoi(text, &cpu) || cpu < 0 || cpu >= kMaxCpus) {
    return absl::InvalidArgumentError(absl::StrCat("CPU list '", list, "': '", text,
                                                   "' is no CPU number in [0, ", kMaxCpus, ")"));
  }
  return cpu;
}

}  // namespace

absl::StatusOr<std::vector<int>> ParseCpuList(absl::string_view list) {
  if (list.empty()) return absl::InvalidArgumentError("empty CPU list");
  std::set<int> cpus;
  for (absl::string_view item : absl::StrSplit(list, ',')) {
    const std::vector<absl::string_view> ends = absl::StrSplit(item, absl::MaxSplits('-', 1));
    absl::StatusOr<int> first = ParseCpu(ends[0], list);
    if (!first.ok()) return first.status();
    absl::StatusOr<int> last = ends.size() == 1 ? first : ParseCpu(ends[1], list);
    if (!last.ok()) return last.status();
    if (*last < *first) {
      return absl::InvalidArgumentError(
          absl::StrCat("CPU list '", list, "': the range '", item, "' runs backwards"));
    }
    for (int cpu = *first; cpu <= *last; ++cpu) cpus.insert(cpu);
  }
  return std::vector<int>(cpus.begin(), cpus.end());
}

std::string FormatCpuList(const std::vector<int>& cpus) {
  std::string out;
  for (size_t i = 0; i < cpus.size();) {
    size_t j = i;
    while (j + 1 < cpus.size() && cpus[j + 1] == cpus[j] + 1) ++j;
    absl::StrAppend(&out, out.empty() ? "" : ",", cpus[i]);
    if (j > i) absl::StrAppend(&out, "-", cpus[j]);
    i = j + 1;
  }
  return out;
}

std::vector<int> AllowedCpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> cpus;
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return cpus;
  for (int cpu = 0; cpu < kMaxCpus; ++cpu) {
    if (CPU_ISSET(cpu, &set)) cpus.push_back(cpu);
  }
  return cpus;
}

std::vector<std::vector<int>> SplitCpus(const std::vector<int>& cpus, int groups) {
  std::vector<std::vector<int>> out;
  if (groups <= 0 || static_cast<int>(cpus.size()) < groups) return out;
  const size_t each = cpus.size() / groups, longer = cpus.size() % groups;
  size_t next = 0;
  for (int g = 0; g < groups; ++g) {
    const size_t n = each + (static_cast<size_t>(g) < longer ? 1 : 0);
    out.emplace_back(cpus.begin() + next, cpus.begin() + next + n);
    next += n;
  }
  return out;
}

namespace {

cpu_set_t CpuSetOf(const std::vector<int>& cpus) {
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int cpu : cpus) {
    if (cpu >= 0 && cpu < kMaxCpus) CPU_SET(cpu, &set);
  }
  return set;
}

}  // namespace

absl::Status RunOnlyOn(const std::vector<int>& cpus) {
  const cpu_set_t set = CpuSetOf(cpus);
  if (sched_setaffinity(0, sizeof(set), &set) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot run on CPUs ", FormatCpuList(cpus), " (", std::strerror(errno),
                     "): this process may use CPUs ", FormatCpuList(AllowedCpus())));
  }
  return absl::OkStatus();
}

absl::Status RunProcessOnlyOn(const std::vector<int>& cpus) {
  PSTRAIN_RETURN_IF_ERROR(RunOnlyOn(cpus));
  const cpu_set_t set = CpuSetOf(cpus);
  const pid_t self = gettid();
  DIR* tasks = opendir("/proc/self/task");
  if (tasks == nullptr) {
    return absl::InternalError(absl::StrCat("/proc/self/task: ", std::strerror(errno)));
  }
  absl::Status status;
  while (const dirent* entry = readdir(tasks)) {
    pid_t tid = 0;
    if (!absl::SimpleAtoi(entry->d_name, &tid) || tid == self) continue;
    // A thread that has just ended (ESRCH) needs no CPUs.
    if (sched_setaffinity(tid, sizeof(set), &set) != 0 && errno != ESRCH && status.ok()) {
      status = absl::InternalError(absl::StrCat("cannot move thread ", tid, " to CPUs ",
                                                FormatCpuList(cpus), ": ", std::strerror(errno)));
    }
  }
  closedir(tasks);
  return status;
}

}  // namespace pstrain
