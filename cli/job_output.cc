#include "cli/job_output.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/clock.h"
#include "common/file_system.h"
#include "common/files.h"
#include "common/job_spec.h"
#include "common/rpc.h"
#include "common/status.h"
#include "server/table_export.h"

namespace pstrain::cli {
namespace {

// A job's script metrics by name (a protobuf map has no order).
std::vector<std::pair<std::string, double>> SortedMetrics(
    const google::protobuf::Map<std::string, double>& metrics) {
  std::vector<std::pair<std::string, double>> sorted(metrics.begin(), metrics.end());
  std::sort(sorted.begin(), sorted.end());
  return sorted;
}

// {"auc":0.791,"mse":0.0123}
std::string MetricsJson(const google::protobuf::Map<std::string, double>& metrics) {
  std::string json;
  for (const auto& [name, value] : SortedMetrics(metrics)) {
    absl::StrAppend(&json, json.empty() ? "" : ",", JsonQuote(name), ":",
                    absl::StrFormat("%.9g", value));
  }
  return absl::StrCat("{", json, "}");
}

}  // namespace

std::string StepTimesSummary(const v1::StepTimes& t) {
  const double total = t.compute_seconds() + t.reduce_seconds() + t.push_seconds() +
                       t.wait_seconds() + t.pull_seconds();
  return absl::StrFormat(
      "compute %.2f ms, reduce %.2f ms, push %.2f ms, wait %.2f ms, pull %.2f ms (%.2f ms per "
      "step)",
      t.compute_seconds() * 1e3, t.reduce_seconds() * 1e3, t.push_seconds() * 1e3,
      t.wait_seconds() * 1e3, t.pull_seconds() * 1e3, total * 1e3);
}

std::string ModelSummary(const v1::JobSpec& spec) {
  if (spec.model().type() == v1::MODEL_TYPE_EXTERNAL) {
    return absl::StrCat("external, ", spec.model().tensors_size(), " tensors, ",
                        NumParamsOf(spec), " parameters");
  }
  if (spec.model().type() == v1::MODEL_TYPE_CLICK) {
    const v1::ClickModelSpec& click = spec.model().click();
    return absl::StrCat("click (", EnumName(click.interaction()), ") bottom ",
                        absl::StrJoin(click.bottom(), "-"), " top ", absl::StrJoin(click.top(), "-"),
                        ", ", spec.tables_size(), " tables of dim ", spec.tables(0).dim());
  }
  std::vector<int64_t> widths = {kernels::DenseInputDim(ModelShapeOf(spec))};
  widths.insert(widths.end(), spec.model().hidden().begin(), spec.model().hidden().end());
  widths.push_back(kFashionClasses);
  std::string convs;  // "conv 32-64 " for a CNN
  if (spec.model().conv_size() > 0) {
    convs = absl::StrCat("conv ", absl::StrJoin(spec.model().conv(), "-"), " ");
  }
  return absl::StrCat(EnumName(spec.model().type()), " ", convs,
                      absl::StrJoin(widths, "-"));
}

std::string WorkerBatchSummary(const v1::JobSpec& spec) {
  if (spec.accumulate_steps() <= 1) return absl::StrCat("batch ", spec.batch_size());
  return absl::StrCat(spec.accumulate_steps(), " x batch ", spec.batch_size(), " accumulated");
}

std::string ModeSummary(const v1::JobSpec& spec) {
  const std::string mode = EnumName(spec.mode());
  if (spec.mode() != v1::MODE_SSP) return mode;
  return absl::StrCat(mode, " (staleness ", spec.staleness(), ")");
}

std::string Printable(absl::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (const char c : s) {
    const auto byte = static_cast<unsigned char>(c);
    if (byte < 0x20 || byte == 0x7f) {
      out += absl::StrFormat("\\x%02x", byte);
    } else if (c == '\\') {
      out += "\\\\";
    } else {
      out += c;
    }
  }
  return out;
}

std::string MetricsText(const google::protobuf::Map<std::string, double>& metrics) {
  std::string text;
  for (const auto& [name, value] : SortedMetrics(metrics)) {
    absl::StrAppend(&text, text.empty() ? "" : ", ", name, absl::StrFormat(" %.6g", value));
  }
  return text;
}

std::string ResultSummary(const v1::Job& job) {
  if (job.state() != v1::JOB_STATE_SUCCEEDED) {
    return absl::StrCat(job.id(), " ", EnumName(job.state()),
                        job.reason().empty() ? "" : ": ", job.reason());
  }
  const v1::JobResult& r = job.result();
  std::string measures;
  if (r.evaluated()) measures = absl::StrFormat("test accuracy %.4f, ", r.test_accuracy());
  if (!r.metrics().empty()) absl::StrAppend(&measures, MetricsText(r.metrics()), ", ");
  return absl::StrFormat("%s succeeded: %sfinal loss %.4f, %d steps in %.1f s (%.0f samples/s)",
                         job.id(), measures, r.final_loss(), r.steps(), r.train_seconds(),
                         r.samples_per_second()) +
         (job.reason().empty() ? "" : " (" + job.reason() + ")");
}

absl::StatusOr<std::string> FetchModelFile(v1::Control::Stub& stub, grpc::ClientContext& context,
                                           const std::string& job_id) {
  v1::ExportModelRequest request;
  request.set_job_id(job_id);
  auto reader = stub.ExportModel(&context, request);
  std::string bytes;
  v1::ModelFileChunk piece;
  while (reader->Read(&piece)) bytes += piece.data();
  PSTRAIN_RETURN_IF_ERROR(FromGrpcStatus(reader->Finish()));
  return bytes;
}

absl::StatusOr<std::string> WriteJobExport(v1::Control::Stub& stub, grpc::ClientContext& context,
                                           const v1::Job& job, const std::string& path,
                                           absl::Duration wait) {
  PSTRAIN_ASSIGN_OR_RETURN(const std::string model, FetchModelFile(stub, context, job.id()));
  if (job.spec().tables_size() == 0) {
    PSTRAIN_RETURN_IF_ERROR(WriteFileAtomically(path, model));
    return absl::StrFormat("wrote %s: %d bytes (%s)", path, model.size(), job.id());
  }
  const server::TableExportSource source{.job_id = job.id(),
                                         .spec = job.spec(),
                                         .step = TotalSteps(job.spec()),
                                         .generation = job.generation()};
  PSTRAIN_RETURN_IF_ERROR(server::ExportTables(PosixFileSystem(), source, model, path, wait));
  return absl::StrFormat("wrote %s/: the model file and %d embedding tables (%s)", path,
                         job.spec().tables_size(), job.id());
}

absl::StatusOr<v1::Job> FollowJob(
    v1::Control::Stub& stub, const std::string& job_id, grpc::ClientContext& context,
    const std::function<void(const v1::JobEvent&, const v1::Job&)>& on_event) {
  v1::WatchJobRequest request;
  request.set_job_id(job_id);
  auto reader = stub.WatchJob(&context, request);
  v1::JobEvent event;
  v1::Job job;
  while (reader->Read(&event)) {
    switch (event.kind_case()) {
      case v1::JobEvent::kSnapshot:
        job = event.snapshot();
        break;
      case v1::JobEvent::kState:
        job.set_state(event.state().state());
        job.set_reason(event.state().reason());
        break;
      case v1::JobEvent::kProgress:
        *job.mutable_progress() = event.progress();
        break;
      case v1::JobEvent::kEvaluation:
        *job.mutable_last_evaluation() = event.evaluation();
        break;
      case v1::JobEvent::kCompleted:
        *job.mutable_result() = event.completed();
        break;
      case v1::JobEvent::kRecovery:
        job.set_generation(event.recovery().generation());
        job.set_recoveries(job.recoveries() + 1);
        *job.add_history() = event.recovery();
        break;
      default:
        break;
    }
    if (on_event) on_event(event, job);
  }
  absl::Status status = FromGrpcStatus(reader->Finish());
  if (!status.ok()) return status;
  return job;
}

void ProgressDisplay::EndLine() {
  if (line_open_) std::fputc('\n', out_);
  line_open_ = false;
}

void ProgressDisplay::OnEvent(const v1::JobEvent& event, const v1::Job& job) {
  switch (event.kind_case()) {
    case v1::JobEvent::kState:
      EndLine();
      std::fprintf(out_, "%s %s%s%s\n", Printable(job.id()).c_str(),
                   EnumName(job.state()).c_str(), job.reason().empty() ? "" : ": ",
                   Printable(job.reason()).c_str());
      break;
    case v1::JobEvent::kSnapshot:
      if (job.state() == v1::JOB_STATE_PENDING || job.state() == v1::JOB_STATE_RUNNING) {
        std::fprintf(out_, "%s %s%s%s\n", Printable(job.id()).c_str(),
                     EnumName(job.state()).c_str(), job.reason().empty() ? "" : ": ",
                     Printable(job.reason()).c_str());
      }
      break;
    case v1::JobEvent::kProgress: {
      const absl::Time now = MonotonicNow();
      if (now - last_ < (terminal_ ? absl::Milliseconds(100) : interval_)) break;
      last_ = now;
      const v1::Progress& p = event.progress();
      std::string text = absl::StrFormat(
          "epoch %d/%d  step %d/%d  loss %.4f  %.0f samples/s", p.epoch() + 1, p.total_epochs(),
          p.step(), p.total_steps(), p.loss(), p.samples_per_second());
      for (const auto& [name, value] : SortedMetrics(p.metrics())) {
        absl::StrAppend(&text, "  ", name, absl::StrFormat(" %.4g", value));
      }
      if (terminal_) {
        constexpr int kWidth = 24;
        const double done = p.total_steps() > 0 ? static_cast<double>(p.step()) / p.total_steps() : 0;
        const int filled = static_cast<int>(done * kWidth);
        std::fprintf(out_, "\r[%s%s] %3.0f%%  %s   ", std::string(filled, '#').c_str(),
                     std::string(kWidth - filled, '.').c_str(), done * 100, text.c_str());
        line_open_ = true;
      } else {
        std::fprintf(out_, "%s\n", text.c_str());
      }
      break;
    }
    case v1::JobEvent::kRecovery:
      EndLine();
      std::fprintf(out_, "%s recovering: generation %d from step %d (%s)\n",
                   Printable(job.id()).c_str(), static_cast<int>(event.recovery().generation()),
                   static_cast<int>(event.recovery().step()),
                   Printable(event.recovery().reason()).c_str());
      break;
    case v1::JobEvent::kEvaluation:
      EndLine();
      std::fprintf(out_, "step %d: test accuracy %.4f%s\n",
                   static_cast<int>(event.evaluation().step()), event.evaluation().test_accuracy(),
                   event.evaluation().has_test_loss()
                       ? absl::StrFormat("  test loss %.4f", event.evaluation().test_loss())
                             .c_str()
                       : "");
      break;
    default:
      break;
  }
  std::fflush(out_);
}

std::string ResultJson(const v1::Job& job) {
  const v1::JobSpec& spec = job.spec();
  const v1::JobResult& r = job.result();
  // Only what the job measured: an evaluation the workers reported, a
  // click model's measures (also among the metrics) at the top.
  std::string measured;
  if (r.evaluated()) absl::StrAppendFormat(&measured, "\"test_accuracy\":%.4f,", r.test_accuracy());
  for (const char* name : {"test_auc", "oracle_auc"}) {
    const auto it = r.metrics().find(name);
    if (it != r.metrics().end()) {
      absl::StrAppendFormat(&measured, "\"%s\":%.6f,", name, it->second);
    }
  }
  const std::string metrics =
      r.metrics().empty() ? "" : absl::StrCat(",\"metrics\":", MetricsJson(r.metrics()));
  return absl::StrFormat(
      "{\"job\":%s,\"name\":%s,\"mode\":%s,\"workers\":%d,\"servers\":%d,\"steps\":%d,"
      "\"train_seconds\":%.3f,\"samples_per_second\":%.1f,\"final_loss\":%.6f,"
      "%s\"recoveries\":%d,\"last_checkpoint_step\":%d%s}",
      JsonQuote(job.id()), JsonQuote(spec.name()), JsonQuote(EnumName(spec.mode())),
      spec.num_workers(), spec.num_servers(), r.steps(), r.train_seconds(),
      r.samples_per_second(), r.final_loss(), measured, job.recoveries(),
      job.last_checkpoint_step(), metrics);
}

void PrintResult(const v1::Job& job) {
  std::printf("step time: %s\n", StepTimesSummary(job.result().step_times()).c_str());
  std::printf("%s\n", ResultSummary(job).c_str());
  std::printf("%s\n", ResultJson(job).c_str());
  std::fflush(stdout);
}

}  // namespace pstrain::cli
