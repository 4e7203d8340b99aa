// Helpers for tests that run the real binaries.
#ifndef PSTRAIN_TESTS_INTEGRATION_INTEGRATION_UTIL_H_
#define PSTRAIN_TESTS_INTEGRATION_INTEGRATION_UTIL_H_

#include <sys/types.h>

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "pstrain/v1/control.grpc.pb.h"

namespace pstrain::testing {

// The directory of the pstrain binaries under test.
inline std::string BinDir() { return PSTRAIN_BIN_DIR; }

// A new empty directory under /tmp, removed by the destructor.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  const std::string& path() const { return path_; }
  // Writes `contents` to path()/name and returns the full path.
  std::string Write(const std::string& name, const std::string& contents) const;

 private:
  std::string path_;
};

struct ProcessResult {
  int status = -1;  // wait status
  std::string out;  // stdout
  std::string err;  // stderr
  int exit_code() const;  // -1 unless it exited normally
};

// Runs argv to completion; fails the test (and kills it) after `patience`.
ProcessResult RunProcess(const std::vector<std::string>& argv,
                         absl::Duration patience = absl::Seconds(60));

// Runs deploy/tls/make-dev-certs.sh with `args` (DIR SERVERS WORKERS, or
// DIR --names NAME...) and `env` ("VAR=value", ...); a test failure if it
// fails.
void MakeDevCertificates(const std::vector<std::string>& args,
                         const std::vector<std::string>& env = {});

// A plain HTTP/1.0 GET of http://host:port/path_and_query; the body, or an
// error for a failed connection or a status other than 200.
absl::StatusOr<std::string> HttpGet(const std::string& host_port, const std::string& path);

// A TCP port on 127.0.0.1 that was free a moment ago (for programs that
// cannot be told to pick one themselves).
int PickFreePort();

// Live (not zombie) processes whose parent is `pid`.
std::vector<pid_t> ChildrenOf(pid_t pid);
// The child of `pid` whose command line has `arg`; -1 if none.
pid_t ChildWithArg(pid_t pid, const std::string& arg);
bool IsAlive(pid_t pid);
// Reaps the child `pid` once it exits; its wait status, or nullopt if it
// still runs at `deadline` (it is left running).
std::optional<int> ReapBefore(pid_t pid, absl::Time deadline);

// Submits the job file `yaml` through `control` within `timeout`, with
// the bearer `token` and the `request_id` where not empty; the new job's id.
absl::StatusOr<std::string> SubmitJobYaml(v1::Control::Stub& control, const std::string& yaml,
                                          absl::Duration timeout, const std::string& token = "",
                                          const std::string& request_id = "");

}  // namespace pstrain::testing

#endif  // PSTRAIN_TESTS_INTEGRATION_INTEGRATION_UTIL_H_
