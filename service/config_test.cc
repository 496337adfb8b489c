#include "service/config.h"

#include <cstdio>
#include <fstream>
#include <string>

#include "gtest/gtest.h"
#include "service/server.h"
#include "service/transfer_service.h"

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

TEST(TransferOptions, OutOfRangeLanesAndImportThreadsAreRefusedNamingTheFlag) {
  // Checked before anything starts (no context, no UCX needed).
  struct Case {
    int32_t TransferOptions::*field;
    int32_t value;
    std::string message;
  };
  for (const Case& c : {Case{&TransferOptions::lanes, 0, "transfer-lanes: expected 1..16, got 0"},
                        Case{&TransferOptions::lanes, 17, "transfer-lanes: expected 1..16, got 17"},
                        Case{&TransferOptions::import_threads, 0,
                             "transfer-import-threads: expected 1..32, got 0"},
                        Case{&TransferOptions::import_threads, 33,
                             "transfer-import-threads: expected 1..32, got 33"}}) {
    TransferOptions o;
    o.*c.field = c.value;
    auto s = TransferService::Create(nullptr, o);
    ASSERT_FALSE(s.ok()) << c.message;
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.status().message().find(c.message), std::string::npos) << s.status();
  }
  auto f = Parse({"--transfer-import-threads=12"});
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->options.transfer_import_threads, 12);
  EXPECT_EQ(ServerOptions{}.transfer_import_threads, 8);
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
  EXPECT_NE(nan.message().find("x.conf:2: --slot-ttl=nan: expected seconds >= 0"),
            std::string::npos)
      << nan;
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
