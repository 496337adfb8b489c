// Retries by request id, concurrent clients, graceful drain and the /metrics endpoint.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "service_fixture.h"

namespace replayssm::testing {
namespace {

using LifecycleTest = ServiceTest;
using Health = grpc::health::v1::HealthCheckResponse;

// The server's health once it says NOT_SERVING (a drain began), or its last answer after 5 s.
absl::StatusOr<Health::ServingStatus> AwaitNotServing(Client& c) {
  absl::StatusOr<Health::ServingStatus> health;
  for (int i = 0; i < 500; ++i) {
    health = c.Health();
    if (health.ok() && *health == Health::NOT_SERVING) break;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return health;
}

// Ids made by processes forked from one parent (workers of a pre-fork server) are their own:
// a repeated id would make the server answer a second worker's Allocate with the first's slot.
TEST(RequestIds, ForkedWorkersNeverRepeatEachOthersIds) {
  const std::string parent = client::NewRequestId();  // the parent's generator, if any, is warm
  EXPECT_EQ(parent.size(), 32u);
  std::vector<std::string> ids = {parent};
  for (int child = 0; child < 3; ++child) {
    int fds[2];
    ASSERT_EQ(pipe(fds), 0);
    const pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      const std::string id = client::NewRequestId();
      const ssize_t n = write(fds[1], id.data(), id.size());
      _exit(n == static_cast<ssize_t>(id.size()) ? 0 : 1);
    }
    close(fds[1]);
    char buf[64] = {};
    const ssize_t n = read(fds[0], buf, sizeof(buf));
    close(fds[0]);
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    ASSERT_EQ(n, 32);
    ids.emplace_back(buf, static_cast<size_t>(n));
  }
  ids.push_back(client::NewRequestId());
  std::sort(ids.begin(), ids.end());
  EXPECT_EQ(std::adjacent_find(ids.begin(), ids.end()), ids.end()) << absl::StrJoin(ids, " ");
}

TEST_F(LifecycleTest, RetriedDecodeReturnsTheOriginalOutputsAndAdvancesOnce) {
  const uint64_t a = NewSlot();
  const int32_t sa = *ref_->NewSequence();
  Prefill(a, sa, 4);
  auto layers = Layers(1);
  v1::DecodeRequest req = DecodeRequest({a}, layers);
  req.set_request_id("decode-retry-1");
  auto first = client_->Decode(req);
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = client_->Decode(req);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(first->SerializeAsString(), second->SerializeAsString());
  EXPECT_EQ(client_->GetSlot(a)->seq_len(), 5);
  // The stream form shares the id space: a replay, not a second application.
  auto stream = client_->OpenStream();
  auto replay = stream->Forward({req.rows(0)}, layers, "decode-retry-1");
  ASSERT_TRUE(replay.ok()) << replay.status();
  EXPECT_EQ(replay->layers(0).out().data(), first->layers(0).out().data());
  EXPECT_EQ(client_->GetSlot(a)->seq_len(), 5);
  // The reference applied it once too: the next step still matches.
  ASSERT_TRUE(ref_->Decode({sa}, layers).ok());
  DecodeStep({a}, {sa});
  // The same id for different rows is a client bug.
  v1::DecodeRequest other = DecodeRequest({a}, layers);
  other.mutable_rows(0)->set_token_id(999);
  other.set_request_id("decode-retry-1");
  EXPECT_EQ(client_->Decode(other).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(LifecycleTest, RetriedPrefillAndVerifyForwardsReplayTheirOutputsAndApplyOnce) {
  const uint64_t a = NewSlot();
  const int32_t sa = *ref_->NewSequence();
  const auto layers = Layers(4);
  const std::vector<int32_t> tokens = {1, 2, 3, 4};
  const std::vector<v1::PrefillRow> rows = {client::MakePrefillRow(a, tokens)};
  auto first = client_->OpenStream()->Prefill(rows, layers, "prefill-retry-1");
  ASSERT_TRUE(first.ok()) << first.status();
  auto want = ref_->Prefill(sa, layers);
  ASSERT_TRUE(want.ok());
  for (int l = 0; l < num_layers(); ++l) ExpectClose(first->layers(l).out(), (*want)[l]);
  // The reply was lost: the retry (a new stream, layers in another order) is a replay.
  auto stream = client_->OpenStream();
  auto begun = stream->BeginPrefill(rows, "prefill-retry-1");
  ASSERT_TRUE(begun.ok()) << begun.status();
  EXPECT_TRUE(begun->replayed());
  for (int l = num_layers() - 1; l >= 0; --l) {
    auto out = stream->RunLayer(layers[l]);
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_EQ(out->out().data(), first->layers(l).out().data());
  }
  auto committed = stream->Commit();
  ASSERT_TRUE(committed.ok()) << committed.status();
  EXPECT_EQ(committed->rows(0).seq_len(), 4);
  EXPECT_EQ(client_->GetSlot(a)->seq_len(), 4) << "applied once";
  // The same id with other tokens is a client bug.
  const std::vector<v1::PrefillRow> other = {client::MakePrefillRow(a, {9, 9, 9, 9})};
  EXPECT_EQ(stream->BeginPrefill(other, "prefill-retry-1").status().code(),
            absl::StatusCode::kInvalidArgument);

  const std::vector<uint64_t> slots = {a};
  const std::vector<int32_t> drafts = {7, 8};
  const auto draft_layers = Layers(2);
  auto verified = client_->OpenStream()->Verify(slots, 2, drafts, draft_layers, "verify-retry-1");
  ASSERT_TRUE(verified.ok()) << verified.status();
  auto again = client_->OpenStream()->Verify(slots, 2, drafts, draft_layers, "verify-retry-1");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->SerializeAsString(), verified->SerializeAsString());
  EXPECT_EQ(client_->GetSlot(a)->pending_drafts(), 2);
  ASSERT_TRUE(client_->Accept(a, 0).ok());
  DecodeStep({a}, {sa});  // the state is the reference's: the prefill applied once
}

TEST_F(LifecycleTest, CancellingAStreamMidPrefillAbandonsTheForwardAndChangesNothing) {
  const uint64_t a = NewSlot();
  const int32_t sa = *ref_->NewSequence();
  Prefill(a, sa, 5);
  DecodeStep({a}, {sa});
  const std::string before = Observe(a);
  const int64_t free_before = client_->Stats()->slots_free();
  auto stream = client_->OpenStream();
  const std::vector<int32_t> tokens = {1, 2, 3};
  ASSERT_TRUE(stream->BeginPrefill({client::MakePrefillRow(a, tokens)}).ok());
  const auto layers = Layers(3);
  for (int l = 0; l + 1 < num_layers(); ++l) ASSERT_TRUE(stream->RunLayer(layers[l]).ok());
  stream->Cancel();
  EXPECT_EQ(stream->Finish().code(), absl::StatusCode::kCancelled);
  for (int i = 0; i < 500 && client_->Stats()->open_forwards() > 0; ++i) {
    absl::SleepFor(absl::Milliseconds(10));  // the server sees the cancellation on its own time
  }
  EXPECT_EQ(client_->Stats()->open_forwards(), 0);
  EXPECT_EQ(client_->Stats()->slots_free(), free_before) << "the spare slot came back";
  EXPECT_EQ(Observe(a), before);
  DecodeStep({a}, {sa});  // usable, and still the reference's state
}

TEST_F(LifecycleTest, RetriedAllocateAndFreeAreAppliedOnce) {
  const int64_t live = client_->Stats()->slots_live();
  auto a1 = client_->Allocate("alloc-1");
  auto a2 = client_->Allocate("alloc-1");
  ASSERT_TRUE(a1.ok() && a2.ok());
  EXPECT_EQ(a1->slot(), a2->slot());
  EXPECT_EQ(client_->Stats()->slots_live(), live + 1);
  EXPECT_TRUE(client_->Free(a1->slot(), "free-1").ok());
  EXPECT_TRUE(client_->Free(a1->slot(), "free-1").ok());  // the retry is not NOT_FOUND
  EXPECT_EQ(client_->Free(a1->slot(), "free-2").code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(client_->Stats()->slots_live(), live);
}

class SmallDedupTest : public ServiceTest {
 protected:
  std::vector<std::string> ServerFlags() const override { return {"--dedup-bytes=1K"}; }
};

TEST_F(SmallDedupTest, ARetryWhoseOutputsWereTooLargeToKeepIsNotAppliedTwice) {
  const uint64_t a = NewSlot();
  v1::DecodeRequest req = DecodeRequest({a}, Layers(1));  // > 1 KiB of outputs
  req.set_request_id("too-large-to-keep");
  ASSERT_TRUE(client_->Decode(req).ok());
  EXPECT_EQ(client_->Decode(req).status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(client_->GetSlot(a)->seq_len(), 1);
  auto again = client_->Allocate("small-reply");  // small replies are still kept
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(client_->Allocate("small-reply")->slot(), again->slot());
}

TEST_F(LifecycleTest, ListSlotsShowsEveryLiveSlotWithItsCursorsAndIdleTime) {
  const uint64_t a = NewSlot();
  Prefill(a, *ref_->NewSequence(), 5);
  const uint64_t b = NewSlot();
  const uint64_t freed = NewSlot();
  ASSERT_TRUE(client_->Free(freed).ok());
  absl::SleepFor(absl::Milliseconds(300));
  ASSERT_TRUE(client_->GetSlot(b).ok());  // a use: b's idle time restarts
  auto list = client_->ListSlots();
  ASSERT_TRUE(list.ok()) << list.status();
  ASSERT_EQ(list->slots_size(), 2) << list->DebugString();
  for (const v1::SlotListing& l : list->slots()) {
    EXPECT_NE(l.state().slot(), freed);
    if (l.state().slot() == a) {
      EXPECT_EQ(l.state().seq_len(), 5);
      EXPECT_EQ(l.state().write_pos(), 0);
      EXPECT_GE(l.idle_seconds(), 0.3);
    } else {
      EXPECT_EQ(l.state().slot(), b);
      EXPECT_EQ(l.state().seq_len(), 0);
      EXPECT_LT(l.idle_seconds(), 0.3);
    }
  }
}

class SlotLeaseTest : public ServiceTest {
 protected:
  std::vector<std::string> ServerFlags() const override { return {"--slot-ttl=1"}; }
};

// The slots of a crashed scheduler used to live forever: with --slot-ttl an unused slot is
// freed after the TTL, and any call naming a handle renews it (listing does not).
TEST_F(SlotLeaseTest, AnIdleSlotExpiresAfterTheTtlAndUseRenewsIt) {
  EXPECT_EQ(info_.slot_ttl_seconds(), 1);
  const uint64_t idle = NewSlot();
  const uint64_t used = NewSlot();
  const absl::Time end = absl::Now() + absl::Milliseconds(2500);
  while (absl::Now() < end) {
    ASSERT_TRUE(client_->GetSlot(used).ok());
    ASSERT_TRUE(client_->ListSlots().ok());
    absl::SleepFor(absl::Milliseconds(200));
  }
  const absl::Status gone = client_->GetSlot(idle).status();
  EXPECT_EQ(gone.code(), absl::StatusCode::kNotFound) << gone;
  EXPECT_NE(gone.message().find(std::to_string(idle)), std::string::npos) << gone;
  EXPECT_TRUE(client_->GetSlot(used).ok());
  auto list = client_->ListSlots();
  ASSERT_TRUE(list.ok());
  ASSERT_EQ(list->slots_size(), 1);
  EXPECT_EQ(list->slots(0).state().slot(), used);
  auto metrics = HttpGet(server_->metrics_address(), "/metrics");
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  EXPECT_EQ(Sample(*metrics, "replayssm_slot_expiries_total"), 1);
  EXPECT_EQ(Sample(*metrics, R"(replayssm_slots{state="live"})"), 1);
}

TEST_F(LifecycleTest, ConcurrentClientsOnDisjointSlotsAllMatchTheReference) {
  constexpr int kClients = 4, kSteps = 12;
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int c = 0; c < kClients; ++c) {
    threads.emplace_back([&, c] {
      auto client = Client::Connect(server_->grpc_address());
      auto ref = CpuReference::Create(model(), 1);
      auto slot = client->Allocate();
      if (!ref.ok() || !slot.ok()) return void(++failures);
      const int32_t seq = *(*ref)->NewSequence();
      auto stream = client->OpenStream();
      for (int step = 0; step < kSteps; ++step) {
        auto layers = client::SyntheticLayers(model(), 1, 1000 * c + step);
        std::vector<v1::DecodeRow> rows(1);
        rows[0].set_slot(slot->slot());
        auto got = stream->Forward(rows, layers);
        auto want = (*ref)->Decode({seq}, layers);
        if (!got.ok() || !want.ok()) return void(++failures);
        for (int l = 0; l < num_layers(); ++l) {
          if (!client::AllClose(got->layers(l).out(), (*want)[l], tol(), tol(), nullptr)) {
            ++failures;
          }
        }
      }
      if (!stream->Finish().ok()) ++failures;
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(client_->Stats()->forwards_committed(), kClients * kSteps);
}

TEST_F(LifecycleTest, DrainReportsNotServingRefusesNewForwardsAndFinishesOpenOnes) {
  const uint64_t a = NewSlot(), b = NewSlot();
  auto stream = client_->OpenStream();
  std::vector<v1::DecodeRow> rows(1);
  rows[0].set_slot(a);
  auto layers = Layers(1);
  ASSERT_TRUE(stream->Begin(rows).ok());
  ASSERT_TRUE(stream->RunLayer(layers[0]).ok());

  server_->Signal(SIGTERM);
  const absl::StatusOr<Health::ServingStatus> health = AwaitNotServing(*client_);
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, Health::NOT_SERVING);
  EXPECT_EQ(client_->Decode(DecodeRequest({b}, Layers(1))).status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(client_->Allocate().status().code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(client_->Stats()->draining());
  // The open forward finishes normally.
  for (int l = 1; l < num_layers(); ++l) ASSERT_TRUE(stream->RunLayer(layers[l]).ok());
  auto committed = stream->Commit();
  ASSERT_TRUE(committed.ok()) << committed.status();
  EXPECT_EQ(committed->rows(0).seq_len(), 1);
  stream->Finish().IgnoreError();
  auto exit = server_->WaitExit(absl::Seconds(20));
  ASSERT_TRUE(exit.ok()) << exit.status();
  EXPECT_EQ(*exit, 0);
}

// A server whose device check runs every 50 ms, on a CPU backend that reports its device failed
// once the file REPLAYSSM_CPU_FAULT_FILE names exists (rssm_device_check, kernels.h).
class DeviceFailureTest : public ServiceTest {
 protected:
  std::vector<std::string> ServerFlags() const override {
    return {"--track-interval=16", "--device-check-interval=0.05"};
  }
  void SetUp() override {
    if (ServerProcess::Device() != "cpu") GTEST_SKIP() << "the CPU backend's fault seam";
    fault_file_ = ::testing::TempDir() + "/replayssm_device_fault_" + std::to_string(getpid());
    std::remove(fault_file_.c_str());
    ASSERT_EQ(setenv("REPLAYSSM_CPU_FAULT_FILE", fault_file_.c_str(), 1), 0);  // the child's
    ServiceTest::SetUp();
    unsetenv("REPLAYSSM_CPU_FAULT_FILE");
  }
  void TearDown() override { std::remove(fault_file_.c_str()); }
  void FailDevice() const {
    std::FILE* f = std::fopen(fault_file_.c_str(), "w");
    ASSERT_NE(f, nullptr);
    std::fclose(f);
  }
  std::string fault_file_;
};

// A device that stops taking work (a sticky CUDA error, injected here) turns health NOT_SERVING
// within the check interval — readiness drops, liveness restarts the pod — and every new piece
// of work is refused UNAVAILABLE with the device's reason; Free still runs, the gauge says it,
// and SIGTERM still stops the server cleanly.
TEST_F(DeviceFailureTest, AFailedDeviceTurnsHealthNotServingAndRefusesNewWork) {
  const uint64_t a = NewSlot();
  ASSERT_TRUE(client_->Decode(DecodeRequest({a}, Layers(1))).ok());
  absl::SleepFor(absl::Milliseconds(200));  // a few checks pass while the device works
  ASSERT_EQ(*client_->Health(), Health::SERVING);
  FailDevice();
  const absl::StatusOr<Health::ServingStatus> health = AwaitNotServing(*client_);
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, Health::NOT_SERVING);
  const absl::Status decode = client_->Decode(DecodeRequest({a}, Layers(1))).status();
  EXPECT_EQ(decode.code(), absl::StatusCode::kUnavailable) << decode;
  const std::string reason =
      "device failed (cpu device 0: rssm_device_check: cpu: a device "
      "failure injected (" +
      fault_file_ + " exists))";
  EXPECT_EQ(decode.message(), reason + ": no new forwards");
  const absl::Status alloc = client_->Allocate().status();
  EXPECT_EQ(alloc.code(), absl::StatusCode::kUnavailable) << alloc;
  EXPECT_EQ(alloc.message(), reason + ": no new work");
  EXPECT_EQ(client_->GetSlot(a)->seq_len(), 1) << "the refused decode advanced nothing";
  // What a drain still runs, since it moves states out or winds a slot down, needs the device.
  const std::string no_device_work = reason + ": no device work";
  EXPECT_EQ(client_->Export(a).status().message(), no_device_work);
  EXPECT_EQ(client_->Accept(a, 0).status().message(), no_device_work);
  EXPECT_EQ(client_->Donate(a).message(), no_device_work);
  const absl::Status moved = client_->TransferSlot(a, "127.0.0.1:1", false).status();
  EXPECT_EQ(moved.code(), absl::StatusCode::kUnavailable) << moved;
  EXPECT_EQ(moved.message(), no_device_work);
  EXPECT_EQ(client_->PullSlot(a, "127.0.0.1:1", false).status().message(), no_device_work);
  v1::RegisterCudaRegionRequest region;
  region.set_name("engine");
  EXPECT_EQ(client_->RegisterCudaRegion(region).message(), no_device_work);
  EXPECT_TRUE(client_->GetSlot(a).ok());  // reads answer
  EXPECT_TRUE(client_->ListSlots().ok());
  EXPECT_TRUE(client_->Stats().ok());
  EXPECT_TRUE(client_->Free(a, "free-after-failure").ok());
  auto text = HttpGet(server_->metrics_address(), "/metrics");
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_EQ(Sample(*text, "replayssm_device_failed"), 1);
  std::remove(fault_file_.c_str());  // the failure stays: a failed context never recovers
  absl::SleepFor(absl::Milliseconds(200));
  EXPECT_EQ(*client_->Health(), Health::NOT_SERVING);
  EXPECT_EQ(client_->Allocate().status().code(), absl::StatusCode::kUnavailable);
  server_->Signal(SIGTERM);
  auto exit = server_->WaitExit(absl::Seconds(20));
  ASSERT_TRUE(exit.ok()) << exit.status();
  EXPECT_EQ(*exit, 0);
  EXPECT_NE(server_->Log().find("replayssm-server: device failed, refusing all new work and "
                                "reporting NOT_SERVING: cpu device 0: "),
            std::string::npos)
      << server_->Log();
}

// A device that fails while the server drains (and waits for its live slots to be moved off) is
// still reported, and ends the wait for slots that can no longer move: the drain exits at once.
class DeviceFailureWhileDrainingTest : public DeviceFailureTest {
 protected:
  std::vector<std::string> ServerFlags() const override {
    return {"--device-check-interval=0.05", "--drain-wait-slots=true", "--drain-timeout=60"};
  }
};

TEST_F(DeviceFailureWhileDrainingTest, IsReportedAndEndsTheWaitForSlots) {
  const uint64_t a = NewSlot();
  server_->Signal(SIGTERM);
  ASSERT_EQ(*AwaitNotServing(*client_), Health::NOT_SERVING);
  absl::SleepFor(absl::Milliseconds(200));
  EXPECT_TRUE(client_->Export(a).ok()) << "a draining server still moves states out";
  FailDevice();
  absl::Status exported;
  for (int i = 0; i < 200; ++i) {  // the next check, within 50 ms
    exported = client_->Export(a).status();
    if (!exported.ok()) break;
    absl::SleepFor(absl::Milliseconds(10));
  }
  // Refused "device failed (...)" if the call came in the ~50 ms between the check and the
  // drain's shutdown, else the shutdown's own UNAVAILABLE (a loaded machine: it failed once
  // asking for the first), or CANCELLED for an export still running when the shutdown's
  // 500 ms grace ended (CI under ASan, once). DeviceFailureTest checks the refusals; the log
  // line and the exit below say that the check ran mid-drain and ended the wait.
  EXPECT_TRUE(exported.code() == absl::StatusCode::kUnavailable ||
              exported.code() == absl::StatusCode::kCancelled)
      << exported;
  auto exit = server_->WaitExit(absl::Seconds(20));  // not the 60 s of --drain-timeout
  ASSERT_TRUE(exit.ok()) << exit.status();
  EXPECT_EQ(*exit, 0);
  EXPECT_NE(server_->Log().find("replayssm-server: device failed"), std::string::npos)
      << server_->Log();
}

// A stream that ends by its deadline or a cancellation is counted as such, not as OK: the
// error-ratio alert sees where forwards fail.
TEST_F(LifecycleTest, AStreamPastItsDeadlineOrCancelledIsCountedSo) {
  const uint64_t a = NewSlot();
  auto stub = v1::ReplaySsm::NewStub(
      grpc::CreateChannel(server_->grpc_address(), grpc::InsecureChannelCredentials()));
  v1::DecodeStreamRequest begin;
  begin.mutable_begin()->add_rows()->set_slot(a);
  begin.mutable_begin()->set_request_id("deadline-1");
  {
    grpc::ClientContext c;
    c.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
    auto stream = stub->DecodeStream(&c);
    ASSERT_TRUE(stream->Write(begin));
    v1::DecodeStreamResponse begun;
    ASSERT_TRUE(stream->Read(&begun));  // the forward is open; no layer follows
    EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  }
  // On a slot of its own: the server's side of the first call may still hold `a` (its copy
  // of the deadline expires a little after the client's), and a begin on a slot in a forward
  // is refused (seen once on a loaded machine: the stream ended before its first reply).
  const uint64_t b = NewSlot();
  {
    grpc::ClientContext c;
    auto stream = stub->DecodeStream(&c);
    begin.mutable_begin()->mutable_rows(0)->set_slot(b);
    begin.mutable_begin()->set_request_id("cancelled-1");
    ASSERT_TRUE(stream->Write(begin));
    v1::DecodeStreamResponse begun;
    ASSERT_TRUE(stream->Read(&begun));
    c.TryCancel();
    EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  double deadline = 0, cancelled = 0, ok = 0;
  for (int i = 0; i < 200; ++i) {  // the server counts once its side of each call ends
    auto text = HttpGet(server_->metrics_address(), "/metrics");
    ASSERT_TRUE(text.ok()) << text.status();
    deadline =
        Sample(*text, R"(replayssm_rpcs_total{code="DEADLINE_EXCEEDED",method="DecodeStream"})");
    cancelled = Sample(*text, R"(replayssm_rpcs_total{code="CANCELLED",method="DecodeStream"})");
    ok = Sample(*text, R"(replayssm_rpcs_total{code="OK",method="DecodeStream"})");
    if (std::max(deadline, 0.0) + std::max(cancelled, 0.0) == 2) break;
    absl::SleepFor(absl::Milliseconds(25));
  }
  // The client's own deadline may cancel the call before the server's copy of it (set from the
  // grpc-timeout when the call arrived, so a little later) expires: the server then sees a
  // cancellation. Either way it is counted as one, never as OK.
  EXPECT_LE(deadline, 1);
  EXPECT_GE(cancelled, 1);
  EXPECT_EQ(std::max(deadline, 0.0) + cancelled, 2);
  EXPECT_LE(ok, 0) << "neither is counted as OK";
  // Both forwards were abandoned: each slot is where it was, free for the next.
  for (const uint64_t s : {a, b}) {
    EXPECT_EQ(client_->GetSlot(s)->seq_len(), 0);
    EXPECT_TRUE(client_->Decode(DecodeRequest({s}, Layers(1))).ok());
  }
}

// A streamed forward whose client goes quiet is abandoned after --stream-idle-timeout without a
// message: it held its slots from every other call (Free, Export, the drain's wait) for as long
// as the stream stayed open, and a client host gone without closing its connection kept it open
// for hours (an outside review). A stream idle between forwards holds nothing and stays open.
class IdleForwardTest : public ServiceTest {
 protected:
  std::vector<std::string> ServerFlags() const override { return {"--stream-idle-timeout=1"}; }
};

TEST_F(IdleForwardTest, AForwardWithoutMessagesIsAbandonedAndItsStreamEnds) {
  const uint64_t a = NewSlot();
  const auto row = [a](int32_t token) {
    v1::DecodeRow r;
    r.set_slot(a);
    r.set_token_id(token);
    return std::vector<v1::DecodeRow>{r};
  };
  auto idle = client_->OpenStream();
  ASSERT_TRUE(idle->Forward(row(1), Layers(1)).ok());
  const std::string before = Observe(a);
  absl::SleepFor(absl::Milliseconds(2500));  // between forwards: nothing is held, nothing ends
  ASSERT_TRUE(idle->Begin(row(2)).ok()) << "a stream idle between forwards stays open";
  ASSERT_TRUE(idle->RunLayer(Layers(1)[0]).ok());  // then the client goes quiet
  EXPECT_EQ(client_->Free(a).code(), absl::StatusCode::kFailedPrecondition) << "held";
  const auto open_streams = [&] {
    auto text = HttpGet(server_->metrics_address(), "/metrics");
    return text.ok() ? Sample(*text, R"(replayssm_open_streams{method="DecodeStream"})") : -2;
  };
  EXPECT_EQ(open_streams(), 1);
  for (int i = 0; i < 100 && client_->Stats()->open_forwards() > 0; ++i) {
    absl::SleepFor(absl::Milliseconds(50));  // --stream-idle-timeout (1 s), the sweep's period
  }
  EXPECT_EQ(client_->Stats()->open_forwards(), 0) << "abandoned";
  EXPECT_EQ(Observe(a), before) << "nothing of it committed";
  const absl::Status ended = idle->Finish();
  EXPECT_EQ(ended.code(), absl::StatusCode::kDeadlineExceeded) << ended;
  EXPECT_NE(ended.message().find("--stream-idle-timeout"), std::string::npos) << ended;
  auto text = HttpGet(server_->metrics_address(), "/metrics");
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_EQ(Sample(*text, R"(replayssm_forwards_total{outcome="abandoned"})"), 1);
  EXPECT_EQ(Sample(*text, R"(replayssm_open_streams{method="WatchCache"})"), 0);
  for (int i = 0; i < 100 && open_streams() != 0; ++i) absl::SleepFor(absl::Milliseconds(20));
  EXPECT_EQ(open_streams(), 0) << "the ended stream is no longer counted";
  EXPECT_TRUE(client_->Free(a).ok());
}

// With --drain-wait-slots the drain lasts until the live slots are moved off or freed (within
// --drain-timeout): the schedulers' time to take their requests elsewhere.
class DrainWaitSlotsTest : public ServiceTest {
 protected:
  std::vector<std::string> ServerFlags() const override {
    return {"--drain-wait-slots=true", "--drain-timeout=60"};
  }
};

TEST_F(DrainWaitSlotsTest, TheDrainWaitsForTheLiveSlotsToGo) {
  const uint64_t a = NewSlot(), b = NewSlot();
  server_->Signal(SIGTERM);
  const absl::StatusOr<Health::ServingStatus> health = AwaitNotServing(*client_);
  ASSERT_TRUE(health.ok() && *health == Health::NOT_SERVING);
  EXPECT_EQ(client_->Allocate().status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(server_->WaitExit(absl::Seconds(1)).status().code(),
            absl::StatusCode::kDeadlineExceeded)
      << "two live slots: still draining";
  // Within its bound (--drain-timeout + --transfer-timeout + 1 s) a drain is not overdue,
  // however long it waits (ReplaySSMDrainStuck fires on replayssm_drain_overdue).
  auto text = HttpGet(server_->metrics_address(), "/metrics");
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_EQ(Sample(*text, "replayssm_draining"), 1);
  EXPECT_EQ(Sample(*text, "replayssm_drain_overdue"), 0) << *text;
  ASSERT_TRUE(client_->Free(a).ok()) << "slots can be freed while draining";
  EXPECT_EQ(server_->WaitExit(absl::Milliseconds(500)).status().code(),
            absl::StatusCode::kDeadlineExceeded)
      << "one live slot: still draining";
  // ... or moved to a peer, which is what the wait is for.
  auto peer = ServerProcess::Start({});
  ASSERT_TRUE(peer.ok()) << peer.status();
  auto moved = client_->TransferSlot(b, (*peer)->grpc_address(), /*keep_source=*/false);
  ASSERT_TRUE(moved.ok()) << moved.status();
  auto there = Client::Connect((*peer)->grpc_address())->GetSlot(moved->remote_slot());
  EXPECT_TRUE(there.ok()) << there.status();
  auto exit = server_->WaitExit(absl::Seconds(20));
  ASSERT_TRUE(exit.ok()) << exit.status();
  EXPECT_EQ(*exit, 0);
}

TEST_F(LifecycleTest, MetricsCountWhatWasDone) {
  const uint64_t a = NewSlot(), b = NewSlot();
  const int32_t sa = *ref_->NewSequence(), sb = *ref_->NewSequence();
  constexpr int kUnary = 5, kStream = 3;
  for (int i = 0; i < kUnary; ++i) DecodeStep({a, b}, {sa, sb});
  auto stream = client_->OpenStream();
  for (int i = 0; i < kStream; ++i) {
    std::vector<v1::DecodeRow> rows(1);
    rows[0].set_slot(a);
    ASSERT_TRUE(stream->Forward(rows, Layers(1)).ok());
  }
  ASSERT_TRUE(stream->Finish().ok());
  v1::DecodeRequest bad = DecodeRequest({a}, Layers(1));
  bad.mutable_layers(0)->mutable_a()->set_dtype(v1::DTYPE_F16);
  ASSERT_EQ(client_->Decode(bad).status().code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(client_->Free(b).ok());

  auto text = HttpGet(server_->metrics_address(), "/metrics");
  ASSERT_TRUE(text.ok()) << text.status();
  const std::string& m = *text;
  EXPECT_EQ(Sample(m, R"(replayssm_rpcs_total{code="OK",method="Decode"})"), kUnary);
  EXPECT_EQ(Sample(m, R"(replayssm_rpcs_total{code="INVALID_ARGUMENT",method="Decode"})"), 1);
  EXPECT_EQ(Sample(m, R"(replayssm_rpcs_total{code="OK",method="DecodeStream"})"), 1);
  EXPECT_EQ(Sample(m, R"(replayssm_rpcs_total{code="OK",method="Allocate"})"), 2);
  EXPECT_EQ(Sample(m, R"(replayssm_rpcs_total{code="OK",method="Free"})"), 1);
  EXPECT_EQ(Sample(m, "replayssm_forward_duration_seconds_count"), kUnary + kStream);
  EXPECT_EQ(Sample(m, "replayssm_forward_batch_size_sum"), 2 * kUnary + kStream);
  EXPECT_EQ(Sample(m, R"(replayssm_forwards_total{outcome="committed"})"), kUnary + kStream);
  EXPECT_EQ(Sample(m, R"(replayssm_kernel_duration_seconds_count{op="run_layer"})"),
            (kUnary + kStream) * num_layers());
  EXPECT_EQ(Sample(m, R"(replayssm_slots{state="live"})"), 1);
  EXPECT_EQ(Sample(m, "replayssm_slots_capacity"), info_.capacity_slots());
  auto stats = client_->Stats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(Sample(m, R"(replayssm_folds_total{reason="ring_full"})"), stats->folds_ring_full());
  EXPECT_EQ(Sample(m, "replayssm_snapshot_hits_total"), stats->snapshot_hits());
  EXPECT_EQ(Sample(m, "replayssm_invariant_refusals_total"), stats->invariant_refusals());
  const int64_t act = static_cast<int64_t>(client::DtypeSize(model().act_dtype()));
  const int64_t a_width = model().gate() == v1::GATE_KDA ? model().num_v_heads() * model().head_k()
                                                         : model().num_v_heads();
  const int64_t in_per_row =
      act * num_layers() *
      (2 * model().num_qk_heads() * model().head_k() + model().num_v_heads() * model().head_v() +
       a_width + model().num_v_heads());
  const int64_t out_per_row = act * num_layers() * model().num_v_heads() * model().head_v();
  const int64_t rows = 2 * kUnary + kStream;  // the refused request counts nothing
  EXPECT_EQ(Sample(m, "replayssm_tensor_received_bytes_total"), in_per_row * rows);
  EXPECT_EQ(Sample(m, "replayssm_tensor_sent_bytes_total"), out_per_row * rows);
  EXPECT_EQ(Sample(m, R"(replayssm_kernel_duration_seconds_count{op="commit"})"),
            kUnary + kStream);

  // A streamed prefill or verify forward's commit is counted as its own op: the decode commits
  // (and the dashboard's kernel share of decode forwards) stay decode's.
  auto prefill = client_->OpenStream();
  ASSERT_TRUE(prefill->BeginPrefill({client::MakePrefillRow(a, std::vector<int32_t>{7, 8})}).ok());
  const std::vector<v1::LayerInput> layers = Layers(2);
  for (int l = 0; l < num_layers(); ++l) ASSERT_TRUE(prefill->RunLayer(layers[l]).ok());
  ASSERT_TRUE(prefill->Commit().ok());
  ASSERT_TRUE(prefill->Finish().ok());
  const std::vector<uint64_t> verified = {a};
  auto verify = client_->OpenStream();
  ASSERT_TRUE(verify->Verify(verified, 2, std::vector<int32_t>{5, 6}, Layers(2)).ok());
  ASSERT_TRUE(verify->Finish().ok());
  auto after = HttpGet(server_->metrics_address(), "/metrics");
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(Sample(*after, R"(replayssm_kernel_duration_seconds_count{op="prefill_commit"})"), 1);
  EXPECT_EQ(Sample(*after, R"(replayssm_kernel_duration_seconds_count{op="prefill_layer"})"),
            num_layers());
  EXPECT_EQ(Sample(*after, R"(replayssm_kernel_duration_seconds_count{op="verify_commit"})"), 1);
  EXPECT_EQ(Sample(*after, R"(replayssm_kernel_duration_seconds_count{op="verify_layer"})"),
            num_layers());
  EXPECT_EQ(Sample(*after, R"(replayssm_kernel_duration_seconds_count{op="commit"})"),
            kUnary + kStream);
}

}  // namespace
}  // namespace replayssm::testing
