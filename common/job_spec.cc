#include "common/job_spec.h"

#include <algorithm>
#include <cmath>
#include <set>

#include "absl/strings/str_cat.h"
#include "common/click_generator.h"
#include "common/enum_names.h"
#include "common/job_spec_sections.h"
#include "common/job_yaml.h"
#include "common/status.h"

namespace pstrain {

namespace {

// model.tensors of an external model.
absl::Status CheckExternalModel(const v1::ModelSpec& model) {
  if (model.hidden_size() != 0 || model.conv_size() != 0 || model.input_dim() != 0 ||
      model.num_classes() != 0) {
    return FieldError(model.hidden_size() != 0 ? "model.hidden"
                      : model.conv_size() != 0 ? "model.conv"
                      : model.input_dim() != 0 ? "model.input_dim"
                                               : "model.num_classes",
                      "an external model is given by its tensors alone");
  }
  if (model.tensors_size() == 0) {
    return FieldError("model.tensors", "an external model needs at least one tensor");
  }
  if (model.tensors_size() > kMaxExternalTensors) {
    return FieldError("model.tensors", absl::StrCat(model.tensors_size(), " tensors; at most ",
                                                    kMaxExternalTensors));
  }
  std::set<std::string> names;
  for (int i = 0; i < model.tensors_size(); ++i) {
    const v1::ExternalTensor& t = model.tensors(i);
    const std::string field = absl::StrCat("model.tensors[", i, "]");
    if (t.name().empty() || t.name().size() > 200) {
      return FieldError(field + ".name", "must be 1..200 characters");
    }
    for (char c : t.name()) {
      if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) {
        return FieldError(field + ".name", "has a control character");
      }
    }
    if (!names.insert(t.name()).second) {
      return FieldError(field + ".name", absl::StrCat("'", t.name(), "' is listed twice"));
    }
    if (t.shape_size() > 8) return FieldError(field + ".shape", "at most 8 dimensions");
    if (!v1::TensorDType_IsValid(t.dtype())) {
      return FieldError(field + ".dtype", absl::StrCat("unknown value ", t.dtype()));
    }
    if (!t.buffer() && t.dtype() != v1::TENSOR_DTYPE_UNSPECIFIED &&
        t.dtype() != v1::TENSOR_DTYPE_FLOAT32) {
      return FieldError(field + ".dtype", "a parameter is float32; only a buffer has another");
    }
    int64_t size = 1;
    for (int d = 0; d < t.shape_size(); ++d) {
      if (t.shape(d) < 1 || t.shape(d) > kMaxParams) {
        return FieldError(absl::StrCat(field, ".shape[", d, "]"),
                          absl::StrCat("must be in [1, ", kMaxParams, "], got ", t.shape(d)));
      }
      size *= t.shape(d);
      if (size > kMaxParams) {
        return FieldError(field + ".shape", absl::StrCat("more than ", kMaxParams, " values"));
      }
    }
  }
  return absl::OkStatus();
}

// optimizer.schedule: each field only where its type uses it, in range.
absl::Status CheckSchedule(v1::OptimizerSpec& opt, int64_t total_steps) {
  v1::LearningRateSchedule& s = *opt.mutable_schedule();
  if (s.type() == v1::SCHEDULE_TYPE_UNSPECIFIED) s.set_type(v1::SCHEDULE_TYPE_CONSTANT);
  if (!v1::ScheduleType_IsValid(s.type())) {
    return FieldError("optimizer.schedule.type", absl::StrCat("unknown value ", s.type()));
  }
  if (s.warmup_steps() < 0 || s.warmup_steps() >= total_steps) {
    return FieldError("optimizer.schedule.warmup_steps",
                      absl::StrCat("must be in [0, ", total_steps, ") (the job's steps)"));
  }
  const bool step = s.type() == v1::SCHEDULE_TYPE_STEP;
  if (step) {
    if (s.decay_every_steps() <= 0) {
      return FieldError("optimizer.schedule.decay_every_steps", "must be > 0");
    }
    if (!(s.decay_factor() > 0 && s.decay_factor() <= 1)) {
      return FieldError("optimizer.schedule.decay_factor", "must be in (0, 1]");
    }
  } else if (s.decay_every_steps() != 0 || s.decay_factor() != 0) {
    return FieldError(s.decay_every_steps() != 0 ? "optimizer.schedule.decay_every_steps"
                                                 : "optimizer.schedule.decay_factor",
                      "applies to type step only");
  }
  if (s.type() == v1::SCHEDULE_TYPE_COSINE) {
    if (!(s.min_learning_rate() >= 0 && s.min_learning_rate() < opt.learning_rate())) {
      return FieldError("optimizer.schedule.min_learning_rate",
                        "must be in [0, optimizer.learning_rate)");
    }
  } else if (s.min_learning_rate() != 0) {
    return FieldError("optimizer.schedule.min_learning_rate", "applies to type cosine only");
  }
  return absl::OkStatus();
}

absl::Status InRange(const std::string& field, int64_t v, int64_t lo, int64_t hi) {
  if (v < lo || v > hi) {
    return FieldError(field, absl::StrCat("must be in [", lo, ", ", hi, "], got ", v));
  }
  return absl::OkStatus();
}

// The model: its type and the shape fields that type has.
absl::Status NormalizeModel(v1::JobSpec& spec) {
  v1::ModelSpec& model = *spec.mutable_model();
  auto check_hidden = [&]() -> absl::Status {
    if (model.hidden_size() > 16) return FieldError("model.hidden", "at most 16 layers");
    for (int i = 0; i < model.hidden_size(); ++i) {
      PSTRAIN_RETURN_IF_ERROR(
          InRange(absl::StrCat("model.hidden[", i, "]"), model.hidden(i), 1, 16384));
    }
    return absl::OkStatus();
  };
  switch (model.type()) {
    case v1::MODEL_TYPE_MLP:
      if (model.hidden_size() == 0) {
        return FieldError("model.hidden", "an mlp needs at least one hidden width");
      }
      PSTRAIN_RETURN_IF_ERROR(check_hidden());
      break;
    case v1::MODEL_TYPE_SOFTMAX:
      if (model.hidden_size() != 0) {
        return FieldError("model.hidden", "softmax regression has no hidden layers");
      }
      break;
    case v1::MODEL_TYPE_CNN:
      if (model.conv_size() == 0) {
        return FieldError("model.conv", "a cnn needs at least one convolution");
      }
      if (model.conv_size() > 4) {
        return FieldError("model.conv", "at most 4 convolutions (each halves the image)");
      }
      for (int i = 0; i < model.conv_size(); ++i) {
        PSTRAIN_RETURN_IF_ERROR(
            InRange(absl::StrCat("model.conv[", i, "]"), model.conv(i), 1, 512));
      }
      PSTRAIN_RETURN_IF_ERROR(check_hidden());
      break;
    case v1::MODEL_TYPE_EXTERNAL:
      PSTRAIN_RETURN_IF_ERROR(CheckExternalModel(model));
      break;
    case v1::MODEL_TYPE_CLICK:
      if (model.hidden_size() != 0) {
        return FieldError("model.hidden", "a click model's widths are model.click.bottom and top");
      }
      PSTRAIN_RETURN_IF_ERROR(job_spec_sections::NormalizeClickModel(*model.mutable_click()));
      break;
    default:
      return FieldError("model.type", "required (softmax, mlp, cnn, external or click)");
  }
  const bool click = model.type() == v1::MODEL_TYPE_CLICK;
  if (!click && model.has_click()) return FieldError("model.click", "only a click model has it");
  if (model.type() != v1::MODEL_TYPE_EXTERNAL && model.tensors_size() != 0) {
    return FieldError("model.tensors", "only an external model lists its tensors");
  }
  if (model.type() != v1::MODEL_TYPE_CNN && model.conv_size() != 0) {
    return FieldError("model.conv", "only a cnn has convolutions");
  }

  if (!click && model.input_dim() != 0 && model.input_dim() != kFashionInputDim) {
    return FieldError("model.input_dim", absl::StrCat(model.input_dim(),
                                                      " does not match the data's ",
                                                      kFashionInputDim, " inputs"));
  }
  if (!click && model.num_classes() != 0 && model.num_classes() != kFashionClasses) {
    return FieldError("model.num_classes", absl::StrCat(model.num_classes(),
                                                        " does not match the data's ",
                                                        kFashionClasses, " classes"));
  }
  return absl::OkStatus();
}

// The embedding tables, each with its defaults, and who may read them.
absl::Status NormalizeTables(v1::JobSpec& spec) {
  const v1::ModelSpec& model = spec.model();
  const bool click = model.type() == v1::MODEL_TYPE_CLICK;
  if (spec.tables_size() > kMaxTables) {
    return FieldError("tables", absl::StrCat(spec.tables_size(), " tables; at most ", kMaxTables));
  }
  if (spec.tables_size() > 0 && model.type() != v1::MODEL_TYPE_EXTERNAL && !click) {
    return FieldError("tables", "the built-in softmax, mlp and cnn read no embedding tables");
  }
  std::set<std::string> table_names;
  for (int t = 0; t < spec.tables_size(); ++t) {
    const std::string at = absl::StrCat("tables[", t, "]");
    PSTRAIN_RETURN_IF_ERROR(job_spec_sections::NormalizeTable(at, *spec.mutable_tables(t)));
    if (!table_names.insert(spec.tables(t).name()).second) {
      return FieldError(at + ".name", absl::StrCat("\"", spec.tables(t).name(), "\" twice"));
    }
    if (!click && spec.tables(t).fields_size() > 0) {
      return FieldError(at + ".fields", "only a click model's tables serve fields");
    }
    if (click && spec.tables(t).initial_rows() > 0) {
      return FieldError(at + ".initial_rows", "an external model's: its worker 0 gives them");
    }
  }
  return absl::OkStatus();
}

// The data: which dataset, where, and what a click model reads.
absl::Status NormalizeData(v1::JobSpec& spec) {
  const v1::ModelSpec& model = spec.model();
  const bool click = model.type() == v1::MODEL_TYPE_CLICK;
  v1::DataSpec& data = *spec.mutable_data();
  const bool external = model.type() == v1::MODEL_TYPE_EXTERNAL;
  if (external) {
    if (data.dataset() != v1::DATASET_UNSPECIFIED || !data.dir().empty()) {
      return FieldError(data.dir().empty() ? "data.dataset" : "data.dir",
                        "an external model's client reads its own data");
    }
    PSTRAIN_RETURN_IF_ERROR(
        InRange("data.train_samples", data.train_samples(), 0, int64_t{1} << 40));
  } else if (data.train_samples() != 0) {
    return FieldError("data.train_samples", "only an external model's data is counted so");
  }
  if (!external && data.dataset() == v1::DATASET_UNSPECIFIED) {
    data.set_dataset(click ? v1::DATASET_CLICKS : v1::DATASET_FASHION_MNIST);
  }
  if (!external && data.dataset() != (click ? v1::DATASET_CLICKS : v1::DATASET_FASHION_MNIST)) {
    return FieldError("data.dataset", click ? "a click model reads clicks"
                                            : "unsupported dataset for this model");
  }
  if (click) {
    if (!data.dir().empty()) return FieldError("data.dir", "click data names its files");
    PSTRAIN_RETURN_IF_ERROR(job_spec_sections::NormalizeClickData(*data.mutable_clicks()));
    PSTRAIN_RETURN_IF_ERROR(job_spec_sections::CheckClickTables(spec));
    if (model.input_dim() != 0 || model.num_classes() != 0) {
      return FieldError(model.input_dim() != 0 ? "model.input_dim" : "model.num_classes",
                        "a click model's inputs are the data's columns");
    }
  } else if (data.has_clicks()) {
    return FieldError("data.clicks", "only a click model reads click data");
  }
  if (!external && !click && data.dir().empty()) data.set_dir(kDefaultDataDir);
  if (data.dir().size() > kMaxPathBytes) {
    return FieldError("data.dir", absl::StrCat("a path of ", data.dir().size(),
                                               " bytes; at most ", kMaxPathBytes));
  }
  return absl::OkStatus();
}

// The dense optimizer and its hyperparameters.
absl::Status NormalizeOptimizer(v1::JobSpec& spec) {
  v1::OptimizerSpec& opt = *spec.mutable_optimizer();
  if (opt.type() == v1::OPTIMIZER_TYPE_UNSPECIFIED) {
    return FieldError("optimizer.type", "required (sgd, adam or adagrad)");
  }
  // The proto path can carry numbers no name stands for.
  if (!v1::OptimizerType_IsValid(opt.type())) {
    return FieldError("optimizer.type", absl::StrCat("unknown value ", opt.type()));
  }
  if (!(opt.learning_rate() > 0)) return FieldError("optimizer.learning_rate", "must be > 0");
  if (opt.learning_rate() > 100) return FieldError("optimizer.learning_rate", "must be <= 100");
  if (!(opt.momentum() >= 0 && opt.momentum() < 1)) {
    return FieldError("optimizer.momentum", "must be in [0, 1)");
  }
  if (opt.momentum() != 0 && opt.type() != v1::OPTIMIZER_TYPE_SGD) {
    return FieldError("optimizer.momentum", "applies to sgd only");
  }
  if (!(opt.weight_decay() >= 0) || !std::isfinite(opt.weight_decay())) {
    return FieldError("optimizer.weight_decay", "must be finite and >= 0");
  }
  if (opt.type() != v1::OPTIMIZER_TYPE_ADAM && (opt.has_beta1() || opt.has_beta2())) {
    return FieldError(opt.has_beta1() ? "optimizer.beta1" : "optimizer.beta2",
                      "applies to adam only");
  }
  if (opt.type() == v1::OPTIMIZER_TYPE_SGD && opt.has_epsilon()) {
    return FieldError("optimizer.epsilon", "applies to adam and adagrad only");
  }
  if (opt.type() == v1::OPTIMIZER_TYPE_ADAM) {
    if (!opt.has_beta1()) opt.set_beta1(0.9f);
    if (!opt.has_beta2()) opt.set_beta2(0.999f);
    if (!(opt.beta1() >= 0 && opt.beta1() < 1)) {
      return FieldError("optimizer.beta1", "must be in [0, 1)");
    }
    if (!(opt.beta2() >= 0 && opt.beta2() < 1)) {
      return FieldError("optimizer.beta2", "must be in [0, 1)");
    }
  }
  if (opt.type() != v1::OPTIMIZER_TYPE_SGD) {
    if (!opt.has_epsilon()) opt.set_epsilon(1e-8f);
    if (!(opt.epsilon() > 0) || !std::isfinite(opt.epsilon())) {
      return FieldError("optimizer.epsilon", "must be finite and > 0");
    }
  }
  return absl::OkStatus();
}

// The update mode, the precision computed in and the wire's.
absl::Status NormalizeModeAndPrecision(v1::JobSpec& spec) {
  if (spec.mode() == v1::MODE_UNSPECIFIED) spec.set_mode(v1::MODE_SYNC);
  if (!v1::Mode_IsValid(spec.mode())) {
    return FieldError("mode", absl::StrCat("unknown value ", spec.mode()));
  }
  if (spec.mode() == v1::MODE_SSP) {
    if (!spec.has_staleness()) {
      return FieldError("staleness", "mode ssp needs a staleness bound (0: as sync)");
    }
    PSTRAIN_RETURN_IF_ERROR(InRange("staleness", spec.staleness(), 0, int64_t{1} << 40));
  } else if (spec.has_staleness()) {
    return FieldError("staleness", absl::StrCat("only mode ssp has a staleness bound (",
                                                EnumName(spec.mode()), ": ",
                                                spec.mode() == v1::MODE_SYNC ? "0" : "unbounded",
                                                ")"));
  }
  if (spec.precision() == v1::PRECISION_UNSPECIFIED) spec.set_precision(v1::PRECISION_FP32);
  if (!v1::Precision_IsValid(spec.precision())) {
    return FieldError("precision", absl::StrCat("unknown value ", spec.precision()));
  }
  if (spec.precision() == v1::PRECISION_FP16) {
    v1::LossScaleSpec& scale = *spec.mutable_loss_scale();
    if (scale.initial() == 0) scale.set_initial(kDefaultLossScale);
    int exponent = 0;
    if (!(scale.initial() >= 1 && scale.initial() <= (1 << 24)) ||
        std::frexp(scale.initial(), &exponent) != 0.5) {
      return FieldError("loss_scale.initial",
                        absl::StrCat(scale.initial(), " is not a power of two in [1, 2^24]"));
    }
    if (scale.growth_steps() == 0) scale.set_growth_steps(2000);
    PSTRAIN_RETURN_IF_ERROR(InRange("loss_scale.growth_steps", scale.growth_steps(), 1, 1000000));
  } else if (spec.has_loss_scale()) {
    return FieldError("loss_scale", "only precision fp16 scales the loss");
  }
  if (spec.wire_dtype() == v1::DTYPE_UNSPECIFIED) spec.set_wire_dtype(v1::DTYPE_FP32);
  if (spec.wire_dtype() != v1::DTYPE_FP32 && spec.wire_dtype() != v1::DTYPE_BF16 &&
      spec.wire_dtype() != v1::DTYPE_FP16) {
    return FieldError("wire_dtype", "must be fp32, bf16 or fp16");
  }
  return absl::OkStatus();
}

// The cluster and the batch: workers, servers, what each model's workers allow.
absl::Status NormalizeCluster(v1::JobSpec& spec) {
  const bool click = spec.model().type() == v1::MODEL_TYPE_CLICK;
  const bool external = spec.model().type() == v1::MODEL_TYPE_EXTERNAL;
  const v1::DataSpec& data = spec.data();
  PSTRAIN_RETURN_IF_ERROR(InRange("num_workers", spec.num_workers(), 1, 1024));
  if (spec.colocated_servers()) {
    if (spec.num_servers() == 0) spec.set_num_servers(spec.num_workers());
    if (spec.num_servers() != spec.num_workers()) {
      return FieldError("num_servers", absl::StrCat("is ", spec.num_servers(),
                                                    ": with colocated_servers each of the ",
                                                    spec.num_workers(),
                                                    " worker processes holds one shard"));
    }
    if (spec.recovery().on_worker_loss() == v1::WORKER_LOSS_POLICY_ELASTIC) {
      return FieldError("colocated_servers",
                        "not with recovery.on_worker_loss: elastic (a worker left out would "
                        "take its process's shard with it)");
    }
    if (external) {
      return FieldError("colocated_servers",
                        "an external model's workers (the client library) hold no server");
    }
  }
  PSTRAIN_RETURN_IF_ERROR(InRange("num_servers", spec.num_servers(), 1, 256));
  PSTRAIN_RETURN_IF_ERROR(InRange("batch_size", spec.batch_size(), 1, 65536));
  if (spec.accumulate_steps() == 0) spec.set_accumulate_steps(1);
  PSTRAIN_RETURN_IF_ERROR(InRange("accumulate_steps", spec.accumulate_steps(), 1, 1024));
  if (click) {
    // The click model's worker: one CPU device, fp32, no micro-batches.
    if (spec.accumulate_steps() != 1) {
      return FieldError("accumulate_steps", "the click model pushes every batch");
    }
    if (spec.precision() != v1::PRECISION_FP32) {
      return FieldError("precision", "the click model computes in fp32");
    }
    if (spec.early_stopping().patience() != 0) {
      return FieldError("early_stopping.patience", "judges test accuracy: not a click model's");
    }
    if (spec.epochs() != 0 && !data.clicks().has_generate()) {
      return FieldError("epochs",
                        "click data from files needs steps (an epoch's length is unknown before "
                        "the files are read)");
    }
  }
  if (external) {
    // What pstrain's own workers do for built-in models, the client does
    // (accumulate_steps: it sums its micro-batches' gradients and pushes
    // once a step; precision: it computes in it, the library keeping the
    // loss scale of fp16).
    if (spec.eval_every_steps() != 0 || spec.early_stopping().patience() != 0) {
      return FieldError(spec.eval_every_steps() != 0 ? "eval_every_steps"
                                                     : "early_stopping.patience",
                        "an external model's client evaluates itself (and reports it when it "
                        "finishes)");
    }
    if (spec.steps() == 0 && data.train_samples() == 0) {
      return FieldError("data.train_samples",
                        "required with epochs: the size of the client's training set");
    }
  }
  const int64_t global_batch = GlobalBatch(spec);
  if (TrainSamplesOf(spec) > 0 && global_batch > TrainSamplesOf(spec)) {
    return FieldError("batch_size",
                      absl::StrCat("num_workers * accumulate_steps * batch_size = ", global_batch,
                                   " exceeds the ", TrainSamplesOf(spec), " training samples"));
  }
  return absl::OkStatus();
}

// How long it trains, its schedule, evaluations and early stopping.
absl::Status NormalizeLength(v1::JobSpec& spec) {
  v1::OptimizerSpec& opt = *spec.mutable_optimizer();
  if (spec.max_skipped_steps() == 0) spec.set_max_skipped_steps(10);
  PSTRAIN_RETURN_IF_ERROR(InRange("max_skipped_steps", spec.max_skipped_steps(), 1, 1000000));
  PSTRAIN_RETURN_IF_ERROR(InRange("epochs", spec.epochs(), 0, 100000));
  PSTRAIN_RETURN_IF_ERROR(InRange("steps", spec.steps(), 0, int64_t{1} << 40));
  if (spec.epochs() == 0 && spec.steps() == 0) {
    return FieldError("epochs", "set epochs or steps to a positive number");
  }
  PSTRAIN_RETURN_IF_ERROR(CheckSchedule(opt, TotalSteps(spec)));
  // Evaluation during training and early stopping.
  PSTRAIN_RETURN_IF_ERROR(
      InRange("eval_every_steps", spec.eval_every_steps(), 0, TotalSteps(spec)));
  const v1::EarlyStopping& stopping = spec.early_stopping();
  PSTRAIN_RETURN_IF_ERROR(InRange("early_stopping.patience", stopping.patience(), 0, 1000000));
  if (!(stopping.min_delta() >= 0 && stopping.min_delta() <= 1)) {
    return FieldError("early_stopping.min_delta", "must be in [0, 1] (an accuracy)");
  }
  if (stopping.patience() > 0 && spec.mode() != v1::MODE_SYNC) {
    return FieldError("early_stopping.patience",
                      absl::StrCat("needs mode sync (", EnumName(spec.mode()),
                                   " workers' views of the model differ)"));
  }
  if (stopping.patience() > 0 && spec.eval_every_steps() == 0) {
    return FieldError("early_stopping.patience",
                      "needs eval_every_steps: early stopping judges the evaluations");
  }
  return absl::OkStatus();
}

// Checkpoints: none without a dir; with one, their defaults.
absl::Status NormalizeCheckpoint(v1::JobSpec& spec) {
  v1::CheckpointSpec& checkpoint = *spec.mutable_checkpoint();
  if (checkpoint.dir().empty()) {
    if (checkpoint.every_steps() != 0 || checkpoint.keep() != 0 || checkpoint.full_every() != 0) {
      return FieldError(checkpoint.every_steps() != 0 ? "checkpoint.every_steps"
                        : checkpoint.keep() != 0      ? "checkpoint.keep"
                                                      : "checkpoint.full_every",
                        "needs checkpoint.dir");
    }
  } else {
    if (checkpoint.dir().size() > kMaxPathBytes) {
      return FieldError("checkpoint.dir", absl::StrCat("a path of ", checkpoint.dir().size(),
                                                       " bytes; at most ", kMaxPathBytes));
    }
    if (checkpoint.dir().front() != '/') {
      return FieldError("checkpoint.dir", "must be an absolute path (servers run elsewhere)");
    }
    if (checkpoint.every_steps() == 0) checkpoint.set_every_steps(kDefaultCheckpointEverySteps);
    if (checkpoint.keep() == 0) checkpoint.set_keep(kDefaultCheckpointsKept);
    if (checkpoint.full_every() == 0) checkpoint.set_full_every(kDefaultFullCheckpointEvery);
    PSTRAIN_RETURN_IF_ERROR(
        InRange("checkpoint.every_steps", checkpoint.every_steps(), 1, int64_t{1} << 40));
    PSTRAIN_RETURN_IF_ERROR(InRange("checkpoint.keep", checkpoint.keep(), 1, 1000));
    PSTRAIN_RETURN_IF_ERROR(InRange("checkpoint.full_every", checkpoint.full_every(), 1, 1000));
  }
  return absl::OkStatus();
}

// Recovery from a lost process.
absl::Status NormalizeRecovery(v1::JobSpec& spec) {
  v1::RecoverySpec& recovery = *spec.mutable_recovery();
  if (!recovery.has_replace_after_seconds()) {
    recovery.set_replace_after_seconds(kDefaultReplaceAfterSeconds);
  }
  if (!recovery.has_wait_timeout_seconds()) {
    recovery.set_wait_timeout_seconds(kDefaultWaitTimeoutSeconds);
  }
  PSTRAIN_RETURN_IF_ERROR(
      InRange("recovery.replace_after_seconds", recovery.replace_after_seconds(), 0, 86400));
  PSTRAIN_RETURN_IF_ERROR(
      InRange("recovery.wait_timeout_seconds", recovery.wait_timeout_seconds(), 1, 864000));
  if (recovery.on_worker_loss() == v1::WORKER_LOSS_POLICY_UNSPECIFIED) {
    recovery.set_on_worker_loss(v1::WORKER_LOSS_POLICY_WAIT);
  }
  if (!v1::WorkerLossPolicy_IsValid(recovery.on_worker_loss())) {
    return FieldError("recovery.on_worker_loss",
                      absl::StrCat("unknown value ", recovery.on_worker_loss()));
  }
  return absl::OkStatus();
}

// Chunks and sizes that would exhaust memory or the plan.
absl::Status CheckSizes(v1::JobSpec& spec) {
  const bool click = spec.model().type() == v1::MODEL_TYPE_CLICK;
  const bool external = spec.model().type() == v1::MODEL_TYPE_EXTERNAL;
  if (!spec.has_chunk_bytes()) spec.set_chunk_bytes(kDefaultChunkBytes);
  PSTRAIN_RETURN_IF_ERROR(InRange("chunk_bytes", spec.chunk_bytes(), 4, kMaxChunkBytes));
  if (spec.chunk_bytes() % 4 != 0) {
    return FieldError("chunk_bytes", "must be a multiple of 4 (whole floats)");
  }

  // Sizes that would exhaust memory or the plan.
  const std::vector<kernels::TensorDesc> tensors = JobTensors(spec);
  int64_t params = 0;
  int64_t chunks = 0;
  for (const kernels::TensorDesc& t : tensors) {
    params += t.size;
    chunks += (t.size * 4 + spec.chunk_bytes() - 1) / spec.chunk_bytes();
  }
  if (params > kMaxParams) {
    return FieldError(external ? "model.tensors" : "model.hidden",
                      absl::StrCat("the model has ", params, " parameters; at most ", kMaxParams));
  }
  if (chunks > kMaxChunks) {
    return FieldError("chunk_bytes", absl::StrCat("cuts the model into ", chunks,
                                                  " chunks; at most ", kMaxChunks));
  }
  if (external) return absl::OkStatus();
  if (click) {
    const kernels::ClickModelShape shape = ClickModelShapeOf(spec);
    int64_t widest = std::max<int64_t>(kernels::InteractionWidth(shape),
                                       int64_t{shape.fields} * shape.dim);
    for (int w : shape.bottom) widest = std::max<int64_t>(widest, w);
    for (int w : shape.top) widest = std::max<int64_t>(widest, w);
    if (int64_t{spec.batch_size()} * widest > kMaxActivationFloats) {
      return FieldError("batch_size", absl::StrCat("batch_size * widest layer = ",
                                                   int64_t{spec.batch_size()} * widest,
                                                   " floats per activation; at most ",
                                                   kMaxActivationFloats));
    }
    return absl::OkStatus();
  }
  const kernels::ModelShape shape = ModelShapeOf(spec);
  int64_t widest = std::max<int64_t>(shape.input_dim, kernels::DenseInputDim(shape));
  for (int width : shape.hidden) widest = std::max<int64_t>(widest, width);
  // A convolution's im2col matrix and output, per sample.
  for (const kernels::ConvLayer& c : kernels::ConvLayers(shape)) {
    widest = std::max<int64_t>(widest, int64_t{std::max(c.patch(), c.out_channels)} *
                                           c.height * c.width);
  }
  if (int64_t{spec.batch_size()} * widest > kMaxActivationFloats) {
    return FieldError("batch_size", absl::StrCat("batch_size * widest layer = ",
                                                 int64_t{spec.batch_size()} * widest,
                                                 " floats per activation; at most ",
                                                 kMaxActivationFloats));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status MakeModelExternal(v1::ModelSpec& model) {
  if (model.type() != v1::MODEL_TYPE_UNSPECIFIED && model.type() != v1::MODEL_TYPE_EXTERNAL) {
    return FieldError("model.type",
                      "the program gives the model's tensors: it is external (pstrain-local runs "
                      "the built-in models)");
  }
  if (model.tensors_size() != 0) {
    return FieldError("model.tensors", "the program gives them (its parameters)");
  }
  model.set_type(v1::MODEL_TYPE_EXTERNAL);
  return absl::OkStatus();
}

absl::StatusOr<v1::JobSpec> NormalizeJobSpec(v1::JobSpec spec) {
  if (spec.name().size() > 200) return FieldError("name", "longer than 200 characters");
  PSTRAIN_RETURN_IF_ERROR(NormalizeModel(spec));
  PSTRAIN_RETURN_IF_ERROR(NormalizeTables(spec));
  PSTRAIN_RETURN_IF_ERROR(NormalizeData(spec));
  PSTRAIN_RETURN_IF_ERROR(NormalizeOptimizer(spec));
  PSTRAIN_RETURN_IF_ERROR(NormalizeModeAndPrecision(spec));
  PSTRAIN_RETURN_IF_ERROR(NormalizeCluster(spec));
  PSTRAIN_RETURN_IF_ERROR(NormalizeLength(spec));
  PSTRAIN_RETURN_IF_ERROR(NormalizeCheckpoint(spec));
  PSTRAIN_RETURN_IF_ERROR(NormalizeRecovery(spec));
  PSTRAIN_RETURN_IF_ERROR(CheckSizes(spec));
  return spec;
}

absl::Status CheckDataFitsJob(const v1::JobSpec& spec, const Dataset& data, bool train) {
  const kernels::ModelShape shape = ModelShapeOf(spec);
  const std::string what = train ? "training set" : "test set";
  if (data.input_dim != shape.input_dim) {
    return FieldError("data.dir", absl::StrCat("the ", what, "'s images have ", data.input_dim,
                                               " values; the model takes ", shape.input_dim));
  }
  if (data.num_classes != shape.num_classes) {
    return FieldError("data.dir", absl::StrCat("the ", what, " has ", data.num_classes,
                                               " classes; the model has ", shape.num_classes));
  }
  if (train && data.num_samples < TrainSamplesOf(spec)) {
    return FieldError("data.dir", absl::StrCat("the training set has ", data.num_samples,
                                               " samples; the job's epochs are planned for ",
                                               TrainSamplesOf(spec)));
  }
  if (data.num_samples < 1) return FieldError("data.dir", absl::StrCat("the ", what, " is empty"));
  return absl::OkStatus();
}

}  // namespace pstrain
