#include "ucx_transport.h"

#include <ucp/api/ucp.h>

#include <chrono>
#include <vector>

#include "absl/strings/str_cat.h"

namespace replayssm::transfer {
namespace {

absl::Status UcsError(ucs_status_t s, const char* what) {
  return absl::UnavailableError(absl::StrCat("ucx: ", what, ": ", ucs_status_string(s)));
}

ucp_worker_h Worker(void* w) { return static_cast<ucp_worker_h>(w); }

// Waits for a non-blocking request (or an immediate status) with the progress thread
// driving it; frees the request.
absl::Status Wait(ucs_status_ptr_t req, const char* what, absl::Time deadline) {
  if (req == nullptr) return absl::OkStatus();
  if (UCS_PTR_IS_ERR(req)) return UcsError(UCS_PTR_STATUS(req), what);
  ucs_status_t s;
  while ((s = ucp_request_check_status(req)) == UCS_INPROGRESS) {
    if (absl::Now() > deadline) {
      ucp_request_cancel(nullptr, req);  // the worker argument is unused by UCX 1.13
      ucp_request_free(req);
      return absl::DeadlineExceededError(absl::StrCat("ucx: ", what, ": timed out"));
    }
    std::this_thread::yield();
  }
  ucp_request_free(req);
  return s == UCS_OK ? absl::OkStatus() : UcsError(s, what);
}

}  // namespace

absl::StatusOr<std::unique_ptr<UcxTransport>> UcxTransport::Create() {
  std::unique_ptr<UcxTransport> t(new UcxTransport());
  ucp_config_t* config = nullptr;
  ucs_status_t s = ucp_config_read(nullptr, nullptr, &config);
  if (s != UCS_OK) return UcsError(s, "read config");
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
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
  wparams.thread_mode = UCS_THREAD_MODE_MULTI;
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
  t->progress_ = std::thread([p = t.get()] { p->ProgressLoop(); });
  return t;
}

UcxTransport::~UcxTransport() {
  stop_ = true;
  if (progress_.joinable()) progress_.join();
  if (worker_ != nullptr) ucp_worker_destroy(Worker(worker_));
  if (context_ != nullptr) ucp_cleanup(static_cast<ucp_context_h>(context_));
}

void UcxTransport::ProgressLoop() {
  while (!stop_.load(std::memory_order_relaxed)) {
    if (ucp_worker_progress(Worker(worker_)) == 0) {
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }
}

UcxTransport::Region::~Region() {
  if (memh_ != nullptr) {
    ucp_mem_unmap(static_cast<ucp_context_h>(context_), static_cast<ucp_mem_h>(memh_));
  }
}

absl::StatusOr<std::unique_ptr<UcxTransport::Region>> UcxTransport::Register(void* addr,
                                                                            size_t size) {
  if (addr == nullptr || size == 0) {
    return absl::InvalidArgumentError("ucx register: expected a non-empty buffer");
  }
  std::unique_ptr<Region> r(new Region());
  r->context_ = context_;
  r->base_ = addr;
  r->size_ = size;
  ucp_mem_map_params_t mp{};
  mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
  mp.address = addr;
  mp.length = size;
  ucp_mem_h memh = nullptr;
  ucs_status_t s = ucp_mem_map(static_cast<ucp_context_h>(context_), &mp, &memh);
  if (s != UCS_OK) return UcsError(s, "mem_map");
  r->memh_ = memh;
  void* packed = nullptr;
  size_t packed_len = 0;
  s = ucp_rkey_pack(static_cast<ucp_context_h>(context_), memh, &packed, &packed_len);
  if (s != UCS_OK) return UcsError(s, "rkey_pack");
  r->rkey_.assign(static_cast<const char*>(packed), packed_len);
  ucp_rkey_buffer_release(packed);
  return r;
}

absl::Status UcxTransport::Put(const std::string& peer_address, const void* local, size_t size,
                               uint64_t remote_addr, const std::string& rkey, size_t chunk,
                               absl::Duration timeout) {
  if (peer_address.empty() || rkey.empty()) {
    return absl::InvalidArgumentError("ucx put: expected a peer address and an rkey");
  }
  if (chunk == 0) chunk = size;
  const absl::Time deadline = absl::Now() + timeout;
  ucp_ep_params_t ep_params{};
  ep_params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  ep_params.address = reinterpret_cast<const ucp_address_t*>(peer_address.data());
  ep_params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  ucp_ep_h ep = nullptr;
  ucs_status_t s = ucp_ep_create(Worker(worker_), &ep_params, &ep);
  if (s != UCS_OK) return UcsError(s, "ep_create");
  ucp_rkey_h remote_key = nullptr;
  s = ucp_ep_rkey_unpack(ep, rkey.data(), &remote_key);
  absl::Status st = s == UCS_OK ? absl::OkStatus() : UcsError(s, "rkey_unpack");
  constexpr size_t kInFlight = 8;  // chunks outstanding before waiting on the oldest
  std::vector<ucs_status_ptr_t> pending;
  const char* src = static_cast<const char*>(local);
  for (size_t off = 0; st.ok() && off < size; off += chunk) {
    ucp_request_param_t rp{};
    ucs_status_ptr_t req = ucp_put_nbx(ep, src + off, std::min(chunk, size - off),
                                       remote_addr + off, remote_key, &rp);
    if (UCS_PTR_IS_ERR(req)) {
      st = UcsError(UCS_PTR_STATUS(req), "put");
      break;
    }
    if (req != nullptr) pending.push_back(req);
    if (pending.size() >= kInFlight) {
      st = Wait(pending.front(), "put", deadline);
      pending.erase(pending.begin());
    }
  }
  for (ucs_status_ptr_t req : pending) {
    const absl::Status w = Wait(req, "put", deadline);
    if (st.ok()) st = w;
  }
  if (st.ok()) {
    ucp_request_param_t rp{};
    st = Wait(ucp_ep_flush_nbx(ep, &rp), "flush", deadline);
  }
  if (remote_key != nullptr) ucp_rkey_destroy(remote_key);
  ucp_request_param_t cp{};
  cp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  cp.flags = st.ok() ? 0 : UCP_EP_CLOSE_FLAG_FORCE;
  const absl::Status closed = Wait(ucp_ep_close_nbx(ep, &cp), "close", deadline + absl::Seconds(1));
  return st.ok() ? closed : st;
}

}  // namespace replayssm::transfer
