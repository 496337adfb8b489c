#include "replayssm/client/bench.h"

#include <algorithm>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/cleanup/cleanup.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "replayssm/client/client.h"
#include "replayssm/client/tensor.h"

namespace replayssm::client {

namespace {

// The measured window, set once every worker has its slots: allocating them (one call per
// slot, many workers at once) is no part of the forwards' rate (an outside review found a
// 16-worker run reporting a third of its rate, and a window spent before any forward).
struct Window {
  explicit Window(const DecodeBenchOptions& o) : options(o) {}
  // Each worker once, with its slots (`ok`) or without: the last one to arrive sets the
  // window. Returns false when some worker failed (the run stops; its error is reported).
  bool Arrive(bool ok, absl::Time* measure_from, absl::Time* stop) {
    absl::MutexLock lock(&mu);
    failed = failed || !ok;
    if (++arrived == options.concurrency) {
      from = absl::Now() + options.warmup;
      until = from + options.duration;
    }
    mu.Await(absl::Condition(
        +[](Window* w) { return w->arrived == w->options.concurrency; }, this));
    *measure_from = from;
    *stop = until;
    return !failed;
  }

  const DecodeBenchOptions& options;
  absl::Mutex mu;
  int arrived ABSL_GUARDED_BY(mu) = 0;
  bool failed ABSL_GUARDED_BY(mu) = false;
  absl::Time from ABSL_GUARDED_BY(mu), until ABSL_GUARDED_BY(mu);
};

// One client thread: allocates its slots, waits for the others (Window), then runs forwards
// until the window's end; the latencies of forwards that started inside it are kept.
absl::Status Worker(const std::string& address, const DecodeBenchOptions& options,
                    const v1::ModelInfo& model, int worker, Window* window,
                    std::vector<double>* latencies_us) {
  auto client = Client::Connect(address, int64_t{256} << 20, options.credentials);
  client->set_token(options.token);
  std::vector<v1::DecodeRow> rows;
  // Every slot allocated goes back, whatever ends the run: the server keeps a live slot until
  // it is freed (or its lease, when the server has one, expires).
  absl::Cleanup free_slots = [&] {
    for (const v1::DecodeRow& row : rows) client->Free(row.slot()).IgnoreError();
  };
  rows.reserve(options.batch);
  absl::Status allocated = absl::OkStatus();
  for (int32_t r = 0; r < options.batch && allocated.ok(); ++r) {
    auto slot = client->Allocate();
    if (slot.ok()) rows.emplace_back().set_slot(slot->slot());
    allocated = slot.status();
  }
  absl::Time measure_from, stop;
  if (!window->Arrive(allocated.ok(), &measure_from, &stop)) return allocated;
  const std::vector<v1::LayerInput> layers = SyntheticLayers(model, options.batch, worker + 1);
  v1::DecodeRequest unary;
  for (const v1::DecodeRow& row : rows) *unary.add_rows() = row;
  for (const v1::LayerInput& l : layers) *unary.add_layers() = l;
  // A stream only for the stream form: an unused one counts against --max-streams.
  std::unique_ptr<ForwardStream> stream = options.unary ? nullptr : client->OpenStream();
  for (int32_t step = 0;; ++step) {
    const absl::Time t0 = absl::Now();
    if (t0 >= stop) break;
    if (options.interrupted != nullptr && options.interrupted->load()) {
      return absl::CancelledError("bench: interrupted; its slots are freed");
    }
    for (v1::DecodeRow& row : rows) row.set_token_id(step);
    for (v1::DecodeRow& row : *unary.mutable_rows()) row.set_token_id(step);  // it decoded 0s
    absl::Status s =
        options.unary ? client->Decode(unary).status() : stream->Forward(rows, layers).status();
    if (!s.ok()) return s;
    if (t0 >= measure_from) latencies_us->push_back(absl::ToDoubleMicroseconds(absl::Now() - t0));
  }
  return stream == nullptr ? absl::OkStatus() : stream->Finish();
}

double Percentile(std::vector<double>& sorted, double p) {
  if (sorted.empty()) return 0;
  const size_t i = std::min(sorted.size() - 1, static_cast<size_t>(p * sorted.size()));
  return sorted[i];
}

}  // namespace

absl::StatusOr<DecodeBenchResult> RunDecodeBench(const std::string& address,
                                                 const DecodeBenchOptions& options) {
  auto probe = Client::Connect(address, int64_t{256} << 20, options.credentials);
  probe->set_token(options.token);
  auto info = probe->Info();
  if (!info.ok()) return info.status();
  Window window(options);
  std::vector<std::vector<double>> latencies(options.concurrency);
  std::vector<absl::Status> status(options.concurrency);
  std::vector<std::thread> threads;
  for (int w = 0; w < options.concurrency; ++w) {
    threads.emplace_back(
        [&, w] { status[w] = Worker(address, options, info->model(), w, &window, &latencies[w]); });
  }
  for (std::thread& t : threads) t.join();
  std::vector<double> all;
  for (int w = 0; w < options.concurrency; ++w) {
    if (!status[w].ok()) return status[w];
    all.insert(all.end(), latencies[w].begin(), latencies[w].end());
  }
  std::sort(all.begin(), all.end());
  DecodeBenchResult r;
  r.forwards = static_cast<int64_t>(all.size());
  r.forwards_per_second = static_cast<double>(all.size()) / absl::ToDoubleSeconds(options.duration);
  r.p50_us = Percentile(all, 0.50);
  r.p99_us = Percentile(all, 0.99);
  double sum = 0;
  for (double x : all) sum += x;
  r.mean_us = all.empty() ? 0 : sum / static_cast<double>(all.size());
  return r;
}

}  // namespace replayssm::client
