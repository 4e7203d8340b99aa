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

absl::StatusOr<std::string> HttpGet(const std::string& host_port, const std::string& path) {
  const size_t colon = host_port.rfind(':');
  sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(std::stoi(host_port.substr(colon + 1))));
  if (inet_pton(AF_INET, host_port.substr(0, colon).c_str(), &addr.sin_addr) != 1) {
    return absl::InvalidArgumentError("HttpGet takes an IPv4 host:port");
  }
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const timeval timeout = {10, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof(timeout));
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return absl::UnavailableError("connect " + host_port + ": " + std::strerror(errno));
  }
  const std::string request = "GET " + path + " HTTP/1.0\r\nHost: " + host_port + "\r\n\r\n";
  send(fd, request.data(), request.size(), MSG_NOSIGNAL);
  std::string response;
  char buf[65536];
  ssize_t n;
  while ((n = recv(fd, buf, sizeof(buf), 0)) > 0) response.append(buf, static_cast<size_t>(n));
  close(fd);
  const size_t head_end = response.find("\r\n\r\n");
  if (head_end == std::string::npos) return absl::UnavailableError("no HTTP response");
  const std::string status_line = response.substr(0, response.find("\r\n"));
  if (status_line.find(" 200 ") == std::string::npos) {
    return absl::UnavailableError(status_line + ": " + response.substr(head_end + 4, 300));
  }
  return response.substr(head_end + 4);
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

bool IsAlive(pid_t pid) {
  char state;
  pid_t parent;
  return ReadStat(pid, &state, &parent) && state != 'Z' && state != 'X';
}

}  // namespace pstrain::testing
