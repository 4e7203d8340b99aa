// Writes the seed corpus of the fuzz targets (tests/fuzz/corpus/TARGET/)
// with pstrain's own writers, so that every seed is a well-formed input the
// mutations start from: pstrain-fuzz-seeds DIR. Run it again when a format
// changes; the inputs in DIR/TARGET/ that it did not write (crashes turned
// regression inputs) are left alone.
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/chunk_codec.h"
#include "common/click_generator.h"
#include "common/file_format.h"
#include "common/file_system.h"
#include "common/job_spec.h"
#include "common/model_file.h"
#include "common/sparse_frames.h"
#include "grpcpp/support/byte_buffer.h"
#include "pstrain/v1/control.pb.h"
#include "pstrain/v1/membership.pb.h"
#include "server/checkpoint.h"
#include "server/job_store.h"
#include "tests/fuzz/fuzz_util.h"

namespace pstrain {
namespace {

std::string FrameBytes(const v1::ChunkHeader& header, const std::vector<float>& values) {
  const grpc::ByteBuffer buffer = EncodeFrame(header, values.empty() ? nullptr : values.data());
  std::vector<grpc::Slice> slices;
  CHECK(buffer.Dump(&slices).ok());
  std::string out;
  for (const grpc::Slice& s : slices)
    out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

void Write(const std::string& dir, const std::string& target, const std::string& name,
           const std::string& bytes) {
  FileSystem* fs = PosixFileSystem();
  CHECK(fs->MakeDirs(absl::StrCat(dir, "/", target)).ok());
  CHECK(fs->WriteFileAtomically(absl::StrCat(dir, "/", target, "/seed-", name), bytes).ok());
}

v1::ChunkHeader Header(v1::FrameKind kind, const std::string& job, uint32_t worker, int64_t step,
                       uint32_t chunk, uint32_t n) {
  v1::ChunkHeader h;
  h.set_kind(kind);
  h.set_job_id(job);
  h.set_worker(worker);
  h.set_step(step);
  h.set_chunk(chunk);
  h.set_version(kind == v1::FRAME_KIND_PULL ? step + 1 : step);
  h.set_dtype(v1::DTYPE_FP32);
  h.set_num_elements(kind == v1::FRAME_KIND_PULL ? 0 : n);
  h.set_generation(1);
  return h;
}

void ParameterSeeds(const std::string& dir) {
  // Both workers' pushes of steps 0 and 1 of every chunk of server 0, with
  // pulls between and both workers' step ends after, for the sync and the
  // async job.
  for (const char* job : {"s", "a"}) {
    const v1::ServerAssignment a = fuzz::SmallJobAssignment(job, job[0] == 's' ? "sync" : "async");
    uint32_t first_chunk = 0;  // of server 0: where its step ends go
    while (a.plan().chunks(first_chunk).server() != 0) ++first_chunk;
    std::string input;
    const auto add = [&input](const std::string& frame) {
      input.push_back(static_cast<char>(frame.size() & 0xff));
      input.push_back(static_cast<char>(frame.size() >> 8));
      input += frame;
    };
    for (int64_t step = 0; step < 2; ++step) {
      for (const v1::ChunkInfo& c : a.plan().chunks()) {
        if (c.server() != 0) continue;
        for (uint32_t w = 0; w < 2; ++w) {
          const std::vector<float> grad(c.size(), 0.01f * (w + 1));
          for (v1::FrameKind kind : {v1::FRAME_KIND_PUSH, v1::FRAME_KIND_PULL}) {
            add(FrameBytes(Header(kind, job, w, step, c.id(), c.size()), grad));
          }
        }
      }
      for (uint32_t w = 0; w < 2; ++w) {
        v1::ChunkHeader h = Header(v1::FRAME_KIND_STEP_END, job, w, step, first_chunk, 0);
        h.set_gradient_max_abs(0.01f * (w + 1));
        add(FrameBytes(h, {}));
      }
    }
    Write(dir, "parameter_requests", job, input);
  }
  // One frame per dtype, cut into three slices.
  for (v1::DType dtype : {v1::DTYPE_FP32, v1::DTYPE_BF16, v1::DTYPE_FP16}) {
    v1::ChunkHeader h = Header(v1::FRAME_KIND_PUSH, "job-1", 0, 3, 0, 5);
    h.set_dtype(dtype);
    const std::vector<float> values = {1.0f, -2.5f, 0.0f, 1e-3f, 65000.0f};
    std::string input = {2, 7, 19};
    input += FrameBytes(h, values);
    Write(dir, "chunk_frame", v1::DType_Name(dtype), input);
  }
}

void FileSeeds(const std::string& dir) {
  FileSystem* fs = PosixFileSystem();
  char tmp_name[] = "/tmp/pstrain-fuzz-seeds-XXXXXX";
  CHECK(mkdtemp(tmp_name) != nullptr);
  const std::string tmp = tmp_name;

  // A checkpoint of server 0 of the checkpoint target's job at step 2.
  const v1::ServerAssignment a = fuzz::SmallJobAssignment("job-1", "sync");
  server::ServerCheckpoint c;
  c.job_id = "job-1";
  c.num_servers = 2;
  c.step = 2;
  c.generation = 1;
  c.total_floats = a.plan().total_floats();
  for (const v1::ChunkInfo& info : a.plan().chunks()) {
    if (info.server() != 0) continue;
    server::ChunkCheckpoint& chunk = c.chunks.emplace_back();
    chunk.id = info.id();
    chunk.version = 2;
    chunk.values.assign(info.size(), 0.5f);
    chunk.state.assign(2 * info.size(), 0.25f);  // Adam's two moments
  }
  CHECK(server::WriteCheckpoint(fs, tmp, c).ok());
  Write(dir, "checkpoint", "step-2", *fs->ReadFile(server::CheckpointPath(tmp, "job-1", 0, 2, 1)));
  // The same with two embedding tables, incremental over step 2: rows,
  // keys evicted since, an admission filter.
  c.step = 4;
  c.base_step = 2;
  c.base_generation = 1;
  for (uint32_t t = 0; t < 2; ++t) {
    server::TableCheckpoint& table = c.tables.emplace_back();
    table.index = t;
    table.dim = 2 + t;
    table.state_floats = table.dim;
    table.version = 4;
    for (uint64_t key : {3u, 17u, 90u}) {
      table.rows.push_back(server::SparseTable::Row{
          .key = key,
          .values = std::vector<float>(table.dim, 0.5f),
          .state = std::vector<float>(table.dim, 0.1f),
          .last_step = 3,
          .touches = 2,
          .updates = 2});
    }
    table.deleted = {5, 40};
    table.filter.counters = std::vector<uint16_t>(8, 1);
  }
  CHECK(server::WriteCheckpoint(fs, tmp, c).ok());
  Write(dir, "checkpoint", "step-4-tables",
        *fs->ReadFile(server::CheckpointPath(tmp, "job-1", 0, 4, 1)));

  // A job log of two jobs, one of them written twice.
  {
    std::vector<v1::Job> none;
    std::unique_ptr<server::JobStore> store = *server::JobStore::Open(fs, tmp, &none);
    v1::Job job;
    job.set_id("job-1");
    *job.mutable_spec() = a.spec();
    job.set_state(v1::JOB_STATE_PENDING);
    CHECK(store->Write(job).ok());
    job.set_state(v1::JOB_STATE_RUNNING);
    job.set_generation(1);
    CHECK(store->Write(job).ok());
    job.set_id("job-2");
    job.set_request_id("r-1");
    CHECK(store->Write(job).ok());
  }
  Write(dir, "job_log", "three-records", *fs->ReadFile(tmp + "/jobs.log"));

  Write(dir, "model_file", "mlp",
        EncodeModelFile("job-1", a.spec(), std::vector<float>(a.plan().total_floats(), 0.125f)));
  CHECK(system(absl::StrCat("rm -rf ", tmp).c_str()) == 0);
}

void SpecSeeds(const std::string& dir, const std::string& examples) {
  for (const char* name : {"fashion_mlp", "fashion_mlp_async", "fashion_mlp_bf16"}) {
    const std::string path = absl::StrCat(examples, "/", name, ".yaml");
    absl::StatusOr<std::string> yaml = PosixFileSystem()->ReadFile(path);
    if (!yaml.ok()) continue;
    Write(dir, "job_spec", absl::StrCat(name, ".yaml"), *yaml);
    absl::StatusOr<v1::JobSpec> spec = ParseJobSpecYaml(*yaml);
    CHECK(spec.ok()) << path << ": " << spec.status();
    Write(dir, "job_spec", absl::StrCat(name, ".pb"), spec->SerializeAsString());

    // The control API: a submission of it, and requests about its job.
    v1::SubmitJobRequest submit;
    *submit.mutable_spec() = *spec;
    Write(dir, "control_requests", absl::StrCat("submit-", name),
          '\0' + submit.SerializeAsString());
    v1::SubmitJobRequest submit_yaml;
    submit_yaml.set_spec_yaml(*yaml);
    submit_yaml.set_request_id("retry-1");
    Write(dir, "control_requests", absl::StrCat("submit-yaml-", name),
          '\0' + submit_yaml.SerializeAsString());
  }
  v1::GetJobRequest get;
  get.set_job_id("job-1");
  for (char method : {1, 3, 5}) {  // GetJob, CancelJob, CheckpointJob
    Write(dir, "control_requests", absl::StrCat("job-request-", int{method}),
          method + get.SerializeAsString());
  }
  for (char method : {9, 10}) {  // WatchJob, ExportModel
    Write(dir, "control_requests", absl::StrCat("job-stream-", int{method}),
          method + get.SerializeAsString());
  }
  v1::SessionRequest session;
  session.set_node_id("server-0");
  session.set_incarnation(1);
  Write(dir, "control_requests", "session", '\13' + session.SerializeAsString());
  v1::UploadModelRequest upload;
  upload.set_node_id("worker-0");
  upload.set_job_id("job-1");
  upload.set_data("PSTM");
  Write(dir, "control_requests", "upload", '\14' + upload.SerializeAsString());
  v1::ListJobsRequest list;
  list.add_states(v1::JOB_STATE_PENDING);
  list.set_page_size(2);
  Write(dir, "control_requests", "list-jobs", '\2' + list.SerializeAsString());
  Write(dir, "control_requests", "list-nodes", std::string("\4"));
  v1::RegisterRequest reg;
  reg.set_role(v1::NODE_ROLE_SERVER);
  reg.set_address("127.0.0.1:1");
  reg.set_hostname("host");
  reg.set_pid(1);
  reg.set_node_id("server-0");
  reg.set_max_memory_bytes(1 << 30);
  Write(dir, "control_requests", "register", '\6' + reg.SerializeAsString());
  v1::HeartbeatRequest beat;
  beat.set_node_id("server-0");
  beat.set_incarnation(1);
  v1::HeldJob* held = beat.add_held();
  held->set_job_id("job-1");
  Write(dir, "control_requests", "heartbeat", '\7' + beat.SerializeAsString());
  v1::ReportProgressRequest progress;
  progress.set_node_id("worker-0");
  progress.set_job_id("job-1");
  progress.set_step(10);
  progress.set_loss(0.5f);
  progress.set_samples(640);
  progress.set_seconds(0.1);
  Write(dir, "control_requests", "progress", '\10' + progress.SerializeAsString());
}

// Generated click logs of 2 integer and 3 categorical columns (layout byte
// 0x22), plain and gzip, with empty and multi-valued fields.
void ClickSeeds(const std::string& dir) {
  ClickDataSpec spec;
  spec.train_rows = 12;
  spec.test_rows = 1;
  spec.layout = {.dense = 2, .fields = 3};
  spec.max_values = 3;
  spec.missing = 0.2;
  const std::string tmp = "/tmp/pstrain-fuzz-seeds-clicks";
  for (bool gzip : {false, true}) {
    CHECK(WriteClickData(spec, tmp, gzip).ok());
    const std::string name = gzip ? "train.txt.gz" : "train.txt";
    Write(dir, "click_file", name, "\x22" + *PosixFileSystem()->ReadFile(tmp + "/" + name));
  }
  CHECK(system(absl::StrCat("rm -rf ", tmp).c_str()) == 0);
}

// Two steps of both workers of the sparse jobs: a dense push, a sparse push
// with both tables, a step end and a sparse pull each, as the fuzz target
// reads them ([u16 LE length][frame]).
void SparseSeeds(const std::string& dir) {
  for (const char* job : {"s", "a"}) {
    std::string input;
    const auto add = [&input](const grpc::ByteBuffer& buffer) {
      std::vector<grpc::Slice> slices;
      CHECK(buffer.Dump(&slices).ok());
      std::string frame;
      for (const grpc::Slice& s : slices)
        frame.append(reinterpret_cast<const char*>(s.begin()), s.size());
      input.push_back(static_cast<char>(frame.size() & 0xff));
      input.push_back(static_cast<char>(frame.size() >> 8));
      input += frame;
    };
    for (int64_t step = 0; step < 2; ++step) {
      for (uint32_t worker = 0; worker < 2; ++worker) {
        v1::ChunkHeader h = Header(v1::FRAME_KIND_PUSH, job, worker, step, 0, 3);
        const std::vector<float> g = {0.5f, -0.25f, 1.0f};
        add(EncodeFrame(h, g.data()));
        std::vector<SparseSection> sections(2);
        sections[0].table = 0;
        sections[0].keys = {7, 1000 + worker};
        sections[0].counts = {2, 1};
        sections[0].grads = {0.5f, -0.5f, 0.25f, 1.0f};
        sections[1].table = 1;
        sections[1].keys = {uint64_t{1} << 40};
        sections[1].counts = {1};
        sections[1].grads = {0.1f, 0.2f, 0.3f};
        int64_t keys = 0;
        std::string payload = EncodeSparsePayload(sections, true, &keys);
        v1::ChunkHeader sparse = Header(v1::FRAME_KIND_SPARSE_PUSH, job, worker, step, 0, 0);
        sparse.set_chunk(0xffffffffu);
        sparse.set_num_keys(static_cast<uint32_t>(keys));
        sparse.set_num_elements(static_cast<uint32_t>(payload.size() / 4));
        add(EncodeFrame(sparse, payload.data()));
        v1::ChunkHeader end = Header(v1::FRAME_KIND_STEP_END, job, worker, step, 0, 0);
        end.set_gradient_max_abs(1.0f);
        add(EncodeFrame(end, nullptr));
        for (SparseSection& s : sections) {
          s.counts.clear();
          s.grads.clear();
        }
        payload = EncodeSparsePayload(sections, false, &keys);
        v1::ChunkHeader pull = Header(v1::FRAME_KIND_SPARSE_PULL, job, worker, step + 1, 0, 0);
        pull.set_chunk(0xffffffffu);
        pull.set_version(job[0] == 's' ? step + 1 : 0);
        pull.set_num_keys(static_cast<uint32_t>(keys));
        pull.set_dtype(v1::DTYPE_FP32);
        pull.set_num_elements(static_cast<uint32_t>(payload.size() / 4));
        add(EncodeFrame(pull, payload.data()));
      }
    }
    Write(dir, "sparse_requests", std::string(job) + "-two-steps", input);
  }
}

}  // namespace
}  // namespace pstrain

int main(int argc, char** argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: %s CORPUS_DIR EXAMPLES_DIR\n", argv[0]);
    return 2;
  }
  pstrain::ParameterSeeds(argv[1]);
  pstrain::FileSeeds(argv[1]);
  pstrain::SpecSeeds(argv[1], argv[2]);
  pstrain::ClickSeeds(argv[1]);
  pstrain::SparseSeeds(argv[1]);
  return 0;
}
