// A job's spec: its limits and defaults, its validation (job_spec.cc), and
// what follows from it (job_values.cc: model shape, step counts, batches,
// memory, learning rates, the staleness bound). Job files (YAML) become
// specs in job_yaml.h.
#ifndef PSTRAIN_COMMON_JOB_SPEC_H_
#define PSTRAIN_COMMON_JOB_SPEC_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/click_generator.h"
#include "common/dataset.h"
#include "common/enum_names.h"
#include "common/job_yaml.h"
#include "kernels/click_model.h"
#include "kernels/model.h"
#include "pstrain/v1/job.pb.h"

namespace pstrain {

inline constexpr char kDefaultDataDir[] = "/usr/share/datasets/fashion-mnist";
inline constexpr int64_t kDefaultChunkBytes = 1 << 20;
inline constexpr int64_t kMaxChunkBytes = 64 << 20;
// Limits that keep a spec from exhausting a node's memory.
inline constexpr int64_t kMaxParams = int64_t{1} << 30;
inline constexpr int64_t kMaxChunks = 1 << 20;
inline constexpr int kMaxExternalTensors = 100000;
inline constexpr int kMaxTables = 1000;
inline constexpr int64_t kMaxActivationFloats = int64_t{1} << 28;
// The longest path a spec may name (PATH_MAX).
inline constexpr size_t kMaxPathBytes = 4096;
// Checkpoint and recovery defaults (JobSpec.checkpoint, .recovery).
inline constexpr int64_t kDefaultCheckpointEverySteps = 100;
inline constexpr int kDefaultCheckpointsKept = 2;
inline constexpr int kDefaultFullCheckpointEvery = 10;
inline constexpr int kDefaultReplaceAfterSeconds = 30;
inline constexpr int kDefaultWaitTimeoutSeconds = 600;
// precision fp16: the loss scale a worker starts from (JobSpec.loss_scale).
inline constexpr double kDefaultLossScale = 65536;
// The largest job file accepted (a real one is a few hundred bytes).
inline constexpr size_t kMaxJobFileBytes = 1 << 20;
// Fashion-MNIST sizes (the only dataset so far).
inline constexpr int kFashionTrainSamples = 60000;
inline constexpr int kFashionTestSamples = 10000;
inline constexpr int kFashionImageSide = 28;
inline constexpr int kFashionInputDim = kFashionImageSide * kFashionImageSide;
inline constexpr int kFashionClasses = 10;

// Fills in defaults (mode sync, dataset fashion_mnist, data.dir, chunk_bytes,
// Adam's betas and epsilon, checkpoint and recovery options) and validates
// every field. Returns the complete spec, or INVALID_ARGUMENT whose message starts with the field's path:
// "optimizer.learning_rate: must be > 0".
absl::StatusOr<v1::JobSpec> NormalizeJobSpec(v1::JobSpec spec);

// A job file for a program that gives the model's tensors itself (the
// client library, a script under pstrain-run): its model becomes
// `external`, with no tensors yet. INVALID_ARGUMENT naming model.type or
// model.tensors for a file that names a built-in model or lists tensors.
absl::Status MakeModelExternal(v1::ModelSpec& model);

// Whether the data read from the job's data.dir fits the job: images of
// the model's input size, labels of its classes, and for the training set
// (`train`) at least the samples its epochs are planned for (the plan does
// not read the files; fewer would make a step read past the set).
// INVALID_ARGUMENT naming data.dir otherwise.
absl::Status CheckDataFitsJob(const v1::JobSpec& spec, const Dataset& data, bool train);

// ---- What follows from a spec (job_values.cc); each requires a normalized
// spec.

// The built-in model's shape.
kernels::ModelShape ModelShapeOf(const v1::JobSpec& spec);
// A click model's shape: the data's columns, the tables' dimension, the MLPs.
kernels::ClickModelShape ClickModelShapeOf(const v1::JobSpec& spec);
// The generator's parameters of data.clicks.generate (its layout the data's).
ClickDataSpec ClickDataSpecOf(const v1::DataSpec& data);
// The tensors of the job's model in flat-space order: a built-in model's
// (kernels::ModelTensors), or an external model's as its spec lists them.
std::vector<kernels::TensorDesc> JobTensors(const v1::JobSpec& spec);
// The floats of the job's flat parameter space.
int64_t NumParamsOf(const v1::JobSpec& spec);
// Bytes of one element of `dtype` (unspecified: float32's 4).
int TensorDTypeBytes(v1::TensorDType dtype);
// The dtype of a name as job files write it ("int64", EnumValueOf);
// INVALID_ARGUMENT naming the ones there are otherwise.
absl::StatusOr<v1::TensorDType> TensorDTypeOf(absl::string_view name);
// The other way: an external tensor's dtype as job files write it
// ("float32" for a parameter, whose values are fp32).
std::string TensorDTypeName(const v1::ExternalTensor& tensor);
// The floats an external tensor takes in the flat space: its elements, or a
// buffer's bytes over 4 rounded up.
int64_t FloatsOf(const v1::ExternalTensor& tensor);
kernels::OptimizerConfig OptimizerConfigOf(const v1::OptimizerSpec& spec);
// Fashion-MNIST's 60000, or an external model's data.train_samples.
int64_t TrainSamplesOf(const v1::JobSpec& spec);
// Bytes a worker process of one device holds for the job, estimated: the
// parameters, the gradient and the values being pulled (fp32 each), a
// batch's activations and their gradients, and the data set (training and
// test images as bytes, and labels). The coordinator places jobs on
// workers with that much room (a worker of several devices holds the model
// and a batch per device: it registers the room it has per device).
int64_t WorkerBytesNeeded(const v1::JobSpec& spec);
// Global batches per epoch: floor(train samples / (workers * batch)); the
// job's steps for an external model without data.train_samples.
int64_t StepsPerEpoch(const v1::JobSpec& spec);
// Samples of one step over all workers: num_workers * accumulate_steps *
// batch_size (normalized).
int64_t GlobalBatch(const v1::JobSpec& spec);
// Steps every worker runs: spec.steps, or epochs * StepsPerEpoch.
int64_t TotalSteps(const v1::JobSpec& spec);

// How many steps a worker may compute ahead of the slowest worker's last
// applied push, the bound all three modes share: 0 for sync, the job's
// staleness for ssp, kUnboundedStaleness for async.
constexpr int64_t kUnboundedStaleness = -1;
int64_t StalenessOf(const v1::JobSpec& spec);
// The steps of every worker that must be applied to the values a worker
// computes `step` from under that bound: step - staleness, at least 0.
int64_t StepsAppliedBefore(int64_t step, int64_t staleness);
// Whether each worker's push is scaled to its share of the global batch's
// mean (sync, ssp) rather than to its own batch's mean (async).
bool ScalesToTheGlobalBatch(const v1::JobSpec& spec);

// The learning rate of the update of `step` (0-based) of a job of
// `total_steps` steps, by opt.schedule (see job.proto).
double LearningRateAt(const v1::OptimizerSpec& opt, int64_t step, int64_t total_steps);

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_JOB_SPEC_H_
