// TLS and mTLS on the gRPC port, against real server processes (docs/operations.md, "Security
// and resource bounds"): a TLS client is served, a plaintext one is not; with a client CA a
// client without a certificate (or with one another CA signed) is refused; two servers move
// a slot over mTLS (bad TLS flags: command_line_test.cc).
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/grpcpp.h"
#include "replayssm/client/client.h"
#include "replayssm/v1/transfer.grpc.pb.h"
#include "server_process.h"

namespace replayssm::testing {
namespace {

// A CA, a server certificate for 127.0.0.1 and localhost, a client certificate, and a second
// CA with its own client certificate, made by the openssl command in a temporary directory.
class Pki {
 public:
  Pki() {
    char tmpl[] = "/tmp/replayssm-tls-XXXXXX";
    dir_ = mkdtemp(tmpl);
    std::ofstream(dir_ + "/san.ext") << "subjectAltName=IP:127.0.0.1,DNS:localhost\n";
    ok_ = Ca("ca") && Leaf("server", "ca", true) && Leaf("client", "ca", false) && Ca("other") &&
          Leaf("stranger", "other", false);
  }
  ~Pki() { std::system(("rm -rf " + dir_).c_str()); }
  bool ok() const { return ok_; }
  std::string Path(const std::string& name) const { return dir_ + "/" + name; }

 private:
  bool Run(const std::string& cmd) {
    return std::system(("cd " + dir_ + " && " + cmd + " >/dev/null 2>&1").c_str()) == 0;
  }
  static std::string Key() { return "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes"; }
  bool Ca(const std::string& n) {
    return Run(absl::StrCat("openssl req -x509 ", Key(), " -keyout ", n, ".key -out ", n,
                            ".pem -days 2 -subj /CN=", n, "-ca"));
  }
  bool Leaf(const std::string& n, const std::string& ca, bool san) {
    return Run(absl::StrCat("openssl req ", Key(), " -keyout ", n, ".key -out ", n,
                            ".csr -subj /CN=", n)) &&
           Run(absl::StrCat("openssl x509 -req -in ", n, ".csr -CA ", ca, ".pem -CAkey ", ca,
                            ".key -CAcreateserial -days 2 -out ", n, ".pem",
                            san ? " -extfile san.ext" : ""));
  }
  std::string dir_;
  bool ok_ = false;
};

std::unique_ptr<client::Client> Connect(const std::string& address,
                                        const client::ChannelSecurity& security) {
  auto creds = client::ChannelCredentialsFor(security);
  EXPECT_TRUE(creds.ok()) << creds.status();
  return client::Client::Connect(address, int64_t{64} << 20, creds.ok() ? *creds : nullptr);
}

class TlsTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(pki_.ok()) << "openssl could not make the test PKI"; }
  std::vector<std::string> ServerTls(bool mtls) const {
    std::vector<std::string> f = {"--tls-cert=" + pki_.Path("server.pem"),
                                  "--tls-key=" + pki_.Path("server.key")};
    if (mtls) f.push_back("--tls-client-ca=" + pki_.Path("ca.pem"));
    return f;
  }
  // --peer-token with the cluster's peer token (a file of the test PKI's directory).
  std::string PeerToken() const {
    const std::string path = pki_.Path("peer-token");
    std::ofstream(path) << kPeerToken << "\n";
    return "--peer-token=" + path;
  }
  static constexpr char kPeerToken[] = "peer-token-0123456789abcdef";
  client::ChannelSecurity ClientTls(const std::string& who = "client") const {
    return {pki_.Path("ca.pem"), who.empty() ? "" : pki_.Path(who + ".pem"),
            who.empty() ? "" : pki_.Path(who + ".key")};
  }
  Pki pki_;
};

TEST_F(TlsTest, ATlsServerServesTlsClientsAndNotPlaintextOnes) {
  auto server = ServerProcess::Start(ServerTls(false));
  ASSERT_TRUE(server.ok()) << server.status();
  auto tls = Connect((*server)->grpc_address(), ClientTls(""));
  auto info = tls->Info();
  EXPECT_TRUE(info.ok()) << info.status();
  auto plain = client::Client::Connect((*server)->grpc_address());
  plain->set_timeout(absl::Seconds(3));
  EXPECT_FALSE(plain->Info().ok());
  // A client that does not trust the server's CA is refused too.
  auto distrust = Connect((*server)->grpc_address(), {pki_.Path("other.pem"), "", ""});
  distrust->set_timeout(absl::Seconds(3));
  EXPECT_FALSE(distrust->Info().ok());
}

TEST_F(TlsTest, WithAClientCaOnlyClientsItSignedAreServed) {
  auto server = ServerProcess::Start(ServerTls(true));
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_TRUE(Connect((*server)->grpc_address(), ClientTls())->Info().ok());
  for (const std::string& who : {std::string(), std::string("stranger")}) {
    auto c = Connect((*server)->grpc_address(), ClientTls(who));
    c->set_timeout(absl::Seconds(3));
    EXPECT_FALSE(c->Info().ok()) << "client certificate: " << (who.empty() ? "none" : who);
  }
}

TEST_F(TlsTest, TwoServersMoveASlotOverMtls) {
  std::vector<std::string> flags = ServerTls(true);
  flags.push_back(PeerToken());
  auto a = ServerProcess::Start(flags);
  auto b = ServerProcess::Start(flags);
  ASSERT_TRUE(a.ok() && b.ok());
  auto ca = Connect((*a)->grpc_address(), ClientTls());
  auto slot = ca->Allocate();
  ASSERT_TRUE(slot.ok()) << slot.status();
  // The server dials its peer with its own certificate, verified against the client CA.
  auto moved = ca->TransferSlot(slot->slot(), (*b)->grpc_address(), /*keep_source=*/false);
  ASSERT_TRUE(moved.ok()) << moved.status();
  auto cb = Connect((*b)->grpc_address(), ClientTls());
  EXPECT_TRUE(cb->GetSlot(moved->remote_slot()).ok());
  // A peer that does not trust this server's certificate refuses the transfer: nothing moves.
  auto c = ServerProcess::Start({"--tls-cert=" + pki_.Path("server.pem"),
                                 "--tls-key=" + pki_.Path("server.key"),
                                 "--tls-client-ca=" + pki_.Path("other.pem"), PeerToken()});
  ASSERT_TRUE(c.ok());
  auto s2 = ca->Allocate();
  ASSERT_TRUE(s2.ok());
  auto refused = ca->TransferSlot(s2->slot(), (*c)->grpc_address(), false);
  EXPECT_FALSE(refused.ok());
  EXPECT_TRUE(ca->GetSlot(s2->slot()).ok()) << "the source must stay";
}

// Issue 31 §3: under mTLS any certificate the cluster CA signed used to act as a peer
// (ReserveTransfer creates a slot in any named tenant). A client's certificate is no peer
// credential: peer calls need the peer token, and without --peer-token a server that
// authenticates its clients takes no incoming transfers.
TEST_F(TlsTest, AClientCertificateIsNoPeerCredential) {
  std::vector<std::string> flags = ServerTls(true);
  flags.push_back(PeerToken());
  auto b = ServerProcess::Start(flags);
  auto no_peer_token = ServerProcess::Start(ServerTls(true));
  ASSERT_TRUE(b.ok() && no_peer_token.ok());
  auto creds = client::ChannelCredentialsFor(ClientTls());
  ASSERT_TRUE(creds.ok()) << creds.status();
  for (const auto* server : {b->get(), no_peer_token->get()}) {
    auto stub = v1::SlotTransfer::NewStub(grpc::CreateChannel(server->grpc_address(), *creds));
    v1::ReserveTransferRequest req;
    req.set_transfer_id("from-a-client");
    req.set_seq_len(0);
    req.set_budget_ms(10000);
    v1::ReserveTransferResponse resp;
    grpc::ClientContext c;
    const grpc::Status st = stub->ReserveTransfer(&c, req, &resp);
    EXPECT_EQ(st.error_code(), server == b->get() ? grpc::StatusCode::UNAUTHENTICATED
                                                  : grpc::StatusCode::PERMISSION_DENIED)
        << st.error_message();
  }
  EXPECT_NE((*no_peer_token)->Log().find("warning: incoming slot transfers are refused"),
            std::string::npos)
      << (*no_peer_token)->Log();
  // Servers that share the peer token move slots; one without it refuses them.
  auto a = ServerProcess::Start(flags);
  ASSERT_TRUE(a.ok());
  auto ca = Connect((*a)->grpc_address(), ClientTls());
  auto s = ca->Allocate();
  ASSERT_TRUE(s.ok()) << s.status();
  auto refused = ca->TransferSlot(s->slot(), (*no_peer_token)->grpc_address(), false);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kPermissionDenied) << refused.status();
  EXPECT_NE(refused.status().message().find("--peer-token"), std::string::npos)
      << refused.status();
  EXPECT_TRUE(ca->GetSlot(s->slot()).ok()) << "the source stays";
  auto moved = ca->TransferSlot(s->slot(), (*b)->grpc_address(), false);
  EXPECT_TRUE(moved.ok()) << moved.status();
}

// The hardened deployment end to end: mTLS on every port and dial, tokens for tenants.
TEST_F(TlsTest, TokensOverMtlsNameTenantsEndToEnd) {
  const std::string tokens = pki_.Path("tokens");
  std::ofstream(tokens) << "alice alice-token-0123456789abcdef\nbob bob-token-0123456789abcdef\n";
  std::vector<std::string> flags = ServerTls(true);
  flags.push_back("--auth-tokens=" + tokens);
  flags.push_back(PeerToken());
  auto a = ServerProcess::Start(flags);
  auto b = ServerProcess::Start(flags);
  ASSERT_TRUE(a.ok() && b.ok());
  auto anonymous = Connect((*a)->grpc_address(), ClientTls());  // a certificate, no token
  EXPECT_EQ(anonymous->Allocate().status().code(), absl::StatusCode::kUnauthenticated);
  auto alice = Connect((*a)->grpc_address(), ClientTls());
  alice->set_token("alice-token-0123456789abcdef");
  auto slot = alice->Allocate();
  ASSERT_TRUE(slot.ok()) << slot.status();
  auto moved = alice->TransferSlot(slot->slot(), (*b)->grpc_address(), /*keep_source=*/false);
  ASSERT_TRUE(moved.ok()) << moved.status();
  auto alice_b = Connect((*b)->grpc_address(), ClientTls());
  alice_b->set_token("alice-token-0123456789abcdef");
  EXPECT_TRUE(alice_b->GetSlot(moved->remote_slot()).ok());
  auto bob_b = Connect((*b)->grpc_address(), ClientTls());
  bob_b->set_token("bob-token-0123456789abcdef");
  EXPECT_EQ(bob_b->GetSlot(moved->remote_slot()).status().code(), absl::StatusCode::kNotFound);
}

// A certificate with another pair's key (or the two swapped) stopped the server with "--grpc-
// address ...: cannot listen" after three lines of gRPC's log: the TLS flags are named now.
TEST_F(TlsTest, AKeyThatIsNotTheCertificatesIsRefusedNamingTheFlag) {
  // An encrypted key: refused at once, never a passphrase asked on the terminal (a server
  // started with a tty hung there).
  ASSERT_EQ(std::system(("openssl pkey -in " + pki_.Path("server.key") + " -aes256 -passout " +
                         "pass:secret -out " + pki_.Path("encrypted.key") + " 2>/dev/null")
                            .c_str()),
            0);
  for (const auto& [cert, key] :
       std::vector<std::pair<std::string, std::string>>{{"server.pem", "client.key"},
                                                        {"server.key", "server.pem"},
                                                        {"server.pem", "encrypted.key"}}) {
    const char* bin = std::getenv("REPLAYSSM_SERVER_BINARY");
    const std::string cmd = absl::StrCat(
        bin != nullptr ? bin : REPLAYSSM_SERVER_BINARY,
        " --device=cpu --grpc-address=127.0.0.1:0 --metrics-address= --tls-cert=", pki_.Path(cert),
        " --tls-key=", pki_.Path(key), " 2>&1");
    FILE* p = popen(cmd.c_str(), "r");
    ASSERT_NE(p, nullptr);
    std::string output;
    char buf[4096];
    for (size_t n; (n = std::fread(buf, 1, sizeof(buf), p)) > 0;) output.append(buf, n);
    const int status = pclose(p);
    EXPECT_EQ(WEXITSTATUS(status), 1) << output;
    EXPECT_TRUE(
        absl::StrContains(output, cert != "server.pem"  ? "--tls-cert: expected a PEM certificate"
                                  : key == "client.key" ? "--tls-key: expected the private key of "
                                                          "--tls-cert's certificate, got another"
                                                        : "--tls-key: expected an unencrypted PEM "
                                                          "private key"))
        << output;
    EXPECT_FALSE(absl::StrContains(output, "cannot listen")) << output;
  }
}

TEST(PeerAllowListTest, OnlyAllowedPeersAreDialled) {
  auto b = ServerProcess::Start({});
  ASSERT_TRUE(b.ok()) << b.status();
  auto a = ServerProcess::Start({"--transfer-peers=" + (*b)->grpc_address()});
  ASSERT_TRUE(a.ok()) << a.status();
  auto c = client::Client::Connect((*a)->grpc_address());
  auto s = c->Allocate();
  ASSERT_TRUE(s.ok());
  // Not on the list (the same server under another name counts as another peer).
  auto refused = c->TransferSlot(s->slot(), "127.0.0.1:1", /*keep_source=*/false);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kPermissionDenied) << refused.status();
  EXPECT_NE(refused.status().message().find("peer_address"), std::string::npos);
  EXPECT_TRUE(c->GetSlot(s->slot()).ok());
  auto moved = c->TransferSlot(s->slot(), (*b)->grpc_address(), false);
  EXPECT_TRUE(moved.ok()) << moved.status();
}

// Issue 31 §5: UCX listened on every interface while gRPC was on loopback (the default). It
// now follows the gRPC address's interface: a default server listens on loopback only.
TEST(TransferInterfaceTest, ADefaultServerListensOnLoopbackOnly) {
  auto server = ServerProcess::Start({});
  ASSERT_TRUE(server.ok()) << server.status();
  auto listening = (*server)->ListeningAddresses();
  ASSERT_TRUE(listening.ok()) << listening.status();
  EXPECT_GE(listening->size(), 2u) << "gRPC and /metrics at least";
  for (const std::string& a : *listening) {
    EXPECT_TRUE(absl::StartsWith(a, "127.") || absl::StartsWith(a, "[::1]:") ||
                absl::StartsWith(a, "[::ffff:127."))
        << a << " is not a loopback address";
  }
}

// Issue 31 §5: settings that run but expose more than they seem to are named at start.
TEST_F(TlsTest, UnsafeSecuritySettingsAreWarnedAboutAtStart) {
  const std::string tokens = pki_.Path("tokens");
  std::ofstream(tokens) << "alice alice-token-0123456789abcdef\n";
  auto plain = ServerProcess::Start({"--auth-tokens=" + tokens});
  auto no_client_ca = ServerProcess::Start(ServerTls(false));
  std::vector<std::string> hardened = ServerTls(true);
  hardened.push_back("--auth-tokens=" + tokens);
  hardened.push_back(PeerToken());
  auto safe = ServerProcess::Start(hardened);
  ASSERT_TRUE(plain.ok() && no_client_ca.ok() && safe.ok());
  EXPECT_NE((*plain)->Log().find("warning: --auth-tokens without TLS"), std::string::npos)
      << (*plain)->Log();
  EXPECT_NE((*no_client_ca)->Log().find("warning: TLS without client certificates"),
            std::string::npos)
      << (*no_client_ca)->Log();
  const std::string log = (*safe)->Log();
  EXPECT_EQ(log.find("without TLS"), std::string::npos) << log;
  EXPECT_EQ(log.find("without client certificates"), std::string::npos) << log;
}

TEST(TransferInterfaceTest, ServersBoundToLoopbackStillTransfer) {
  auto b = ServerProcess::Start({"--transfer-interface=lo"});
  auto a = ServerProcess::Start({"--transfer-interface=lo"});
  ASSERT_TRUE(a.ok() && b.ok());
  auto c = client::Client::Connect((*a)->grpc_address());
  auto s = c->Allocate();
  ASSERT_TRUE(s.ok());
  auto moved = c->TransferSlot(s->slot(), (*b)->grpc_address(), false);
  EXPECT_TRUE(moved.ok()) << moved.status();
}

}  // namespace
}  // namespace replayssm::testing
