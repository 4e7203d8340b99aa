#include "common/tls_flags.h"

#include <tuple>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "common/init.h"
#include "common/node_id.h"

ABSL_FLAG(std::string, tls_cert, "",
          "PEM certificate (chain) this process presents; with --tls_key and --tls_ca every "
          "connection is mutual TLS, and the certificate's name is the node's id and role");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert");
ABSL_FLAG(std::string, tls_ca, "", "PEM certificate(s) of the CA every peer must be signed by");
ABSL_FLAG(bool, insecure, false,
          "allow plaintext on a listen address other than loopback (logged as a warning)");

namespace pstrain {

std::unique_ptr<TransportSecurity> TransportSecurityFromFlags(absl::string_view program,
                                                              PeerRole role,
                                                              const std::string& node_id) {
  TlsFiles files;
  for (auto [flag, value, path] :
       {std::tuple{"--tls_cert", absl::GetFlag(FLAGS_tls_cert), &files.cert},
        std::tuple{"--tls_key", absl::GetFlag(FLAGS_tls_key), &files.key},
        std::tuple{"--tls_ca", absl::GetFlag(FLAGS_tls_ca), &files.ca}}) {
    absl::StatusOr<std::string> expanded = ExpandNodeId(flag, value, node_id);
    if (!expanded.ok()) ExitForBadFlag(program, expanded.status().message());
    *path = *std::move(expanded);
  }
  // --check_flags checks the command line, not the files it names (a
  // manifest is checked where its Secrets are not mounted).
  if (files.empty() || OnlyCheckingFlags()) return nullptr;
  absl::StatusOr<std::unique_ptr<TransportSecurity>> security = TransportSecurity::Load(files);
  if (!security.ok()) ExitForBadFlag(program, security.status().message());
  const PeerIdentity& identity = (*security)->identity();
  if (identity.role != role) {
    ExitForBadFlag(program,
                   absl::StrCat("--tls_cert names '", identity.name, "', a ",
                                PeerRoleName(identity.role), "; this process needs a ",
                                PeerRoleName(role),
                                "'s certificate (see deploy/tls/make-dev-certs.sh)"));
  }
  return std::move(*security);
}

std::string CertifiedNodeId(absl::string_view program, const TransportSecurity* security,
                            const std::string& node_id) {
  if (security == nullptr) return node_id;
  const std::string& name = security->identity().name;
  if (!node_id.empty() && node_id != name) {
    ExitForBadFlag(program, absl::StrCat("the node id '", node_id,
                                         "' is not the name of --tls_cert ('", name,
                                         "'): a node runs under its certificate's name"));
  }
  return name;
}

bool InsecureFlag() { return absl::GetFlag(FLAGS_insecure); }

}  // namespace pstrain
