#include "tests/integration/integration_util.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>
#include <sys/wait.h>
#include <stdlib.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "common/http_client.h"
#include "common/process.h"
#include "common/rpc.h"
#include "common/status.h"
#include "gtest/gtest.h"
#include "tests/test_util.h"

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
  PSTRAIN_EXPECT_OK(pid);
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

absl::StatusOr<std::string> HttpGet(const std::string& host_port, const std::string& path) {
  PSTRAIN_ASSIGN_OR_RETURN(HttpResponse response,
                           pstrain::HttpGet(host_port, path, absl::Seconds(10)));
  if (response.status != 200) {
    return absl::UnavailableError(
        absl::StrCat("HTTP ", response.status, ": ", response.body.substr(0, 300)));
  }
  return std::move(response.body);
}

int PickFreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
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

pid_t ChildWithArg(pid_t pid, const std::string& arg) {
  for (pid_t child : ChildrenOf(pid)) {
    std::ifstream in("/proc/" + std::to_string(child) + "/cmdline", std::ios::binary);
    std::string a;
    while (std::getline(in, a, '\0')) {
      if (a == arg) return child;
    }
  }
  return -1;
}

std::optional<int> ReapBefore(pid_t pid, absl::Time deadline) {
  while (true) {
    if (std::optional<int> status = TryReap(pid)) return status;
    if (absl::Now() > deadline) return std::nullopt;
    absl::SleepFor(absl::Milliseconds(20));
  }
}

bool IsAlive(pid_t pid) {
  char state;
  pid_t parent;
  return ReadStat(pid, &state, &parent) && state != 'Z' && state != 'X';
}

void MakeDevCertificates(const std::vector<std::string>& args,
                         const std::vector<std::string>& env) {
  std::vector<std::string> argv = {"env"};
  argv.insert(argv.end(), env.begin(), env.end());
  argv.push_back(std::string(PSTRAIN_SOURCE_DIR) + "/deploy/tls/make-dev-certs.sh");
  argv.insert(argv.end(), args.begin(), args.end());
  ProcessResult made = RunProcess(argv);
  EXPECT_EQ(made.exit_code(), 0) << made.err;
}

absl::StatusOr<std::string> SubmitJobYaml(v1::Control::Stub& control, const std::string& yaml,
                                          absl::Duration timeout, const std::string& token,
                                          const std::string& request_id) {
  v1::SubmitJobRequest request;
  request.set_spec_yaml(yaml);
  request.set_request_id(request_id);
  v1::SubmitJobResponse response;
  grpc::ClientContext context;
  SetTimeout(context, timeout);
  AddBearerToken(context, token);
  PSTRAIN_RETURN_IF_ERROR(FromGrpcStatus(control.SubmitJob(&context, request, &response)));
  return response.job_id();
}

}  // namespace pstrain::testing
