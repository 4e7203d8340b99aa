// Pieces shared by pstrain-bench's sub-commands: result tables with one JSON
// line per row, jobs of a given size, parameter servers in this process.
#ifndef PSTRAIN_BENCH_BENCH_UTIL_H_
#define PSTRAIN_BENCH_BENCH_UTIL_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "pstrain/v1/job.pb.h"
#include "server/parameter_server.h"

namespace pstrain::bench {

// A result table: rows printed as they come, aligned under the header, and
// one JSON line per row after the table (Finish).
class Table {
 public:
  Table(std::string bench, std::vector<std::string> columns);
  ~Table();

  // Cells in column order: numbers are printed with `digits` decimals.
  class Row {
   public:
    Row& Text(absl::string_view value);
    Row& Number(double value, int digits = 2);
    Row& Int(int64_t value);

   private:
    friend class Table;
    std::vector<std::string> cells_;
    std::vector<std::string> json_;  // the same cells as JSON values
  };
  void Add(const Row& row);
  // Prints the JSON lines: {"bench": ..., column: value, ...}.
  void Finish();

 private:
  std::string bench_;
  std::vector<std::string> columns_;
  std::vector<size_t> widths_;
  std::vector<std::string> json_lines_;
  bool finished_ = false;
};

// Seconds since `start`.
double SecondsSince(absl::Time start);

// The share of the machine's CPU time (every CPU, from /proc/stat) spent
// busy since construction, in [0, 1]: 1 is every core busy all along. A
// run that keeps the machine busy is bound by the work it does per byte.
// 0 where /proc/stat cannot be read.
class MachineBusy {
 public:
  MachineBusy() : start_(Read()) {}
  double Share() const;

 private:
  struct Ticks {
    uint64_t busy = 0, total = 0;
  };
  static Ticks Read();
  Ticks start_;
};

// A sync MLP job on Fashion-MNIST's shape whose parameters are about
// `floats` floats (hidden layers sized to fit), with these servers,
// workers and chunk size, trained with plain SGD.
v1::JobSpec JobOfSize(int64_t floats, int servers, int workers, int64_t chunk_bytes);
// The job's partition plan; the job must be valid.
v1::PartitionPlan PlanOf(const v1::JobSpec& spec);

// Parameter servers in this process, on 127.0.0.1, holding one job.
class LocalServers {
 public:
  static absl::StatusOr<std::unique_ptr<LocalServers>> Start(const std::string& job_id,
                                                             const v1::JobSpec& spec,
                                                             const v1::PartitionPlan& plan);
  ~LocalServers();
  const std::vector<std::string>& addresses() const { return addresses_; }

 private:
  std::vector<std::unique_ptr<server::ParameterServer>> servers_;
  std::vector<std::string> addresses_;
};

// One run of pstrain-local (in bin_dir) on a job file's text.
struct LocalRun {
  std::string result;  // its last line: the JSON result
  double samples_per_second = 0;
  // Its "step time: compute ... (T ms per step)" line, without the prefix.
  std::string step_time;
  std::string run_dir;  // its logs; removed unless kept
};
absl::StatusOr<LocalRun> RunPstrainLocal(const std::string& bin_dir, const std::string& job_yaml,
                                         bool keep_run_dir = false,
                                         const std::string& extra_flags = "");
// Removes a run directory kept by RunPstrainLocal.
void RemoveRunDir(const std::string& dir);

// Comma-separated positive integers ("1,2,4").
absl::StatusOr<std::vector<int>> ParseIntList(absl::string_view text);

}  // namespace pstrain::bench

#endif  // PSTRAIN_BENCH_BENCH_UTIL_H_
