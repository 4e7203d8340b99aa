// The measures of a binary classifier's scores: the area under the ROC
// curve and the logistic loss.
#ifndef PSTRAIN_COMMON_ROC_AUC_H_
#define PSTRAIN_COMMON_ROC_AUC_H_

#include <vector>

namespace pstrain {

// The chance that a positive (label 1) scores above a negative (label 0),
// ties counting one half: the area under the ROC curve. NaN without both
// classes. O(n log n).
double RocAuc(const std::vector<double>& scores, const std::vector<float>& labels);

// The mean logistic loss (log loss) of logits against 0/1 labels, computed
// without overflow for any logit. NaN for no samples.
double MeanLogLoss(const std::vector<double>& logits, const std::vector<float>& labels);

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_ROC_AUC_H_
