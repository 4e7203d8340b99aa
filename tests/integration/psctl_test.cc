// psctl as a user runs it: every verb, in table and JSON form, and its exit
// codes.
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "gtest/gtest.h"
#include "cli/job_output.h"
#include "common/files.h"
#include "tests/cluster_util.h"
#include "tests/integration/cluster_fixture.h"

namespace pstrain::testing {
namespace {

constexpr char kJob[] = R"(name: psctl-test
model: {type: mlp, hidden: [64]}
optimizer: {type: adam, learning_rate: 0.001}
batch_size: 64
steps: 150
num_servers: 1
num_workers: 1
)";

class PsctlTest : public ClusterFixture {};

TEST_F(PsctlTest, UsageErrorsExit2WithoutAnyCoordinator) {
  const std::string psctl = BinDir() + "/psctl";
  ProcessResult help = RunProcess({psctl, "--help"});
  EXPECT_EQ(help.exit_code(), 0);
  EXPECT_TRUE(absl::StrContains(help.out, "usage: psctl")) << help.out;
  const std::vector<std::vector<std::string>> bad = {
      {},                        // no verb
      {"frobnicate"},            // unknown verb
      {"--bogus", "list"},       // unknown flag
      {"get"},                   // missing argument
      {"export", "job-1"},       // missing argument
      {"list", "--limit", "0"},  // bad value
      {"-o", "yaml", "list"},    // bad output format
      {"get", "job-1", "--state", "running"},  // flag of another verb
      {"list", "--state", "sleeping"},         // unknown state
      {"--coordinator", "-o", "json", "nodes"},  // a flag where a value should be
      {"submit", "help"},                      // a file named help that does not exist
  };
  for (const std::vector<std::string>& args : bad) {
    std::vector<std::string> argv = {psctl};
    argv.insert(argv.end(), args.begin(), args.end());
    ProcessResult r = RunProcess(argv);
    EXPECT_EQ(r.exit_code(), 2) << absl::StrJoin(args, " ") << ": " << r.err;
    EXPECT_TRUE(absl::StartsWith(r.err, "psctl: ")) << r.err;
  }
  // Nobody listens there: exit 3.
  ProcessResult down = RunProcess({psctl, "--coordinator=127.0.0.1:1", "--timeout=2", "list"});
  EXPECT_EQ(down.exit_code(), 3) << down.err;
}

TEST_F(PsctlTest, EveryVerbInTableAndJson) {
  ASSERT_NO_FATAL_FAILURE(StartCluster(1, 1));
  const std::string job_file = dir_.Write("job.yaml", kJob);

  // submit: the id on stdout; JSON: {"job_id": ...}.
  ProcessResult submitted = Psctl({"submit", job_file});
  ASSERT_EQ(submitted.exit_code(), 0) << submitted.err;
  const std::string id(absl::StripAsciiWhitespace(submitted.out));
  EXPECT_TRUE(absl::StartsWith(id, "job-")) << id;
  ProcessResult json_submit = Psctl({"-o", "json", "submit", job_file});
  ASSERT_EQ(json_submit.exit_code(), 0);
  EXPECT_TRUE(absl::StrContains(json_submit.out, "\"job_id\":\"job-")) << json_submit.out;
  const size_t id_at = json_submit.out.find("job-");
  const std::string second = json_submit.out.substr(id_at, json_submit.out.find('"', id_at) - id_at);

  // watch: follows to the end, exit 0 for a succeeded job.
  ProcessResult watched = Psctl({"watch", id});
  EXPECT_EQ(watched.exit_code(), 0) << watched.err;
  EXPECT_TRUE(absl::StrContains(watched.out, "succeeded: test accuracy")) << watched.out;
  ProcessResult json_watch = Psctl({"watch", second, "-o", "json"});
  EXPECT_EQ(json_watch.exit_code(), 0) << json_watch.err;
  EXPECT_TRUE(absl::StartsWith(json_watch.out, "{\"time_ms\"")) << json_watch.out;
  EXPECT_TRUE(absl::StrContains(json_watch.out, "\"completed\"")) << json_watch.out;

  // get.
  ProcessResult got = Psctl({"get", id});
  EXPECT_EQ(got.exit_code(), 0);
  EXPECT_TRUE(absl::StrContains(got.out, "succeeded\n")) << got.out;
  EXPECT_TRUE(absl::StrContains(got.out, "mlp 784-64-10\n")) << got.out;
  EXPECT_TRUE(absl::StartsWith(got.out, "id:")) << got.out;
  ProcessResult json_get = Psctl({"get", id, "-o=json"});
  EXPECT_TRUE(absl::StrContains(json_get.out, "\"state\":\"JOB_STATE_SUCCEEDED\"")) << json_get.out;

  // list, with a state filter.
  ProcessResult listed = Psctl({"list"});
  EXPECT_EQ(listed.exit_code(), 0);
  EXPECT_TRUE(absl::StartsWith(listed.out, "ID  ")) << listed.out;
  EXPECT_TRUE(absl::StrContains(listed.out, id)) << listed.out;
  ProcessResult none_running = Psctl({"list", "--state=running,pending", "-o", "json"});
  EXPECT_EQ(none_running.exit_code(), 0);
  EXPECT_FALSE(absl::StrContains(none_running.out, id)) << none_running.out;

  // nodes.
  ProcessResult nodes = Psctl({"nodes"});
  EXPECT_EQ(nodes.exit_code(), 0);
  EXPECT_TRUE(absl::StrContains(nodes.out, "server  alive")) << nodes.out;
  EXPECT_TRUE(absl::StrContains(nodes.out, "worker  alive")) << nodes.out;
  EXPECT_TRUE(absl::StrContains(Psctl({"nodes", "-o", "json"}).out, "\"role\":\"NODE_ROLE_SERVER\""));

  // export.
  const std::string model = dir_.path() + "/model.pstm";
  ProcessResult exported = Psctl({"export", id, model});
  EXPECT_EQ(exported.exit_code(), 0) << exported.err;
  EXPECT_TRUE(absl::StrContains(exported.out, "wrote " + model)) << exported.out;

  // checkpoint: of a job without a checkpoint.dir, refused (2); of a
  // running job with one, taken, and shown by get and list.
  EXPECT_EQ(Psctl({"checkpoint", id}).exit_code(), 2) << "it is not running";
  std::string long_job = kJob;
  long_job.replace(long_job.find("steps: 150"), 10, "steps: 1000000");
  const std::string checkpointed(absl::StripAsciiWhitespace(
      Psctl({"submit", dir_.Write("checkpointed.yaml",
                                  long_job + "checkpoint: {dir: " + dir_.path() +
                                      "/checkpoints, every_steps: 1000000000}\n")})
          .out));
  WaitFor(checkpointed, [](const v1::Job& job) { return job.progress().step() > 10; });
  ProcessResult checkpoint = Psctl({"checkpoint", checkpointed});
  EXPECT_EQ(checkpoint.exit_code(), 0) << checkpoint.err;
  EXPECT_TRUE(absl::StrContains(checkpoint.out, "complete\n")) << checkpoint.out;
  const std::string shown = Psctl({"get", checkpointed}).out;
  EXPECT_TRUE(absl::StrContains(shown, ", every 1000000000 steps in ")) << shown;
  EXPECT_TRUE(absl::StrContains(Psctl({"list"}).out, "CKPT"));
  Psctl({"cancel", checkpointed});

  // cancel, and watch of a cancelled job: exit 1.
  const std::string third(absl::StripAsciiWhitespace(
      Psctl({"submit", dir_.Write("long.yaml", long_job)}).out));
  ProcessResult cancelled = Psctl({"cancel", third});
  EXPECT_EQ(cancelled.exit_code(), 0);
  EXPECT_EQ(cancelled.out, third + " cancelled\n");
  EXPECT_EQ(Psctl({"watch", third}).exit_code(), 1);
  // Nothing to export from a cancelled job; unknown ids; bad job files: 2.
  EXPECT_EQ(Psctl({"export", third, model}).exit_code(), 2);
  ProcessResult unknown = Psctl({"get", "job-999999"});
  EXPECT_EQ(unknown.exit_code(), 2);
  EXPECT_TRUE(absl::StrContains(unknown.err, "job-999999")) << unknown.err;
  ProcessResult invalid = Psctl({"submit", dir_.Write("bad.yaml", "model: {type: transformer}\n")});
  EXPECT_EQ(invalid.exit_code(), 2);
  EXPECT_TRUE(absl::StrContains(invalid.err, "model.type")) << invalid.err;

  // The coordinator from the environment.
  ProcessResult from_env = RunProcess({"/usr/bin/env",
                                       "PSTRAIN_COORDINATOR=" + cluster_->coordinator_address(),
                                       BinDir() + "/psctl", "get", id});
  EXPECT_EQ(from_env.exit_code(), 0) << from_env.err;
}

// A job with embedding tables exports a directory: its model file and its
// tables, which pstrain-local --eval scores at the job's own test AUC.
TEST_F(PsctlTest, AJobWithTablesExportsADirectoryThatScoresItsAuc) {
  ASSERT_NO_FATAL_FAILURE(StartCluster(2, 2));
  const std::string job_file = dir_.Write("click.yaml", absl::StrCat(R"(
model: {type: click, click: {bottom: [8], top: [8]}}
tables:
  - {name: users, dim: 4, fields: [1]}
  - {name: ads, dim: 4, fields: [2, 3], admission: {min_count: 2, filter_counters: 256}}
data:
  clicks:
    dense: 2
    fields: 3
    generate: {seed: 4, train_rows: 6400, test_rows: 512, vocabulary: 50, token_weight: 0.8}
optimizer: {type: sgd, learning_rate: 0.1}
batch_size: 32
steps: 100
num_workers: 2
num_servers: 2
checkpoint: {dir: )", dir_.path(), "/checkpoints, every_steps: 30, full_every: 2}\n"));
  ProcessResult submitted = Psctl({"submit", job_file});
  ASSERT_EQ(submitted.exit_code(), 0) << submitted.err;
  const std::string id(absl::StripAsciiWhitespace(submitted.out));
  ASSERT_EQ(Psctl({"watch", id}).exit_code(), 0);
  const std::string exported = dir_.path() + "/export";
  ProcessResult written = Psctl({"export", id, exported});
  ASSERT_EQ(written.exit_code(), 0) << written.err;
  EXPECT_TRUE(absl::StrContains(written.out, "2 embedding tables")) << written.out;
  absl::StatusOr<std::string> manifest = ReadFile(exported + "/export.json");
  PSTRAIN_ASSERT_OK(manifest);
  EXPECT_TRUE(absl::StrContains(*manifest, "\"name\":\"ads\"")) << *manifest;

  ProcessResult eval = RunProcess({BinDir() + "/pstrain-local", "--eval", exported});
  ASSERT_EQ(eval.exit_code(), 0) << eval.err;
  const v1::Job job = Get(id);
  ASSERT_TRUE(job.result().metrics().contains("test_auc"));
  EXPECT_TRUE(absl::StrContains(
      eval.out, absl::StrFormat("\"test_auc\":%.6f", job.result().metrics().at("test_auc"))))
      << eval.out;
}

TEST(PrintableTest, ControlCharactersAreEscaped) {
  EXPECT_EQ(cli::Printable("plain name-0.1"), "plain name-0.1");
  EXPECT_EQ(cli::Printable("a\x1b[2Jb\nc\td\x7f\\"), "a\\x1b[2Jb\\x0ac\\x09d\\x7f\\\\");
  EXPECT_EQ(cli::Printable("caf\xc3\xa9"), "caf\xc3\xa9");  // UTF-8 stays
}

// What a submitter or a node put in a name cannot drive the terminal of
// someone who lists it.
TEST_F(PsctlTest, NamesArePrintedWithControlCharactersEscaped) {
  ASSERT_NO_FATAL_FAILURE(StartCluster(1, 1));
  v1::JobSpec spec = MlpSpec(v1::OPTIMIZER_TYPE_SGD, 0.05f, 1, 32, 1, 20);
  spec.set_name("evil\x1b[2J\nforged line");
  const std::string id = Submit(spec);
  for (const std::vector<std::string>& verb : {std::vector<std::string>{"list"},
                                               std::vector<std::string>{"get", id}}) {
    ProcessResult r = Psctl(verb);
    ASSERT_EQ(r.exit_code(), 0) << r.err;
    EXPECT_EQ(r.out.find('\x1b'), std::string::npos) << r.out;
    EXPECT_TRUE(absl::StrContains(r.out, "evil\\x1b[2J\\x0aforged line")) << r.out;
  }
}

}  // namespace
}  // namespace pstrain::testing
