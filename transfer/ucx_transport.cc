#include "replayssm/transfer/ucx_transport.h"

#include <ucp/api/ucp.h>

#include <algorithm>
#include <chrono>
#include <deque>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace replayssm::transfer {
namespace {

absl::Status UcsError(ucs_status_t s, const char* what) {
  return absl::UnavailableError(absl::StrCat("ucx: ", what, ": ", ucs_status_string(s)));
}

ucp_worker_h Worker(void* w) { return static_cast<ucp_worker_h>(w); }

}  // namespace

absl::StatusOr<std::unique_ptr<UcxTransport>> UcxTransport::Create(bool progress_thread) {
  std::unique_ptr<UcxTransport> t(new UcxTransport());
  ucp_config_t* config = nullptr;
  ucs_status_t s = ucp_config_read(nullptr, nullptr, &config);
  if (s != UCS_OK) return UcsError(s, "read config");
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_RMA;
  params.mt_workers_shared = 1;
  ucp_context_h context = nullptr;
  s = ucp_init(&params, config, &context);
  ucp_config_release(config);
  if (s != UCS_OK) return UcsError(s, "init");
  t->context_ = context;
  ucp_context_attr_t cattr{};
  cattr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
  if (ucp_context_query(context, &cattr) == UCS_OK) {
    t->cuda_memory_ = (cattr.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0;
  }
  ucp_worker_params_t wparams{};
  wparams.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wparams.thread_mode = UCS_THREAD_MODE_SERIALIZED;
  ucp_worker_h worker = nullptr;
  s = ucp_worker_create(context, &wparams, &worker);
  if (s != UCS_OK) return UcsError(s, "create worker");
  t->worker_ = worker;
  ucp_address_t* addr = nullptr;
  size_t len = 0;
  s = ucp_worker_get_address(worker, &addr, &len);
  if (s != UCS_OK) return UcsError(s, "worker address");
  t->address_.assign(reinterpret_cast<const char*>(addr), len);
  ucp_worker_release_address(worker, addr);
  if (progress_thread) t->progress_ = std::thread([p = t.get()] { p->ProgressLoop(); });
  return t;
}

UcxTransport::~UcxTransport() {
  stop_ = true;
  if (progress_.joinable()) progress_.join();
  for (auto& [key, rkey] : rkeys_) ucp_rkey_destroy(static_cast<ucp_rkey_h>(rkey.handle));
  for (auto& [addr, ep] : eps_) {
    ucp_request_param_t cp{};
    cp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    cp.flags = UCP_EP_CLOSE_FLAG_FORCE;
    Wait(ucp_ep_close_nbx(static_cast<ucp_ep_h>(ep.handle), &cp), "close",
         absl::Now() + absl::Seconds(1))
        .IgnoreError();
  }
  if (worker_ != nullptr) ucp_worker_destroy(Worker(worker_));
  if (context_ != nullptr) ucp_cleanup(static_cast<ucp_context_h>(context_));
}

// Spins while there is work (a transfer's software-emulated RMA needs the target to
// progress too) and for a couple of milliseconds after the last event, then naps, so an
// idle server costs little CPU and a busy one loses no time to sleeping.
void UcxTransport::ProgressLoop() {
  using Clock = std::chrono::steady_clock;
  auto last_event = Clock::now();
  while (!stop_.load(std::memory_order_relaxed)) {
    unsigned events;
    {
      std::lock_guard<std::mutex> lock(mu_);
      events = ucp_worker_progress(Worker(worker_));
    }
    if (events != 0) {
      last_event = Clock::now();
    } else if (Clock::now() - last_event > std::chrono::milliseconds(2)) {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
}

UcxTransport::Region::~Region() {
  if (memh_ != nullptr) {
    ucp_mem_unmap(static_cast<ucp_context_h>(context_), static_cast<ucp_mem_h>(memh_));
  }
}

absl::StatusOr<std::unique_ptr<UcxTransport::Region>> UcxTransport::Map(void* addr, size_t size) {
  std::unique_ptr<Region> r(new Region());
  r->context_ = context_;
  ucp_mem_map_params_t mp{};
  mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                  UCP_MEM_MAP_PARAM_FIELD_FLAGS;
  mp.address = addr;
  mp.length = size;
  mp.flags = addr == nullptr ? UCP_MEM_MAP_ALLOCATE : 0;
  ucp_mem_h memh = nullptr;
  ucs_status_t s = ucp_mem_map(static_cast<ucp_context_h>(context_), &mp, &memh);
  if (s != UCS_OK) return UcsError(s, addr == nullptr ? "mem_map(allocate)" : "mem_map");
  r->memh_ = memh;
  r->base_ = addr;
  if (addr == nullptr) {  // where UCX put it
    ucp_mem_attr_t attr{};
    attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS;
    s = ucp_mem_query(memh, &attr);
    if (s != UCS_OK) return UcsError(s, "mem_query");
    r->base_ = attr.address;
  }
  r->size_ = size;
  void* packed = nullptr;
  size_t packed_len = 0;
  s = ucp_rkey_pack(static_cast<ucp_context_h>(context_), memh, &packed, &packed_len);
  if (s != UCS_OK) return UcsError(s, "rkey_pack");
  r->rkey_.assign(static_cast<const char*>(packed), packed_len);
  ucp_rkey_buffer_release(packed);
  return r;
}

absl::StatusOr<std::unique_ptr<UcxTransport::Region>> UcxTransport::Register(void* addr,
                                                                             size_t size) {
  if (addr == nullptr || size == 0) {
    return absl::InvalidArgumentError("ucx register: expected a non-empty buffer");
  }
  return Map(addr, size);
}

absl::StatusOr<std::unique_ptr<UcxTransport::Region>> UcxTransport::Allocate(size_t size) {
  if (size == 0) return absl::InvalidArgumentError("ucx allocate: expected a non-empty size");
  return Map(nullptr, size);
}

absl::Status UcxTransport::Wait(void* request, const char* what, absl::Time deadline) {
  ucs_status_ptr_t req = request;
  if (req == nullptr) return absl::OkStatus();
  if (UCS_PTR_IS_ERR(req)) return UcsError(UCS_PTR_STATUS(req), what);
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      // The waiter drives its own request: a progress thread that is not scheduled (a busy
      // host) would otherwise add its delay to every flush.
      ucp_worker_progress(Worker(worker_));
      const ucs_status_t s = ucp_request_check_status(req);
      if (s != UCS_INPROGRESS) {
        ucp_request_free(req);
        return s == UCS_OK ? absl::OkStatus() : UcsError(s, what);
      }
      if (absl::Now() > deadline) {
        ucp_request_cancel(Worker(worker_), req);
        ucp_request_free(req);
        return absl::DeadlineExceededError(absl::StrCat("ucx: ", what, ": timed out"));
      }
    }
    std::this_thread::yield();
  }
}

absl::StatusOr<std::pair<void*, void*>> UcxTransport::EndpointAndKeyLocked(
    const std::string& peer_address, const std::string& rkey) {
  auto ep_it = eps_.find(peer_address);
  if (ep_it == eps_.end()) {
    if (eps_.size() >= kMaxPeers) {  // the least recently used idle peer goes
      auto lru = eps_.end();
      for (auto it = eps_.begin(); it != eps_.end(); ++it) {
        if (it->second.streams == 0 && (lru == eps_.end() || it->second.used < lru->second.used)) {
          lru = it;
        }
      }
      if (lru == eps_.end()) {
        return absl::ResourceExhaustedError(
            absl::StrCat("ucx: ", kMaxPeers, " peers have transfers running"));
      }
      ForgetPeerLocked(std::string(lru->first));
    }
    // No peer error-handling mode: in UCX 1.13 it rules out the shared-memory transports
    // (the transfer then crawls over TCP loopback). A dead peer is caught by the deadline.
    ucp_ep_params_t ep_params{};
    ep_params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
    ep_params.address = reinterpret_cast<const ucp_address_t*>(peer_address.data());
    ucp_ep_h ep = nullptr;
    const ucs_status_t s = ucp_ep_create(Worker(worker_), &ep_params, &ep);
    if (s != UCS_OK) return UcsError(s, "ep_create");
    ep_it = eps_.emplace(peer_address, Cached{ep}).first;
  }
  const auto key = std::make_pair(peer_address, rkey);
  auto rk_it = rkeys_.find(key);
  if (rk_it == rkeys_.end()) {
    // A receiver hands out a new buffer (a new rkey) when it drops one: the peer's least
    // recently used idle rkeys go past kMaxKeysPerPeer.
    size_t held = 0;
    auto lru = rkeys_.end();
    for (auto it = rkeys_.lower_bound({peer_address, ""});
         it != rkeys_.end() && it->first.first == peer_address; ++it) {
      ++held;
      if (it->second.streams == 0 && (lru == rkeys_.end() || it->second.used < lru->second.used)) {
        lru = it;
      }
    }
    if (held >= kMaxKeysPerPeer && lru != rkeys_.end()) {
      ucp_rkey_destroy(static_cast<ucp_rkey_h>(lru->second.handle));
      rkeys_.erase(lru);
    }
    ucp_rkey_h remote_key = nullptr;
    const ucs_status_t s =
        ucp_ep_rkey_unpack(static_cast<ucp_ep_h>(ep_it->second.handle), rkey.data(), &remote_key);
    if (s != UCS_OK) return UcsError(s, "rkey_unpack");
    rk_it = rkeys_.emplace(key, Cached{remote_key}).first;
  }
  ++ep_it->second.streams;
  ++rk_it->second.streams;
  ep_it->second.used = rk_it->second.used = ++clock_;
  return std::make_pair(ep_it->second.handle, rk_it->second.handle);
}

void UcxTransport::ReleaseLocked(const std::string& peer_address, const std::string& rkey) {
  if (auto it = eps_.find(peer_address); it != eps_.end() && it->second.streams > 0) {
    --it->second.streams;
  }
  if (auto it = rkeys_.find({peer_address, rkey}); it != rkeys_.end() && it->second.streams > 0) {
    --it->second.streams;
  }
}

size_t UcxTransport::cached_peers() {
  std::lock_guard<std::mutex> lock(mu_);
  return eps_.size();
}

size_t UcxTransport::cached_keys() {
  std::lock_guard<std::mutex> lock(mu_);
  return rkeys_.size();
}

void UcxTransport::ForgetPeerLocked(const std::string& peer_address) {
  for (auto it = rkeys_.begin(); it != rkeys_.end();) {
    if (it->first.first == peer_address) {
      ucp_rkey_destroy(static_cast<ucp_rkey_h>(it->second.handle));
      it = rkeys_.erase(it);
    } else {
      ++it;
    }
  }
  auto ep = eps_.find(peer_address);
  if (ep == eps_.end()) return;
  ucp_request_param_t cp{};
  cp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  cp.flags = UCP_EP_CLOSE_FLAG_FORCE;
  ucs_status_ptr_t req = ucp_ep_close_nbx(static_cast<ucp_ep_h>(ep->second.handle), &cp);
  if (req != nullptr && !UCS_PTR_IS_ERR(req)) ucp_request_free(req);  // completes on its own
  eps_.erase(ep);
}

// One transfer's puts over a cached endpoint; destroyed without Finish (a failed transfer) it
// cancels what is outstanding and forgets the peer's endpoint, so the next transfer connects
// afresh.
class UcxTransport::Stream final : public PutStream {
 public:
  Stream(UcxTransport* ucx, std::string peer, std::string packed_rkey, void* ep, void* rkey,
         absl::Time deadline)
      : ucx_(ucx),
        peer_(std::move(peer)),
        packed_rkey_(std::move(packed_rkey)),
        ep_(ep),
        rkey_(rkey),
        deadline_(deadline) {}
  ~Stream() override;
  absl::StatusOr<uint64_t> Write(const void* local, size_t size, uint64_t remote_addr) override;
  absl::Status WaitFor(uint64_t ticket) override;
  absl::Status Fence() override;
  absl::Status Flush() override;
  absl::Status Finish() override;

 private:
  absl::Status WaitOldest();
  UcxTransport* const ucx_;
  const std::string peer_;
  const std::string packed_rkey_;  // the cache's key of rkey_
  void* const ep_;    // ucp_ep_h
  void* const rkey_;  // ucp_rkey_h
  const absl::Time deadline_;
  uint64_t issued_ = 0, completed_ = 0;             // tickets
  std::deque<std::pair<uint64_t, void*>> pending_;  // (ticket, request)
  bool failed_ = false, finished_ = false;
};

absl::StatusOr<std::unique_ptr<PutStream>> UcxTransport::OpenPutStream(
    const std::string& peer_address, const std::string& rkey, absl::Time deadline) {
  if (peer_address.empty() || rkey.empty()) {
    return absl::InvalidArgumentError(
        "ucx put: expected a peer address and an rkey, got an empty one");
  }
  std::lock_guard<std::mutex> lock(mu_);
  absl::StatusOr<std::pair<void*, void*>> er = EndpointAndKeyLocked(peer_address, rkey);
  if (!er.ok()) return er.status();
  return std::make_unique<Stream>(this, peer_address, rkey, er->first, er->second, deadline);
}

UcxTransport::Stream::~Stream() {
  std::lock_guard<std::mutex> lock(ucx_->mu_);
  if (finished_) {  // the endpoint and rkey stay cached, idle
    ucx_->ReleaseLocked(peer_, packed_rkey_);
    return;
  }
  for (auto& [ticket, req] : pending_) {
    ucp_request_cancel(Worker(ucx_->worker_), req);
    ucp_request_free(req);
  }
  ucx_->ForgetPeerLocked(peer_);
}

absl::Status UcxTransport::Stream::WaitOldest() {
  const auto [ticket, req] = pending_.front();
  pending_.pop_front();
  absl::Status st = ucx_->Wait(req, "put", deadline_);
  if (!st.ok()) failed_ = true;
  completed_ = std::max(completed_, ticket);
  return st;
}

absl::StatusOr<uint64_t> UcxTransport::Stream::Write(const void* local, size_t size,
                                                     uint64_t remote_addr) {
  constexpr size_t kInFlight = 8;  // puts outstanding before waiting on the oldest
  if (failed_ || finished_) return absl::FailedPreconditionError("ucx put: the stream is closed");
  const uint64_t ticket = ++issued_;
  ucs_status_ptr_t req;
  {
    std::lock_guard<std::mutex> lock(ucx_->mu_);
    ucp_request_param_t rp{};
    req = ucp_put_nbx(static_cast<ucp_ep_h>(ep_), local, size, remote_addr,
                      static_cast<ucp_rkey_h>(rkey_), &rp);
  }
  if (UCS_PTR_IS_ERR(req)) {
    failed_ = true;
    return UcsError(UCS_PTR_STATUS(req), "put");
  }
  if (req == nullptr) {
    if (pending_.empty()) completed_ = ticket;
  } else {
    pending_.emplace_back(ticket, req);
  }
  while (pending_.size() > kInFlight) {
    absl::Status st = WaitOldest();
    if (!st.ok()) return st;
  }
  return ticket;
}

absl::Status UcxTransport::Stream::WaitFor(uint64_t ticket) {
  while (completed_ < ticket && !pending_.empty()) {
    absl::Status st = WaitOldest();
    if (!st.ok()) return st;
  }
  if (pending_.empty()) completed_ = issued_;
  return absl::OkStatus();
}

absl::Status UcxTransport::Stream::Fence() {
  if (failed_ || finished_) return absl::FailedPreconditionError("ucx put: the stream is closed");
  std::lock_guard<std::mutex> lock(ucx_->mu_);
  const ucs_status_t s = ucp_worker_fence(Worker(ucx_->worker_));
  if (s == UCS_OK) return absl::OkStatus();
  failed_ = true;
  return UcsError(s, "fence");
}

absl::Status UcxTransport::Stream::Finish() {
  absl::Status st = Flush();
  if (!st.ok()) return st;
  finished_ = true;
  return absl::OkStatus();
}

absl::Status UcxTransport::Stream::Flush() {
  if (failed_ || finished_) return absl::FailedPreconditionError("ucx put: the stream is closed");
  absl::Status st = WaitFor(issued_);
  if (!st.ok()) return st;
  ucs_status_ptr_t req;
  {
    std::lock_guard<std::mutex> lock(ucx_->mu_);
    ucp_request_param_t rp{};
    req = ucp_ep_flush_nbx(static_cast<ucp_ep_h>(ep_), &rp);
  }
  st = ucx_->Wait(req, "flush", deadline_);
  if (!st.ok()) failed_ = true;
  return st;
}

absl::Status UcxTransport::Put(const std::string& peer_address, const void* local, size_t size,
                               uint64_t remote_addr, const std::string& rkey, size_t chunk,
                               absl::Duration timeout) {
  absl::StatusOr<std::unique_ptr<PutStream>> stream =
      OpenPutStream(peer_address, rkey, absl::Now() + timeout);
  if (!stream.ok()) return stream.status();
  if (chunk == 0) chunk = size;
  const char* src = static_cast<const char*>(local);
  for (size_t off = 0; off < size; off += chunk) {
    absl::StatusOr<uint64_t> t =
        (*stream)->Write(src + off, std::min(chunk, size - off), remote_addr + off);
    if (!t.ok()) return t.status();
  }
  return (*stream)->Finish();
}

}  // namespace replayssm::transfer
