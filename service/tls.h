// Transport security of the gRPC port (docs/operations.md, "Security and resource bounds"):
// TLS with the server's certificate, and mTLS when a client CA is given (every client, and
// every peer server in a slot transfer, must present a certificate that CA signed). The same
// certificate is the server's client identity when it dials a peer for a transfer.
#ifndef REPLAYSSM_SERVICE_TLS_H_
#define REPLAYSSM_SERVICE_TLS_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"

namespace replayssm::service {

struct TlsOptions {
  std::string cert_file;       // PEM certificate chain of this server (--tls-cert)
  std::string key_file;        // its PEM private key (--tls-key)
  std::string client_ca_file;  // PEM CA that client certificates must chain to (--tls-client-ca)
  bool enabled() const { return !cert_file.empty() || !key_file.empty(); }
};

// The credentials of this server's listening port: insecure when TLS is off. INVALID_ARGUMENT
// naming the flag for a file that cannot be read, a certificate without its key (or the
// reverse), or a client CA without a certificate.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentialsFor(
    const TlsOptions& tls);
// The credentials this server dials peers with: insecure when TLS is off; else TLS that
// verifies the peer against the client CA (the cluster's CA; the system roots without one)
// and presents this server's certificate.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> PeerCredentialsFor(const TlsOptions& tls);

}  // namespace replayssm::service

#endif  // REPLAYSSM_SERVICE_TLS_H_
