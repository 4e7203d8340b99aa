// Mutual TLS between pstrain's processes: the certificates a process
// presents, the role each certificate carries, and the gRPC credentials made
// from them.
//
// A certificate's identity is its subject's common name (CN), and its role
// follows from that name:
//   "coordinator"                           the coordinator
//   "server-N", or PREFIX "-server-N"       a parameter server (N: digits)
//   "worker-N", or PREFIX "-worker-N"       a worker
//   anything else ("admin", "alice", ...)   a client: psctl and users' tools
// so that a StatefulSet's pod names (pstrain-server-0) are certificate names
// too. A node's id is its certificate's name: the coordinator admits a node
// only in the role and under the id its certificate carries.
#ifndef PSTRAIN_COMMON_TLS_H_
#define PSTRAIN_COMMON_TLS_H_

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/security/tls_certificate_provider.h"

namespace pstrain {

enum class PeerRole { kCoordinator, kServer, kWorker, kClient };

// "coordinator", "server", "worker", "client".
absl::string_view PeerRoleName(PeerRole role);

// The role a certificate whose common name is `name` carries (see above).
PeerRole RoleOfName(absl::string_view name);

struct PeerIdentity {
  PeerRole role = PeerRole::kClient;
  std::string name;  // the certificate's common name
};

// The PEM files of --tls_cert, --tls_key and --tls_ca.
struct TlsFiles {
  std::string cert;  // this process's certificate (chain), leaf first
  std::string key;   // its private key
  std::string ca;    // the certificate(s) every peer must be signed by
  bool empty() const { return cert.empty() && key.empty() && ca.empty(); }
};

class TransportSecurity {
 public:
  // Reads and checks the three files: each must be readable PEM, the key
  // must match the certificate, the certificate must be signed by the CA
  // and valid now, and its common name must be 1 to 63 characters of
  // [a-z0-9.-] (a DNS label, like node ids). INVALID_ARGUMENT naming the
  // flag otherwise, and when only some of the three are given.
  static absl::StatusOr<std::unique_ptr<TransportSecurity>> Load(const TlsFiles& files);

  // What this process's certificate says it is.
  const PeerIdentity& identity() const { return identity_; }

  // Credentials for a channel that presents this process's certificate and
  // accepts only a server whose certificate the CA signed and whose role is
  // one of `peer_roles` (empty: any). The peer's name is not compared with the address
  // dialed: the address came from the coordinator, over mutual TLS.
  std::shared_ptr<grpc::ChannelCredentials> ChannelCredentials(
      std::vector<PeerRole> peer_roles) const;

  // Credentials for a server that presents this process's certificate and
  // requires every client to present one the CA signed; which client may
  // call which method is decided per call (CallerIdentity).
  std::shared_ptr<grpc::ServerCredentials> ServerCredentials() const;

 private:
  // The certificate, key and CA for gRPC, as one credentials object takes them.
  std::shared_ptr<grpc::experimental::CertificateProviderInterface> Provider() const;

  TransportSecurity(PeerIdentity identity, std::string cert_pem, std::string key_pem,
                    std::string ca_pem)
      : identity_(std::move(identity)),
        cert_pem_(std::move(cert_pem)),
        key_pem_(std::move(key_pem)),
        ca_pem_(std::move(ca_pem)) {}

  const PeerIdentity identity_;
  const std::string cert_pem_;
  const std::string key_pem_;
  const std::string ca_pem_;
};

// Credentials for a server listening on `listen`: `security`'s, or plaintext
// when it is null. Plaintext on anything but a loopback address (127.0.0.0/8,
// ::1, localhost, unix:) is INVALID_ARGUMENT unless `insecure`, and then
// logs a warning.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ListenCredentials(
    const TransportSecurity* security, const std::string& listen, bool insecure);

// Whether `listen` (host:port) binds only a loopback interface.
bool IsLoopbackAddress(const std::string& listen);

// Who made the call: the identity of its client certificate, or nullopt on a
// plaintext server (where every caller is trusted: loopback or --insecure).
std::optional<PeerIdentity> CallerIdentity(const grpc::ServerContextBase& context);

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_TLS_H_
