#include "common/tls.h"

#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509_vfy.h>

#include <algorithm>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/files.h"
#include "common/node_id.h"
#include "common/status.h"
#include "glog/logging.h"
#include "grpcpp/security/tls_certificate_provider.h"
#include "grpcpp/security/tls_certificate_verifier.h"
#include "grpcpp/security/tls_credentials_options.h"

namespace pstrain {

absl::string_view PeerRoleName(PeerRole role) {
  switch (role) {
    case PeerRole::kCoordinator:
      return "coordinator";
    case PeerRole::kServer:
      return "server";
    case PeerRole::kWorker:
      return "worker";
    case PeerRole::kClient:
      return "client";
  }
  return "client";
}

namespace {

// Whether `name` is `word`-N or PREFIX-`word`-N, N one or more digits.
bool IsIndexedName(absl::string_view name, absl::string_view word) {
  const size_t dash = name.rfind('-');
  if (dash == absl::string_view::npos || dash + 1 == name.size()) return false;
  const absl::string_view index = name.substr(dash + 1);
  if (!std::all_of(index.begin(), index.end(), absl::ascii_isdigit)) return false;
  const absl::string_view stem = name.substr(0, dash);
  if (stem == word) return true;
  return stem.size() > word.size() && absl::EndsWith(stem, word) &&
         stem[stem.size() - word.size() - 1] == '-';
}

}  // namespace

PeerRole RoleOfName(absl::string_view name) {
  if (name == "coordinator") return PeerRole::kCoordinator;
  if (IsIndexedName(name, "server")) return PeerRole::kServer;
  if (IsIndexedName(name, "worker")) return PeerRole::kWorker;
  return PeerRole::kClient;
}

namespace {

struct BioFree {
  void operator()(BIO* b) const { BIO_free(b); }
};
struct X509Free {
  void operator()(X509* x) const { X509_free(x); }
};
struct KeyFree {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};
struct StoreFree {
  void operator()(X509_STORE* s) const { X509_STORE_free(s); }
};
struct StoreCtxFree {
  void operator()(X509_STORE_CTX* c) const { X509_STORE_CTX_free(c); }
};
struct StackFree {
  void operator()(STACK_OF(X509) * s) const { sk_X509_pop_free(s, X509_free); }
};
using UniqueX509 = std::unique_ptr<X509, X509Free>;

// OpenSSL's queued error, as text (and the queue emptied).
std::string OpenSslError() {
  const unsigned long code = ERR_get_error();
  ERR_clear_error();
  if (code == 0) return "not PEM";
  char text[256];
  ERR_error_string_n(code, text, sizeof(text));
  return text;
}

// Every certificate in `pem`, in order; INVALID_ARGUMENT naming `flag` if
// there is none or one does not parse.
absl::StatusOr<std::vector<UniqueX509>> ParseCertificates(const std::string& flag,
                                                          const std::string& path,
                                                          const std::string& pem) {
  std::unique_ptr<BIO, BioFree> bio(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
  std::vector<UniqueX509> certs;
  while (true) {
    UniqueX509 cert(PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr));
    if (cert == nullptr) break;
    certs.push_back(std::move(cert));
  }
  // The loop ends on "no start line" once the input is used up; anything
  // else is a damaged certificate.
  const unsigned long last = ERR_peek_last_error();
  ERR_clear_error();
  if (certs.empty() || (ERR_GET_REASON(last) != PEM_R_NO_START_LINE && last != 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": ", path, " is not a PEM certificate file"));
  }
  return certs;
}

std::string CommonName(X509* cert) {
  X509_NAME* subject = X509_get_subject_name(cert);
  const int index = X509_NAME_get_index_by_NID(subject, NID_commonName, -1);
  if (index < 0) return "";
  ASN1_STRING* data = X509_NAME_ENTRY_get_data(X509_NAME_get_entry(subject, index));
  unsigned char* utf8 = nullptr;
  const int length = ASN1_STRING_to_UTF8(&utf8, data);
  if (length < 0) return "";
  std::string name(reinterpret_cast<char*>(utf8), length);
  OPENSSL_free(utf8);
  return name;
}

absl::StatusOr<std::string> ReadPem(const std::string& flag, const std::string& path) {
  absl::StatusOr<std::string> pem = ReadFile(path);
  if (!pem.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": cannot read ", path, ": ", pem.status().message()));
  }
  return pem;
}

// Checks the certificate chain of `cert_pem` against `ca_pem` as a peer
// would, now.
absl::Status VerifyAgainstCa(const std::vector<UniqueX509>& chain,
                             const std::vector<UniqueX509>& cas, const std::string& cert_path,
                             const std::string& ca_path) {
  std::unique_ptr<X509_STORE, StoreFree> store(X509_STORE_new());
  for (const UniqueX509& ca : cas) X509_STORE_add_cert(store.get(), ca.get());
  std::unique_ptr<STACK_OF(X509), StackFree> intermediates(sk_X509_new_null());
  for (size_t i = 1; i < chain.size(); ++i) {
    X509_up_ref(chain[i].get());
    sk_X509_push(intermediates.get(), chain[i].get());
  }
  std::unique_ptr<X509_STORE_CTX, StoreCtxFree> context(X509_STORE_CTX_new());
  if (X509_STORE_CTX_init(context.get(), store.get(), chain[0].get(), intermediates.get()) != 1) {
    return absl::InternalError(absl::StrCat("cannot verify a certificate: ", OpenSslError()));
  }
  if (X509_verify_cert(context.get()) != 1) {
    const int error = X509_STORE_CTX_get_error(context.get());
    ERR_clear_error();
    return absl::InvalidArgumentError(absl::StrCat(
        "--tls_cert: ", cert_path, " does not verify against --tls_ca ", ca_path, ": ",
        X509_verify_cert_error_string(error)));
  }
  return absl::OkStatus();
}

// Accepts a server certificate only in one of the expected roles; the chain
// itself has been verified against the CA before this is asked.
class RoleVerifier final : public grpc::experimental::ExternalCertificateVerifier {
 public:
  explicit RoleVerifier(std::vector<PeerRole> roles) : roles_(std::move(roles)) {}

  bool Verify(grpc::experimental::TlsCustomVerificationCheckRequest* request,
              std::function<void(grpc::Status)> /*callback*/,
              grpc::Status* sync_status) override {
    const std::string name(request->common_name().data(), request->common_name().size());
    const PeerRole role = RoleOfName(name);
    if (roles_.empty() || std::find(roles_.begin(), roles_.end(), role) != roles_.end()) {
      *sync_status = grpc::Status::OK;
    } else {
      std::vector<std::string> wanted;
      for (PeerRole r : roles_) wanted.emplace_back(PeerRoleName(r));
      *sync_status = grpc::Status(
          grpc::StatusCode::UNAUTHENTICATED,
          absl::StrCat("the peer's certificate '", name, "' is a ", PeerRoleName(role),
                       "'s; expected a ", absl::StrJoin(wanted, " or ")));
    }
    return true;
  }

  void Cancel(grpc::experimental::TlsCustomVerificationCheckRequest* /*request*/) override {}

 private:
  const std::vector<PeerRole> roles_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<TransportSecurity>> TransportSecurity::Load(
    const TlsFiles& files) {
  if (files.cert.empty() || files.key.empty() || files.ca.empty()) {
    return absl::InvalidArgumentError(
        "--tls_cert, --tls_key and --tls_ca go together: give all three or none");
  }
  PSTRAIN_ASSIGN_OR_RETURN(std::string cert_pem, ReadPem("--tls_cert", files.cert));
  PSTRAIN_ASSIGN_OR_RETURN(std::string key_pem, ReadPem("--tls_key", files.key));
  PSTRAIN_ASSIGN_OR_RETURN(std::string ca_pem, ReadPem("--tls_ca", files.ca));
  PSTRAIN_ASSIGN_OR_RETURN(std::vector<UniqueX509> chain,
                           ParseCertificates("--tls_cert", files.cert, cert_pem));
  PSTRAIN_ASSIGN_OR_RETURN(std::vector<UniqueX509> cas,
                           ParseCertificates("--tls_ca", files.ca, ca_pem));
  std::unique_ptr<BIO, BioFree> key_bio(
      BIO_new_mem_buf(key_pem.data(), static_cast<int>(key_pem.size())));
  std::unique_ptr<EVP_PKEY, KeyFree> key(
      PEM_read_bio_PrivateKey(key_bio.get(), nullptr, nullptr, nullptr));
  if (key == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--tls_key: ", files.key, " is not an unencrypted PEM private key (", OpenSslError(), ")"));
  }
  if (X509_check_private_key(chain[0].get(), key.get()) != 1) {
    ERR_clear_error();
    return absl::InvalidArgumentError(absl::StrCat("--tls_key: ", files.key,
                                                   " is not the key of --tls_cert ", files.cert));
  }
  PSTRAIN_RETURN_IF_ERROR(VerifyAgainstCa(chain, cas, files.cert, files.ca));
  const std::string name = CommonName(chain[0].get());
  if (!IsValidNodeId(name)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--tls_cert: ", files.cert, ": the certificate's common name '", name,
        "' is not 1 to 63 characters of [a-z0-9.-] starting and ending with a letter or digit"));
  }
  PeerIdentity identity{.role = RoleOfName(name), .name = name};
  return std::unique_ptr<TransportSecurity>(new TransportSecurity(
      std::move(identity), std::move(cert_pem), std::move(key_pem), std::move(ca_pem)));
}

std::shared_ptr<grpc::experimental::CertificateProviderInterface> TransportSecurity::Provider()
    const {
  return std::make_shared<grpc::experimental::StaticDataCertificateProvider>(
      ca_pem_, std::vector<grpc::experimental::IdentityKeyCertPair>{
                   {.private_key = key_pem_, .certificate_chain = cert_pem_}});
}

std::shared_ptr<grpc::ChannelCredentials> TransportSecurity::ChannelCredentials(
    std::vector<PeerRole> peer_roles) const {
  grpc::experimental::TlsChannelCredentialsOptions options;
  options.set_certificate_provider(Provider());
  options.watch_root_certs();
  options.watch_identity_key_cert_pairs();
  options.set_verify_server_certs(true);
  options.set_check_call_host(false);
  options.set_certificate_verifier(
      grpc::experimental::ExternalCertificateVerifier::Create<RoleVerifier>(
          std::move(peer_roles)));
  return grpc::experimental::TlsCredentials(options);
}

std::shared_ptr<grpc::ServerCredentials> TransportSecurity::ServerCredentials() const {
  grpc::experimental::TlsServerCredentialsOptions options(Provider());
  options.watch_root_certs();
  options.watch_identity_key_cert_pairs();
  options.set_cert_request_type(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  options.set_certificate_verifier(
      std::make_shared<grpc::experimental::NoOpCertificateVerifier>());
  return grpc::experimental::TlsServerCredentials(options);
}

bool IsLoopbackAddress(const std::string& listen) {
  if (absl::StartsWith(listen, "unix:")) return true;
  std::string host = listen;
  if (!host.empty() && host.front() == '[') {
    host = host.substr(1, host.find(']') - 1);
  } else if (const size_t colon = host.rfind(':'); colon != std::string::npos) {
    host = host.substr(0, colon);
  }
  return host == "localhost" || host == "::1" || absl::StartsWith(host, "127.");
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ListenCredentials(
    const TransportSecurity* security, const std::string& listen, bool insecure) {
  if (security != nullptr) return security->ServerCredentials();
  if (!IsLoopbackAddress(listen)) {
    if (!insecure) {
      return absl::InvalidArgumentError(absl::StrCat(
          "plaintext on ", listen,
          ", which is not a loopback address, lets anyone on the network in: give --tls_cert, "
          "--tls_key and --tls_ca, or say --insecure"));
    }
    LOG(WARNING) << "listening on " << listen
                 << " in plaintext (--insecure): anyone who can reach it can use it";
  }
  return grpc::InsecureServerCredentials();
}

std::optional<PeerIdentity> CallerIdentity(const grpc::ServerContextBase& context) {
  const std::shared_ptr<const grpc::AuthContext> auth = context.auth_context();
  if (auth == nullptr || !auth->IsPeerAuthenticated()) return std::nullopt;
  const std::vector<grpc::string_ref> names = auth->FindPropertyValues(GRPC_X509_CN_PROPERTY_NAME);
  PeerIdentity identity;
  if (!names.empty()) identity.name.assign(names.front().data(), names.front().size());
  identity.role = RoleOfName(identity.name);
  return identity;
}

}  // namespace pstrain
