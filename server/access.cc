#include "server/access.h"

#include <openssl/crypto.h>
#include <openssl/sha.h>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/files.h"
#include "common/rpc.h"
#include "common/tls.h"

namespace pstrain::server {
namespace {

std::array<unsigned char, 32> Sha256(absl::string_view text) {
  std::array<unsigned char, 32> hash;
  SHA256(reinterpret_cast<const unsigned char*>(text.data()), text.size(), hash.data());
  return hash;
}

absl::string_view UserRoleName(UserRole role) {
  return role == UserRole::kOperator ? "operator" : "viewer";
}

bool IsHex(absl::string_view text) {
  return std::all_of(text.begin(), text.end(), [](char c) { return absl::ascii_isxdigit(c); });
}

}  // namespace

std::string Sha256Hex(absl::string_view text) {
  const std::array<unsigned char, 32> hash = Sha256(text);
  return absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(hash.data()), hash.size()));
}

absl::StatusOr<AuthTokens> AuthTokens::Parse(absl::string_view text, absl::string_view source) {
  AuthTokens tokens;
  int line_number = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_number;
    line = line.substr(0, line.find('#'));
    std::vector<absl::string_view> fields =
        absl::StrSplit(line, absl::ByAnyChar(" \t\r"), absl::SkipEmpty());
    if (fields.empty()) continue;
    const auto bad = [&](absl::string_view why) {
      return absl::InvalidArgumentError(absl::StrCat(source, ":", line_number, ": ", why));
    };
    if (fields.size() != 3) return bad("expected 'ROLE NAME SHA256'");
    Entry entry;
    if (fields[0] == "viewer") {
      entry.user.role = UserRole::kViewer;
    } else if (fields[0] == "operator") {
      entry.user.role = UserRole::kOperator;
    } else {
      return bad("the role must be viewer or operator");
    }
    entry.user.name = std::string(fields[1].substr(0, 64));
    if (fields[2].size() != 64 || !IsHex(fields[2])) {
      return bad("the token's SHA-256 must be 64 hex digits (printf %s TOKEN | sha256sum)");
    }
    const std::string bytes = absl::HexStringToBytes(absl::AsciiStrToLower(fields[2]));
    std::copy(bytes.begin(), bytes.end(), entry.hash.begin());
    for (const Entry& other : tokens.entries_) {
      if (other.hash == entry.hash) {
        return bad(absl::StrCat("the same token as user '", other.user.name, "'"));
      }
    }
    tokens.entries_.push_back(std::move(entry));
  }
  if (tokens.entries_.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": no users"));
  }
  return tokens;
}

absl::StatusOr<AuthTokens> AuthTokens::Load(const std::string& path) {
  absl::StatusOr<std::string> text = ReadFile(path);
  if (!text.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--auth_tokens_file: cannot read ", path, ": ", text.status().message()));
  }
  return Parse(*text, path);
}

std::optional<AuthTokens::User> AuthTokens::Find(absl::string_view token) const {
  const std::array<unsigned char, 32> hash = Sha256(token);
  const Entry* found = nullptr;
  for (const Entry& entry : entries_) {
    // No early exit: every entry is compared, in constant time each.
    const bool equal = CRYPTO_memcmp(entry.hash.data(), hash.data(), hash.size()) == 0;
    if (equal) found = &entry;
  }
  if (found == nullptr) return std::nullopt;
  return found->user;
}

absl::Status AccessPolicy::CheckUser(const grpc::ServerContextBase& context, UserRole role,
                                     absl::string_view what) const {
  const std::optional<PeerIdentity> caller = CallerIdentity(context);
  if (!tokens_.has_value()) {
    if (caller.has_value() && caller->role != PeerRole::kClient) {
      return absl::PermissionDeniedError(absl::StrCat(
          "the certificate '", caller->name, "' is a ", PeerRoleName(caller->role),
          "'s, not a user's: use a client certificate (e.g. admin) to ", what));
    }
    return absl::OkStatus();
  }
  const auto& metadata = context.client_metadata();
  auto it = metadata.find(kAuthorizationKey);
  if (it == metadata.end()) {
    return absl::UnauthenticatedError(absl::StrCat(
        "this coordinator needs a bearer token to ", what,
        " (psctl --token_file=FILE or PSTRAIN_TOKEN)"));
  }
  const absl::string_view header(it->second.data(), it->second.size());
  constexpr absl::string_view kBearer = kBearerPrefix;
  if (!absl::StartsWith(header, kBearer)) {
    return absl::UnauthenticatedError("the authorization metadata is not 'Bearer TOKEN'");
  }
  const std::optional<AuthTokens::User> user = tokens_->Find(header.substr(kBearer.size()));
  if (!user.has_value()) {
    return absl::UnauthenticatedError("the bearer token is not one this coordinator knows");
  }
  if (user->role < role) {
    return absl::PermissionDeniedError(absl::StrCat("user '", user->name, "' is a ",
                                                    UserRoleName(user->role), ": to ", what,
                                                    " needs an ", UserRoleName(role), "'s token"));
  }
  return absl::OkStatus();
}

absl::Status AccessPolicy::CheckNode(const grpc::ServerContextBase& context,
                                     absl::string_view node_id, v1::NodeRole role) const {
  const std::optional<PeerIdentity> caller = CallerIdentity(context);
  if (!caller.has_value()) return absl::OkStatus();
  const bool node_role = caller->role == PeerRole::kServer || caller->role == PeerRole::kWorker;
  const bool role_ok = role == v1::NODE_ROLE_SERVER   ? caller->role == PeerRole::kServer
                       : role == v1::NODE_ROLE_WORKER ? caller->role == PeerRole::kWorker
                                                      : node_role;
  if (!role_ok) {
    return absl::PermissionDeniedError(absl::StrCat(
        "the certificate '", caller->name, "' is a ", PeerRoleName(caller->role), "'s, not a ",
        role == v1::NODE_ROLE_SERVER   ? "server's"
        : role == v1::NODE_ROLE_WORKER ? "worker's"
                                       : "node's"));
  }
  if (!node_id.empty() && node_id != caller->name) {
    return absl::PermissionDeniedError(absl::StrCat("the certificate '", caller->name,
                                                    "' does not carry the node id '",
                                                    node_id.substr(0, 80), "'"));
  }
  return absl::OkStatus();
}

std::string AccessPolicy::CertifiedNodeId(const grpc::ServerContextBase& context) {
  const std::optional<PeerIdentity> caller = CallerIdentity(context);
  return caller.has_value() ? caller->name : "";
}

}  // namespace pstrain::server
