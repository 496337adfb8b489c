// UcxTransport: the UCX (ucp) data plane of slot transfers between instances. One ucp
// context and worker per transport, a progress thread, registration of receive buffers
// (memory map + packed rkey), and one-sided puts into a peer's registered buffer completed by
// a flush (a PutLane). The control plane (reserve, commit, abort) is the Peer's. Transports
// and their tuning come from UCX's own environment variables (UCX_TLS, UCX_NET_DEVICES, ...);
// nothing here overrides them.
//
// Thread safety: every method is thread-safe. The worker runs in UCS_THREAD_MODE_SERIALIZED
// behind mu_ (the multi-threaded mode rules out the shared-memory transports in UCX 1.13).
#ifndef REPLAYSSM_TRANSFER_UCX_TRANSPORT_H_
#define REPLAYSSM_TRANSFER_UCX_TRANSPORT_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "replayssm/transfer/put_lane.h"

namespace replayssm::transfer {

class UcxTransport final : public PutLane {
 public:
  // progress_thread = false: a sender's extra put lane (Sender's lanes): nothing is ever put
  // into it, so no thread polls its worker; waits on its requests progress it themselves.
  static absl::StatusOr<std::unique_ptr<UcxTransport>> Create(bool progress_thread = true);
  ~UcxTransport() override;
  UcxTransport(const UcxTransport&) = delete;
  UcxTransport& operator=(const UcxTransport&) = delete;

  // This worker's address, to hand to a peer over the control channel.
  const std::string& address() const { return address_; }
  // Whether the UCX loaded at run time can put from/to CUDA device memory directly
  // (ucp_context_query: memory_types contains UCS_MEMORY_TYPE_CUDA).
  bool takes_device_memory() const override { return cuda_memory_; }

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

  absl::StatusOr<std::unique_ptr<PutStream>> OpenPutStream(const std::string& peer_address,
                                                           const std::string& rkey,
                                                           absl::Time deadline) override;

  // Puts local[0, size) into the peer's region at remote_addr in chunks of `chunk` bytes
  // (several in flight), then flushes, so the bytes are in the peer's memory on return.
  absl::Status Put(const std::string& peer_address, const void* local, size_t size,
                   uint64_t remote_addr, const std::string& rkey, size_t chunk,
                   absl::Duration timeout);

 private:
  class Stream;  // a PutStream over one endpoint
  UcxTransport() = default;
  void ProgressLoop();
  // Maps [addr, addr + size) for remote access (addr null: UCX allocates it) and packs its rkey.
  absl::StatusOr<std::unique_ptr<Region>> Map(void* addr, size_t size);
  // Waits for a request, progressing the worker itself; frees it.
  absl::Status Wait(void* request, const char* what, absl::Time deadline);
  // A cached endpoint to `peer_address` and the rkey unpacked on it: mapping a peer's region
  // (shared memory: attach and first-touch faults) costs more than a put, so both are kept
  // for the next transfer to the same buffer, and held (not evictable) until the stream that
  // asked releases them (ReleaseLocked). Bounded: kMaxPeers endpoints and kMaxKeysPerPeer
  // rkeys a peer, the least recently used idle one evicted for a new one. A peer that
  // restarts has a new worker address, so its old endpoint is never asked for again: without
  // the bound they piled up (with their shared-memory attachments) until the 65th peer was
  // refused for good (an outside review's soak). Requires mu_.
  absl::StatusOr<std::pair<void*, void*>> EndpointAndKeyLocked(const std::string& peer_address,
                                                               const std::string& rkey);
  void ReleaseLocked(const std::string& peer_address, const std::string& rkey);
  void ForgetPeerLocked(const std::string& peer_address);

  void* context_ = nullptr;  // ucp_context_h
  void* worker_ = nullptr;   // ucp_worker_h
  std::string address_;
  bool cuda_memory_ = false;
  std::atomic<bool> stop_{false};
  std::thread progress_;  // not started for a lane (Create(false)): Wait progresses instead
  std::mutex mu_;         // every call on worker_ after Create
  struct Cached {
    void* handle = nullptr;  // ucp_ep_h or ucp_rkey_h
    int streams = 0;         // open streams using it: not evictable
    uint64_t used = 0;       // clock_ at its last use (LRU)
  };
  std::map<std::string, Cached> eps_;                            // peer address -> endpoint
  std::map<std::pair<std::string, std::string>, Cached> rkeys_;  // (peer, packed) -> rkey
  uint64_t clock_ = 0;

 public:
  static constexpr size_t kMaxPeers = 64;
  static constexpr size_t kMaxKeysPerPeer = 16;
  // Cached endpoints and rkeys now (tests).
  size_t cached_peers();
  size_t cached_keys();
};

}  // namespace replayssm::transfer

#endif  // REPLAYSSM_TRANSFER_UCX_TRANSPORT_H_
