// UcxTransport: the UCX (ucp) data plane of slot transfers between instances. One ucp
// context and worker per process, a progress thread, registration of receive buffers
// (memory map + packed rkey), and a chunked one-sided put into a peer's registered buffer
// completed by a flush. The control plane (reserve, commit, abort, leases) is gRPC and lives
// in the service. Transports and their tuning come from UCX's own environment variables
// (UCX_TLS, UCX_NET_DEVICES, ...); nothing here overrides them.
//
// Thread safety: every method is thread-safe. The worker runs in UCS_THREAD_MODE_SERIALIZED
// behind mu_ (the multi-threaded mode rules out the shared-memory transports in UCX 1.13).
#ifndef REPLAYSSM_SERVICE_TRANSFER_UCX_TRANSPORT_H_
#define REPLAYSSM_SERVICE_TRANSFER_UCX_TRANSPORT_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace replayssm::transfer {

class UcxTransport {
 public:
  // progress_thread = false: a sender's extra put lane (Sender's lanes): nothing is ever put
  // into it, so no thread polls its worker; waits on its requests progress it themselves.
  static absl::StatusOr<std::unique_ptr<UcxTransport>> Create(bool progress_thread = true);
  ~UcxTransport();
  UcxTransport(const UcxTransport&) = delete;
  UcxTransport& operator=(const UcxTransport&) = delete;

  // This worker's address, to hand to a peer over the control channel.
  const std::string& address() const { return address_; }
  // Whether the UCX loaded at run time can put from/to CUDA device memory directly
  // (ucp_context_query: memory_types contains UCS_MEMORY_TYPE_CUDA).
  bool cuda_memory() const { return cuda_memory_; }
  // For tests of the path selection: pretend the capability is (not) there.
  void OverrideCudaMemoryForTest(bool on) { cuda_memory_ = on; }

  // A registered receive buffer: peers put into [addr, addr + size) with `rkey`.
  class Region {
   public:
    ~Region();
    uint64_t addr() const { return reinterpret_cast<uint64_t>(base_); }
    uint8_t* data() const { return static_cast<uint8_t*>(base_); }
    size_t size() const { return size_; }
    const std::string& rkey() const { return rkey_; }

   private:
    friend class UcxTransport;
    Region() = default;
    void* context_ = nullptr;  // ucp_context_h
    void* memh_ = nullptr;     // ucp_mem_h
    void* base_ = nullptr;
    size_t size_ = 0;
    std::string rkey_;
  };
  absl::StatusOr<std::unique_ptr<Region>> Register(void* addr, size_t size);
  // Memory that UCX allocates and registers itself (freed with the region). Prefer it for
  // receive buffers: shared-memory transports can map it into the sender directly, where a
  // buffer of ours would be reached through software-emulated RMA (active messages).
  absl::StatusOr<std::unique_ptr<Region>> Allocate(size_t size);

  // One transfer's puts into one registered region of one peer, issued as the data becomes
  // ready (a pipeline: stage chunk i+1 while chunk i is put). Not thread-safe itself; one
  // stream per transfer. Destroying it without Finish (a failed transfer) cancels what is
  // outstanding and forgets the peer's endpoint.
  class PutStream {
   public:
    ~PutStream();
    // Issues a put of local[0, size) to remote_addr (at most kInFlight outstanding; waits on
    // the oldest beyond). `local` must stay valid until WaitFor(the returned ticket).
    absl::StatusOr<uint64_t> Write(const void* local, size_t size, uint64_t remote_addr);
    // Writes `value` (8 bytes) to remote_addr after every earlier Write has landed (a fence):
    // the receiver's doorbell, so it can consume the bytes as they arrive.
    absl::Status Signal(uint64_t remote_addr, uint64_t value);
    // Waits until the puts up to `ticket` completed locally (their source may be reused).
    absl::Status WaitFor(uint64_t ticket);
    // Waits for everything and flushes the endpoint: every put issued so far is in the peer's
    // memory on return (a put issued afterwards, on any endpoint, lands after them). The
    // stream stays open.
    absl::Status Flush();
    // Waits for everything and flushes: the bytes are in the peer's memory on return.
    absl::Status Finish();

   private:
    friend class UcxTransport;
    PutStream() = default;
    absl::Status WaitOldest();
    UcxTransport* ucx_ = nullptr;
    std::string peer_;
    void* ep_ = nullptr;    // ucp_ep_h
    void* rkey_ = nullptr;  // ucp_rkey_h
    absl::Time deadline_;
    uint64_t issued_ = 0, completed_ = 0;           // tickets
    std::deque<std::pair<uint64_t, void*>> pending_;  // (ticket, request)
    std::deque<uint64_t> signals_;                    // sources of Signal's puts, kept alive
    bool failed_ = false, finished_ = false;
  };
  absl::StatusOr<std::unique_ptr<PutStream>> OpenPutStream(const std::string& peer_address,
                                                           const std::string& rkey,
                                                           absl::Duration timeout);

  // Puts local[0, size) into the peer's region at remote_addr in chunks of `chunk` bytes
  // (several in flight), then flushes, so the bytes are in the peer's memory on return.
  absl::Status Put(const std::string& peer_address, const void* local, size_t size,
                   uint64_t remote_addr, const std::string& rkey, size_t chunk,
                   absl::Duration timeout);

 private:
  UcxTransport() = default;
  void ProgressLoop();
  // Waits for a request with the progress thread driving it; frees it.
  absl::Status Wait(void* request, const char* what, absl::Time deadline);
  // A cached endpoint to `peer_address` and the rkey unpacked on it: mapping a peer's region
  // (shared memory: attach and first-touch faults) costs more than a put, so both are kept
  // for the next transfer to the same buffer. Requires mu_.
  absl::StatusOr<std::pair<void*, void*>> EndpointAndKeyLocked(const std::string& peer_address,
                                                               const std::string& rkey);
  void ForgetPeerLocked(const std::string& peer_address);

  void* context_ = nullptr;  // ucp_context_h
  void* worker_ = nullptr;   // ucp_worker_h
  std::string address_;
  bool cuda_memory_ = false;
  std::atomic<bool> stop_{false};
  std::thread progress_;  // not started for a lane (Create(false)): Wait progresses instead
  std::mutex mu_;                                  // every call on worker_ after Create
  std::map<std::string, void*> eps_;               // peer address -> ucp_ep_h
  std::map<std::pair<std::string, std::string>, void*> rkeys_;  // (peer, packed) -> ucp_rkey_h
};

}  // namespace replayssm::transfer

#endif  // REPLAYSSM_SERVICE_TRANSFER_UCX_TRANSPORT_H_
