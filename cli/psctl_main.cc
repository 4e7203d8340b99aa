// psctl: the control API from a shell.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "cli/job_output.h"
#include "common/clock.h"
#include "common/files.h"
#include "common/http_client.h"
#include "common/job_spec.h"
#include "common/rpc.h"
#include "common/tls.h"
#include "google/protobuf/util/json_util.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "pstrain/v1/control.grpc.pb.h"

namespace pstrain::cli {
namespace {

constexpr int kExitOk = 0;
constexpr int kExitJobFailed = 1;
constexpr int kExitUsage = 2;
constexpr int kExitUnavailable = 3;
constexpr int kExitDenied = 4;
constexpr char kDefaultCoordinator[] = "127.0.0.1:50050";

constexpr char kUsage[] = R"(usage: psctl [--coordinator HOST:PORT] [-o table|json] [--timeout SECONDS]
             [--tls_cert FILE --tls_key FILE --tls_ca FILE] [--token_file FILE] VERB ...

verbs:
  submit FILE          submit a job file (YAML); prints the job id
  get ID               show one job
  list [--state S]... [--limit N]
                       jobs, newest first (S: pending, running, succeeded,
                       failed, cancelled; repeat or separate with commas)
  watch ID             follow a job live until it ends
  cancel ID            cancel a pending or running job
  nodes                registered servers and workers
  export ID PATH       write a succeeded job's model file to PATH; a job with
                       embedding tables: a directory PATH of its model file and
                       tables (read from its checkpoint.dir, which must be
                       reachable from here)
  checkpoint ID        checkpoint a running job now; waits until every node
                       has written its part (at most --timeout)
  health TARGET [--service NAME]
                       probe one process (for HEALTHCHECK and exec probes):
                       HOST:PORT asks the gRPC health service of a
                       coordinator or server (NAME: one service, default the
                       server as a whole) and prints SERVING or NOT_SERVING;
                       http://HOST:PORT/PATH gets /healthz, /readyz or
                       /metrics of any process and prints the body. Exit 0
                       if healthy (SERVING, HTTP 2xx), 1 if not

--check_flags checks the command line and exits 0 without contacting anything.

The coordinator is --coordinator, else $PSTRAIN_COORDINATOR, else 127.0.0.1:50050.
With --tls_cert, --tls_key and --tls_ca psctl speaks mutual TLS (a client
certificate, e.g. admin.crt of deploy/tls/make-dev-certs.sh). The bearer token
is the first line of --token_file, else $PSTRAIN_TOKEN.
Exit status: 0 success; 1 the watched job failed or was cancelled, or the
probed process is not healthy; 2 usage or invalid input (bad job file,
unknown job); 3 coordinator (or probed process) unreachable or other errors;
4 not authenticated or not allowed (token, certificate).
)";

struct Command {
  std::string verb;
  std::vector<std::string> args;
  std::string coordinator;
  bool json = false;
  absl::Duration timeout = absl::Seconds(10);
  std::vector<v1::JobState> states;  // list
  int limit = 50;                    // list
  std::string service;               // health
  bool check_flags = false;
  TlsFiles tls;
  std::string token;  // bearer token; empty: none
};

// A usage error: message on stderr, exit 2.
int Usage(const std::string& message) {
  std::cerr << "psctl: " << message << "\n" << "run 'psctl --help' for usage\n";
  return kExitUsage;
}

// Parses the command line. Returns an exit code on error or --help.
std::optional<int> Parse(int argc, char** argv, Command* cmd) {
  const char* env = std::getenv("PSTRAIN_COORDINATOR");
  cmd->coordinator = env != nullptr && *env != '\0' ? env : kDefaultCoordinator;
  std::vector<std::string> positional;
  bool saw_state = false, saw_limit = false, saw_service = false;
  std::string token_file;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "-h" || arg == "--help" || (arg == "help" && positional.empty())) {
      std::cout << kUsage;
      return kExitOk;
    }
    if (arg == "--") {
      for (++i; i < argc; ++i) positional.push_back(argv[i]);
      break;
    }
    if (arg.size() < 2 || arg[0] != '-') {
      positional.push_back(arg);
      continue;
    }
    if (arg == "--check_flags") {
      cmd->check_flags = true;
      continue;
    }
    std::string name = arg.substr(arg[1] == '-' ? 2 : 1);
    std::string value;
    const size_t eq = name.find('=');
    const bool inline_value = eq != std::string::npos;
    if (inline_value) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
    }
    static const std::set<std::string> kValueFlags = {
        "coordinator", "o",       "output",  "timeout", "state",     "limit",
        "service",     "tls_cert", "tls_key", "tls_ca", "token_file"};
    if (!kValueFlags.contains(name)) return Usage(absl::StrCat("unknown flag ", arg));
    if (!inline_value) {
      // A value that looks like a flag is taken only as --flag=value.
      if (i + 1 >= argc || (argv[i + 1][0] == '-' && argv[i + 1][1] != '\0')) {
        return Usage(absl::StrCat("flag ", arg, " needs a value"));
      }
      value = argv[++i];
    }
    if (name == "coordinator") {
      cmd->coordinator = value;
    } else if (name == "o" || name == "output") {
      if (value != "json" && value != "table") {
        return Usage(absl::StrCat("-o takes table or json, not '", value, "'"));
      }
      cmd->json = value == "json";
    } else if (name == "timeout") {
      double seconds;
      if (!absl::SimpleAtod(value, &seconds) || !(seconds > 0)) {
        return Usage(absl::StrCat("--timeout takes a positive number of seconds, not '", value, "'"));
      }
      cmd->timeout = absl::Seconds(seconds);
    } else if (name == "state") {
      saw_state = true;
      for (absl::string_view s : absl::StrSplit(value, ',', absl::SkipEmpty())) {
        v1::JobState state;
        if (!v1::JobState_Parse(absl::StrCat("JOB_STATE_", absl::AsciiStrToUpper(s)), &state) ||
            state == v1::JOB_STATE_UNSPECIFIED) {
          return Usage(absl::StrCat("unknown state '", s, "'"));
        }
        cmd->states.push_back(state);
      }
    } else if (name == "service") {
      saw_service = true;
      cmd->service = value;
    } else if (name == "tls_cert") {
      cmd->tls.cert = value;
    } else if (name == "tls_key") {
      cmd->tls.key = value;
    } else if (name == "tls_ca") {
      cmd->tls.ca = value;
    } else if (name == "token_file") {
      token_file = value;
    } else if (name == "limit") {
      saw_limit = true;
      if (!absl::SimpleAtoi(value, &cmd->limit) || cmd->limit < 1) {
        return Usage(absl::StrCat("--limit takes a positive integer, not '", value, "'"));
      }
    }
  }
  if (positional.empty()) return Usage("missing verb");
  cmd->verb = positional[0];
  cmd->args.assign(positional.begin() + 1, positional.end());
  static const std::map<std::string, size_t> kArity = {
      {"submit", 1}, {"get", 1}, {"list", 0}, {"watch", 1},
      {"cancel", 1}, {"nodes", 0}, {"export", 2}, {"checkpoint", 1}, {"health", 1}};
  auto it = kArity.find(cmd->verb);
  if (it == kArity.end()) return Usage(absl::StrCat("unknown verb '", cmd->verb, "'"));
  if (cmd->args.size() != it->second) {
    return Usage(absl::StrCat(cmd->verb, " takes ", it->second, " argument(s), got ",
                              cmd->args.size()));
  }
  if ((saw_state || saw_limit) && cmd->verb != "list") {
    return Usage("--state and --limit go with list");
  }
  if (saw_service && cmd->verb != "health") return Usage("--service goes with health");
  if (cmd->check_flags) {
    std::cout << "flags ok\n";
    return kExitOk;
  }
  // The files named are read once the command line is known to be good, so
  // that a bad one is a usage error before any call.
  if (!token_file.empty()) {
    absl::StatusOr<std::string> text = ReadFile(token_file);
    if (!text.ok()) return Usage(absl::StrCat("--token_file: cannot read ", token_file));
    cmd->token = std::string(absl::StripAsciiWhitespace(text->substr(0, text->find('\n'))));
    if (cmd->token.empty()) return Usage(absl::StrCat("--token_file: ", token_file, " is empty"));
  } else if (const char* token = std::getenv("PSTRAIN_TOKEN"); token != nullptr) {
    cmd->token = std::string(absl::StripAsciiWhitespace(token));
  }
  if (!cmd->tls.empty()) {
    if (absl::Status s = TransportSecurity::Load(cmd->tls).status(); !s.ok()) {
      return Usage(std::string(s.message()));
    }
  }
  return std::nullopt;
}

// An RPC failure: message on stderr; 2 for what the user got wrong, 3 else.
int Failed(const grpc::Status& status) {
  std::cerr << "psctl: " << Printable(status.error_message()) << "\n";
  switch (status.error_code()) {
    case grpc::StatusCode::INVALID_ARGUMENT:
    case grpc::StatusCode::NOT_FOUND:
    case grpc::StatusCode::FAILED_PRECONDITION:
    case grpc::StatusCode::ALREADY_EXISTS:
    case grpc::StatusCode::OUT_OF_RANGE:
      return kExitUsage;
    case grpc::StatusCode::UNAUTHENTICATED:
    case grpc::StatusCode::PERMISSION_DENIED:
      return kExitDenied;
    case grpc::StatusCode::UNAVAILABLE:
      std::cerr << "psctl: is a coordinator running at the address given? (--coordinator, "
                   "$PSTRAIN_COORDINATOR)\n";
      return kExitUnavailable;
    default:
      return kExitUnavailable;
  }
}

std::string ToJson(const google::protobuf::Message& message) {
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  options.always_print_primitive_fields = true;
  std::string out;
  (void)google::protobuf::util::MessageToJsonString(message, &out, options);
  return out;
}

std::string Ago(int64_t time_ms) {
  if (time_ms <= 0) return "-";
  const int64_t s = std::max<int64_t>(0, (absl::ToUnixMillis(absl::Now()) - time_ms) / 1000);
  if (s < 120) return absl::StrCat(s, "s");
  if (s < 7200) return absl::StrCat(s / 60, "m");
  if (s < 172800) return absl::StrCat(s / 3600, "h");
  return absl::StrCat(s / 86400, "d");
}

// Whether `psctl export` can write the succeeded job's model: a job with
// tables exports from its servers' checkpoints of the last step.
std::string ModelFileRow(const v1::Job& job) {
  if (!job.has_model()) return "no";
  if (job.spec().tables_size() > 0 && job.spec().checkpoint().dir().empty()) {
    return "not exportable: its tables are exported from checkpoints, and the job had no "
           "checkpoint.dir";
  }
  return "yes (psctl export)";
}

std::string Time(int64_t time_ms) {
  if (time_ms <= 0) return "-";
  return absl::FormatTime("%Y-%m-%d %H:%M:%S", absl::FromUnixMillis(time_ms),
                          absl::LocalTimeZone());
}

// Prints rows as columns padded to their widest cell.
void PrintTable(const std::vector<std::vector<std::string>>& rows) {
  std::vector<size_t> width;
  for (const auto& row : rows) {
    width.resize(std::max(width.size(), row.size()), 0);
    for (size_t c = 0; c < row.size(); ++c) width[c] = std::max(width[c], Printable(row[c]).size());
  }
  for (const auto& row : rows) {
    std::string line;
    for (size_t c = 0; c < row.size(); ++c) {
      const std::string cell = Printable(row[c]);
      line += cell;
      if (c + 1 < row.size()) line += std::string(width[c] - cell.size() + 2, ' ');
    }
    std::cout << line << "\n";
  }
}

class Psctl {
 public:
  explicit Psctl(const Command& cmd)
      : cmd_(cmd),
        security_(cmd.tls.empty() ? nullptr : *TransportSecurity::Load(cmd.tls)),
        stub_(v1::Control::NewStub(MakeChannel(
            cmd.coordinator,
            {.security = security_.get(), .peer_roles = {PeerRole::kCoordinator}}))) {}

  int Run() {
    if (cmd_.verb == "submit") return Submit(cmd_.args[0]);
    if (cmd_.verb == "get") return Get(cmd_.args[0]);
    if (cmd_.verb == "list") return List();
    if (cmd_.verb == "watch") return Watch(cmd_.args[0]);
    if (cmd_.verb == "cancel") return Cancel(cmd_.args[0]);
    if (cmd_.verb == "nodes") return Nodes();
    if (cmd_.verb == "checkpoint") return Checkpoint(cmd_.args[0]);
    if (cmd_.verb == "health") return Health(cmd_.args[0]);
    return Export(cmd_.args[0], cmd_.args[1]);
  }

 private:
  // The call's deadline (`timeout`, default --timeout; infinite: none) and
  // the user's token.
  void Prepare(grpc::ClientContext& context,
               std::optional<absl::Duration> timeout = std::nullopt) const {
    const absl::Duration t = timeout.value_or(cmd_.timeout);
    if (t != absl::InfiniteDuration()) SetTimeout(context, t);
    AddBearerToken(context, cmd_.token);
  }

  int Submit(const std::string& path) {
    absl::StatusOr<std::string> text = ReadFile(path);
    if (!text.ok()) {
      std::cerr << "psctl: cannot read job file " << path << "\n";
      return kExitUsage;
    }
    v1::SubmitJobRequest request;
    request.set_spec_yaml(*text);
    // Retried under one request id while the coordinator is unreachable
    // (within --timeout): a reply lost on the way back makes no second job.
    std::random_device random;
    request.set_request_id(absl::StrFormat("psctl-%08x%08x%08x", random(), random(), random()));
    v1::SubmitJobResponse response;
    const absl::Time give_up = MonotonicNow() + cmd_.timeout;
    grpc::Status status;
    while (true) {
      grpc::ClientContext context;
      Prepare(context, std::max(give_up - MonotonicNow(), absl::Milliseconds(1)));
      status = stub_->SubmitJob(&context, request, &response);
      if (status.error_code() != grpc::StatusCode::UNAVAILABLE || MonotonicNow() >= give_up) break;
      absl::SleepFor(absl::Milliseconds(200));
    }
    if (!status.ok()) {
      if (status.error_code() == grpc::StatusCode::INVALID_ARGUMENT) {
        std::cerr << "psctl: " << path << ": " << status.error_message() << "\n";
        return kExitUsage;
      }
      return Failed(status);
    }
    if (cmd_.json) {
      std::cout << ToJson(response) << "\n";
    } else {
      std::cout << response.job_id() << "\n";
    }
    return kExitOk;
  }

  int Get(const std::string& id) {
    v1::GetJobRequest request;
    request.set_job_id(id);
    v1::Job job;
    grpc::ClientContext context;
    Prepare(context);
    if (grpc::Status s = stub_->GetJob(&context, request, &job); !s.ok()) return Failed(s);
    if (cmd_.json) {
      std::cout << ToJson(job) << "\n";
      return kExitOk;
    }
    const v1::JobSpec& spec = job.spec();
    const v1::Progress& p = job.progress();
    std::vector<std::vector<std::string>> rows = {
        {"id:", job.id()},
        {"name:", spec.name().empty() ? "-" : spec.name()},
        {"state:", EnumName(job.state())},
        {"reason:", job.reason().empty() ? "-" : job.reason()},
        {"model:", ModelSummary(spec)},
        {"optimizer:", absl::StrFormat("%s, learning rate %g",
                                       EnumName(spec.optimizer().type()),
                                       spec.optimizer().learning_rate())},
        {"mode:", ModeSummary(spec)},
        {"workers:", absl::StrFormat("%d x %s  %s", spec.num_workers(), WorkerBatchSummary(spec),
                                     absl::StrJoin(job.worker_nodes(), " "))},
        {"servers:", absl::StrFormat("%d  %s", spec.num_servers(),
                                     absl::StrJoin(job.server_addresses(), " "))},
        {"progress:", absl::StrFormat("step %d/%d, epoch %d/%d, loss %.4f, %.0f samples/s",
                                      p.step(), p.total_steps(), p.epoch() + 1,
                                      p.total_epochs(), p.loss(), p.samples_per_second())},
        {"checkpoint:", job.last_checkpoint_step() > 0
                            ? absl::StrFormat("step %d, every %d steps in %s",
                                              job.last_checkpoint_step(),
                                              spec.checkpoint().every_steps(),
                                              spec.checkpoint().dir())
                            : spec.checkpoint().dir().empty() ? "none (no checkpoint.dir)"
                                                              : "none yet"},
        {"recovery:", absl::StrFormat("generation %d, %d recoveries; on worker loss %s, "
                                      "replace after %ds, wait at most %ds",
                                      job.generation(), job.recoveries(),
                                      EnumName(spec.recovery().on_worker_loss()),
                                      spec.recovery().replace_after_seconds(),
                                      spec.recovery().wait_timeout_seconds())},
        {"created:", Time(job.create_time_ms())},
        {"started:", Time(job.start_time_ms())},
        {"ended:", Time(job.end_time_ms())},
    };
    for (const v1::MembershipChange& change : job.history()) {
      rows.push_back({absl::StrCat("generation ", change.generation(), ":"),
                      absl::StrFormat("%s, from step %d: %s", Time(change.time_ms()), change.step(),
                                      change.reason())});
    }
    for (const auto& [label, eval] : {std::pair{"last evaluation:", &job.last_evaluation()},
                                      std::pair{"best evaluation:", &job.best_evaluation()}}) {
      if (eval->step() == 0) continue;  // none during training
      rows.push_back({label, absl::StrFormat("step %d: test accuracy %.4f", eval->step(),
                                             eval->test_accuracy()) +
                                 (eval->has_test_loss()
                                      ? absl::StrFormat(", test loss %.4f", eval->test_loss())
                                      : "")});
    }
    const bool succeeded = job.state() == v1::JOB_STATE_SUCCEEDED;
    const auto& metrics = succeeded ? job.result().metrics() : job.progress().metrics();
    if (!metrics.empty()) rows.push_back({"metrics:", MetricsText(metrics)});
    if (succeeded) {
      const v1::JobResult& r = job.result();
      rows.push_back(
          {"result:", (r.evaluated() ? absl::StrFormat("test accuracy %.4f, ", r.test_accuracy())
                                     : "") +
                          (r.evaluated() && r.has_test_loss()
                               ? absl::StrFormat("test loss %.4f, ", r.test_loss())
                               : "") +
                          absl::StrFormat("final loss %.4f", r.final_loss())});
      rows.push_back({"training:", absl::StrFormat("%d steps in %.1f s, %.0f samples/s",
                                                   r.steps(), r.train_seconds(),
                                                   r.samples_per_second())});
      rows.push_back({"step time:", StepTimesSummary(r.step_times())});
      rows.push_back({"model file:", ModelFileRow(job)});
    }
    PrintTable(rows);
    return kExitOk;
  }

  int List() {
    v1::ListJobsResponse all;
    v1::ListJobsRequest request;
    for (v1::JobState s : cmd_.states) request.add_states(s);
    while (all.jobs_size() < cmd_.limit) {
      request.set_page_size(std::min(cmd_.limit - all.jobs_size(), 1000));
      v1::ListJobsResponse page;
      grpc::ClientContext context;
      Prepare(context);
      if (grpc::Status s = stub_->ListJobs(&context, request, &page); !s.ok()) return Failed(s);
      for (v1::Job& job : *page.mutable_jobs()) *all.add_jobs() = std::move(job);
      if (page.next_page_token().empty()) break;
      request.set_page_token(page.next_page_token());
    }
    if (cmd_.json) {
      std::cout << ToJson(all) << "\n";
      return kExitOk;
    }
    std::vector<std::vector<std::string>> rows = {{"ID", "NAME", "STATE", "MODEL", "MODE",
                                                   "WORKERS", "STEP", "CKPT", "LOSS", "ACCURACY",
                                                   "AGE"}};
    for (const v1::Job& job : all.jobs()) {
      const bool done = job.state() == v1::JOB_STATE_SUCCEEDED;
      rows.push_back({job.id(), job.spec().name().empty() ? "-" : job.spec().name(),
                      EnumName(job.state()), ModelSummary(job.spec()),
                      EnumName(job.spec().mode()), absl::StrCat(job.spec().num_workers()),
                      absl::StrCat(job.progress().step(), "/", job.progress().total_steps()),
                      job.last_checkpoint_step() > 0 ? absl::StrCat(job.last_checkpoint_step())
                                                     : "-",
                      job.progress().step() > 0 ? absl::StrFormat("%.4f", job.progress().loss())
                                                : "-",
                      done && job.result().evaluated()
                          ? absl::StrFormat("%.4f", job.result().test_accuracy())
                          : "-",
                      Ago(job.create_time_ms())});
    }
    PrintTable(rows);
    return kExitOk;
  }

  int Watch(const std::string& id) {
    grpc::ClientContext context;
    Prepare(context, absl::InfiniteDuration());  // a job may run for days
    ProgressDisplay display(stdout, isatty(STDOUT_FILENO), absl::Seconds(1));
    absl::StatusOr<v1::Job> job =
        FollowJob(*stub_, id, context, [&](const v1::JobEvent& event, const v1::Job& now) {
          if (cmd_.json) {
            std::cout << ToJson(event) << std::endl;
          } else {
            display.OnEvent(event, now);
          }
        });
    if (!job.ok()) return Failed(ToGrpcStatus(job.status()));
    if (!cmd_.json) std::cout << ResultSummary(*job) << "\n";
    return job->state() == v1::JOB_STATE_SUCCEEDED ? kExitOk : kExitJobFailed;
  }

  int Cancel(const std::string& id) {
    v1::CancelJobRequest request;
    request.set_job_id(id);
    v1::Job job;
    grpc::ClientContext context;
    Prepare(context);
    if (grpc::Status s = stub_->CancelJob(&context, request, &job); !s.ok()) return Failed(s);
    if (cmd_.json) {
      std::cout << ToJson(job) << "\n";
    } else {
      std::cout << job.id() << " " << EnumName(job.state()) << "\n";
    }
    return kExitOk;
  }

  int Nodes() {
    v1::ListNodesResponse response;
    grpc::ClientContext context;
    Prepare(context);
    if (grpc::Status s = stub_->ListNodes(&context, v1::ListNodesRequest(), &response); !s.ok()) {
      return Failed(s);
    }
    if (cmd_.json) {
      std::cout << ToJson(response) << "\n";
      return kExitOk;
    }
    std::vector<std::vector<std::string>> rows = {
        {"ID", "ROLE", "STATE", "ADDRESS", "PID", "JOBS", "MEMORY", "HEARTBEAT"}};
    for (const v1::Node& n : response.nodes()) {
      std::string memory = "-";
      if (n.role() == v1::NODE_ROLE_SERVER) {
        memory = n.max_memory_bytes() > 0
                     ? absl::StrFormat("%.1f/%.1f MB", n.reserved_bytes() / 1e6,
                                       n.max_memory_bytes() / 1e6)
                     : absl::StrFormat("%.1f MB", n.reserved_bytes() / 1e6);
      }
      rows.push_back({n.id(), EnumName(n.role()), EnumName(n.state()),
                      n.address().empty() ? "-" : n.address(),
                      n.pid() > 0 ? absl::StrCat(n.pid()) : "-",
                      n.jobs().empty() ? "-" : absl::StrJoin(n.jobs(), ","), memory,
                      n.last_heartbeat_ms() > 0 ? Ago(n.last_heartbeat_ms()) + " ago" : "-"});
    }
    PrintTable(rows);
    return kExitOk;
  }

  // Asks for a checkpoint, then waits until it is complete.
  int Checkpoint(const std::string& id) {
    v1::CheckpointJobRequest request;
    request.set_job_id(id);
    v1::CheckpointJobResponse response;
    {
      grpc::ClientContext context;
      Prepare(context);
      if (grpc::Status s = stub_->CheckpointJob(&context, request, &response); !s.ok()) {
        return Failed(s);
      }
    }
    if (!cmd_.json) std::cout << id << ": checkpoint at step " << response.step() << " asked for\n";
    const absl::Time give_up = MonotonicNow() + cmd_.timeout;
    while (true) {
      v1::GetJobRequest get;
      get.set_job_id(id);
      v1::Job job;
      grpc::ClientContext context;
      Prepare(context);
      if (grpc::Status s = stub_->GetJob(&context, get, &job); !s.ok()) return Failed(s);
      if (job.last_checkpoint_step() >= response.step()) {
        if (cmd_.json) {
          std::cout << absl::StrFormat("{\"job_id\":%s,\"step\":%d}\n", JsonQuote(id),
                                       job.last_checkpoint_step());
        } else {
          std::cout << id << ": checkpoint of step " << job.last_checkpoint_step()
                    << " complete\n";
        }
        return kExitOk;
      }
      if (job.state() != v1::JOB_STATE_RUNNING || job.checkpoint_request_step() != response.step()) {
        std::cerr << "psctl: " << id << " is " << EnumName(job.state())
                  << (job.state() == v1::JOB_STATE_RUNNING ? " at a new generation" : "")
                  << ": the checkpoint of step " << response.step() << " was not taken\n";
        return kExitJobFailed;
      }
      if (MonotonicNow() > give_up) {
        std::cerr << "psctl: the checkpoint of step " << response.step()
                  << " is not complete yet (--timeout)\n";
        return kExitUnavailable;
      }
      absl::SleepFor(absl::Milliseconds(100));
    }
  }

  int Export(const std::string& id, const std::string& path) {
    v1::Job job;
    {
      grpc::ClientContext context;
      Prepare(context, cmd_.timeout);
      v1::GetJobRequest request;
      request.set_job_id(id);
      if (grpc::Status s = stub_->GetJob(&context, request, &job); !s.ok()) return Failed(s);
    }
    grpc::ClientContext context;
    Prepare(context, cmd_.timeout + absl::Minutes(5));
    absl::StatusOr<std::string> written = WriteJobExport(*stub_, context, job, path, cmd_.timeout);
    if (!written.ok()) return Failed(ToGrpcStatus(written.status()));
    if (cmd_.json) {
      std::cout << absl::StrFormat("{\"job_id\":%s,\"path\":%s,\"tables\":%d}\n", JsonQuote(id),
                                   JsonQuote(path), job.spec().tables_size());
    } else {
      std::cout << *written << "\n";
    }
    return kExitOk;
  }

  int Health(const std::string& target) {
    bool healthy = false;
    std::string answer;
    if (absl::StartsWith(target, "http://")) {
      const std::string rest = target.substr(strlen("http://"));
      const size_t slash = rest.find('/');
      const std::string host_port = rest.substr(0, slash);
      const std::string path = slash == std::string::npos ? "/" : rest.substr(slash);
      absl::StatusOr<HttpResponse> response = HttpGet(host_port, path, cmd_.timeout);
      if (!response.ok()) {
        std::cerr << "psctl: " << response.status().message() << "\n";
        return response.status().code() == absl::StatusCode::kInvalidArgument ? kExitUsage
                                                                              : kExitUnavailable;
      }
      healthy = response->status >= 200 && response->status < 300;
      answer = response->body;
      if (!healthy) std::cerr << "psctl: " << target << ": HTTP " << response->status << "\n";
    } else {
      auto health =
          grpc::health::v1::Health::NewStub(MakeChannel(target, {.security = security_.get()}));
      grpc::health::v1::HealthCheckRequest request;
      request.set_service(cmd_.service);
      grpc::health::v1::HealthCheckResponse response;
      grpc::ClientContext context;
      Prepare(context);
      if (grpc::Status s = health->Check(&context, request, &response); !s.ok()) {
        std::cerr << "psctl: " << target << ": " << s.error_message() << "\n";
        return s.error_code() == grpc::StatusCode::NOT_FOUND ? kExitJobFailed : kExitUnavailable;
      }
      healthy = response.status() == grpc::health::v1::HealthCheckResponse::SERVING;
      answer = absl::StrCat(
          grpc::health::v1::HealthCheckResponse::ServingStatus_Name(response.status()), "\n");
    }
    if (cmd_.json) {
      std::cout << absl::StrFormat("{\"target\":%s,\"healthy\":%s,\"answer\":%s}\n",
                                   JsonQuote(target), healthy ? "true" : "false",
                                   JsonQuote(answer));
    } else {
      std::cout << answer;
    }
    return healthy ? kExitOk : kExitJobFailed;
  }

  const Command& cmd_;
  const std::unique_ptr<TransportSecurity> security_;
  std::unique_ptr<v1::Control::Stub> stub_;
};

}  // namespace
}  // namespace pstrain::cli

int main(int argc, char** argv) {
  pstrain::cli::Command cmd;
  if (std::optional<int> exit = pstrain::cli::Parse(argc, argv, &cmd)) return *exit;
  const int code = pstrain::cli::Psctl(cmd).Run();
  // gRPC's threads may still be finishing with a connection (a TLS
  // handshake) after the channels are gone; the exit handlers would clean
  // OpenSSL up under them (a crash at exit, found under AddressSanitizer).
  // The output is flushed and nothing else is left to do: end without them.
  std::cout.flush();
  std::cerr.flush();
  _exit(code);
}
