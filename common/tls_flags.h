// The TLS flags every pstrain daemon takes (--tls_cert, --tls_key,
// --tls_ca, --insecure), defined here so that only the binaries that use
// them have them.
#ifndef PSTRAIN_COMMON_TLS_FLAGS_H_
#define PSTRAIN_COMMON_TLS_FLAGS_H_

#include <memory>
#include <string>

#include "absl/strings/string_view.h"
#include "common/tls.h"

namespace pstrain {

// The process's certificate from --tls_cert, --tls_key and --tls_ca, in
// whose paths "{node_id}" stands for `node_id` (one manifest for every pod
// of a StatefulSet); null when none of them is given (plaintext). Exits 2
// with the reason, naming the flag, when they are incomplete, do not check
// out, or the certificate is not of `role`. With --check_flags the files
// are not read (null).
std::unique_ptr<TransportSecurity> TransportSecurityFromFlags(absl::string_view program,
                                                              PeerRole role,
                                                              const std::string& node_id = "");

// The id a node with `security` runs under: `node_id` (from --node_id or
// PSTRAIN_NODE_ID) or, when that is empty, its certificate's name. Exits 2
// when the two differ: the coordinator would refuse the node.
std::string CertifiedNodeId(absl::string_view program, const TransportSecurity* security,
                            const std::string& node_id);

// --insecure: plaintext may listen on an address other than loopback.
bool InsecureFlag();

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_TLS_FLAGS_H_
