// pstrain::ClickReader (pstrain/client.h): the click stream of
// common/click_data.h for programs of their own.
#include "absl/strings/str_cat.h"
#include "common/click_data.h"
#include "common/status.h"
#include "pstrain/client.h"

namespace pstrain {

class ClickReader::Impl {
 public:
  Impl(std::unique_ptr<ClickStream> stream, ClickLayout layout)
      : stream_(std::move(stream)), layout_(layout) {}

  absl::StatusOr<ClickSamples> Read(int64_t from, int64_t count) {
    if (from < 0 || count < 0) return absl::InvalidArgumentError("negative position or count");
    ClickBatch batch;
    batch.layout = layout_;
    PSTRAIN_RETURN_IF_ERROR(stream_->Read(from, count, batch));
    return ClickSamples{std::move(batch.labels), std::move(batch.dense),
                        std::move(batch.bag_starts), std::move(batch.keys)};
  }

  absl::StatusOr<int64_t> Available(int64_t end) { return stream_->Available(end); }

 private:
  std::unique_ptr<ClickStream> stream_;
  const ClickLayout layout_;
};

absl::StatusOr<std::unique_ptr<ClickReader>> ClickReader::Open(Options options) {
  if (options.dense < 0 || options.fields < 1) {
    return absl::InvalidArgumentError(absl::StrCat("dense ", options.dense, " and fields ",
                                                   options.fields,
                                                   ": dense must be >= 0 and fields >= 1"));
  }
  if (options.epoch < 0) return absl::InvalidArgumentError("negative epoch");
  const ClickLayout layout{.dense = options.dense, .fields = options.fields};
  PSTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<ClickStream> stream,
                           ClickStream::Open({.files = std::move(options.files),
                                              .layout = layout,
                                              .seed = options.seed,
                                              .epoch = options.epoch,
                                              .shuffle_window = options.shuffle_window}));
  return std::unique_ptr<ClickReader>(
      new ClickReader(std::make_unique<Impl>(std::move(stream), layout)));
}

ClickReader::ClickReader(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ClickReader::~ClickReader() = default;

absl::StatusOr<ClickSamples> ClickReader::Read(int64_t from, int64_t count) {
  return impl_->Read(from, count);
}

absl::StatusOr<int64_t> ClickReader::Available(int64_t end) { return impl_->Available(end); }

}  // namespace pstrain
