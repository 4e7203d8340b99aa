// Who may call what on the coordinator. Nodes authenticate by certificate
// (common/tls.h): a node's calls must come from the certificate that names
// it, in the role the certificate carries. Users authenticate by bearer
// token (the "authorization: Bearer TOKEN" metadata) when the coordinator
// has an --auth_tokens_file; a node's certificate is never a user's
// credential.
//
// Without tokens, the control API is open to any plaintext caller (plaintext
// listens on loopback unless --insecure) and, over TLS, to any client
// certificate (not a node's).
#ifndef PSTRAIN_SERVER_ACCESS_H_
#define PSTRAIN_SERVER_ACCESS_H_

#include <array>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "grpcpp/grpcpp.h"
#include "pstrain/v1/membership.pb.h"

namespace pstrain::server {

// What a user may do: a viewer gets, lists and watches jobs and lists
// nodes; an operator also submits, cancels, checkpoints and exports.
enum class UserRole { kViewer, kOperator };

// The contents of an --auth_tokens_file: one user per line,
//   ROLE NAME SHA256
// ROLE viewer or operator, NAME the user's name (for logs and messages),
// SHA256 the token's SHA-256 in 64 hex digits (`printf %s TOKEN | sha256sum`).
// '#' starts a comment; blank lines are skipped. Only the hashes are kept.
class AuthTokens {
 public:
  struct User {
    UserRole role = UserRole::kViewer;
    std::string name;
  };

  // INVALID_ARGUMENT naming `source` and the line for a malformed line, a
  // duplicate hash or a file without users.
  static absl::StatusOr<AuthTokens> Parse(absl::string_view text, absl::string_view source);
  static absl::StatusOr<AuthTokens> Load(const std::string& path);

  // The user holding `token`. Compares with every entry, in time that does
  // not depend on where (or whether) the token matches.
  std::optional<User> Find(absl::string_view token) const;

 private:
  struct Entry {
    std::array<unsigned char, 32> hash;
    User user;
  };
  std::vector<Entry> entries_;
};

// SHA-256 of `text` in lowercase hex.
std::string Sha256Hex(absl::string_view text);

class AccessPolicy {
 public:
  // `tokens`: the users; nullopt: no tokens (see above).
  explicit AccessPolicy(std::optional<AuthTokens> tokens) : tokens_(std::move(tokens)) {}

  // OK if the caller of `context` may do what needs `role`; `what` names the
  // action for the message ("submit a job"). UNAUTHENTICATED without a
  // valid token where one is needed, PERMISSION_DENIED for a viewer asking
  // for an operator's action or a node certificate used as a user's.
  absl::Status CheckUser(const grpc::ServerContextBase& context, UserRole role,
                         absl::string_view what) const;

  // OK if the caller of `context` is node `node_id` (or, when it is empty,
  // any node) in `role` (or any node role when NODE_ROLE_UNSPECIFIED).
  // PERMISSION_DENIED otherwise. Plaintext callers are not checked.
  absl::Status CheckNode(const grpc::ServerContextBase& context, absl::string_view node_id,
                         v1::NodeRole role) const;

  // The id a node registering over `context` must hold: its certificate's
  // name; empty over plaintext (any id).
  static std::string CertifiedNodeId(const grpc::ServerContextBase& context);

 private:
  const std::optional<AuthTokens> tokens_;
};

}  // namespace pstrain::server

#endif  // PSTRAIN_SERVER_ACCESS_H_
