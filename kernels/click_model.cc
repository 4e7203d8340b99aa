#include "kernels/click_model.h"

#include <string>

namespace pstrain::kernels {
namespace {

// The widths of the bottom and the top MLP, input first.
std::vector<int64_t> BottomWidths(const ClickModelShape& shape) {
  std::vector<int64_t> widths = {shape.dense};
  widths.insert(widths.end(), shape.bottom.begin(), shape.bottom.end());
  widths.push_back(shape.dim);
  return widths;
}

std::vector<int64_t> TopWidths(const ClickModelShape& shape) {
  std::vector<int64_t> widths = {InteractionWidth(shape)};
  widths.insert(widths.end(), shape.top.begin(), shape.top.end());
  widths.push_back(1);
  return widths;
}

void AddLayers(const std::string& name, const std::vector<int64_t>& widths,
               std::vector<TensorDesc>& tensors, int64_t& offset) {
  for (size_t l = 0; l + 1 < widths.size(); ++l) {
    const int64_t in = widths[l], out = widths[l + 1];
    const std::string layer = name + std::to_string(l);
    tensors.push_back({layer + ".weight", {in, out}, offset, in * out, in, false});
    offset += in * out;
    tensors.push_back({layer + ".bias", {out}, offset, out, in, true});
    offset += out;
  }
}

}  // namespace

absl::Status CheckClickModelShape(const ClickModelShape& shape) {
  if (shape.dense < 1 || shape.fields < 1) {
    return absl::InvalidArgumentError("the click model needs dense >= 1 and fields >= 1");
  }
  if (shape.dim < 1 || shape.dim > 1024) {
    return absl::InvalidArgumentError("embedding dim " + std::to_string(shape.dim) +
                                      " is outside [1, 1024]");
  }
  for (const std::vector<int>* widths : {&shape.bottom, &shape.top}) {
    for (int width : *widths) {
      if (width < 1 || width > 65536) {
        return absl::InvalidArgumentError("layer width " + std::to_string(width) +
                                          " is outside [1, 65536]");
      }
    }
  }
  return absl::OkStatus();
}

int64_t InteractionWidth(const ClickModelShape& shape) {
  const int64_t f = shape.fields;
  return shape.interaction == Interaction::kDot ? shape.dim + f * (f + 1) / 2
                                                : int64_t{shape.dim} * (f + 1);
}

std::vector<TensorDesc> ClickModelTensors(const ClickModelShape& shape) {
  std::vector<TensorDesc> tensors;
  int64_t offset = 0;
  AddLayers("bottom", BottomWidths(shape), tensors, offset);
  AddLayers("top", TopWidths(shape), tensors, offset);
  return tensors;
}

int64_t ClickModelParams(const ClickModelShape& shape) {
  const std::vector<TensorDesc> tensors = ClickModelTensors(shape);
  return tensors.back().offset + tensors.back().size;
}

void InitClickParams(const ClickModelShape& shape, uint64_t seed, int64_t begin, int64_t end,
                     float* out) {
  InitTensors(ClickModelTensors(shape), seed, begin, end, out);
}

BagIndexView BagIndex::view() const {
  return {.bags = static_cast<int64_t>(bag_starts.size()) - 1,
          .rows = rows,
          .entries = static_cast<int64_t>(entry_rows.size()),
          .bag_starts = bag_starts.data(),
          .entry_rows = entry_rows.data(),
          .row_starts = row_starts.data(),
          .row_bags = row_bags.data()};
}

absl::Status TransposeBags(BagIndex& index) {
  const int64_t entries = index.bag_starts.empty() ? 0 : index.bag_starts.back();
  if (static_cast<int64_t>(index.entry_rows.size()) != entries) {
    return absl::InvalidArgumentError("bag entries and entry rows disagree");
  }
  index.row_starts.assign(index.rows + 1, 0);
  for (int32_t row : index.entry_rows) {
    if (row < 0 || row >= index.rows) {
      return absl::InvalidArgumentError("entry row " + std::to_string(row) + " outside [0, " +
                                        std::to_string(index.rows) + ")");
    }
    ++index.row_starts[row + 1];
  }
  for (int64_t r = 0; r < index.rows; ++r) index.row_starts[r + 1] += index.row_starts[r];
  index.row_bags.resize(entries);
  std::vector<int64_t> next(index.row_starts.begin(), index.row_starts.end() - 1);
  const int64_t bags = static_cast<int64_t>(index.bag_starts.size()) - 1;
  for (int64_t b = 0; b < bags; ++b) {
    for (int64_t e = index.bag_starts[b]; e < index.bag_starts[b + 1]; ++e) {
      index.row_bags[next[index.entry_rows[e]]++] = b;
    }
  }
  return absl::OkStatus();
}

}  // namespace pstrain::kernels
