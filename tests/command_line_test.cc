// The command lines of every binary: unknown or misplaced arguments are errors that name the
// argument (exit 2, nothing done), and what a tool cannot measure it says instead of printing
// a figure.
#include <signal.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "server_process.h"

namespace replayssm::testing {
namespace {

struct Outcome {
  int exit_code = -1;
  std::string output;  // stdout and stderr together
};

// Runs `binary` with `args`, `env` ("NAME=VALUE") added to the environment; with `sig`, sends
// it that signal `after` the process started.
Outcome RunBinary(const std::string& binary, std::vector<std::string> args,
                  const std::vector<std::string>& env = {}, int sig = 0,
                  absl::Duration after = absl::ZeroDuration()) {
  int out[2];
  if (pipe(out) != 0) return {};
  args.insert(args.begin(), binary);
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  const pid_t pid = fork();
  if (pid == 0) {
    for (const std::string& e : env) putenv(const_cast<char*>(e.c_str()));
    dup2(out[1], 1);
    dup2(out[1], 2);
    close(out[0]);
    execv(argv[0], argv.data());
    _exit(127);
  }
  close(out[1]);
  if (sig != 0) {
    absl::SleepFor(after);
    kill(pid, sig);
  }
  Outcome o;
  char buf[4096];
  for (ssize_t n; (n = read(out[0], buf, sizeof(buf))) > 0;) o.output.append(buf, n);
  close(out[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  o.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return o;
}

const std::vector<std::string>& Binaries() {
  static const std::vector<std::string> kBinaries = {
      REPLAYSSM_SERVER_BINARY,        REPLAYSSM_CLI_BINARY,
      REPLAYSSM_BENCH_CACHE_BINARY,   REPLAYSSM_BENCH_FORWARDS_BINARY,
      REPLAYSSM_BENCH_SERVICE_BINARY, REPLAYSSM_BENCH_TRANSFER_BINARY,
      REPLAYSSM_BENCH_HOST_TIER_BINARY};
  return kBinaries;
}

// The CLI's arguments need a command before them.
std::vector<std::string> WithCommand(const std::string& binary, std::vector<std::string> args) {
  if (binary == REPLAYSSM_CLI_BINARY) args.insert(args.begin(), "info");
  return args;
}

void ExpectRefused(const std::string& binary, const std::vector<std::string>& args,
                   const std::string& message) {
  const Outcome o = RunBinary(binary, args);
  std::string line = binary;
  for (const std::string& a : args) line += " " + a;
  EXPECT_EQ(o.exit_code, 2) << line << "\n" << o.output;
  EXPECT_TRUE(absl::StrContains(o.output, message)) << line << "\nexpected: " << message << "\n"
                                                    << o.output;
}

TEST(CommandLine, EveryBinaryRefusesAnUnknownFlagNamingIt) {
  for (const std::string& b : Binaries()) {
    ExpectRefused(b, WithCommand(b, {"--no-such-flag=1"}), "--no-such-flag");
  }
}

TEST(CommandLine, EveryBinaryRefusesAStrayArgumentNamingIt) {
  for (const std::string& b : Binaries()) {
    ExpectRefused(b, WithCommand(b, {"stray"}), "'stray'");
  }
}

TEST(CommandLine, EveryBinaryRefusesAFlagWithoutItsValue) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {REPLAYSSM_SERVER_BINARY, "--model"},       {REPLAYSSM_CLI_BINARY, "--address"},
      {REPLAYSSM_BENCH_CACHE_BINARY, "--json"},   {REPLAYSSM_BENCH_FORWARDS_BINARY, "--rounds"},
      {REPLAYSSM_BENCH_SERVICE_BINARY, "--json"}, {REPLAYSSM_BENCH_TRANSFER_BINARY, "--json"}};
  for (const auto& [binary, flag] : cases) {
    ExpectRefused(binary, WithCommand(binary, {flag}), flag + ": missing value");
    // Nor does it take the next flag for its value.
    ExpectRefused(binary, WithCommand(binary, {flag, "--help"}), flag + ": missing value");
  }
}

TEST(CommandLine, BenchesRefuseMalformedAndOutOfRangeValuesNamingTheFlag) {
  ExpectRefused(REPLAYSSM_BENCH_CACHE_BINARY, {"--backend=gpu"},
                "--backend: expected one of cuda, cpu, got 'gpu'");
  ExpectRefused(REPLAYSSM_BENCH_CACHE_BINARY, {"--steps", "ten"}, "--steps: expected an integer");
  ExpectRefused(REPLAYSSM_BENCH_CACHE_BINARY, {"--batch=1,x"},
                "--batch: expected an integer, comma-separated, got '1,x'");
  ExpectRefused(REPLAYSSM_BENCH_CACHE_BINARY, {"--io=disk"},
                "--io: expected one of host, device, comma-separated, got 'disk'");
  ExpectRefused(REPLAYSSM_BENCH_CACHE_BINARY, {"--model=tiny"}, "--model: expected one of");
  ExpectRefused(REPLAYSSM_BENCH_FORWARDS_BINARY, {"--rounds=0"},
                "--rounds: expected 1..1048576, got '0'");
  ExpectRefused(REPLAYSSM_BENCH_FORWARDS_BINARY, {"--tokens=1,x"},
                "--tokens: expected an integer, comma-separated, got '1,x'");
  ExpectRefused(REPLAYSSM_BENCH_FORWARDS_BINARY, {"--backend=gpu"},
                "--backend: expected one of cuda, cpu, got 'gpu'");
  ExpectRefused(REPLAYSSM_BENCH_HOST_TIER_BINARY, {"--gpu-slots=2"},
                "--gpu-slots: expected 4..1048576, got '2'");
  ExpectRefused(REPLAYSSM_BENCH_HOST_TIER_BINARY, {"--sessions=many"},
                "--sessions: expected an integer");
  ExpectRefused(REPLAYSSM_BENCH_SERVICE_BINARY, {"--seconds=0"}, "--seconds: expected seconds > 0");
  ExpectRefused(REPLAYSSM_BENCH_SERVICE_BINARY, {"--unary=yes"}, "--unary takes no value");
  ExpectRefused(REPLAYSSM_BENCH_TRANSFER_BINARY, {"--slots=0"},
                "--slots: expected 1..65536, got '0'");
  ExpectRefused(REPLAYSSM_BENCH_TRANSFER_BINARY, {"--lanes", "17"},
                "--lanes: expected 1..16, got '17'");
  ExpectRefused(REPLAYSSM_BENCH_TRANSFER_BINARY, {"--state-dtype=f16"},
                "--state-dtype: expected one of f32, bf16, got 'f16'");
  ExpectRefused(REPLAYSSM_BENCH_TRANSFER_BINARY, {"--put-lanes=2"}, "unknown flag --put-lanes");
}

TEST(CommandLine, CliRefusesMisplacedExtraAndMalformedArguments) {
  const std::string cli = REPLAYSSM_CLI_BINARY;
  ExpectRefused(cli, {}, "missing command");
  ExpectRefused(cli, {"frobnicate"}, "unknown command 'frobnicate'");
  ExpectRefused(cli, {"--keep", "transfer", "1", "h:1"},
                "unknown option --keep before the command (only --address, --tls-* and "
                "--token-file go there)");
  ExpectRefused(cli, {"demo", "--keep"}, "demo: unknown option --keep");
  ExpectRefused(cli, {"--tls-cert", "/nonexistent.pem", "info"},
                "--tls-key: expected the private key of --tls-cert, got none");
  ExpectRefused(cli, {"info", "--tls-ca=/nonexistent.pem"},
                "--tls-ca: expected a readable PEM file");
  ExpectRefused(cli, {"demo", "--requests"}, "--requests: missing value");
  ExpectRefused(cli, {"demo", "--requests=0"}, "--requests: expected an integer in 1..");
  ExpectRefused(cli, {"free"}, "free: expected SLOT, got 0 arguments");
  ExpectRefused(cli, {"free", "1", "2"}, "free: unexpected argument '2'");
  ExpectRefused(cli, {"transfer", "1"}, "transfer: expected SLOT PEER, got 1 argument");
  ExpectRefused(cli, {"free", "one"}, "SLOT: expected a slot handle (a number), got 'one'");
  ExpectRefused(cli, {"alloc", "1", "x"}, "alloc: expected token ids (integers), got 'x'");
  ExpectRefused(cli, {"transfer", "1", "h:1", "--keep=yes"}, "--keep takes no value");
  ExpectRefused(cli, {"bench", "--concurrency=0"}, "--concurrency: expected an integer in 1..");
  ExpectRefused(cli, {"bench", "--seconds=-1"}, "--seconds: expected seconds > 0, got '-1'");
  ExpectRefused(cli, {"health", "--address="}, "--address: expected a value, got an empty one");
  // An empty value is a mistake, never "off" (`--tls-ca "$CA"` with CA unset would connect in
  // plaintext and send the token in the clear), and a second use would silently win.
  for (const char* empty : {"--tls-ca=", "--tls-cert=", "--tls-key=", "--token-file="}) {
    ExpectRefused(cli, {empty, "info"},
                  std::string(empty, strlen(empty) - 1) + ": expected a value, got an empty one");
  }
  ExpectRefused(cli, {"demo", "--disaggregated="},
                "--disaggregated: expected a value, got an empty one");
  ExpectRefused(cli, {"demo", "--requests", "2", "--requests", "3"}, "--requests: given twice");
  ExpectRefused(cli, {"--address=h:1", "info", "--address=h:2"}, "--address: given twice");
  ExpectRefused(cli, {"transfer", "1", "h:1", "--keep", "--keep"}, "--keep: given twice");
}

// A bench or demo that fails leaves no slot behind on the server: live slots stay until freed.
TEST(CommandLine, AFailedBenchOrDemoFreesEverySlotItTook) {
  auto small = ServerProcess::Start({"--memory-budget=1M"});
  ASSERT_TRUE(small.ok()) << small.status();
  const std::string address = "--address=" + (*small)->grpc_address();
  const Outcome bench = RunBinary(
      REPLAYSSM_CLI_BINARY, {address, "bench", "--concurrency=2", "--batch=4096", "--seconds=0.2"});
  EXPECT_EQ(bench.exit_code, 1) << bench.output;
  EXPECT_TRUE(absl::StrContains(bench.output, "RESOURCE_EXHAUSTED")) << bench.output;
  auto tp = ServerProcess::Start({"--tp-size=2"});
  ASSERT_TRUE(tp.ok()) << tp.status();
  const Outcome demo =
      RunBinary(REPLAYSSM_CLI_BINARY, {"--address=" + (*tp)->grpc_address(), "demo"});
  EXPECT_EQ(demo.exit_code, 1) << demo.output;
  EXPECT_TRUE(absl::StrContains(demo.output, "run it against a --tp-size=1 server")) << demo.output;
  // A TP decode server is refused before anything is prefilled (it failed at its first decode,
  // every request moved there).
  auto one = ServerProcess::Start({});
  ASSERT_TRUE(one.ok()) << one.status();
  const Outcome split = RunBinary(
      REPLAYSSM_CLI_BINARY,
      {"--address=" + (*one)->grpc_address(), "demo", "--disaggregated=" + (*tp)->grpc_address()});
  EXPECT_EQ(split.exit_code, 1) << split.output;
  EXPECT_TRUE(absl::StrContains(split.output, "the decode server serves 2 tensor-parallel ranks"))
      << split.output;
  EXPECT_FALSE(absl::StrContains(split.output, "moved")) << split.output;
  // A second turn whose prefix hit falls short (one snapshot kept: the later requests' evict
  // the first's) fails the demo; the slot that hit took was left live (an outside review).
  auto few = ServerProcess::Start({"--tenant-max-snapshots=1"});
  ASSERT_TRUE(few.ok()) << few.status();
  const Outcome short_hit =
      RunBinary(REPLAYSSM_CLI_BINARY, {"--address=" + (*few)->grpc_address(), "demo"});
  EXPECT_EQ(short_hit.exit_code, 1) << short_hit.output;
  EXPECT_TRUE(absl::StrContains(short_hit.output, "turn 2: prefix hit of")) << short_hit.output;
  for (ServerProcess* s : {small->get(), tp->get(), one->get(), few->get()}) {
    const Outcome stats =
        RunBinary(REPLAYSSM_CLI_BINARY, {"--address=" + s->grpc_address(), "stats"});
    EXPECT_EQ(stats.exit_code, 0) << stats.output;
    EXPECT_TRUE(absl::StrContains(stats.output, "\"slots_live\": \"0\"")) << stats.output;
  }
}

// Ctrl-C (or SIGTERM) in a demo or bench stops it at its next step and frees the slots it took;
// the server keeps a live slot until it is freed, and they used to stay (an outside review).
// Also: a bench's window opens once its workers have their slots, so an over-large batch is
// reported as the server's refusal, not as "no forward started"; and --unary opens no stream.
TEST(CommandLine, AnInterruptedDemoOrBenchFreesItsSlots) {
  auto server = ServerProcess::Start({"--max-streams=1"});
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string address = "--address=" + (*server)->grpc_address();
  const auto live = [&] {
    const Outcome stats = RunBinary(REPLAYSSM_CLI_BINARY, {address, "stats"});
    return stats.output;
  };
  const Outcome demo = RunBinary(REPLAYSSM_CLI_BINARY, {address, "demo", "--steps=100000"}, {},
                                 SIGINT, absl::Milliseconds(1500));
  EXPECT_EQ(demo.exit_code, 1) << demo.output;
  EXPECT_TRUE(absl::StrContains(demo.output, "interrupted")) << demo.output;
  EXPECT_TRUE(absl::StrContains(live(), "\"slots_live\": \"0\"")) << live();
  const Outcome bench =
      RunBinary(REPLAYSSM_CLI_BINARY, {address, "bench", "--batch=8", "--seconds=30"}, {}, SIGTERM,
                absl::Milliseconds(1500));
  EXPECT_EQ(bench.exit_code, 1) << bench.output;
  EXPECT_TRUE(absl::StrContains(bench.output, "interrupted")) << bench.output;
  EXPECT_TRUE(absl::StrContains(live(), "\"slots_live\": \"0\"")) << live();
  // 16 workers allocating 300 slots each took longer than the 0.2 s window they were timed in.
  // (A server of its own: --max-streams=1 would refuse 15 of the streams first.)
  auto roomy = ServerProcess::Start({});
  ASSERT_TRUE(roomy.ok()) << roomy.status();
  const Outcome wide =
      RunBinary(REPLAYSSM_CLI_BINARY, {"--address=" + (*roomy)->grpc_address(), "bench",
                                       "--concurrency=16", "--batch=300", "--seconds=0.2"});
  EXPECT_EQ(wide.exit_code, 1) << wide.output;
  EXPECT_TRUE(absl::StrContains(wide.output, "rows: expected 1..256 rows, got 300")) << wide.output;
  const Outcome unary = RunBinary(
      REPLAYSSM_CLI_BINARY, {address, "bench", "--concurrency=3", "--seconds=0.3", "--unary"});
  EXPECT_EQ(unary.exit_code, 0) << "no stream against --max-streams=1: " << unary.output;
  EXPECT_TRUE(absl::StrContains(live(), "\"slots_live\": \"0\"")) << live();
}

// The CLI's changing commands take --request-id, so that a script retrying one (its answer
// lost) is answered once: it had none, and each run was a new request (a second slot).
TEST(CommandLine, TheCliRetriesACallUnderItsRequestId) {
  auto server = ServerProcess::Start({});
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string address = "--address=" + (*server)->grpc_address();
  const Outcome first = RunBinary(REPLAYSSM_CLI_BINARY, {address, "alloc", "--request-id=r1"});
  const Outcome again = RunBinary(REPLAYSSM_CLI_BINARY, {address, "alloc", "--request-id=r1"});
  ASSERT_EQ(first.exit_code, 0) << first.output;
  ASSERT_EQ(again.exit_code, 0) << again.output;
  EXPECT_TRUE(absl::StrContains(first.output, "\"slot\"")) << first.output;
  EXPECT_EQ(again.output, first.output) << "the same answer: the same slot";
  const Outcome stats = RunBinary(REPLAYSSM_CLI_BINARY, {address, "stats"});
  EXPECT_TRUE(absl::StrContains(stats.output, "\"slots_live\": \"1\"")) << stats.output;
  const Outcome empty = RunBinary(REPLAYSSM_CLI_BINARY, {address, "alloc", "--request-id="});
  EXPECT_EQ(empty.exit_code, 2) << empty.output;
  EXPECT_TRUE(absl::StrContains(empty.output, "--request-id: expected a value, got an empty one"))
      << empty.output;
}

// A server on a Unix-domain socket reported its address as "unix:1" (gRPC's port for one) in
// its log line and ready file, and PullSlot's default self address with it.
TEST(CommandLine, AUnixSocketServerReportsItsOwnAddress) {
  const std::string socket =
      absl::StrCat("unix:", ::testing::TempDir(), "/replayssm-", getpid(), ".sock");
  auto server = ServerProcess::Start({"--grpc-address=" + socket});
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_EQ((*server)->grpc_address(), socket);
  const Outcome info =
      RunBinary(REPLAYSSM_CLI_BINARY, {"--address=" + (*server)->grpc_address(), "info"});
  EXPECT_EQ(info.exit_code, 0) << info.output;
  EXPECT_TRUE(absl::StrContains(info.output, "tiny-gdn")) << info.output;
}

// Cache-event flags the server cannot honour stop it at start, naming the flag.
TEST(CommandLine, ServerRefusesCacheEventFlagsItCannotHonour) {
  const std::vector<std::string> base = {"--device=cpu", "--grpc-address=127.0.0.1:0",
                                         "--metrics-address="};
  const struct {
    std::string flag, message;
  } cases[] = {
      {"--kv-events-replay-endpoint=tcp://127.0.0.1:5999",
       "--kv-events-replay-endpoint: expected it with --kv-events-endpoint"},
      {"--kv-events-endpoint=bogus", "--kv-events-endpoint bogus: cannot bind"},
      {"--cache-events-retain=0", "--cache-events-retain: expected 1..1048576, got 0"},
      {"--kv-events-endpoint=tcp://127.0.0.1:0 --kv-events-clients-file=/dev/null",
       "--kv-events-clients-file: expected it with --kv-events-curve-secret-file"},
      {"--kv-events-endpoint=tcp://127.0.0.1:0 --kv-events-curve-secret-file=/dev/null "
       "--kv-events-clients-file=/dev/null",
       "--kv-events-curve-secret-file: expected a CURVE secret key (40 Z85 characters), got 0"},
  };
  for (const auto& c : cases) {
    std::vector<std::string> args = base;
    for (absl::string_view f : absl::StrSplit(c.flag, ' ')) args.emplace_back(f);
    const Outcome o = RunBinary(REPLAYSSM_SERVER_BINARY, args);
    // 2: a flag's syntax or bound; 1: a start that failed.
    EXPECT_TRUE(o.exit_code == 1 || o.exit_code == 2) << c.flag << "\n" << o.output;
    EXPECT_TRUE(absl::StrContains(o.output, c.message)) << c.flag << "\n" << o.output;
  }
  const Outcome tenant = RunBinary(
      REPLAYSSM_SERVER_BINARY,
      {"--device=cpu", "--grpc-address=127.0.0.1:0", "--metrics-address=",
       "--kv-events-endpoint=tcp://127.0.0.1:0", "--kv-events-tenant=nobody"});
  EXPECT_EQ(tenant.exit_code, 1) << tenant.output;
  EXPECT_TRUE(absl::StrContains(tenant.output, "--kv-events-tenant: expected a tenant"))
      << tenant.output;
  // With tokens every caller is a named tenant: ZMQ on the implicit one published nothing.
  const std::string tokens = ::testing::TempDir() + "/zmq_tokens_" + std::to_string(getpid());
  {
    std::ofstream f(tokens);
    f << "alice alice-token-0123456789abcdef\n";
  }
  chmod(tokens.c_str(), 0600);
  const Outcome unnamed = RunBinary(
      REPLAYSSM_SERVER_BINARY,
      {"--device=cpu", "--grpc-address=127.0.0.1:0",
       "--metrics-address=", "--kv-events-endpoint=tcp://127.0.0.1:0", "--auth-tokens=" + tokens});
  EXPECT_EQ(unnamed.exit_code, 1) << unnamed.output;
  EXPECT_TRUE(absl::StrContains(unnamed.output,
                                "--kv-events-tenant: expected a tenant of the --auth-tokens file "
                                "with --kv-events-endpoint"))
      << unnamed.output;
  // A tenant's bound without tokens (one tenant) was taken and never applied.
  const Outcome bound = RunBinary(
      REPLAYSSM_SERVER_BINARY,
      {"--device=cpu", "--grpc-address=127.0.0.1:0", "--metrics-address=", "--tenant-max-slots=3"});
  EXPECT_EQ(bound.exit_code, 2) << bound.output;
  EXPECT_TRUE(absl::StrContains(bound.output, "--tenant-max-slots: expected it with --auth-tokens"))
      << bound.output;
  std::remove(tokens.c_str());
  // Without the publisher too (it was ignored: the server started with a name it never knew);
  // a usage error now, naming the flag it needs.
  const Outcome no_zmq =
      RunBinary(REPLAYSSM_SERVER_BINARY, {"--device=cpu", "--grpc-address=127.0.0.1:0",
                                          "--metrics-address=", "--kv-events-tenant=nobody"});
  EXPECT_EQ(no_zmq.exit_code, 2) << no_zmq.output;
  EXPECT_TRUE(
      absl::StrContains(no_zmq.output, "--kv-events-tenant: expected it with --kv-events-endpoint"))
      << no_zmq.output;
}

TEST(CommandLine, CliSendsTheTokenOfItsTokenFileOrEnvironment) {
  const std::string dir = ::testing::TempDir();
  std::ofstream(dir + "/cli-tokens") << "alice alice-token-0123456789abcdef\n";
  std::ofstream(dir + "/cli-token") << "alice-token-0123456789abcdef\n";
  auto server = ServerProcess::Start({"--auth-tokens=" + dir + "/cli-tokens"});
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string address = "--address=" + (*server)->grpc_address();
  const Outcome none = RunBinary(REPLAYSSM_CLI_BINARY, {address, "alloc"});
  EXPECT_EQ(none.exit_code, 1) << none.output;
  EXPECT_TRUE(absl::StrContains(none.output, "UNAUTHENTICATED")) << none.output;
  for (const char* command : {"alloc", "stats"}) {
    const Outcome file =
        RunBinary(REPLAYSSM_CLI_BINARY, {address, "--token-file", dir + "/cli-token", command});
    EXPECT_EQ(file.exit_code, 0) << file.output;
  }
  const Outcome env = RunBinary(REPLAYSSM_CLI_BINARY, {address, "alloc"},
                                {"REPLAYSSM_TOKEN=alice-token-0123456789abcdef"});
  EXPECT_EQ(env.exit_code, 0) << env.output;
  const Outcome bench =
      RunBinary(REPLAYSSM_CLI_BINARY, {address, "--token-file=" + dir + "/cli-token", "bench",
                                       "--seconds=0.3"});
  EXPECT_EQ(bench.exit_code, 0) << bench.output;
  // A token must travel as a header value: gRPC aborted the CLI (exit 134) on a newline in
  // one (an outside review). Surrounding whitespace is stripped from the environment's too.
  const Outcome padded = RunBinary(REPLAYSSM_CLI_BINARY, {address, "stats"},
                                   {"REPLAYSSM_TOKEN=alice-token-0123456789abcdef\n"});
  EXPECT_EQ(padded.exit_code, 0) << padded.output;
  const Outcome broken =
      RunBinary(REPLAYSSM_CLI_BINARY, {address, "stats"}, {"REPLAYSSM_TOKEN=alice\ntoken"});
  EXPECT_EQ(broken.exit_code, 2) << broken.output;
  EXPECT_TRUE(absl::StrContains(
      broken.output,
      "REPLAYSSM_TOKEN: expected a token of printable ASCII without spaces, got byte 0x0a"))
      << broken.output;
  std::ofstream(dir + "/cli-token-2") << "alice\ntoken\n";
  const Outcome two_lines =
      RunBinary(REPLAYSSM_CLI_BINARY, {address, "--token-file", dir + "/cli-token-2", "stats"});
  EXPECT_EQ(two_lines.exit_code, 2) << two_lines.output;
  EXPECT_TRUE(absl::StrContains(two_lines.output, "--token-file: expected a token of printable"))
      << two_lines.output;
  const Outcome missing =
      RunBinary(REPLAYSSM_CLI_BINARY, {address, "--token-file=/nonexistent/token", "alloc"});
  EXPECT_EQ(missing.exit_code, 2) << missing.output;
  EXPECT_TRUE(absl::StrContains(missing.output, "--token-file: expected a readable file"))
      << missing.output;
}

TEST(CommandLine, EveryBinaryPrintsItsUsageOnHelpAndExitsZero) {
  for (const std::string& b : Binaries()) {
    const Outcome o = RunBinary(b, {"--help"});
    EXPECT_EQ(o.exit_code, 0) << b << "\n" << o.output;
    EXPECT_TRUE(absl::StrContains(o.output, "usage: ")) << b << "\n" << o.output;
  }
}

TEST(CommandLine, CliAddressAfterTheCommandIsTheAddressDialed) {
  auto server = ServerProcess::Start({});
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string here = (*server)->grpc_address();
  const std::string nowhere = "127.0.0.1:1";  // nothing listens on port 1
  // The default address reaches the server; the flag after the command must win over it.
  const Outcome demo = RunBinary(REPLAYSSM_CLI_BINARY, {"demo", "--address=" + nowhere},
                                 {"REPLAYSSM_ADDRESS=" + here});
  EXPECT_EQ(demo.exit_code, 1) << demo.output;
  EXPECT_TRUE(absl::StrContains(demo.output, "UNAVAILABLE")) << demo.output;
  EXPECT_FALSE(absl::StrContains(demo.output, "demo: OK")) << demo.output;
  // And the other way round, in both spellings.
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"health", "--address=" + here},
        std::vector<std::string>{"health", "--address", here}}) {
    const Outcome health = RunBinary(REPLAYSSM_CLI_BINARY, args, {"REPLAYSSM_ADDRESS=" + nowhere});
    EXPECT_EQ(health.exit_code, 0) << health.output;
    EXPECT_TRUE(absl::StrContains(health.output, "SERVING")) << health.output;
  }
}

TEST(CommandLine, CacheBenchGivesNoVerdictFromTooFewRoundsForQuartiles) {
  const Outcome o =
      RunBinary(REPLAYSSM_BENCH_CACHE_BINARY, {"--backend=cpu", "--model=tiny-gdn", "--batch=64",
                                               "--io=device", "--steps=1", "--rounds=2"});
  ASSERT_EQ(o.exit_code, 0) << o.output;
  EXPECT_TRUE(absl::StrContains(o.output, "n/a (2 rounds, fewer than 5)")) << o.output;
  EXPECT_TRUE(absl::StrContains(o.output, "no verdict: 2 rounds per point")) << o.output;
  EXPECT_FALSE(absl::StrContains(o.output, "DEMONSTRATED")) << o.output;
}

// A directory for a PATH: empty, or holding a fake ucx_perftest that prints `output`.
std::string PathWith(const std::string& name, const std::string* fake_output) {
  const std::string dir = ::testing::TempDir() + "/" + name;
  mkdir(dir.c_str(), 0755);
  if (fake_output != nullptr) {
    const std::string fake = dir + "/ucx_perftest";
    std::ofstream(fake) << "#!/bin/sh\necho '" << *fake_output << "'\n";
    chmod(fake.c_str(), 0755);
  }
  return dir;
}

void ExpectNoReferenceAndNoVerdict(const std::string& path_dir, const std::string& reason) {
  const std::string json = path_dir + "/transfer.json";
  const Outcome o =
      RunBinary(REPLAYSSM_BENCH_TRANSFER_BINARY,
                {"--model=tiny-gdn", "--slots=1", "--json=" + json}, {"PATH=" + path_dir});
  ASSERT_EQ(o.exit_code, 0) << o.output;
  EXPECT_TRUE(absl::StrContains(o.output, "reference not measured: ")) << o.output;
  EXPECT_TRUE(absl::StrContains(o.output, reason)) << o.output;
  EXPECT_TRUE(absl::StrContains(o.output, "no verdict")) << o.output;
  EXPECT_FALSE(absl::StrContains(o.output, "-> met")) << o.output;
  EXPECT_FALSE(absl::StrContains(o.output, "NOT met")) << o.output;
  EXPECT_FALSE(absl::StrContains(o.output, "-0.00")) << o.output;
  std::ifstream in(json);
  const std::string written((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_TRUE(absl::StrContains(written, "\"perftest_put_gbs\": null")) << written;
  EXPECT_TRUE(absl::StrContains(written, "\"of_perftest_put\": null")) << written;
  EXPECT_TRUE(absl::StrContains(written, "\"perftest_error\": \"")) << written;
}

TEST(CommandLine, TransferBenchWithoutUcxPerftestSaysTheReferenceIsMissingAndGivesNoVerdict) {
  ExpectNoReferenceAndNoVerdict(PathWith("no-perftest", nullptr),
                                "cannot run ucx_perftest: No such file or directory (not on the "
                                "PATH)");
}

TEST(CommandLine, TransferBenchSaysWhenUcxPerftestPrintsNoBandwidth) {
  const std::string garbage = "ucx_perftest: unknown transport";
  ExpectNoReferenceAndNoVerdict(
      PathWith("bad-perftest", &garbage),
      "printed no \"Final:\" bandwidth (exit status 0; last line: '" + garbage + "')");
}

// A model config.json of wrong types or missing keys stops the server with exit 1 and a
// message naming the key (a string where a number belongs used to abort it with SIGABRT).
TEST(CommandLine, ServerExitsNamingTheKeyOfABadModelConfig) {
  const std::string gdn = R"("linear_num_key_heads": 2, "linear_num_value_heads": 4,
      "linear_key_head_dim": 32, "linear_value_head_dim": 32)";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"{" + gdn + R"(, "num_hidden_layers": 8, "full_attention_interval": "4"})",
       "full_attention_interval: expected an integer in 0..2147483647, got a string \"4\""},
      {"{" + gdn + "}", "num_hidden_layers: expected an integer in 1..2147483647, got nothing"},
      {"{" + gdn + R"(, "layer_types": [1, 2]})", "layer_types[0]: expected a string"},
      {R"({"linear_attn_config": "kda"})", "linear_attn_config: expected an object"},
      {R"({"linear_attn_config": {"num_heads": 2, "head_dim": 32}})",
       "linear_attn_config.kda_layers: expected a list, got nothing"},
  };
  const std::string dir = ::testing::TempDir() + "/bad-model-config";
  mkdir(dir.c_str(), 0755);
  const std::string config = dir + "/config.json";
  for (const auto& [json, message] : cases) {
    std::ofstream(config) << json;
    const Outcome o = RunBinary(
        REPLAYSSM_SERVER_BINARY,
        {"--model=" + config, "--device=cpu", "--grpc-address=127.0.0.1:0", "--metrics-address="});
    EXPECT_EQ(o.exit_code, 1) << json << "\n" << o.output;  // -1: killed by a signal
    EXPECT_TRUE(absl::StrContains(o.output, config + ": ")) << o.output;
    EXPECT_TRUE(absl::StrContains(o.output, message)) << "expected: " << message << "\n"
                                                      << o.output;
  }
}

// Each case's flags stop the CPU server with exit 1 (a start that failed) or 2 (a flag's
// syntax or bound) and a message containing the case's text.
void ExpectServerStops(const std::vector<std::pair<std::vector<std::string>, std::string>>& cases) {
  for (const auto& [flags, message] : cases) {
    std::vector<std::string> args = {"--device=cpu", "--grpc-address=127.0.0.1:0",
                                     "--metrics-address="};
    args.insert(args.end(), flags.begin(), flags.end());
    const Outcome o = RunBinary(REPLAYSSM_SERVER_BINARY, args);
    EXPECT_TRUE(o.exit_code == 1 || o.exit_code == 2) << o.output;
    EXPECT_TRUE(absl::StrContains(o.output, message)) << "expected: " << message << "\n"
                                                      << o.output;
  }
}

TEST(CommandLine, BadModelOptionsStopTheServerNamingTheFlag) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--ring-dtype=f8"}, "--ring-dtype: expected f32, bf16 or f16, got f8"},
      {{"--state-dtype=bf16", "--ring-dtype=f32"},
       "--ring-dtype f32 with a bf16 state: rssm_check_shape: shape.ring_dtype: expected a ring "
       "of the state dtype"},
      {{"--beta-rounding=yes"}, "--beta-rounding: expected act or f32, got yes"},
      {{"--device=cuda:-1"}, "--device: expected auto, cpu, cuda or cuda:N (N >= 0), got cuda:-1"},
      {{"--ring-length=1"}, "--ring-length: expected 0 (the preset's) or 2..64"},
      {{"--memory-budget=1K"}, "--memory-budget (per TP rank): expected at least one slot"},
      {{"--memory-budget=1T"},
       "--memory-budget: expected at most the memory this process may use on the CPU backend"},
      {{"--devices=3"},
       "--devices: expected 2 or more devices (one per rank of a TP group), got 1 (3); a "
       "one-GPU server takes its GPU from --device (cuda:N)"},
      {{"--devices=0,x"}, "--devices: expected device indices like 0,1,2,3, got 0,x"},
  };
  ExpectServerStops(cases);
}

// On the CPU backend the pool (--memory-budget) and the host tier are both host memory: their
// sum is bounded, not each alone (an outside review: two flags at 3/4 of the machine each
// passed, and with --host-pin-at-start the process was killed without a word).
TEST(CommandLine, HostMemoryFlagsAreBoundedTogetherOnTheCpu) {
  // Bounded by timeout(1): where the memory is unknown (or above 1T) the probe would serve.
  const Outcome probe =
      RunBinary("/usr/bin/timeout",
                {"20", REPLAYSSM_SERVER_BINARY, "--device=cpu", "--grpc-address=127.0.0.1:0",
                 "--metrics-address=", "--host-snapshot-bytes=1T"});
  const size_t at = probe.output.find(" MiB: the container's limit or MemTotal");
  ASSERT_NE(at, std::string::npos) << probe.output;
  const size_t open = probe.output.rfind('(', at);
  int64_t usable_mib = 0;
  ASSERT_TRUE(absl::SimpleAtoi(probe.output.substr(open + 1, at - open - 1), &usable_mib))
      << probe.output;
  const std::string each = absl::StrCat(usable_mib * 3 / 5, "M");
  ExpectServerStops({{{"--memory-budget=" + each, "--host-snapshot-bytes=" + each},
                      "--host-snapshot-bytes + --memory-budget: expected at most the memory "
                      "this process may use on the CPU backend"}});
}

// A ring length of 1 is out of the flag's range, so it stops the server as a bound does
// (exit 2, before anything starts); the cache used to refuse it later (exit 1).
TEST(CommandLine, ARingLengthOfOneIsABoundExit2) {
  const Outcome o = RunBinary(
      REPLAYSSM_SERVER_BINARY,
      {"--device=cpu", "--grpc-address=127.0.0.1:0", "--metrics-address=", "--ring-length=1"});
  EXPECT_EQ(o.exit_code, 2) << o.output;
  EXPECT_TRUE(absl::StrContains(o.output, "--ring-length: expected 0 (the preset's) or 2..64"))
      << o.output;
  EXPECT_TRUE(absl::StrContains(o.output, "got 1")) << o.output;
}

// A word outside a flag's few is a usage error, as a bound is (exit 2, before anything starts):
// each used to stop the start (exit 1) while --forward-graphs=yes was already exit 2.
TEST(CommandLine, AWordOutsideAFlagsWordsIsAUsageErrorExit2) {
  const std::vector<std::string> base = {"--grpc-address=127.0.0.1:0", "--metrics-address="};
  for (const auto& [flag, message] : std::vector<std::pair<std::string, std::string>>{
           {"--device=gpu", "--device: expected auto, cpu, cuda or cuda:N (N >= 0), got gpu"},
           {"--state-dtype=f8", "--state-dtype: expected f32, bf16 or f16, got f8"},
           {"--ring-dtype=f8", "--ring-dtype: expected f32, bf16 or f16, got f8"},
           {"--beta-rounding=yes", "--beta-rounding: expected act or f32, got yes"},
           {"--host-snapshot-policy=mru", "--host-snapshot-policy: expected lru or value, got mru"},
           {"--model=qwen4", "--model: expected a preset (qwen3-next-80b-a3b, "},
           {"--forward-graphs=yes", "--forward-graphs=yes: expected true or false"}}) {
    std::vector<std::string> args = base;
    if (!absl::StartsWith(flag, "--device")) args.push_back("--device=cpu");
    args.push_back(flag);
    ExpectRefused(REPLAYSSM_SERVER_BINARY, args, message);
  }
}

// A flag that means nothing without another is a usage error naming both (exit 2): the topic
// alone started a server that published nothing (bounded by timeout(1): it served).
TEST(CommandLine, AFlagWithoutTheFlagItNeedsIsAUsageErrorExit2) {
  for (const auto& [flag, message] : std::vector<std::pair<std::string, std::string>>{
           {"--kv-events-topic=vllm", "--kv-events-topic: expected it with --kv-events-endpoint"},
           {"--kv-events-tenant=alice",
            "--kv-events-tenant: expected it with --kv-events-endpoint"},
           {"--tenant-max-slots=3", "--tenant-max-slots: expected it with --auth-tokens"},
           {"--tls-key=/k.pem", "--tls-key: expected it with --tls-cert"}}) {
    const Outcome o =
        RunBinary("/usr/bin/timeout", {"20", REPLAYSSM_SERVER_BINARY, "--device=cpu",
                                       "--grpc-address=127.0.0.1:0", "--metrics-address=", flag});
    EXPECT_EQ(o.exit_code, 2) << flag << "\n" << o.output;
    EXPECT_TRUE(absl::StrContains(o.output, message)) << "expected: " << message << "\n"
                                                      << o.output;
  }
}

TEST(CommandLine, BadHostTierFlagsStopTheServerNamingTheFlag) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--host-snapshot-policy=mru"}, "--host-snapshot-policy: expected lru or value, got mru"},
      {{"--host-snapshot-bytes=1K"},
       "--host-snapshot-bytes (per TP rank): host_snapshot_bytes: expected 0 (no host tier) or "
       "at least one snapshot ("},
      {{"--host-spill-ahead=-1"}, "--host-spill-ahead: expected 0..65536, got -1"},
  };
  ExpectServerStops(cases);
}

// An outside review's start-up findings: gRPC listened on whatever a bad address made of it
// (port 99999 on 34463, none on 443), shared a port another server held (SO_REUSEPORT), pinned
// more host memory than the machine has until the OOM killer came, and found an unwritable
// ready file only once serving.
TEST(CommandLine, BadAddressesMemoryAndReadyFilesStopTheServerBeforeItServes) {
  ExpectServerStops({
      {{"--grpc-address=127.0.0.1:99999"},
       "--grpc-address: expected host:port with a port in 0..65535 (0: any free one), got "
       "\"127.0.0.1:99999\""},
      {{"--grpc-address=127.0.0.1"}, "--grpc-address: expected host:port"},
      {{"--grpc-address=127.0.0.1:-1"}, "--grpc-address: expected host:port"},
      {{"--metrics-address=127.0.0.1:x"}, "--metrics-address: expected host:port"},
      {{"--host-snapshot-bytes=1T"},
       "--host-snapshot-bytes: expected at most the memory this process may use"},
      {{"--ready-file=/nonexistent/dir/ready"}, "--ready-file /nonexistent/dir/ready: cannot"},
      {{"--ready-file=" + ::testing::TempDir()}, "cannot write it"},
  });
  auto first = ServerProcess::Start({});
  ASSERT_TRUE(first.ok()) << first.status();
  const Outcome second = RunBinary(
      REPLAYSSM_SERVER_BINARY,
      {"--device=cpu", "--metrics-address=", "--grpc-address=" + (*first)->grpc_address()});
  EXPECT_EQ(second.exit_code, 1) << second.output;
  EXPECT_TRUE(absl::StrContains(second.output, "cannot listen")) << second.output;
}

TEST(CommandLine, BadSecurityFlagsStopTheServerNamingTheFlag) {
  const std::string dir = ::testing::TempDir();
  std::ofstream(dir + "/not-a.pem") << "hello\n";
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--tls-cert=" + dir + "/x.pem"}, "--tls-cert: expected it with --tls-key"},
      {{"--tls-key=" + dir + "/x.key"}, "--tls-key: expected it with --tls-cert"},
      {{"--tls-client-ca=" + dir + "/ca.pem"}, "--tls-client-ca: expected it with --tls-cert"},
      {{"--tls-cert=/nonexistent.pem", "--tls-key=" + dir + "/x.key"},
       "--tls-cert: expected a readable PEM file"},
      {{"--tls-cert=" + dir + "/not-a.pem", "--tls-key=" + dir + "/x.key"}, "no PEM block"},
      {{"--transfer-interface=nonexistent0"}, "--transfer-interface: expected a network"},
      {{"--auth-tokens=/nonexistent/tokens"}, "--auth-tokens: expected a readable token file"},
      {{"--auth-tokens=" + dir + "/not-a.pem"}, "/not-a.pem:1: expected `tenant token`, got 1"},
      // An outside review: each of these started a server (one refusing every call, one with
      // keys it never read, one with peers it could never dial).
      {{"--auth-tokens=" + dir}, "--auth-tokens: expected a token file, got a directory"},
      {{"--auth-tokens=" + dir + "/no-tokens"},
       "--auth-tokens: expected at least one `tenant token` line"},
      {{"--kv-events-curve-secret-file=" + dir + "/x.key"},
       "--kv-events-curve-secret-file: expected it with --kv-events-endpoint"},
      {{"--transfer-peers=:"}, "expected host:port entries with a port in 1..65535, got \":\""},
      {{"--transfer-peers=a:1,host:notaport"}, "got \"host:notaport\""},
  };
  std::ofstream(dir + "/no-tokens") << "# nobody yet\n";
  ExpectServerStops(cases);
}

}  // namespace
}  // namespace replayssm::testing
