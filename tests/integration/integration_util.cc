#include "tests/integration/integration_util.h"

#include <dirent.h>
#include <sys/wait.h>
#include <stdlib.h>

#include <cstdlib>
#include <fstream>
#include <sstream>

#include "common/process.h"
#include "gtest/gtest.h"

namespace pstrain::testing {
namespace {

// (state, parent) from /proc/PID/stat; false if the process is gone.
bool ReadStat(pid_t pid, char* state, pid_t* parent) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(in, line)) return false;
  const size_t close = line.rfind(')');  // the command name may hold spaces
  if (close == std::string::npos) return false;
  std::istringstream rest(line.substr(close + 1));
  rest >> *state >> *parent;
  return static_cast<bool>(rest);
}

}  // namespace

TempDir::TempDir() {
  char tmpl[] = "/tmp/pstrain-test.XXXXXX";
  path_ = mkdtemp(tmpl) ? tmpl : "/tmp";
}

TempDir::~TempDir() {
  if (path_ != "/tmp") std::system(("rm -rf '" + path_ + "'").c_str());
}

std::string TempDir::Write(const std::string& name, const std::string& contents) const {
  const std::string path = path_ + "/" + name;
  std::ofstream(path) << contents;
  return path;
}

int ProcessResult::exit_code() const {
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

ProcessResult RunProcess(const std::vector<std::string>& argv, absl::Duration patience) {
  TempDir dir;
  SpawnOptions spawn;
  spawn.argv = argv;
  spawn.log_path = dir.path() + "/out";
  spawn.stderr_path = dir.path() + "/err";
  ProcessResult result;
  absl::StatusOr<pid_t> pid = Spawn(spawn);
  EXPECT_TRUE(pid.ok()) << pid.status();
  if (!pid.ok()) return result;
  const absl::Time give_up = absl::Now() + patience;
  while (true) {
    if (std::optional<int> status = TryReap(*pid)) {
      result.status = *status;
      break;
    }
    if (absl::Now() > give_up) {
      ADD_FAILURE() << argv[0] << " did not exit within " << patience;
      result.status = StopProcess(*pid, absl::Seconds(5));
      break;
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  auto slurp = [](const std::string& path) {
    std::ifstream in(path);
    std::stringstream text;
    text << in.rdbuf();
    return text.str();
  };
  result.out = slurp(spawn.log_path);
  result.err = slurp(spawn.stderr_path);
  return result;
}

std::vector<pid_t> ChildrenOf(pid_t pid) {
  std::vector<pid_t> children;
  DIR* proc = opendir("/proc");
  if (proc == nullptr) return children;
  while (dirent* entry = readdir(proc)) {
    char* end = nullptr;
    const long candidate = strtol(entry->d_name, &end, 10);
    if (*end != '\0' || candidate <= 0) continue;
    char state;
    pid_t parent;
    if (ReadStat(static_cast<pid_t>(candidate), &state, &parent) && parent == pid &&
        state != 'Z') {
      children.push_back(static_cast<pid_t>(candidate));
    }
  }
  closedir(proc);
  return children;
}

bool IsAlive(pid_t pid) {
  char state;
  pid_t parent;
  return ReadStat(pid, &state, &parent) && state != 'Z' && state != 'X';
}

}  // namespace pstrain::testing
