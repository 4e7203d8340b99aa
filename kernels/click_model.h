// The click model (DLRM's layout): the integer features through a bottom
// MLP, each categorical field's bag of embedding rows pooled, an
// interaction of the bottom output with the pooled fields, a top MLP to one
// logit, and the logistic loss. The embedding rows live outside the model's
// flat parameters (on the servers, by key): a pass reads the batch's unique
// rows and writes their gradients.
#ifndef PSTRAIN_KERNELS_CLICK_MODEL_H_
#define PSTRAIN_KERNELS_CLICK_MODEL_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/model.h"

namespace pstrain::kernels {

// How a bag of rows becomes one vector: their sum or their mean (an empty
// bag: zeros).
enum class Pooling { kSum, kMean };

// How the top MLP's input is made from the bottom output z and the pooled
// fields e_1..e_F (all of `dim` floats):
//   kDot: z, then the dot products of every pair of (z, e_1, ..., e_F) in
//         the order (1,0), (2,0), (2,1), (3,0), ... (DLRM's): dim + F(F+1)/2
//   kCat: z, e_1, ..., e_F concatenated: dim * (F + 1)
enum class Interaction { kDot, kCat };

struct ClickModelShape {
  int dense = 13;   // integer features (what the model reads of them)
  int fields = 26;  // categorical fields, each a bag of rows of `dim` floats
  int dim = 16;
  std::vector<int> bottom = {64};  // hidden widths; the bottom MLP ends in `dim`
  std::vector<int> top = {64};     // hidden widths; the top MLP ends in 1
  Interaction interaction = Interaction::kDot;
  Pooling pooling = Pooling::kSum;
};

// INVALID_ARGUMENT naming what is wrong (dense or fields < 1, a width < 1,
// dim outside [1, 1024]).
absl::Status CheckClickModelShape(const ClickModelShape& shape);

// Widths of the top MLP's input.
int64_t InteractionWidth(const ClickModelShape& shape);

// The model's dense tensors in flat order: bottom0.weight, bottom0.bias,
// ..., then top0.weight, top0.bias, ...; weights {in, out} row-major, ReLU
// after every layer but the top's last.
std::vector<TensorDesc> ClickModelTensors(const ClickModelShape& shape);
int64_t ClickModelParams(const ClickModelShape& shape);

// Initial dense values of flat floats [begin, end): as InitParams (He
// uniform weights, zero biases), from (seed, tensor, element) alone.
void InitClickParams(const ClickModelShape& shape, uint64_t seed, int64_t begin, int64_t end,
                     float* out);

// A batch's categorical side, as index arrays into the batch's unique rows
// (`rows` of them, `dim` floats each, however many tables they come from).
// Bag b = sample * fields + field holds entries [bag_starts[b],
// bag_starts[b+1]); entry e is row entry_rows[e]. The transpose lists, for
// each row r, the bags its entries are in — row_bags[row_starts[r] ..
// row_starts[r+1]), ascending — so that a row's gradient is summed in one
// fixed order on every device.
struct BagIndexView;
struct BagIndex {
  int64_t rows = 0;
  std::vector<int64_t> bag_starts;  // samples * fields + 1
  std::vector<int32_t> entry_rows;
  std::vector<int64_t> row_starts;  // rows + 1
  std::vector<int64_t> row_bags;

  BagIndexView view() const;
};

// A BagIndex's arrays wherever they are: host memory, or a GPU's.
struct BagIndexView {
  int64_t bags = 0;
  int64_t rows = 0;
  int64_t entries = 0;
  const int64_t* bag_starts = nullptr;
  const int32_t* entry_rows = nullptr;
  const int64_t* row_starts = nullptr;
  const int64_t* row_bags = nullptr;
};

// The transpose of bag_starts/entry_rows (fills row_starts and row_bags);
// INVALID_ARGUMENT if an entry's row is outside [0, rows).
absl::Status TransposeBags(BagIndex& index);

// Embedding bags on the host (the CUDA twins, bitwise the same, are in
// cuda_api.h):
//   forward:  out[b] = the sum of rows[entry_rows[e]] over the bag's
//             entries in order, times 1 / (the bag's size) for kMean
//   backward: row_grad[r] = the sum over r's entries, in bag order, of
//             d_out[b] (times 1 / (b's size) for kMean), overwriting row_grad
// No multiply-add is fused, so that every device rounds alike.
void EmbeddingBagForward(const BagIndexView& index, int dim, Pooling pooling, const float* rows,
                         float* out);
void EmbeddingBagBackward(const BagIndexView& index, int dim, Pooling pooling, const float* d_out,
                          float* row_grad);

// Totals over the samples of one call.
struct ClickStats {
  double loss_sum = 0;  // logistic losses
  int64_t samples = 0;
};

// One batch of the model's input, in host memory: `samples` rows of
// `dense` floats, 0/1 labels, and the bags.
struct ClickInputs {
  int samples = 0;
  const float* dense = nullptr;
  const float* labels = nullptr;
  const BagIndex* bags = nullptr;
};

class ClickModelKernels {
 public:
  virtual ~ClickModelKernels() = default;

  // Writes grad (ClickModelParams floats) = grad_scale * d(sum of the
  // batch's losses)/d(params), row_grad (bags->rows x dim) the same for the
  // rows, logits (if set) the batch's logits, and adds to *stats.
  // INVALID_ARGUMENT for a batch outside [1, max_batch].
  virtual absl::Status ForwardBackward(const float* params, const float* rows,
                                       const ClickInputs& inputs, float grad_scale, float* grad,
                                       float* row_grad, float* logits, ClickStats* stats) = 0;
  // The batch's logits only (any size up to max_batch).
  virtual absl::Status Forward(const float* params, const float* rows, const ClickInputs& inputs,
                               float* logits) = 0;
};

// The CPU implementation, for batches of up to max_batch samples.
absl::StatusOr<std::unique_ptr<ClickModelKernels>> CreateCpuClickModelKernels(
    const ClickModelShape& shape, int max_batch);

}  // namespace pstrain::kernels

#endif  // PSTRAIN_KERNELS_CLICK_MODEL_H_
