#include "service/tls.h"

#include <openssl/pem.h>
#include <openssl/x509.h>

#include <fstream>
#include <memory>
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

absl::Status CheckKeyMatchesCert(const std::string& cert_pem, const std::string& key_pem,
                                 const TlsOptions& tls) {
  using Bio = std::unique_ptr<BIO, decltype(&BIO_free)>;
  Bio cb(BIO_new_mem_buf(cert_pem.data(), static_cast<int>(cert_pem.size())), &BIO_free);
  Bio kb(BIO_new_mem_buf(key_pem.data(), static_cast<int>(key_pem.size())), &BIO_free);
  std::unique_ptr<X509, decltype(&X509_free)> cert(
      cb ? PEM_read_bio_X509(cb.get(), nullptr, nullptr, nullptr) : nullptr, &X509_free);
  if (cert == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--tls-cert: expected a PEM certificate first in \"", tls.cert_file, "\", got none"));
  }
  std::unique_ptr<EVP_PKEY, decltype(&EVP_PKEY_free)> key(
      // No passphrase callback of OpenSSL's: it asks on the terminal, and a server started
      // with an encrypted key and a tty (docker run -it) hung there (an outside review).
      kb ? PEM_read_bio_PrivateKey(
               kb.get(), nullptr, [](char*, int, int, void*) -> int { return 0; }, nullptr)
         : nullptr,
      &EVP_PKEY_free);
  if (key == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--tls-key: expected an unencrypted PEM private key in \"", tls.key_file, "\", got none"));
  }
  if (X509_check_private_key(cert.get(), key.get()) != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--tls-key: expected the private key of --tls-cert's certificate, got another (\"",
        tls.key_file, "\" does not match \"", tls.cert_file, "\")"));
  }
  return absl::OkStatus();
}

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
  // The pair must match: gRPC's own refusal said "--grpc-address ...: cannot listen" after
  // three lines of its log (an outside review).
  if (absl::Status m = CheckKeyMatchesCert(p.cert, p.key, tls); !m.ok()) return m;
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
