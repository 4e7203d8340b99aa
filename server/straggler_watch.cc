#include "server/straggler_watch.h"

#include <algorithm>
#include <utility>

#include "glog/logging.h"

namespace pstrain::server {

void StragglerWatch::Start(const std::string& job_id, int num_workers) {
  absl::MutexLock lock(&mu_);
  job_id_ = job_id;
  late_steps_.assign(num_workers, 0);
}

void StragglerWatch::SetGauges(std::vector<prometheus::Gauge*> gauges) {
  absl::MutexLock lock(&mu_);
  gauges_ = std::move(gauges);
}

void StragglerWatch::Observe(absl::Time opened, const std::vector<absl::Time>& arrived) {
  constexpr int kSteps = 10;
  const int n = static_cast<int>(arrived.size());
  if (n < 2) return;
  std::vector<double> lag(n);
  for (int w = 0; w < n; ++w) lag[w] = absl::ToDoubleSeconds(arrived[w] - opened);
  absl::MutexLock lock(&mu_);
  for (int w = 0; w < n; ++w) {
    std::vector<double> others;
    for (int o = 0; o < n; ++o) {
      if (o != w) others.push_back(lag[o]);
    }
    std::nth_element(others.begin(), others.begin() + others.size() / 2, others.end());
    const double median = others[others.size() / 2];
    prometheus::Gauge* gauge = w < static_cast<int>(gauges_.size()) ? gauges_[w] : nullptr;
    int& late = late_steps_[w];
    if (lag[w] > 3 * median) {
      if (++late == kSteps) {
        LOG(WARNING) << "job " << job_id_ << ": worker " << w << " is a straggler: its pushes "
                     << "reach the barrier " << lag[w] * 1e3 << " ms after the step opens, the "
                     << "others' median " << median * 1e3 << " ms, " << kSteps
                     << " steps in a row";
        if (gauge != nullptr) gauge->Set(1);
      }
    } else {
      if (late >= kSteps) {
        LOG(INFO) << "job " << job_id_ << ": worker " << w << " keeps up again";
        if (gauge != nullptr) gauge->Set(0);
      }
      late = 0;
    }
  }
}

}  // namespace pstrain::server
