// What follows from a normalized job spec (job_spec.h): the model's shape
// and tensors, step counts and batches, memory, the learning rate by step,
// the staleness bound.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/enum_names.h"
#include "common/job_spec.h"
#include "common/status.h"

namespace pstrain {

kernels::ModelShape ModelShapeOf(const v1::JobSpec& spec) {
  kernels::ModelShape shape;
  shape.input_dim = kFashionInputDim;
  shape.num_classes = kFashionClasses;
  shape.hidden.assign(spec.model().hidden().begin(), spec.model().hidden().end());
  shape.conv.assign(spec.model().conv().begin(), spec.model().conv().end());
  shape.image_channels = 1;
  shape.image_height = kFashionImageSide;
  shape.image_width = kFashionImageSide;
  return shape;
}

kernels::ClickModelShape ClickModelShapeOf(const v1::JobSpec& spec) {
  const v1::ClickModelSpec& click = spec.model().click();
  kernels::ClickModelShape shape;
  shape.dense = spec.data().clicks().dense();
  shape.fields = spec.data().clicks().fields();
  shape.dim = spec.tables_size() > 0 ? spec.tables(0).dim() : 1;
  shape.bottom.assign(click.bottom().begin(), click.bottom().end());
  shape.top.assign(click.top().begin(), click.top().end());
  shape.interaction = click.interaction() == v1::INTERACTION_CAT ? kernels::Interaction::kCat
                                                                  : kernels::Interaction::kDot;
  shape.pooling =
      click.pooling() == v1::POOLING_MEAN ? kernels::Pooling::kMean : kernels::Pooling::kSum;
  return shape;
}

ClickDataSpec ClickDataSpecOf(const v1::DataSpec& data) {
  const v1::ClickGeneratorSpec& g = data.clicks().generate();
  ClickDataSpec spec;
  spec.seed = g.seed();
  spec.train_rows = g.train_rows();
  spec.test_rows = g.test_rows();
  spec.layout = {.dense = data.clicks().dense(), .fields = data.clicks().fields()};
  spec.vocabulary = g.vocabulary();
  spec.zipf = g.zipf();
  spec.max_values = g.max_values();
  spec.missing = g.missing();
  spec.token_weight = g.token_weight();
  spec.dense_weight = g.dense_weight();
  spec.bias = g.bias();
  return spec;
}

kernels::OptimizerConfig OptimizerConfigOf(const v1::OptimizerSpec& spec) {
  kernels::OptimizerConfig c;
  switch (spec.type()) {
    case v1::OPTIMIZER_TYPE_ADAM:
      c.type = kernels::OptimizerConfig::Type::kAdam;
      break;
    case v1::OPTIMIZER_TYPE_ADAGRAD:
      c.type = kernels::OptimizerConfig::Type::kAdagrad;
      break;
    default:
      c.type = kernels::OptimizerConfig::Type::kSgd;
  }
  c.learning_rate = spec.learning_rate();
  c.momentum = spec.momentum();
  c.beta1 = spec.beta1();
  c.beta2 = spec.beta2();
  c.epsilon = spec.epsilon();
  c.weight_decay = spec.weight_decay();
  return c;
}

std::vector<kernels::TensorDesc> JobTensors(const v1::JobSpec& spec) {
  if (spec.model().type() == v1::MODEL_TYPE_CLICK) {
    return kernels::ClickModelTensors(ClickModelShapeOf(spec));
  }
  if (spec.model().type() != v1::MODEL_TYPE_EXTERNAL) {
    return kernels::ModelTensors(ModelShapeOf(spec));
  }
  std::vector<kernels::TensorDesc> tensors;
  int64_t offset = 0;
  for (const v1::ExternalTensor& t : spec.model().tensors()) {
    kernels::TensorDesc& d = tensors.emplace_back();
    d.name = t.name();
    d.shape.assign(t.shape().begin(), t.shape().end());
    d.offset = offset;
    d.size = FloatsOf(t);
    d.buffer = t.buffer();
    offset += d.size;
  }
  return tensors;
}

int TensorDTypeBytes(v1::TensorDType dtype) {
  switch (dtype) {
    case v1::TENSOR_DTYPE_FLOAT64:
    case v1::TENSOR_DTYPE_INT64:
      return 8;
    case v1::TENSOR_DTYPE_FLOAT16:
    case v1::TENSOR_DTYPE_BFLOAT16:
    case v1::TENSOR_DTYPE_INT16:
      return 2;
    case v1::TENSOR_DTYPE_INT8:
    case v1::TENSOR_DTYPE_UINT8:
    case v1::TENSOR_DTYPE_BOOL:
      return 1;
    default:
      return 4;
  }
}

std::string TensorDTypeName(const v1::ExternalTensor& tensor) {
  if (!tensor.buffer() || tensor.dtype() == v1::TENSOR_DTYPE_UNSPECIFIED) return "float32";
  return EnumName(tensor.dtype());
}

absl::StatusOr<v1::TensorDType> TensorDTypeOf(absl::string_view name) {
  PSTRAIN_ASSIGN_OR_RETURN(const google::protobuf::EnumValueDescriptor* value,
                           EnumValueOf(v1::TensorDType_descriptor(), name));
  return static_cast<v1::TensorDType>(value->number());
}

int64_t FloatsOf(const v1::ExternalTensor& tensor) {
  int64_t elements = 1;
  for (int64_t dim : tensor.shape()) elements *= dim;
  if (!tensor.buffer()) return elements;
  return (elements * TensorDTypeBytes(tensor.dtype()) + 3) / 4;
}

int64_t NumParamsOf(const v1::JobSpec& spec) {
  if (spec.model().type() == v1::MODEL_TYPE_CLICK) {
    return kernels::ClickModelParams(ClickModelShapeOf(spec));
  }
  if (spec.model().type() != v1::MODEL_TYPE_EXTERNAL) return kernels::NumParams(ModelShapeOf(spec));
  int64_t n = 0;
  for (const kernels::TensorDesc& t : JobTensors(spec)) n += t.size;
  return n;
}

int64_t TrainSamplesOf(const v1::JobSpec& spec) {
  switch (spec.model().type()) {
    case v1::MODEL_TYPE_EXTERNAL:
      return spec.data().train_samples();
    case v1::MODEL_TYPE_CLICK:  // files: unknown before they are read
      return spec.data().clicks().generate().train_rows();
    default:
      return kFashionTrainSamples;
  }
}

int64_t WorkerBytesNeeded(const v1::JobSpec& spec) {
  // An external model's worker is the client's own process.
  if (spec.model().type() == v1::MODEL_TYPE_EXTERNAL) return 0;
  if (spec.model().type() == v1::MODEL_TYPE_CLICK) {
    // Parameters, gradient and pushed gradient; per sample the activations
    // and their gradients, the pooled rows, and each key's row and gradient;
    // a window of lines (about 300 bytes each) and the test set's samples.
    const kernels::ClickModelShape shape = ClickModelShapeOf(spec);
    int64_t widths = shape.dense + 2 * int64_t{shape.fields} * shape.dim +
                     kernels::InteractionWidth(shape) + 1;
    for (int w : shape.bottom) widths += w;
    for (int w : shape.top) widths += w;
    const v1::ClickDataSpec& clicks = spec.data().clicks();
    const int64_t values = std::max(1, clicks.generate().max_values());
    const int64_t per_sample = 4 * (2 * widths + 3 * shape.fields * values * (shape.dim + 2));
    const int64_t test = clicks.test_samples() > 0 ? clicks.test_samples()
                         : clicks.has_generate() ? clicks.generate().test_rows()
                                                 : 1000000;
    return 4 * 3 * NumParamsOf(spec) + per_sample * spec.batch_size() +
           300 * std::max<int64_t>(clicks.shuffle_window(), 65536) +
           test * 4 * (shape.dense + 3 * shape.fields * values + 1);
  }
  const kernels::ModelShape shape = ModelShapeOf(spec);
  int64_t widths = shape.input_dim + shape.num_classes;
  for (int h : shape.hidden) widths += h;
  // A convolution's im2col, output, its gradient, pooled output and argmax.
  for (const kernels::ConvLayer& c : kernels::ConvLayers(shape)) {
    widths += int64_t{c.patch() + 2 * c.out_channels} * c.height * c.width +
              2 * int64_t{c.out_channels} * c.pooled_height() * c.pooled_width();
  }
  // Parameters, gradient, pushed gradient (and the sum of micro-batches).
  const int64_t copies = spec.accumulate_steps() > 1 ? 4 : 3;
  const int64_t model =
      4 * (copies * kernels::NumParams(shape) + 2 * int64_t{spec.batch_size()} * widths);
  const int64_t samples = kFashionTrainSamples + kFashionTestSamples;
  return model + samples * (shape.input_dim + 4);
}

int64_t GlobalBatch(const v1::JobSpec& spec) {
  return int64_t{spec.num_workers()} * std::max(1, spec.accumulate_steps()) * spec.batch_size();
}

int64_t StepsPerEpoch(const v1::JobSpec& spec) {
  // An external model's job of `steps` whose client counts no samples: one
  // epoch.
  if (TrainSamplesOf(spec) == 0) return std::max<int64_t>(spec.steps(), 1);
  return TrainSamplesOf(spec) / GlobalBatch(spec);
}

int64_t TotalSteps(const v1::JobSpec& spec) {
  return spec.steps() > 0 ? spec.steps() : int64_t{spec.epochs()} * StepsPerEpoch(spec);
}

double LearningRateAt(const v1::OptimizerSpec& opt, int64_t step, int64_t total_steps) {
  const v1::LearningRateSchedule& s = opt.schedule();
  const double rate = opt.learning_rate();
  if (step < s.warmup_steps()) {
    return rate * static_cast<double>(step + 1) / static_cast<double>(s.warmup_steps());
  }
  const int64_t t = step - s.warmup_steps();
  switch (s.type()) {
    case v1::SCHEDULE_TYPE_STEP:
      return rate * std::pow(static_cast<double>(s.decay_factor()),
                             static_cast<double>(t / s.decay_every_steps()));
    case v1::SCHEDULE_TYPE_COSINE: {
      const double span = static_cast<double>(std::max<int64_t>(total_steps - s.warmup_steps(), 1));
      const double min = s.min_learning_rate();
      return min + (rate - min) * (1 + std::cos(M_PI * static_cast<double>(t) / span)) / 2;
    }
    default:
      return rate;
  }
}

int64_t StalenessOf(const v1::JobSpec& spec) {
  switch (spec.mode()) {
    case v1::MODE_SSP:
      return spec.staleness();
    case v1::MODE_ASYNC:
      return kUnboundedStaleness;
    default:
      return 0;
  }
}

int64_t StepsAppliedBefore(int64_t step, int64_t staleness) {
  return staleness == kUnboundedStaleness ? 0 : std::max<int64_t>(0, step - staleness);
}

bool ScalesToTheGlobalBatch(const v1::JobSpec& spec) { return spec.mode() != v1::MODE_ASYNC; }

}  // namespace pstrain
