#include "bench/bench_util.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/files.h"
#include "common/job_spec.h"
#include "common/partition.h"
#include "common/status.h"
#include "glog/logging.h"
#include "kernels/model.h"

namespace pstrain::bench {
namespace {

std::string JsonString(absl::string_view s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out + "\"";
}

}  // namespace

Table::Table(std::string bench, std::vector<std::string> columns)
    : bench_(std::move(bench)), columns_(std::move(columns)) {
  std::string header;
  for (const std::string& c : columns_) {
    widths_.push_back(std::max<size_t>(c.size(), 10));
    absl::StrAppend(&header, absl::StrFormat("%*s  ", static_cast<int>(widths_.back()), c));
  }
  std::printf("\n== %s ==\n%s\n", bench_.c_str(), header.c_str());
  std::fflush(stdout);
}

Table::~Table() { Finish(); }

Table::Row& Table::Row::Text(absl::string_view value) {
  cells_.emplace_back(value);
  json_.push_back(JsonString(value));
  return *this;
}

Table::Row& Table::Row::Number(double value, int digits) {
  cells_.push_back(absl::StrFormat("%.*f", digits, value));
  json_.push_back(absl::StrFormat("%.6g", value));
  return *this;
}

Table::Row& Table::Row::Int(int64_t value) {
  cells_.push_back(absl::StrCat(value));
  json_.push_back(absl::StrCat(value));
  return *this;
}

void Table::Add(const Row& row) {
  CHECK_EQ(row.cells_.size(), columns_.size()) << "a row of " << bench_;
  std::string line;
  std::string json = absl::StrCat("{\"bench\":", JsonString(bench_));
  for (size_t i = 0; i < columns_.size(); ++i) {
    absl::StrAppend(&line,
                    absl::StrFormat("%*s  ", static_cast<int>(widths_[i]), row.cells_[i]));
    absl::StrAppend(&json, ",", JsonString(columns_[i]), ":", row.json_[i]);
  }
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
  json_lines_.push_back(json + "}");
}

void Table::Finish() {
  if (finished_) return;
  finished_ = true;
  for (const std::string& line : json_lines_) std::printf("%s\n", line.c_str());
  std::fflush(stdout);
}

double SecondsSince(absl::Time start) { return absl::ToDoubleSeconds(absl::Now() - start); }

MachineBusy::Ticks MachineBusy::Read() {
  // "cpu  user nice system idle iowait irq softirq steal ...": idle and
  // iowait are the idle time, the rest busy.
  Ticks ticks;
  FILE* stat = std::fopen("/proc/stat", "r");
  if (stat == nullptr) return ticks;
  unsigned long long v[8] = {};
  const int got = std::fscanf(stat, "cpu %llu %llu %llu %llu %llu %llu %llu %llu", &v[0], &v[1],
                              &v[2], &v[3], &v[4], &v[5], &v[6], &v[7]);
  std::fclose(stat);
  if (got != 8) return ticks;
  for (unsigned long long t : v) ticks.total += t;
  ticks.busy = ticks.total - v[3] - v[4];
  return ticks;
}

double MachineBusy::Share() const {
  const Ticks now = Read();
  if (now.total <= start_.total) return 0;
  return static_cast<double>(now.busy - start_.busy) / static_cast<double>(now.total - start_.total);
}

v1::JobSpec JobOfSize(int64_t floats, int servers, int workers, int64_t chunk_bytes) {
  v1::JobSpec spec;
  spec.set_name("bench");
  spec.mutable_model()->set_type(v1::MODEL_TYPE_MLP);
  // 784 inputs, 10 classes: one hidden layer of h units holds 795 h + 10
  // floats; two of 16384 and k units hold 785 * 16384 + 10 + 16395 k.
  constexpr int64_t kWidest = 16384;
  const int64_t one_layer = std::max<int64_t>(1, (floats - 10) / 795);
  if (one_layer <= kWidest) {
    spec.mutable_model()->add_hidden(static_cast<int>(one_layer));
  } else {
    spec.mutable_model()->add_hidden(kWidest);
    const int64_t first = 785 * kWidest + 10;
    spec.mutable_model()->add_hidden(
        static_cast<int>(std::clamp<int64_t>((floats - first) / (kWidest + 11), 1, kWidest)));
  }
  spec.mutable_data()->set_dir("/usr/share/datasets/fashion-mnist");
  spec.mutable_optimizer()->set_type(v1::OPTIMIZER_TYPE_SGD);
  spec.mutable_optimizer()->set_learning_rate(1e-6f);
  spec.set_mode(v1::MODE_SYNC);
  spec.set_batch_size(1);
  spec.set_steps(1'000'000);
  spec.set_num_servers(servers);
  spec.set_num_workers(workers);
  spec.set_chunk_bytes(chunk_bytes);
  spec.set_seed(1);
  return spec;
}

v1::PartitionPlan PlanOf(const v1::JobSpec& spec) {
  absl::StatusOr<v1::PartitionPlan> plan =
      ComputePartitionPlan(JobTensors(spec), spec.chunk_bytes(), spec.num_servers());
  CHECK(plan.ok()) << plan.status();
  return *std::move(plan);
}

absl::StatusOr<std::unique_ptr<LocalServers>> LocalServers::Start(
    const std::string& job_id, const v1::JobSpec& spec, const v1::PartitionPlan& plan) {
  auto out = std::unique_ptr<LocalServers>(new LocalServers);
  for (int i = 0; i < spec.num_servers(); ++i) {
    PSTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<server::ParameterServer> s,
                             server::ParameterServer::Create({}));
    v1::ServerAssignment a;
    a.set_job_id(job_id);
    a.set_server_index(i);
    *a.mutable_spec() = spec;
    *a.mutable_plan() = plan;
    PSTRAIN_RETURN_IF_ERROR(s->store().AddJob(a));
    out->addresses_.push_back(s->address());
    out->servers_.push_back(std::move(s));
  }
  return out;
}

LocalServers::~LocalServers() {
  for (auto& s : servers_) s->Shutdown(absl::Seconds(1));
}

absl::StatusOr<std::vector<int>> ParseIntList(absl::string_view text) {
  std::vector<int> out;
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    int v;
    if (!absl::SimpleAtoi(part, &v) || v < 1) {
      return absl::InvalidArgumentError(absl::StrCat("not a positive integer: '", part, "'"));
    }
    out.push_back(v);
  }
  if (out.empty()) return absl::InvalidArgumentError("empty list");
  return out;
}

absl::StatusOr<LocalRun> RunPstrainLocal(const std::string& bin_dir, const std::string& job_yaml,
                                         bool keep_run_dir, const std::string& extra_flags) {
  char dir_template[] = "/tmp/pstrain-bench.XXXXXX";
  if (mkdtemp(dir_template) == nullptr) return absl::InternalError("cannot make a directory");
  LocalRun run;
  run.run_dir = dir_template;
  const std::string job = run.run_dir + "/job.yaml";
  PSTRAIN_RETURN_IF_ERROR(WriteFileAtomically(job, job_yaml));
  const std::string command =
      absl::StrCat(bin_dir, "/pstrain-local --job ", job, " --run_dir ", run.run_dir,
                   " --progress_interval_s=1000 ", extra_flags, " 2>", run.run_dir, "/stderr.txt");
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return absl::InternalError("cannot start pstrain-local");
  std::string line;
  char buffer[4096];
  while (std::fgets(buffer, sizeof(buffer), pipe) != nullptr) {
    line += buffer;
    if (!line.empty() && line.back() == '\n') {
      if (line.size() > 1) run.result = line;
      if (absl::StartsWith(line, "step time: ")) {
        run.step_time = std::string(absl::StripTrailingAsciiWhitespace(line.substr(11)));
      }
      line.clear();
    }
  }
  const int status = pclose(pipe);
  if (status != 0) {
    return absl::InternalError(
        absl::StrCat("pstrain-local failed (status ", status, "), logs in ", run.run_dir));
  }
  const size_t key = run.result.find("\"samples_per_second\":");
  if (key == std::string::npos) {
    return absl::InternalError(
        absl::StrCat("no samples_per_second in: ", run.result, " (logs in ", run.run_dir, ")"));
  }
  run.samples_per_second = std::atof(run.result.c_str() + key + 21);
  if (!keep_run_dir) RemoveRunDir(run.run_dir);  // the logs of a run that went well
  return run;
}

void RemoveRunDir(const std::string& dir) {
  std::error_code ignored;
  std::filesystem::remove_all(dir, ignored);
}

}  // namespace pstrain::bench
