// The client library (pstrain/client.h) against a cluster of real
// processes: a training loop of the test's own, in threads of this process,
// as the workers of an external model's job.
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "common/dataset.h"
#include "common/job_spec.h"
#include "common/status.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_kernels.h"
#include "pstrain/client.h"
#include "tests/cluster_util.h"
#include "tests/integration/cluster_fixture.h"
#include "tests/test_util.h"

namespace pstrain::testing {
namespace {

// Pool workers of one OpenBLAS thread, whatever the machine's CPUs: the
// in-process clients compare bitwise with them (OpenBLAS's products round
// by its threads).
cli::LocalCluster::Options OneBlasThreadEach(int workers) {
  cli::LocalCluster::Options options;
  for (int w = 0; w < workers; ++w) options.worker_flags[w] = {"--blas_threads=1"};
  return options;
}

class ClientTest : public ClusterFixture {
 protected:
  ConnectOptions Connect() const {
    ConnectOptions c;
    c.coordinator = cluster_->coordinator_address();
    return c;
  }

  // The job file of an external model's job that trains what `spec` (a
  // built-in model's job) does.
  static std::string ExternalJobYaml(const v1::JobSpec& spec) {
    return absl::StrCat("name: external\n", "optimizer: {type: ",
                        EnumName(spec.optimizer().type()),
                        ", learning_rate: ", spec.optimizer().learning_rate(), "}\n",
                        "batch_size: ", spec.batch_size(), "\n", "steps: ", spec.steps(), "\n",
                        "num_servers: ", spec.num_servers(), "\n",
                        "num_workers: ", spec.num_workers(), "\n",
                        "chunk_bytes: ", spec.chunk_bytes(), "\n", "seed: ", spec.seed(), "\n");
  }

  static std::vector<TensorSpec> TensorsOf(const v1::JobSpec& spec) {
    std::vector<TensorSpec> tensors;
    for (const kernels::TensorDesc& t : JobTensors(spec)) tensors.push_back({t.name, t.shape});
    return tensors;
  }
};

// One worker of the external job: the built-in model's CPU kernels as "the
// user's model", initialised from the seed as the built-in job is, its
// gradient computed and pushed as pstrain's own workers do. With
// leave_at_step, the worker's client goes away at that step, as a killed
// process would, and a new one joins under the same node id.
absl::Status RunWorker(const ConnectOptions& connect, const std::string& job_id,
                       const v1::JobSpec& model_spec, const Dataset& train,
                       std::vector<float>* final_params, const std::string& node_id = "",
                       int64_t leave_at_step = -1) {
  const kernels::ModelShape shape = ModelShapeOf(model_spec);
  const int64_t n = kernels::NumParams(shape);
  const std::vector<kernels::TensorDesc> tensors = JobTensors(model_spec);
  std::vector<float> params(n), grad(n);
  for (bool left = false;;) {
    Client::Options options;
    options.connect = connect;
    options.job_id = job_id;
    options.node_id = node_id;
    PSTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<Client> client, Client::Join(options));
    kernels::InitParams(shape, model_spec.seed(), 0, n, params.data());
    for (size_t t = 0; t < tensors.size(); ++t) {
      PSTRAIN_RETURN_IF_ERROR(client->BindTensor(static_cast<int>(t),
                                                 params.data() + tensors[t].offset,
                                                 tensors[t].size));
    }
    PSTRAIN_RETURN_IF_ERROR(client->Start());
    const int batch = client->batch_size();
    PSTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<kernels::ModelKernels> model,
                             kernels::CreateCpuModelKernels(shape, batch));
    std::vector<float> x(static_cast<size_t>(batch) * train.input_dim);
    std::vector<int32_t> y(batch);
    while (client->step() < client->total_steps()) {
      if (client->step() == leave_at_step && !left) break;
      PSTRAIN_ASSIGN_OR_RETURN(std::vector<int64_t> samples,
                               client->BatchIndices(client->step(), train.num_samples));
      train.Gather(samples.data(), batch, x.data(), y.data());
      kernels::BatchStats stats;
      // Each layer's weight and bias (tensors 2l, 2l+1) pushed as soon as
      // backward has finished the layer, as pstrain's own workers push.
      absl::Status pushed;
      auto on_ready = [&](int layer, int64_t ready) {
        const kernels::TensorDesc& w = tensors[2 * layer];
        const kernels::TensorDesc& b = tensors[2 * layer + 1];
        if (ready < w.size + b.size || !pushed.ok()) return;
        pushed = client->PushGradient(2 * layer, grad.data() + w.offset, w.size);
        if (pushed.ok()) {
          pushed = client->PushGradient(2 * layer + 1, grad.data() + b.offset, b.size);
        }
      };
      // The gradient of the summed loss over the global batch: the mean
      // loss's times gradient_scale().
      PSTRAIN_RETURN_IF_ERROR(model->ForwardBackward(
          params.data(), x.data(), y.data(), batch,
          static_cast<float>(client->gradient_scale() / batch), grad.data(), &stats, on_ready));
      PSTRAIN_RETURN_IF_ERROR(pushed);
      PSTRAIN_RETURN_IF_ERROR(client->EndStep(stats.loss_sum / batch, batch).status());
    }
    if (client->step() < client->total_steps()) {
      left = true;  // the client is destroyed here: the "process" is gone
      continue;
    }
    PSTRAIN_RETURN_IF_ERROR(client->Finish(Evaluation{0.5, 1.5}));
    if (final_params != nullptr) *final_params = params;
    return absl::OkStatus();
  }
}

TEST_F(ClientTest, AnExternalModelTrainsBitwiseWhatTheBuiltInOneDoes) {
  ASSERT_NO_FATAL_FAILURE(StartCluster(2, 2, OneBlasThreadEach(2)));
  v1::JobSpec spec = MlpSpec(v1::OPTIMIZER_TYPE_ADAM, 1e-3f, 2, 32, 2, 30);
  const std::vector<float> built_in = FinalParams(Submit(spec));

  absl::StatusOr<std::string> id = SubmitJob(Connect(), ExternalJobYaml(spec), TensorsOf(spec));
  PSTRAIN_ASSERT_OK(id);
  // The pool's idle workers are not given it.
  const v1::Job pending = WaitFor(*id, [](const v1::Job& j) { return !j.reason().empty(); });
  EXPECT_EQ(pending.state(), v1::JOB_STATE_PENDING);
  EXPECT_EQ(pending.reason(), "waiting for 2 free workers (0 free)");

  // One BLAS thread, as the pool's workers run: the same products to the
  // bit.
  kernels::SetBlasThreads(1);
  absl::StatusOr<std::shared_ptr<const Dataset>> train =
      DatasetCache().FashionMnist(kFashionDir, true);
  PSTRAIN_ASSERT_OK(train);
  std::vector<absl::Status> statuses(2);
  std::vector<std::vector<float>> params(2);
  std::vector<std::thread> workers;
  for (int w = 0; w < 2; ++w) {
    workers.emplace_back([&, w] {
      statuses[w] = RunWorker(Connect(), *id, spec, **train, &params[w]);
    });
  }
  for (std::thread& t : workers) t.join();
  for (const absl::Status& s : statuses) PSTRAIN_ASSERT_OK(s);

  v1::Job ended;
  const std::vector<float> external = FinalParams(*id, &ended);
  ExpectBitwiseEqual(external, built_in);
  // What each client holds after its last step is the final model too.
  ExpectBitwiseEqual(params[0], built_in);
  ExpectBitwiseEqual(params[1], built_in);
  EXPECT_EQ(ended.result().steps(), 30);
  EXPECT_FLOAT_EQ(ended.result().test_accuracy(), 0.5f);
  ASSERT_EQ(ended.worker_nodes_size(), 2);
  for (const v1::Node& node : Nodes()) {
    if (node.id() == ended.worker_nodes(0) || node.id() == ended.worker_nodes(1)) {
      EXPECT_EQ(node.join_job(), *id);
    }
  }
}

// A client that goes away mid-job and comes back under its node id: the
// job goes on from its last checkpoint, the other client goes back with it
// on its own, and the result is bitwise the undisturbed one.
TEST_F(ClientTest, AWorkerThatComesBackUnderItsIdChangesNothing) {
  ASSERT_NO_FATAL_FAILURE(StartCluster(2, 2, OneBlasThreadEach(2)));
  v1::JobSpec spec = MlpSpec(v1::OPTIMIZER_TYPE_ADAM, 1e-3f, 2, 32, 2, 60);
  spec.mutable_checkpoint()->set_dir(dir_.path() + "/checkpoints");
  spec.mutable_checkpoint()->set_every_steps(20);
  const std::vector<float> built_in = FinalParams(Submit(spec));

  absl::StatusOr<std::string> id = SubmitJob(
      Connect(),
      ExternalJobYaml(spec) + "checkpoint: {dir: " + spec.checkpoint().dir() + ", every_steps: 20}\n",
      TensorsOf(spec));
  PSTRAIN_ASSERT_OK(id);
  kernels::SetBlasThreads(1);
  absl::StatusOr<std::shared_ptr<const Dataset>> train =
      DatasetCache().FashionMnist(kFashionDir, true);
  PSTRAIN_ASSERT_OK(train);
  std::vector<absl::Status> statuses(2);
  std::vector<std::thread> workers;
  for (int w = 0; w < 2; ++w) {
    workers.emplace_back([&, w] {
      statuses[w] = RunWorker(Connect(), *id, spec, **train, nullptr, absl::StrCat("client-", w),
                              w == 1 ? 30 : -1);
    });
  }
  for (std::thread& t : workers) t.join();
  for (const absl::Status& s : statuses) PSTRAIN_ASSERT_OK(s);
  v1::Job ended;
  ExpectBitwiseEqual(FinalParams(*id, &ended), built_in);
  EXPECT_GE(ended.recoveries(), 1);
}

TEST_F(ClientTest, BadRequestsAreClearErrors) {
  ASSERT_NO_FATAL_FAILURE(StartCluster(1, 1));
  const v1::JobSpec spec = MlpSpec(v1::OPTIMIZER_TYPE_SGD, 0.1f, 1, 32, 1, 5);
  const std::string yaml = ExternalJobYaml(spec);

  absl::StatusOr<std::string> bad = SubmitJob(Connect(), yaml, {{"w", {3, 0}}});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(bad.status().message(), "model.tensors[0].shape[1]"))
      << bad.status();
  bad = SubmitJob(Connect(), yaml, {{"w", {3}}, {"w", {4}}});
  EXPECT_TRUE(absl::StrContains(bad.status().message(), "'w' is listed twice")) << bad.status();
  bad = SubmitJob(Connect(), yaml, {});
  EXPECT_TRUE(absl::StrContains(bad.status().message(), "model.tensors")) << bad.status();
  bad = SubmitJob(Connect(), "model: {type: mlp, hidden: [8]}\n" + yaml, {{"w", {3}}});
  EXPECT_TRUE(absl::StrContains(bad.status().message(), "model.type")) << bad.status();

  Client::Options options;
  options.connect = Connect();
  options.job_id = "no-such-job";
  EXPECT_EQ(Client::Join(options).status().code(), absl::StatusCode::kNotFound);
  options.job_id = Submit(spec);  // a built-in model's job
  absl::StatusOr<std::unique_ptr<Client>> joined = Client::Join(options);
  EXPECT_EQ(joined.status().code(), absl::StatusCode::kInvalidArgument) << joined.status();

  absl::StatusOr<std::string> id = SubmitJob(Connect(), yaml, {{"w", {2, 3}}, {"b", {3}}});
  PSTRAIN_ASSERT_OK(id);
  options.job_id = *id;
  joined = Client::Join(options);
  PSTRAIN_ASSERT_OK(joined);
  Client& client = **joined;
  EXPECT_EQ(client.TensorIndex("b").value_or(-1), 1);
  EXPECT_EQ(client.TensorIndex("nope").status().code(), absl::StatusCode::kNotFound);
  std::vector<float> w(6, 0.5f), b(3, 0.0f);
  EXPECT_EQ(client.BindTensor(0, w.data(), 5).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client.BindTensor(2, b.data(), 3).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client.PushGradient(0, w.data(), 6).code(), absl::StatusCode::kFailedPrecondition);
  PSTRAIN_ASSERT_OK(client.BindTensor(0, w.data(), 6));
  EXPECT_EQ(client.Start().code(), absl::StatusCode::kFailedPrecondition);  // b not bound
  PSTRAIN_ASSERT_OK(client.BindTensor(1, b.data(), 3));
  PSTRAIN_ASSERT_OK(client.Start());
  EXPECT_EQ(client.BatchIndices(0, 10).status().code(), absl::StatusCode::kInvalidArgument);
  std::vector<float> g(6, 1.0f);
  PSTRAIN_ASSERT_OK(client.PushGradient(0, g.data(), 6));
  EXPECT_EQ(client.PushGradient(0, g.data(), 6).code(), absl::StatusCode::kInvalidArgument);
  // b's gradient is zero: SGD moves w alone.
  absl::StatusOr<int64_t> next = client.EndStep(1.0, 32);
  PSTRAIN_ASSERT_OK(next);
  EXPECT_EQ(*next, 1);
  EXPECT_FLOAT_EQ(w[0], 0.5f - 0.1f);
  EXPECT_FLOAT_EQ(b[0], 0.0f);
  EXPECT_EQ(client.Finish().code(), absl::StatusCode::kFailedPrecondition);  // 4 steps to go
}

// A table the model brings (a PyTorch nn.Embedding with sparse=True): its
// row optimizer the job's twin, or the job file's table of its name; its
// initial rows bound and sent by worker 0 (python tests train with them).
TEST_F(ClientTest, TablesTheModelBringsAndTheirInitialRows) {
  ASSERT_NO_FATAL_FAILURE(StartCluster(1, 0));
  const v1::JobSpec spec = MlpSpec(v1::OPTIMIZER_TYPE_SGD, 0.1f, 1, 32, 1, 5);
  const std::string yaml = ExternalJobYaml(spec);
  absl::StatusOr<std::string> bad =
      SubmitJob(Connect(), absl::StrReplaceAll(yaml, {{"learning_rate:", "momentum: 0.9, learning_rate:"}}),
                {{"w", {3}}}, "", {{.name = "emb", .dim = 4, .initial_rows = 10}});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(bad.status().message(), "table emb takes the job's optimizer for "
                                                        "its rows, and rows have no momentum"))
      << bad.status();
  bad = SubmitJob(Connect(), yaml + "tables: [{name: emb, dim: 8}]\n", {{"w", {3}}}, "",
                  {{.name = "emb", .dim = 4, .initial_rows = 10}});
  EXPECT_TRUE(absl::StrContains(bad.status().message(), "emb has dim 8 in the job file, 4 in "
                                                        "the model"))
      << bad.status();
  absl::StatusOr<std::string> id = SubmitJob(Connect(), yaml, {{"w", {3}}}, "",
                                             {{.name = "emb", .dim = 4, .initial_rows = 10}});
  PSTRAIN_ASSERT_OK(id);
  const v1::Job job = Get(*id);
  ASSERT_EQ(job.spec().tables_size(), 1);
  EXPECT_EQ(job.spec().tables(0).optimizer().type(), v1::TABLE_OPTIMIZER_TYPE_SGD);
  EXPECT_FLOAT_EQ(job.spec().tables(0).optimizer().learning_rate(), 0.1f);
  EXPECT_EQ(job.spec().tables(0).initial_rows(), 10);

  Client::Options options;
  options.connect = Connect();
  options.job_id = *id;
  absl::StatusOr<std::unique_ptr<Client>> joined = Client::Join(options);
  PSTRAIN_ASSERT_OK(joined);
  Client& client = **joined;
  ASSERT_EQ(client.tables().size(), 1u);
  EXPECT_EQ(client.tables()[0].initial_rows, 10);
  std::vector<float> w(3, 0.0f), rows(40);
  for (size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<float>(i);
  PSTRAIN_ASSERT_OK(client.BindTensor(0, w.data(), 3));
  EXPECT_EQ(client.Start().code(), absl::StatusCode::kFailedPrecondition);  // rows not bound
  EXPECT_EQ(client.BindTableRows(0, rows.data(), 9).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client.BindTableRows(1, rows.data(), 10).code(), absl::StatusCode::kInvalidArgument);
  PSTRAIN_ASSERT_OK(client.BindTableRows(0, rows.data(), 10));
  PSTRAIN_ASSERT_OK(client.Start());
  const std::vector<uint64_t> keys = {9, 2};
  std::vector<float> pulled(8);
  PSTRAIN_ASSERT_OK(client.PullRows({{.table = 0, .keys = keys.data(), .n = 2,
                                      .rows = pulled.data()}}));
  EXPECT_EQ(pulled, (std::vector<float>{36, 37, 38, 39, 8, 9, 10, 11}));
  PSTRAIN_EXPECT_OK(client.Fail("done"));
}

TEST_F(ClientTest, TheExampleProgramTrainsItsOwnModel) {
  ASSERT_NO_FATAL_FAILURE(StartCluster(1, 0));
  const ProcessResult run = RunProcess(
      {BinDir() + "/softmax_client", cluster_->coordinator_address()}, absl::Minutes(5));
  ASSERT_EQ(run.exit_code(), 0) << run.err;
  // {"job_id": "...", "worker": 0, "test_accuracy": 0.8..., ...}
  const size_t at = run.out.find("\"test_accuracy\": ");
  ASSERT_NE(at, std::string::npos) << run.out;
  const double accuracy = std::stod(run.out.substr(at + 17));
  EXPECT_GE(accuracy, 0.75) << run.out;
  const size_t id_at = run.out.find("\"job_id\": \"") + 11;
  const v1::Job job = WaitForEnd(run.out.substr(id_at, run.out.find('"', id_at) - id_at));
  EXPECT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.reason();
  EXPECT_NEAR(job.result().test_accuracy(), accuracy, 1e-4);
}

}  // namespace
}  // namespace pstrain::testing
