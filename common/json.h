// JSON text of pstrain's own: result lines, export manifests.
#ifndef PSTRAIN_COMMON_JSON_H_
#define PSTRAIN_COMMON_JSON_H_

#include <string>

namespace pstrain {

// `s` as a JSON string literal, quotes included.
std::string JsonQuote(const std::string& s);

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_JSON_H_
