// The math of pstrain's built-in models, behind interfaces with one
// implementation per device kind (cpu/ now; cuda/ slots in beside it).
// Nothing here knows about gRPC, protobuf or the rest of pstrain.
#ifndef PSTRAIN_KERNELS_MODEL_H_
#define PSTRAIN_KERNELS_MODEL_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace pstrain::kernels {

// How a device multiplies matrices: fp32, or its inputs as TF32, bf16 or
// fp16, with fp32 accumulation. CUDA devices use their tensor cores; CPU
// devices round the inputs and multiply in fp32 (the GPU's twin: same
// roundings, an fp16 overflow an infinity, at a cost in speed).
enum class Precision { kFp32, kTf32, kBf16, kFp16 };

// A classifier: optional convolutions (a CNN), then dense layers
// hidden[0] -> ... -> num_classes with ReLU after every hidden layer, and
// softmax cross-entropy on the logits. No convolutions and no hidden
// layers is softmax regression.
//
// With convolutions the input is an image of image_channels x image_height
// x image_width values (= input_dim; channel after channel, rows within a
// channel). conv[i] is the output channels of convolution i: 3x3 kernels,
// padding 1, stride 1, then ReLU and 2x2 max-pooling of stride 2 (an odd
// side drops its last row or column). The last pooling's output, flattened
// (channel, row, column), is the first dense layer's input.
struct ModelShape {
  int input_dim = 0;
  std::vector<int> hidden;
  int num_classes = 0;
  std::vector<int> conv = {};  // "= {}": brace-initialised shapes may leave it out
  int image_channels = 1;
  int image_height = 0;
  int image_width = 0;
};

// One convolution of a CNN, with the size of the image it reads.
struct ConvLayer {
  int in_channels = 0;
  int out_channels = 0;
  int height = 0;  // of its input and its output (padding 1)
  int width = 0;
  int pooled_height() const { return height / 2; }
  int pooled_width() const { return width / 2; }
  // im2col rows: the inputs of one output value.
  int patch() const { return in_channels * 9; }
};

// The convolutions of a shape, input side first (empty for a dense model).
std::vector<ConvLayer> ConvLayers(const ModelShape& shape);
// Inputs of the first dense layer: input_dim, or the last pooling's output.
int64_t DenseInputDim(const ModelShape& shape);

// OK if kernels can be built for the shape; INVALID_ARGUMENT naming what
// is wrong otherwise (a non-positive width, an image that does not hold
// input_dim values, a convolution whose input is too small to pool).
absl::Status CheckModelShape(const ModelShape& shape);

// One tensor in the flat parameter space.
struct TensorDesc {
  std::string name;            // "conv0.weight", ..., "layer0.weight", "layer0.bias", ...
  // Dense weight: {in, out} row-major; convolution weight: {out, in, 3, 3}
  // row-major; bias: {out}.
  std::vector<int64_t> shape;
  int64_t offset = 0;          // first float in the flat space
  int64_t size = 0;            // floats
  int64_t fan_in = 0;          // inputs of the layer it belongs to
  bool is_bias = false;
  bool buffer = false;         // an external model's buffer: not trained
};

// The model's tensors in flat-space order: layer l's weight, then its bias,
// the convolutions first (layers 0 .. conv.size()-1, named conv0, ...),
// then the dense layers (named layer0, layer1, ... among themselves).
std::vector<TensorDesc> ModelTensors(const ModelShape& shape);
int64_t NumParams(const ModelShape& shape);

// Writes the initial values of flat floats [begin, end) to out[0, end-begin):
// He-uniform weights, zero biases. Each value depends only on (seed, tensor,
// element), so any range can be initialised independently and identically
// on any process.
void InitParams(const ModelShape& shape, uint64_t seed, int64_t begin, int64_t end,
                float* out);
// The same for any tensors laid out in a flat space (tensor t's stream
// drawn from (seed, t)).
void InitTensors(const std::vector<TensorDesc>& tensors, uint64_t seed, int64_t begin,
                 int64_t end, float* out);

// Totals over the samples of one call.
struct BatchStats {
  double loss_sum = 0;  // sum of per-sample cross-entropy losses
  int64_t correct = 0;  // samples whose arg-max logit is the label
};

// Called during backward as a layer's gradient becomes final, layers in
// reverse order (the last layer first): the first `ready_floats` floats of
// layer `layer`'s gradient (its weight, row-major, then its bias, as laid
// out in the flat space) are final, and the pass will not read the
// parameters of those floats again, so they may be overwritten. The last
// call for a layer covers all of it; a kernel may announce a prefix earlier
// (the CPU MLP does so for the first layer's weight, computed in row blocks,
// whose parameters backward never reads).
using GradientReadyFn = std::function<void(int layer, int64_t ready_floats)>;

// Called during the forward pass before the kernel first reads the first
// `floats` floats of layer `layer`'s parameters (laid out as above), in
// forward order; returns once they hold the values the pass is to use, so
// that a caller whose values are still arriving lets the pass start on the
// first ones (the CPU MLP's first layer asks in row blocks). Every layer is
// asked for in full before the pass writes any of the gradient. An error
// ends the pass with it.
using ParamsNeededFn = std::function<absl::Status(int layer, int64_t floats)>;

// Forward and backward passes of one model on one device. Every pointer is
// in the memory of the implementation's device (host memory for the CPU,
// device memory for a GPU). Not thread-safe: one instance per device.
class ModelKernels {
 public:
  virtual ~ModelKernels() = default;

  // Writes grad = grad_scale * d(sum of the batch's losses)/d(params) over
  // all NumParams floats (overwriting grad) and adds the batch to *stats.
  // x: batch rows of input_dim floats; labels in [0, num_classes).
  // on_ready, if set, runs after each layer's gradient is final;
  // params_needed, if set, before each layer's parameters are read.
  // INVALID_ARGUMENT if batch exceeds the max_batch given at creation or a
  // label is out of range.
  virtual absl::Status ForwardBackward(const float* params, const float* x,
                                       const int32_t* labels, int batch,
                                       float grad_scale, float* grad,
                                       BatchStats* stats,
                                       const GradientReadyFn& on_ready = nullptr,
                                       const ParamsNeededFn& params_needed = nullptr) = 0;

  // Forward only, any batch size (processed in pieces of max_batch).
  virtual absl::Status Evaluate(const float* params, const float* x,
                                const int32_t* labels, int64_t batch,
                                BatchStats* stats) = 0;
};

// Plain configuration of an optimizer; see OptimizerSpec in job.proto.
struct OptimizerConfig {
  enum class Type { kSgd, kAdam, kAdagrad };
  Type type = Type::kSgd;
  float learning_rate = 0.01f;
  float momentum = 0;  // SGD
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float epsilon = 1e-8f;
  float weight_decay = 0;
};

// The arrays of one optimizer update of n parameters.
struct OptimizerSpan {
  const float* params = nullptr;  // the current values
  float* new_params = nullptr;    // where the updated values go; may be `params`
  const float* grad = nullptr;
  // StateFloatsPerParam() arrays of n floats, state_stride floats apart (a
  // span inside a larger array passes the array's length).
  float* state = nullptr;
  int64_t state_stride = 0;
  int64_t n = 0;
  // This update's learning rate (a schedule's); 0: the config's.
  float learning_rate = 0;
};

// The learning rate of an update: the span's, else the config's.
inline float RateOf(const OptimizerConfig& c, const OptimizerSpan& s) {
  return s.learning_rate > 0 ? s.learning_rate : c.learning_rate;
}

// An optimizer update rule applied to any range of parameters. Element-wise,
// so applying it chunk by chunk, or tile by tile, equals applying it to the
// whole model. Thread-safe (const); callers own params and state.
class Optimizer {
 public:
  virtual ~Optimizer() = default;

  // Floats of optimizer state per parameter (momentum, Adam's m and v, ...),
  // zero-initialised.
  virtual int StateFloatsPerParam() const = 0;

  // One update. update_count is the 1-based number of this update (Adam's
  // bias correction). Pointers are in the implementation's device memory;
  // an error is the device's.
  virtual absl::Status Apply(const OptimizerSpan& span, int64_t update_count) const = 0;

  // The whole of n parameters in place, state arrays n floats apart.
  absl::Status ApplyInPlace(float* params, const float* grad, float* state, int64_t n,
                            int64_t update_count) const {
    return Apply(OptimizerSpan{params, params, grad, state, n, n}, update_count);
  }
};

}  // namespace pstrain::kernels

#endif  // PSTRAIN_KERNELS_MODEL_H_
