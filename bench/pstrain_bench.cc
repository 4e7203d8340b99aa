// pstrain-bench: the data-plane and recovery benchmarks (see bench/RESULTS.md).
//   pstrain-bench transport|sparse|tables|rows|apply|train|conv|ssp|checkpoint|tls|recovery|all
//                 [--tiny] [flags]
#include <cstdio>
#include <iostream>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "bench/bench.h"
#include "bench/bench_util.h"
#include "cli/local_cluster.h"
#include "common/init.h"
#include "common/job_spec.h"
#include "glog/logging.h"

ABSL_FLAG(bool, tiny, false,
          "a configuration of seconds (CI runs it so that the benchmarks cannot rot)");
ABSL_FLAG(std::string, model_mib, "1,4,16,64", "transport: model sizes, MiB");
ABSL_FLAG(std::string, shapes, "1x1,2x2,4x4", "transport: WORKERSxSERVERS, comma-separated");
ABSL_FLAG(std::string, transports, "tcp,grpc-tcp,unix,shm",
          "transport: which carriers run (tcp, grpc-tcp, unix, shm), comma-separated");
ABSL_FLAG(int64_t, chunk_bytes, 1 << 20, "transport, apply: the job's chunk_bytes");
ABSL_FLAG(int, channels_per_server, pstrain::worker::GrpcTransportOptions().channels_per_server,
          "transport: gRPC channels per server");
ABSL_FLAG(int, window, pstrain::worker::GrpcTransportOptions().window,
          "transport: chunks a stream sends ahead of their replies");
ABSL_FLAG(int, shm_connections, pstrain::worker::GrpcTransportOptions().shm_connections,
          "transport: shared-memory connections per server");
ABSL_FLAG(double, transport_seconds, 4,
          "transport: seconds each configuration is timed (pstrain and the plain sockets)");
ABSL_FLAG(int64_t, serve_floats, 0, "transport_servers (the transport bench's own): model floats");
ABSL_FLAG(int, serve_servers, 1, "transport_servers: servers");
ABSL_FLAG(int, serve_workers, 1, "transport_servers: workers of the job");
ABSL_FLAG(std::string, serve_address_file, "", "transport_servers: where the addresses go");
ABSL_FLAG(bool, serve_echo, false, "transport_servers: plain gRPC echo servers instead");
ABSL_FLAG(int, serve_table_dim, 0, "transport_servers: the sparse bench's job, with this dim");
ABSL_FLAG(std::string, sparse_keys, "1024,4096,16384,65536",
          "sparse: distinct keys per worker and step, comma-separated");
ABSL_FLAG(std::string, sparse_shapes, "1x1,2x2", "sparse: WORKERSxSERVERS, comma-separated");
ABSL_FLAG(int, sparse_dim, 16, "sparse: the table's dim");
ABSL_FLAG(std::string, table_rows, "1000000,10000000,50000000",
          "tables: a table's rows at its cap, comma-separated");
ABSL_FLAG(int, table_keys, pstrain::bench::TableBenchOptions().keys,
          "tables: distinct keys a step");
ABSL_FLAG(std::string, table_policy, "lru", "tables: eviction policy, lru or lfu");
ABSL_FLAG(int, table_steps, pstrain::bench::TableBenchOptions().steps, "tables: timed steps");
ABSL_FLAG(int, apply_mib, 64, "apply: model size, MiB");
ABSL_FLAG(std::string, apply_workers, "1,4", "apply: worker counts (gradients summed)");
ABSL_FLAG(int, apply_steps, 5, "apply: timed steps");
ABSL_FLAG(int, train_batch, pstrain::bench::TrainBenchOptions().batch, "train: per-worker batch");
ABSL_FLAG(int, train_steps, pstrain::bench::TrainBenchOptions().steps, "train: steps per worker");
ABSL_FLAG(int64_t, train_chunk_bytes, pstrain::bench::TrainBenchOptions().chunk_bytes,
          "train: the jobs' chunk_bytes");
ABSL_FLAG(int, conv_batch, 64, "conv: the batch of the convolutions");
ABSL_FLAG(double, conv_seconds, 8, "conv: seconds per layer");
ABSL_FLAG(std::string, ssp_staleness, "0,1,4,inf", "ssp: staleness bounds (inf: unbounded)");
ABSL_FLAG(int, ssp_steps, 1000, "ssp: steps per worker");
ABSL_FLAG(std::string, bin_dir, "",
          "train, checkpoint, tls, recovery: where the pstrain binaries are; default: beside this one");
ABSL_FLAG(int, checkpoint_pairs, 5, "checkpoint: runs with and without checkpoints");
ABSL_FLAG(int, tls_pairs, 5, "tls: runs of the quick-start job with and without --tls");
ABSL_FLAG(int, recovery_kills, 10, "recovery: kills of a server and of a worker");
ABSL_FLAG(int, spare_kills, 3, "recovery: kills of servers that a spare replaces");

namespace pstrain::bench {
namespace {

int Usage() {
  std::cerr << "usage: pstrain-bench "
               "transport|sparse|tables|rows|apply|train|conv|ssp|checkpoint|tls|recovery|all "
               "[--tiny] [flags]\n";
  return 2;
}

// WORKERSxSERVERS, comma-separated; false (with a line on stderr) if not.
bool ParseShapes(const char* flag, const std::string& text,
                 std::vector<std::pair<int, int>>& shapes) {
  shapes.clear();
  for (absl::string_view shape : absl::StrSplit(text, ',')) {
    const std::vector<std::string> counts = absl::StrSplit(shape, 'x');
    int workers = 0, servers = 0;
    if (counts.size() != 2 || !absl::SimpleAtoi(counts[0], &workers) ||
        !absl::SimpleAtoi(counts[1], &servers) || workers < 1 || servers < 1) {
      std::cerr << "pstrain-bench: " << flag << ": '" << shape
                << "' is not WORKERSxSERVERS with positive counts\n";
      return false;
    }
    shapes.emplace_back(workers, servers);
  }
  return true;
}

int Main(const std::vector<char*>& args) {
  if (args.size() != 2) return Usage();
  const std::string command = args[1];
  if (command == "transport_servers") {
    TransportServersOptions o;
    o.floats = absl::GetFlag(FLAGS_serve_floats);
    o.servers = absl::GetFlag(FLAGS_serve_servers);
    o.workers = absl::GetFlag(FLAGS_serve_workers);
    o.chunk_bytes = absl::GetFlag(FLAGS_chunk_bytes);
    o.address_file = absl::GetFlag(FLAGS_serve_address_file);
    o.echo = absl::GetFlag(FLAGS_serve_echo);
    o.table_dim = absl::GetFlag(FLAGS_serve_table_dim);
    return RunTransportServers(o);
  }
  if (command != "transport" && command != "sparse" && command != "tables" && command != "rows" &&
      command != "apply" &&
      command != "train" &&
      command != "checkpoint" && command != "tls" && command != "recovery" && command != "conv" &&
      command != "ssp" && command != "all") {
    return Usage();
  }
  const int64_t chunk_bytes = absl::GetFlag(FLAGS_chunk_bytes);
  if (chunk_bytes < 4 || chunk_bytes % 4 != 0 || chunk_bytes > (64 << 20)) {
    std::cerr << "pstrain-bench: --chunk_bytes must be a multiple of 4 in [4, 64 MiB]\n";
    return 2;
  }
  if (absl::GetFlag(FLAGS_apply_mib) < 1 || absl::GetFlag(FLAGS_apply_steps) < 1 ||
      absl::GetFlag(FLAGS_train_batch) < 1 || absl::GetFlag(FLAGS_train_steps) < 1 ||
      !(absl::GetFlag(FLAGS_transport_seconds) > 0)) {
    std::cerr << "pstrain-bench: sizes, steps and batches must be positive\n";
    return 2;
  }
  const bool tiny = absl::GetFlag(FLAGS_tiny);
  int status = 0;

  if (command == "transport" || command == "all") {
    TransportBenchOptions o;
    absl::StatusOr<std::vector<int>> mib = ParseIntList(absl::GetFlag(FLAGS_model_mib));
    if (!mib.ok()) {
      std::cerr << "pstrain-bench: --model_mib: " << mib.status().message() << "\n";
      return 2;
    }
    o.model_mib = *mib;
    if (!ParseShapes("--shapes", absl::GetFlag(FLAGS_shapes), o.shapes)) return 2;
    o.transports = absl::StrSplit(absl::GetFlag(FLAGS_transports), ',');
    for (const std::string& t : o.transports) {
      if (t != "tcp" && t != "grpc-tcp" && t != "unix" && t != "shm") {
        std::cerr << "pstrain-bench: --transports: '" << t
                  << "' is none of tcp, grpc-tcp, unix, shm\n";
        return 2;
      }
    }
    o.chunk_bytes = chunk_bytes;
    o.grpc.channels_per_server = absl::GetFlag(FLAGS_channels_per_server);
    o.grpc.window = absl::GetFlag(FLAGS_window);
    o.grpc.shm_connections = absl::GetFlag(FLAGS_shm_connections);
    if (absl::Status s = worker::ValidateGrpcTransportOptions(o.grpc); !s.ok()) {
      std::cerr << "pstrain-bench: --channels_per_server / --window / --shm_connections: "
                << s.message() << "\n";
      return 2;
    }
    o.duration = absl::Seconds(absl::GetFlag(FLAGS_transport_seconds));
    if (tiny) {
      o.model_mib = {1};
      o.shapes = {{1, 1}, {2, 2}};
      o.duration = absl::Milliseconds(300);
    }
    status |= RunTransportBench(o);
  }
  if (command == "sparse" || command == "all") {
    SparseBenchOptions o;
    absl::StatusOr<std::vector<int>> keys = ParseIntList(absl::GetFlag(FLAGS_sparse_keys));
    if (!keys.ok() || absl::GetFlag(FLAGS_sparse_dim) < 1 ||
        absl::GetFlag(FLAGS_sparse_dim) > 1024) {
      std::cerr << "pstrain-bench: --sparse_keys must be positive counts and --sparse_dim in "
                   "[1, 1024]\n";
      return 2;
    }
    o.keys = *keys;
    if (!ParseShapes("--sparse_shapes", absl::GetFlag(FLAGS_sparse_shapes), o.shapes)) return 2;
    o.dim = absl::GetFlag(FLAGS_sparse_dim);
    o.duration = absl::Seconds(absl::GetFlag(FLAGS_transport_seconds));
    if (tiny) {
      o.keys = {1024};
      o.duration = absl::Milliseconds(300);
    }
    status |= RunSparseBench(o);
  }
  if (command == "tables" || command == "all") {
    TableBenchOptions o;
    o.rows.clear();
    for (absl::string_view part : absl::StrSplit(absl::GetFlag(FLAGS_table_rows), ',')) {
      int64_t rows = 0;
      if (!absl::SimpleAtoi(part, &rows) || rows < 1 || rows > (int64_t{1} << 32)) {
        std::cerr << "pstrain-bench: --table_rows: not a row count in [1, 2^32]: '" << part
                  << "'\n";
        return 2;
      }
      o.rows.push_back(rows);
    }
    o.keys = absl::GetFlag(FLAGS_table_keys);
    o.policy = absl::GetFlag(FLAGS_table_policy);
    o.steps = absl::GetFlag(FLAGS_table_steps);
    if (o.keys < 1 || o.keys > (1 << 20) || o.steps < 1 ||
        (o.policy != "lru" && o.policy != "lfu")) {
      std::cerr << "pstrain-bench: --table_keys in [1, 2^20], --table_steps positive, "
                   "--table_policy lru or lfu\n";
      return 2;
    }
    if (tiny) {
      o.rows = {20000};
      o.keys = 1024;
      o.warmup_steps = 2;
      o.steps = 10;
    }
    status |= RunTableBench(o);
  }
  if (command == "rows" || command == "all") {
    RowUpdateBenchOptions o;
    if (tiny) {
      o.rows = 20000;
      o.warmup_steps = 2;
      o.steps = 5;
    }
    status |= RunRowUpdateBench(o);
  }
  if (command == "apply" || command == "all") {
    ApplyBenchOptions o;
    absl::StatusOr<std::vector<int>> workers = ParseIntList(absl::GetFlag(FLAGS_apply_workers));
    if (!workers.ok()) {
      std::cerr << "pstrain-bench: --apply_workers: " << workers.status().message() << "\n";
      return 2;
    }
    o.mib = absl::GetFlag(FLAGS_apply_mib);
    o.workers = *workers;
    o.chunk_bytes = chunk_bytes;
    o.steps = absl::GetFlag(FLAGS_apply_steps);
    if (tiny) {
      o.mib = 2;
      o.steps = 2;
    }
    status |= RunApplyBench(o);
  }
  const std::string bin_dir =
      absl::GetFlag(FLAGS_bin_dir).empty() ? cli::ExecutableDir() : absl::GetFlag(FLAGS_bin_dir);
  if (command == "train" || command == "all") {
    TrainBenchOptions o;
    o.batch = absl::GetFlag(FLAGS_train_batch);
    o.steps = absl::GetFlag(FLAGS_train_steps);
    o.chunk_bytes = absl::GetFlag(FLAGS_train_chunk_bytes);
    if (o.chunk_bytes < 4 || o.chunk_bytes % 4 != 0 || o.chunk_bytes > (64 << 20)) {
      std::cerr << "pstrain-bench: --train_chunk_bytes must be a multiple of 4 in [4, 64 MiB]\n";
      return 2;
    }
    o.bin_dir = bin_dir;
    if (tiny) {
      o.batch = 64;
      o.steps = 20;
    }
    status |= RunTrainBench(o);
  }
  if (command == "conv" || command == "all") {
    ConvBenchOptions o;
    o.batch = absl::GetFlag(FLAGS_conv_batch);
    o.seconds = absl::GetFlag(FLAGS_conv_seconds);
    if (tiny) {
      o.conv = {4, 8};
      o.hidden = {};
      o.batch = 8;
      o.seconds = 0.2;
      o.rounds = 1;
    }
    if (o.batch < 1 || !(o.seconds > 0)) {
      std::cerr << "pstrain-bench: --conv_batch and --conv_seconds must be positive\n";
      return 2;
    }
    status |= RunConvBench(o);
  }
  if (command == "ssp" || command == "all") {
    SspBenchOptions o;
    o.staleness.clear();
    for (absl::string_view part :
         absl::StrSplit(absl::GetFlag(FLAGS_ssp_staleness), ',', absl::SkipEmpty())) {
      int64_t bound = kUnboundedStaleness;
      if (part != "inf" && (!absl::SimpleAtoi(part, &bound) || bound < 0)) {
        std::cerr << "pstrain-bench: --ssp_staleness: not a bound >= 0 or inf: '" << part << "'\n";
        return 2;
      }
      o.staleness.push_back(bound);
    }
    o.steps = absl::GetFlag(FLAGS_ssp_steps);
    if (tiny) o.steps = 20;
    if (o.steps < 1 || o.staleness.empty()) {
      std::cerr << "pstrain-bench: --ssp_steps must be positive, --ssp_staleness not empty\n";
      return 2;
    }
    status |= RunSspBench(o);
  }
  if (command == "checkpoint" || command == "all") {
    CheckpointBenchOptions o;
    o.pairs = absl::GetFlag(FLAGS_checkpoint_pairs);
    o.bin_dir = bin_dir;
    if (tiny) {
      o.pairs = 1;
      o.steps = 60;
      o.every_steps = 20;
    }
    status |= RunCheckpointBench(o);
  }
  if (command == "tls" || command == "all") {
    TlsBenchOptions o;
    o.pairs = absl::GetFlag(FLAGS_tls_pairs);
    o.bin_dir = bin_dir;
    if (tiny) {
      o.pairs = 1;
      o.steps = 60;
    }
    if (o.pairs < 1) {
      std::cerr << "pstrain-bench: --tls_pairs must be positive\n";
      return 2;
    }
    status |= RunTlsBench(o);
  }
  if (command == "recovery" || command == "all") {
    RecoveryBenchOptions o;
    o.kills = absl::GetFlag(FLAGS_recovery_kills);
    o.spare_kills = absl::GetFlag(FLAGS_spare_kills);
    o.bin_dir = bin_dir;
    if (tiny) {
      o.kills = 1;
      o.spare_kills = 1;
      o.every_steps = 20;
    }
    if (o.kills < 1 || o.spare_kills < 1 || absl::GetFlag(FLAGS_checkpoint_pairs) < 1) {
      std::cerr << "pstrain-bench: pairs and kills must be positive\n";
      return 2;
    }
    status |= RunRecoveryBench(o);
  }
  return status;
}

}  // namespace
}  // namespace pstrain::bench

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "pstrain-bench transport|sparse|tables|rows|apply|train|conv|ssp|checkpoint|tls|recovery|all "
      "[--tiny] [flags]");
  pstrain::HelpListsOwnFlags();
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  FLAGS_logtostderr = true;
  FLAGS_minloglevel = google::GLOG_WARNING;  // not the servers' start and stop lines
  google::InitGoogleLogging(argv[0]);
  pstrain::SkipMutexDeadlockDetection();  // as in the daemons
  pstrain::KeepFreedMemoryForReuse();
  return pstrain::bench::Main(args);
}
