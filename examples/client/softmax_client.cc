// A training loop of one's own against pstrain's servers, through the
// client library alone (pstrain/client.h): softmax regression on
// Fashion-MNIST, written out by hand.
//
//   softmax_client COORDINATOR [JOB_ID [NODE_ID]]
//
// Without JOB_ID it submits a one-worker job of its own and trains it;
// with one, it joins that job as one of its workers (start one process per
// worker). PSTRAIN_COORDINATOR, PSTRAIN_JOB_ID and PSTRAIN_NODE_ID, as
// pstrain-run sets them, stand in for missing arguments.
#include <zlib.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "pstrain/client.h"

namespace {

constexpr int kInputs = 784;
constexpr int kClasses = 10;

struct Data {
  std::vector<float> x;  // n * 784, in [0, 1]
  std::vector<int> y;
  int64_t n = 0;
};

// Reads a gzipped IDX file, skipping its header of `header_bytes`.
bool ReadGz(const std::string& path, int header_bytes, std::vector<unsigned char>* out) {
  gzFile f = gzopen(path.c_str(), "rb");
  if (f == nullptr) return false;
  std::vector<unsigned char> header(header_bytes);
  bool ok = gzread(f, header.data(), header_bytes) == header_bytes;
  unsigned char buffer[1 << 16];
  int got;
  while (ok && (got = gzread(f, buffer, sizeof buffer)) > 0) out->insert(out->end(), buffer, buffer + got);
  gzclose(f);
  return ok;
}

bool Load(const std::string& dir, const std::string& prefix, Data* data) {
  std::vector<unsigned char> pixels, labels;
  if (!ReadGz(dir + "/" + prefix + "-images-idx3-ubyte.gz", 16, &pixels) ||
      !ReadGz(dir + "/" + prefix + "-labels-idx1-ubyte.gz", 8, &labels) ||
      pixels.size() != labels.size() * kInputs) {
    return false;
  }
  data->n = static_cast<int64_t>(labels.size());
  data->x.resize(pixels.size());
  for (size_t i = 0; i < pixels.size(); ++i) data->x[i] = pixels[i] / 255.0f;
  data->y.assign(labels.begin(), labels.end());
  return true;
}

// Softmax probabilities of sample i into p; returns its loss.
double Forward(const std::vector<float>& w, const std::vector<float>& b, const float* x,
               int label, float* p) {
  float top = -1e30f;
  for (int c = 0; c < kClasses; ++c) {
    float z = b[c];
    for (int k = 0; k < kInputs; ++k) z += x[k] * w[k * kClasses + c];
    p[c] = z;
    top = std::max(top, z);
  }
  double sum = 0;
  for (int c = 0; c < kClasses; ++c) sum += std::exp(p[c] - top);
  for (int c = 0; c < kClasses; ++c) p[c] = static_cast<float>(std::exp(p[c] - top) / sum);
  return -std::log(std::max(p[label], 1e-30f));
}

int Fail(const char* what, const absl::Status& status) {
  std::fprintf(stderr, "softmax_client: %s: %s\n", what, status.ToString().c_str());
  return 1;
}

const char* Arg(int argc, char** argv, int i, const char* env) {
  if (i < argc) return argv[i];
  const char* value = std::getenv(env);
  return value != nullptr && *value != '\0' ? value : nullptr;
}

}  // namespace

int main(int argc, char** argv) {
  const char* coordinator = Arg(argc, argv, 1, "PSTRAIN_COORDINATOR");
  if (coordinator == nullptr) {
    std::fprintf(stderr, "usage: softmax_client COORDINATOR [JOB_ID [NODE_ID]]\n");
    return 2;
  }
  pstrain::ConnectOptions connect;
  connect.coordinator = coordinator;
  const char* job = Arg(argc, argv, 2, "PSTRAIN_JOB_ID");
  std::string job_id = job != nullptr ? job : "";
  if (job_id.empty()) {
    absl::StatusOr<std::string> submitted = pstrain::SubmitJob(
        connect,
        "name: softmax-client\n"
        "optimizer: {type: sgd, learning_rate: 0.5}\n"
        "batch_size: 100\nepochs: 1\ndata: {train_samples: 60000}\n"
        "num_workers: 1\nnum_servers: 1\n",
        {{"weight", {kInputs, kClasses}}, {"bias", {kClasses}}});
    if (!submitted.ok()) return Fail("submit", submitted.status());
    job_id = *submitted;
  }
  const char* data_dir = std::getenv("PSTRAIN_DATA_DIR");
  const std::string dir = data_dir != nullptr ? data_dir : "/usr/share/datasets/fashion-mnist";
  Data train, test;
  if (!Load(dir, "train", &train) || !Load(dir, "t10k", &test)) {
    std::fprintf(stderr, "softmax_client: cannot read Fashion-MNIST from %s\n", dir.c_str());
    return 1;
  }

  pstrain::Client::Options options;
  options.connect = connect;
  options.job_id = job_id;
  if (const char* node = Arg(argc, argv, 3, "PSTRAIN_NODE_ID")) options.node_id = node;
  absl::StatusOr<std::unique_ptr<pstrain::Client>> joined = pstrain::Client::Join(options);
  if (!joined.ok()) return Fail("join", joined.status());
  pstrain::Client& client = **joined;

  std::vector<float> w(kInputs * kClasses, 0.0f), b(kClasses, 0.0f);
  std::vector<float> gw(w.size()), gb(b.size());
  absl::Status s = client.BindTensor(0, w.data(), static_cast<int64_t>(w.size()));
  if (s.ok()) s = client.BindTensor(1, b.data(), static_cast<int64_t>(b.size()));
  if (s.ok()) s = client.Start();
  if (!s.ok()) return Fail("start", s);

  float p[kClasses];
  while (client.step() < client.total_steps()) {
    absl::StatusOr<std::vector<int64_t>> batch = client.BatchIndices(client.step(), train.n);
    if (!batch.ok()) return Fail("batch", batch.status());
    // The gradient of the mean loss, times this worker's share of the
    // global batch: the servers sum the workers' pushes.
    const float scale = static_cast<float>(client.gradient_scale() / batch->size());
    std::fill(gw.begin(), gw.end(), 0.0f);
    std::fill(gb.begin(), gb.end(), 0.0f);
    double loss = 0;
    for (int64_t i : *batch) {
      const float* x = &train.x[i * kInputs];
      loss += Forward(w, b, x, train.y[i], p);
      p[train.y[i]] -= 1;
      for (int c = 0; c < kClasses; ++c) gb[c] += scale * p[c];
      for (int k = 0; k < kInputs; ++k) {
        if (x[k] == 0) continue;
        for (int c = 0; c < kClasses; ++c) gw[k * kClasses + c] += scale * x[k] * p[c];
      }
    }
    s = client.PushGradient(1, gb.data(), static_cast<int64_t>(gb.size()));
    if (s.ok()) s = client.PushGradient(0, gw.data(), static_cast<int64_t>(gw.size()));
    if (!s.ok()) return Fail("push", s);
    absl::StatusOr<int64_t> next =
        client.EndStep(loss / batch->size(), static_cast<int64_t>(batch->size()));
    if (!next.ok()) return Fail("step", next.status());
  }

  // The final model is in w and b: evaluate it.
  int correct = 0;
  double test_loss = 0;
  for (int64_t i = 0; i < test.n; ++i) {
    test_loss += Forward(w, b, &test.x[i * kInputs], test.y[i], p);
    correct += std::max_element(p, p + kClasses) - p == test.y[i];
  }
  const pstrain::Evaluation eval{static_cast<double>(correct) / test.n, test_loss / test.n};
  s = client.Finish(eval);
  if (!s.ok()) return Fail("finish", s);
  std::printf("{\"job_id\": \"%s\", \"worker\": %d, \"test_accuracy\": %.4f, \"test_loss\": %.4f}\n",
              job_id.c_str(), client.worker_index(), eval.accuracy, eval.loss);
  return 0;
}
