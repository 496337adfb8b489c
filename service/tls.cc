#include "service/tls.h"

#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"

namespace replayssm::service {
namespace {

absl::StatusOr<std::string> ReadPem(const std::string& path, const char* flag) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  if (in) text << in.rdbuf();
  if (!in || text.str().find("-----BEGIN ") == std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, ": expected a readable PEM file, got \"", path, "\"",
                     in ? " (no PEM block in it)" : " (cannot be read)"));
  }
  return text.str();
}

struct Pems {
  std::string cert, key, client_ca;
};

absl::StatusOr<Pems> Load(const TlsOptions& tls) {
  if (tls.cert_file.empty() != tls.key_file.empty()) {
    return absl::InvalidArgumentError(
        tls.cert_file.empty()
            ? "--tls-cert: expected the certificate that goes with --tls-key, got none"
            : "--tls-key: expected the private key that goes with --tls-cert, got none");
  }
  Pems p;
  if (!tls.enabled()) {
    if (!tls.client_ca_file.empty()) {
      return absl::InvalidArgumentError(
          "--tls-client-ca: expected --tls-cert and --tls-key too (mTLS is TLS with client "
          "certificates), got neither");
    }
    return p;
  }
  absl::StatusOr<std::string> s = ReadPem(tls.cert_file, "tls-cert");
  if (!s.ok()) return s.status();
  p.cert = *std::move(s);
  s = ReadPem(tls.key_file, "tls-key");
  if (!s.ok()) return s.status();
  p.key = *std::move(s);
  if (!tls.client_ca_file.empty()) {
    s = ReadPem(tls.client_ca_file, "tls-client-ca");
    if (!s.ok()) return s.status();
    p.client_ca = *std::move(s);
  }
  return p;
}

}  // namespace

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentialsFor(
    const TlsOptions& tls) {
  absl::StatusOr<Pems> p = Load(tls);
  if (!p.ok()) return p.status();
  if (!tls.enabled()) return grpc::InsecureServerCredentials();
  grpc::SslServerCredentialsOptions o(
      p->client_ca.empty() ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
                           : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  o.pem_root_certs = p->client_ca;
  o.pem_key_cert_pairs.push_back({p->key, p->cert});
  return grpc::SslServerCredentials(o);
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> PeerCredentialsFor(
    const TlsOptions& tls) {
  absl::StatusOr<Pems> p = Load(tls);
  if (!p.ok()) return p.status();
  if (!tls.enabled()) return grpc::InsecureChannelCredentials();
  grpc::SslCredentialsOptions o;
  o.pem_root_certs = p->client_ca;
  o.pem_private_key = p->key;
  o.pem_cert_chain = p->cert;
  return grpc::SslCredentials(o);
}

}  // namespace replayssm::service
