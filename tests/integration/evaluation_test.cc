// Evaluation during training and early stopping, on a cluster of real
// processes: the evaluations are the job's (psctl get shows them), early
// stopping ends the job SUCCEEDED at the step it says, and the model it
// ends with is bitwise that of a job that simply had that many steps.
#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "tests/cluster_util.h"
#include "tests/integration/cluster_fixture.h"

namespace pstrain::testing {
namespace {

class EvaluationTest : public ClusterFixture {
 protected:
  static v1::JobSpec Spec(int64_t steps) {
    return MlpSpec(v1::OPTIMIZER_TYPE_ADAM, 1e-3f, /*workers=*/2, /*batch=*/32,
                   /*servers=*/2, steps);
  }
};

TEST_F(EvaluationTest, EvaluationsDuringTrainingAndEarlyStopping) {
  ASSERT_NO_FATAL_FAILURE(StartCluster(2, 2));

  // Every 25 steps, then the final model's.
  v1::JobSpec evaluated = Spec(100);
  evaluated.set_eval_every_steps(25);
  const std::string a = Submit(evaluated);
  const v1::Job during = WaitFor(a, [](const v1::Job& j) {
    return j.last_evaluation().step() > 0 || j.state() >= v1::JOB_STATE_SUCCEEDED;
  });
  EXPECT_EQ(during.last_evaluation().step() % 25, 0);
  EXPECT_GT(during.last_evaluation().test_accuracy(), 0.1f);
  v1::Job ended;
  FinalParams(a, &ended);
  EXPECT_EQ(ended.last_evaluation().step(), 100);
  EXPECT_EQ(ended.last_evaluation().test_accuracy(), ended.result().test_accuracy());
  EXPECT_GE(ended.best_evaluation().test_accuracy(), ended.last_evaluation().test_accuracy());
  EXPECT_EQ(ended.result().steps(), 100);
  EXPECT_EQ(ended.reason(), "");
  const ProcessResult get = Psctl({"get", a});
  EXPECT_TRUE(absl::StrContains(get.out, "last evaluation:  step 100")) << get.out;
  EXPECT_TRUE(absl::StrContains(get.out, "best evaluation:")) << get.out;

  // An improvement of more than a whole accuracy never comes: the first
  // evaluation (step 20) stays the best, and two without one end the job
  // at step 60.
  v1::JobSpec stopping = Spec(400);
  stopping.set_eval_every_steps(20);
  stopping.mutable_early_stopping()->set_patience(2);
  stopping.mutable_early_stopping()->set_min_delta(1.0f);
  const std::string b = Submit(stopping);
  v1::Job stopped;
  const std::vector<float> stopped_params = FinalParams(b, &stopped);
  EXPECT_EQ(stopped.state(), v1::JOB_STATE_SUCCEEDED);
  EXPECT_TRUE(absl::StartsWith(stopped.reason(), "early stopping at step 60: ")) << stopped.reason();
  EXPECT_TRUE(absl::StrContains(stopped.reason(), "(step 20)")) << stopped.reason();
  EXPECT_EQ(stopped.result().steps(), 60);
  EXPECT_EQ(stopped.last_evaluation().step(), 60);
  // The job's best is the best accuracy (min_delta is early stopping's).
  EXPECT_EQ(stopped.best_evaluation().step() % 20, 0);
  EXPECT_GE(stopped.best_evaluation().test_accuracy(), stopped.last_evaluation().test_accuracy());

  // Stopping is exact: the model is that of a 60-step job.
  const std::vector<float> sixty = FinalParams(Submit(Spec(60)));
  ExpectBitwiseEqual(stopped_params, sixty);
}

}  // namespace
}  // namespace pstrain::testing
