#include "service/config.h"

#include <cstdio>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "service/server.h"

namespace replayssm::service {
namespace {

absl::StatusOr<ServerFlags> Parse(std::vector<const char*> args) {
  args.insert(args.begin(), "replayssm-server");
  return ParseServerFlags(static_cast<int>(args.size()), args.data());
}

TEST(ServerFlags, DefaultsMatchTheIssue) {
  auto f = Parse({});
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->options.grpc_address, "127.0.0.1:50051");
  EXPECT_EQ(f->options.metrics_address, "127.0.0.1:9400");
  EXPECT_EQ(f->options.device, "auto");
  EXPECT_TRUE(f->options.forward_graphs);
}

TEST(ServerFlags, ForwardGraphsTakeTrueOrFalseOnly) {
  auto off = Parse({"--forward-graphs=false"});
  ASSERT_TRUE(off.ok()) << off.status();
  EXPECT_FALSE(off->options.forward_graphs);
  auto bad = Parse({"--forward-graphs=yes"});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("--forward-graphs=yes: expected true or false"),
            std::string::npos)
      << bad.status();
}

TEST(ServerFlags, BothSpellingsAndByteSuffixesParse) {
  auto f = Parse({"--grpc-address=0.0.0.0:1234", "--memory-budget", "512M", "--ring-length=16",
                  "--max-message-bytes=2GiB", "--drain-timeout=1.5"});
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->options.grpc_address, "0.0.0.0:1234");
  EXPECT_EQ(f->options.memory_budget_bytes, int64_t{512} << 20);
  EXPECT_EQ(f->options.ring_length, 16);
  EXPECT_EQ(f->options.max_message_bytes, int64_t{2} << 30);
  EXPECT_EQ(f->options.drain_timeout, absl::Milliseconds(1500));
}

TEST(ServerFlags, UnknownFlagsAndBadValuesNameTheFlag) {
  auto unknown = Parse({"--grpc_address=x"});
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(unknown.status().message().find("grpc_address"), std::string::npos);
  auto bad = Parse({"--memory-budget=lots"});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("--memory-budget"), std::string::npos);
  EXPECT_FALSE(Parse({"--model"}).ok());  // no value
  auto host = Parse({"--host-snapshot-bytes=lots"});
  EXPECT_EQ(host.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(host.status().message().find("--host-snapshot-bytes"), std::string::npos);
  auto on = Parse({"--host-snapshot-bytes=64G", "--host-snapshot-policy=value"});
  ASSERT_TRUE(on.ok()) << on.status();
  EXPECT_EQ(on->options.host_snapshot_bytes, int64_t{64} << 30);
  EXPECT_EQ(on->options.host_snapshot_policy, "value");
  EXPECT_EQ(on->options.host_spill_ahead, 4);
  EXPECT_TRUE(on->options.host_pin_at_start);
  auto ahead = Parse({"--host-spill-ahead=0"});
  ASSERT_TRUE(ahead.ok()) << ahead.status();
  EXPECT_EQ(ahead->options.host_spill_ahead, 0);
}

TEST(ServerFlags, AFlagWithoutItsValueDoesNotSwallowTheNextFlag) {
  auto f = Parse({"--grpc-address", "--model=tiny-kda"});
  EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(f.status().message().find("--grpc-address: missing value"), std::string::npos)
      << f.status();
}

TEST(ServerFlags, AnIntegerTheFieldCannotHoldIsRefusedNotTruncated) {
  auto f = Parse({"--max-batch=4294967297"});  // 2^32 + 1 would truncate to 1
  EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(f.status().message().find("--max-batch=4294967297"), std::string::npos) << f.status();
}

TEST(ServerFlags, AStrayArgumentIsRefusedNamingIt) {
  auto f = Parse({"--model=tiny-gdn", "tiny-kda"});
  EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(f.status().message().find("'tiny-kda'"), std::string::npos) << f.status();
}

// A flag's bounds live in one table (config.cc), checked by Server::Start over the options
// whether they came from flags or from code.
TEST(ServerFlags, OutOfRangeValuesAreRefusedNamingTheFlagWhereverTheyComeFrom) {
  struct Case {
    const char* arg;
    int32_t ServerOptions::*field;
    int32_t value;
    std::string message;
  };
  for (const Case& c :
       {Case{"--transfer-lanes=0", &ServerOptions::transfer_lanes, 0,
             "--transfer-lanes: expected 1..16, got 0"},
        Case{"--transfer-lanes=17", &ServerOptions::transfer_lanes, 17,
             "--transfer-lanes: expected 1..16, got 17"},
        Case{"--transfer-import-threads=0", &ServerOptions::transfer_import_threads, 0,
             "--transfer-import-threads: expected 1..32, got 0"},
        Case{"--transfer-import-threads=33", &ServerOptions::transfer_import_threads, 33,
             "--transfer-import-threads: expected 1..32, got 33"},
        Case{"--max-request-id-bytes=0", &ServerOptions::max_request_id_bytes, 0,
             "--max-request-id-bytes: expected 1..65536, got 0"},
        Case{"--host-spill-ahead=65537", &ServerOptions::host_spill_ahead, 65537,
             "--host-spill-ahead: expected 0..65536, got 65537"},
        Case{"--tp-size=0", &ServerOptions::tp_size, 0, "--tp-size: expected 1..8, got 0"},
        Case{"--tp-size=9", &ServerOptions::tp_size, 9, "--tp-size: expected 1..8, got 9"}}) {
    auto parsed = Parse({c.arg});
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    const absl::Status from_flags = CheckServerBounds(parsed->options);
    EXPECT_EQ(from_flags.code(), absl::StatusCode::kInvalidArgument) << c.arg;
    EXPECT_EQ(from_flags.message(), c.message);
    ServerOptions o;
    o.*c.field = c.value;
    EXPECT_EQ(CheckServerBounds(o).message(), c.message);
  }
  EXPECT_TRUE(CheckServerBounds(ServerOptions{}).ok());
  auto f = Parse({"--transfer-import-threads=12"});
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->options.transfer_import_threads, 12);
}

// A flag that takes one of a few words is refused like a bound (exit 2), naming the flag, its
// words and what came; before, each stopped the start (exit 1).
TEST(ServerFlags, AWordOutsideAFlagsWordsIsRefusedNamingTheWords) {
  for (const auto& [arg, message] : std::vector<std::pair<std::string, std::string>>{
           {"--device=gpu", "--device: expected auto, cpu, cuda or cuda:N (N >= 0), got gpu"},
           {"--device=cuda:-1",
            "--device: expected auto, cpu, cuda or cuda:N (N >= 0), got cuda:-1"},
           {"--state-dtype=f8", "--state-dtype: expected f32, bf16 or f16, got f8"},
           {"--ring-dtype=int8", "--ring-dtype: expected f32, bf16 or f16, got int8"},
           {"--beta-rounding=yes", "--beta-rounding: expected act or f32, got yes"},
           {"--host-snapshot-policy=mru", "--host-snapshot-policy: expected lru or value, got mru"},
           {"--model=qwen4",
            "--model: expected a preset (qwen3-next-80b-a3b, kimi-linear-48b-a3b, tiny-gdn, "
            "tiny-kda, tiny-gdn-tp) or a HF config.json, got qwen4"}}) {
    auto parsed = Parse({arg.c_str()});
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    const absl::Status s = CheckServerBounds(parsed->options);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << arg;
    EXPECT_EQ(s.message(), message);
  }
  auto words =
      Parse({"--device=cuda:1", "--state-dtype=bf16", "--ring-dtype=", "--beta-rounding=fp32",
             "--host-snapshot-policy=value", "--model=/models/qwen/config.json"});
  ASSERT_TRUE(words.ok()) << words.status();
  EXPECT_TRUE(CheckServerBounds(words->options).ok()) << CheckServerBounds(words->options);
}

// A flag that means nothing without another is refused naming both, like a bound (exit 2):
// --kv-events-topic alone was taken and never used.
TEST(ServerFlags, AFlagWithoutTheFlagItNeedsIsRefusedNamingBoth) {
  for (const auto& [args, message] : std::vector<std::pair<std::vector<const char*>, std::string>>{
           {{"--kv-events-topic=vllm"},
            "--kv-events-topic: expected it with --kv-events-endpoint (the ZMQ publisher whose "
            "topic it names), got vllm alone"},
           {{"--kv-events-replay-endpoint=tcp://127.0.0.1:5558"},
            "--kv-events-replay-endpoint: expected it with --kv-events-endpoint (the ZMQ "
            "publisher whose batches it replays), got tcp://127.0.0.1:5558 alone"},
           {{"--kv-events-tenant=alice"},
            "--kv-events-tenant: expected it with --kv-events-endpoint (the ZMQ publisher of that "
            "tenant's events), got alice alone"},
           {{"--kv-events-curve-secret-file=/k"},
            "--kv-events-curve-secret-file: expected it with --kv-events-endpoint (the ZMQ events "
            "it secures), got /k alone"},
           {{"--kv-events-endpoint=tcp://127.0.0.1:5557", "--kv-events-clients-file=/c"},
            "--kv-events-clients-file: expected it with --kv-events-curve-secret-file (CURVE needs "
            "the server's key and the routers' keys), got /c alone"},
           {{"--tenant-max-slots=3"},
            "--tenant-max-slots: expected it with --auth-tokens (without tokens there is one "
            "tenant, bounded by the server's own limits), got 3 alone"},
           {{"--tls-cert=/c.pem"},
            "--tls-cert: expected it with --tls-key (the certificate's private key), got "
            "/c.pem alone"},
           {{"--tls-key=/k.pem"},
            "--tls-key: expected it with --tls-cert (the certificate of the key), got /k.pem "
            "alone"},
           {{"--tls-client-ca=/ca.pem"},
            "--tls-client-ca: expected it with --tls-cert (mTLS is TLS with client certificates), "
            "got /ca.pem alone"}}) {
    auto parsed = Parse(args);
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    const absl::Status s = CheckServerBounds(parsed->options);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << args[0];
    EXPECT_EQ(s.message(), message);
  }
  // Its default is no mistake, and each with its partner passes.
  auto pairs = Parse({"--kv-events-topic=kv-events", "--kv-events-endpoint=tcp://127.0.0.1:5557",
                      "--kv-events-replay-endpoint=tcp://127.0.0.1:5558"});
  ASSERT_TRUE(pairs.ok()) << pairs.status();
  EXPECT_TRUE(CheckServerBounds(pairs->options).ok()) << CheckServerBounds(pairs->options);
  EXPECT_TRUE(CheckServerBounds(Parse({"--kv-events-topic=kv-events"})->options).ok());
}

// Values that parsed but could only fail later (every incoming transfer, every request) are
// refused at start, naming the flag and its range.
TEST(ServerFlags, ValuesThatWouldFailEveryCallAreRefusedAtStart) {
  for (const auto& [arg, message] : std::vector<std::pair<std::string, std::string>>{
           {"--ring-length=-3",
            "--ring-length: expected 0 (the preset's) or 2..64 (a ring holds L-1 decode records), "
            "got -3"},
           {"--ring-length=1",
            "--ring-length: expected 0 (the preset's) or 2..64 (a ring holds L-1 decode records), "
            "got 1"},
           {"--ring-length=65",
            "--ring-length: expected 0 (the preset's) or 2..64 (a ring holds L-1 decode records), "
            "got 65"},
           {"--max-batch=0", "--max-batch: expected 1..65535, got 0"},
           {"--max-batch=100000", "--max-batch: expected 1..65535, got 100000"},
           {"--max-prefill-tokens=0", "--max-prefill-tokens: expected 1..2147483647, got 0"},
           {"--max-message-bytes=0", "--max-message-bytes: expected 4096..2147483647, got 0"},
           {"--max-message-bytes=3G",
            "--max-message-bytes: expected 4096..2147483647, got 3221225472"},
           {"--dedup-bytes=0", "--dedup-bytes: expected 1..9223372036854775807, got 0"},
           {"--track-interval=-1", "--track-interval: expected 0..2147483647, got -1"},
           {"--dedup-entries=-1", "--dedup-entries: expected 1..9223372036854775807, got -1"},
           {"--max-regions=-1", "--max-regions: expected 0..2147483647, got -1"},
           {"--transfer-chunk-bytes=0", "--transfer-chunk-bytes: expected 1..1073741824, got 0"},
           {"--transfer-chunk-bytes=2G",
            "--transfer-chunk-bytes: expected 1..1073741824, got 2147483648"}}) {
    auto parsed = Parse({arg.c_str()});
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    const absl::Status s = CheckServerBounds(parsed->options);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << arg;
    EXPECT_EQ(s.message(), message);
  }
  auto edge = Parse({"--ring-length=64", "--max-batch=65535", "--max-regions=0",
                     "--transfer-chunk-bytes=4K", "--max-message-bytes=4K"});
  ASSERT_TRUE(edge.ok()) << edge.status();
  EXPECT_TRUE(CheckServerBounds(edge->options).ok());
  const std::string usage = ServerUsage();
  EXPECT_NE(
      usage.find("  --transfer-chunk-bytes  UCX put granularity of slot transfers, 1..1G [4M]\n"),
      std::string::npos)
      << usage;
}

// The usage's defaults come from a default ServerOptions: they cannot drift from it.
TEST(ServerFlags, TheUsageShowsEachDefaultAndBoundFromTheOptions) {
  const std::string usage = ServerUsage();
  for (const char* line :
       {"  --memory-budget  bytes for slots and snapshots (per TP rank), e.g. 512M, 4G [1G]\n",
        "  --transfer-lanes  sender threads putting a slot's chunks at once, 1..16 [4]\n",
        "  --drain-timeout  seconds to wait for open forwards on SIGTERM [30]\n",
        "  --forward-graphs  true | false: a planned decode forward that repeats runs as one CUDA "
        "graph [true]\n",
        "  --device  auto | cpu | cuda | cuda:N [auto]\n"}) {
    EXPECT_NE(usage.find(line), std::string::npos) << line << usage;
  }
}

TEST(ServerFlags, ConfigFileSetsFlagsAndTheCommandLineWins) {
  const std::string path = ::testing::TempDir() + "/replayssm-config-test.conf";
  {
    std::ofstream out(path);
    out << "# a comment\nmodel = tiny-kda\n  track-interval=32  # trailing\n"
           "grpc-address = 127.0.0.1:7000\n\n";
  }
  auto f = Parse({"--grpc-address=127.0.0.1:9000", "--config", path.c_str()});
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->options.model, "tiny-kda");
  EXPECT_EQ(f->options.track_interval, 32);
  EXPECT_EQ(f->options.grpc_address, "127.0.0.1:9000");
  {
    std::ofstream out(path);
    out << "no-such-flag = 1\n";
  }
  auto bad = Parse({"--config", path.c_str()});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find(":1:"), std::string::npos) << bad.status();
  std::remove(path.c_str());
}

TEST(ServerFlags, ConfigTextParsesLikeAFileAndNaNSecondsAreRefused) {
  ServerFlags flags;
  ASSERT_TRUE(ApplyConfig("max-batch = 8\nslot-ttl=2.5\n", "x.conf", {}, &flags).ok());
  EXPECT_EQ(flags.options.max_batch, 8);
  EXPECT_EQ(flags.options.slot_ttl, absl::Milliseconds(2500));
  const absl::Status nan = ApplyConfig("\nslot-ttl = nan\n", "x.conf", {}, &flags);
  EXPECT_EQ(nan.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(nan.message().find("x.conf:2: --slot-ttl=nan: expected decimal seconds >= 0"),
            std::string::npos)
      << nan;
  // 0 would abandon every forward at once (an outside review, for the stream's idle bound).
  const absl::Status zero = ApplyConfig("forward-timeout = 0\n", "x.conf", {}, &flags);
  EXPECT_EQ(zero.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(zero.message().find("--forward-timeout=0: expected decimal seconds > 0"),
            std::string::npos)
      << zero;
  EXPECT_TRUE(ApplyConfig("forward-timeout = 0.5\n", "x.conf", {}, &flags).ok());
  const absl::Status idle = ApplyConfig("stream-idle-timeout = 0\n", "x.conf", {}, &flags);
  EXPECT_NE(idle.message().find("--stream-idle-timeout=0: expected decimal seconds > 0"),
            std::string::npos)
      << idle;
  ASSERT_TRUE(ApplyConfig("stream-idle-timeout = 2.5\n", "x.conf", {}, &flags).ok());
  EXPECT_EQ(flags.options.stream_idle_timeout, absl::Milliseconds(2500));
  // An outside review's durations: 0 for the transfer bounds (every move, every reservation
  // over at once), 1e-300 (> 0, yet a zero duration), hex, infinite ones.
  for (const char* line :
       {"transfer-timeout = 0", "transfer-lease = 0", "forward-timeout = 1e-300", "slot-ttl = 0x10",
        "slot-ttl = inf", "slot-ttl = 1e400", "drain-timeout = -1", "slot-ttl = 2e9"}) {
    const absl::Status refused = ApplyConfig(line, "x.conf", {}, &flags);
    EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << line;
    EXPECT_NE(refused.message().find("expected decimal seconds"), std::string::npos) << refused;
  }
  ASSERT_TRUE(ApplyConfig("transfer-timeout = 1e1\nslot-ttl=.5", "x.conf", {}, &flags).ok());
  EXPECT_EQ(flags.options.transfer_timeout, absl::Seconds(10));
  EXPECT_EQ(flags.options.slot_ttl, absl::Milliseconds(500));
}

// The file's syntax, after an outside review: # starts a comment only at a line's start or
// after a blank (values may hold one), a BOM is no part of the first name, and a bad line is
// refused even where the command line sets its flag.
TEST(ServerFlags, ConfigCommentsValuesWithHashesAndLinesTheCommandLineOverrides) {
  ServerFlags flags;
  ASSERT_TRUE(ApplyConfig("\xEF\xBB\xBFkv-events-topic = a#b  # the topic\n# all of it\n"
                          "   # indented\nmax-batch = 9 #nine\n",
                          "x.conf", {}, &flags)
                  .ok());
  EXPECT_EQ(flags.options.kv_events_topic, "a#b");
  EXPECT_EQ(flags.options.max_batch, 9);
  const absl::Status bad = ApplyConfig("max-batch = abc\n", "x.conf", {{"max-batch", "5"}}, &flags);
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.message().find("x.conf:1: --max-batch=abc"), std::string::npos) << bad;
  ASSERT_TRUE(ApplyConfig("max-batch = 7\n", "x.conf", {{"max-batch", "5"}}, &flags).ok());
  EXPECT_EQ(flags.options.max_batch, 9) << "the command line's (applied by the caller) wins";
}

// --config names one regular file: a directory (a ConfigMap's mount) read as nothing and the
// server started on defaults; an empty value, or a second --config, dropped a file silently.
TEST(ServerFlags, ConfigMustBeOneFile) {
  const std::string dir = ::testing::TempDir();
  for (const auto& [args, message] : std::vector<std::pair<std::vector<const char*>, std::string>>{
           {{"--config", dir.c_str()}, "expected a file of `name = value` lines, got a directory"},
           {{"--config="}, "--config: expected a file, got an empty value"},
           {{"--config=a.conf", "--config=b.conf"},
            "--config: expected one file, got \"a.conf\" and \"b.conf\""},
           {{"--bogus"}, "unknown flag --bogus"},
           {{"--bogus", "1"}, "unknown flag --bogus"}}) {
    auto parsed = Parse(args);
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument) << message;
    EXPECT_NE(parsed.status().message().find(message), std::string::npos) << parsed.status();
  }
}

TEST(ParseBytes, AcceptsPlainAndBinaryUnitsOnly) {
  EXPECT_EQ(*ParseBytes("1024"), 1024);
  EXPECT_EQ(*ParseBytes("4k"), 4096);
  EXPECT_EQ(*ParseBytes("1G"), int64_t{1} << 30);
  EXPECT_EQ(*ParseBytes("3MiB"), int64_t{3} << 20);
  EXPECT_FALSE(ParseBytes("-1").ok());
  EXPECT_FALSE(ParseBytes("1X").ok());
  EXPECT_FALSE(ParseBytes("").ok());
  EXPECT_FALSE(ParseBytes("9999999999T").ok());  // would overflow int64
}

}  // namespace
}  // namespace replayssm::service
