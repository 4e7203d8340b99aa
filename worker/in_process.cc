#include "worker/in_process.h"

#include "common/job_spec.h"
#include "common/status.h"
#include "kernels/cpu/cpu_kernels.h"

namespace pstrain::worker {

absl::StatusOr<std::vector<float>> TrainInProcess(const v1::JobSpec& job_spec, int64_t steps,
                                                  const Dataset& train) {
  PSTRAIN_ASSIGN_OR_RETURN(v1::JobSpec spec, NormalizeJobSpec(job_spec));
  PSTRAIN_RETURN_IF_ERROR(CheckDataFitsJob(spec, train, /*train=*/true));
  const kernels::ModelShape shape = ModelShapeOf(spec);
  const int batch = static_cast<int>(GlobalBatch(spec));
  const int64_t steps_per_epoch = StepsPerEpoch(spec);
  const int64_t total_steps = TotalSteps(spec);
  PSTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<kernels::ModelKernels> model,
                           kernels::CreateCpuModelKernels(shape, batch));
  PSTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<kernels::Optimizer> optimizer,
                           kernels::CreateCpuOptimizer(OptimizerConfigOf(spec.optimizer())));
  const int64_t n = kernels::NumParams(shape);
  std::vector<float> params(n), grad(n);
  std::vector<float> state(static_cast<size_t>(optimizer->StateFloatsPerParam()) * n, 0.0f);
  kernels::InitParams(shape, spec.seed(), 0, n, params.data());
  std::vector<float> x(static_cast<size_t>(batch) * train.input_dim);
  std::vector<int32_t> y(batch);
  std::vector<int64_t> order;
  int64_t epoch = -1;
  for (int64_t step = 0; step < steps; ++step) {
    if (step / steps_per_epoch != epoch) {
      epoch = step / steps_per_epoch;
      order = EpochOrder(spec.seed(), epoch, train.num_samples);
    }
    train.Gather(order.data() + (step % steps_per_epoch) * batch, batch, x.data(), y.data());
    kernels::BatchStats stats;
    PSTRAIN_RETURN_IF_ERROR(model->ForwardBackward(params.data(), x.data(), y.data(), batch,
                                                   1.0f / batch, grad.data(), &stats));
    kernels::OptimizerSpan span{params.data(), params.data(), grad.data(), state.data(), n, n};
    span.learning_rate =
        static_cast<float>(LearningRateAt(spec.optimizer(), step, total_steps));
    PSTRAIN_RETURN_IF_ERROR(optimizer->Apply(span, step + 1));
  }
  return params;
}

absl::StatusOr<Evaluation> Evaluate(const v1::JobSpec& spec, const std::vector<float>& params,
                                    const Dataset& data) {
  const kernels::ModelShape shape = ModelShapeOf(spec);
  if (static_cast<int64_t>(params.size()) != kernels::NumParams(shape)) {
    return absl::InvalidArgumentError("parameters do not match the model");
  }
  PSTRAIN_RETURN_IF_ERROR(CheckDataFitsJob(spec, data, /*train=*/false));
  PSTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<kernels::ModelKernels> model,
                           kernels::CreateCpuModelKernels(shape, spec.batch_size()));
  std::vector<float> x(static_cast<size_t>(data.num_samples) * data.input_dim);
  std::vector<int32_t> y(data.num_samples);
  std::vector<int64_t> all(data.num_samples);
  for (int64_t i = 0; i < data.num_samples; ++i) all[i] = i;
  data.Gather(all.data(), static_cast<int>(data.num_samples), x.data(), y.data());
  kernels::BatchStats stats;
  PSTRAIN_RETURN_IF_ERROR(model->Evaluate(params.data(), x.data(), y.data(), data.num_samples,
                                          &stats));
  return Evaluation{static_cast<double>(stats.correct) / data.num_samples,
                    stats.loss_sum / data.num_samples};
}

}  // namespace pstrain::worker
