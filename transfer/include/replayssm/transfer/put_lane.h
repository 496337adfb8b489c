// Where a sender's bytes go: one-sided puts into a peer's registered buffer. UcxTransport is
// the real lane; tests wrap one to fail or watch puts (a fault-injecting transport, as
// LevelDB's fault-injection Env).
#ifndef REPLAYSSM_TRANSFER_PUT_LANE_H_
#define REPLAYSSM_TRANSFER_PUT_LANE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace replayssm::transfer {

// One transfer's puts into one peer's region. Not thread-safe; one stream per lane and
// transfer. Destroying it without Finish (a failed transfer) cancels what is outstanding.
class PutStream {
 public:
  virtual ~PutStream() = default;
  // Issues a put of local[0, size) to remote_addr; `local` stays valid until WaitFor(the
  // returned ticket) or Flush returned.
  virtual absl::StatusOr<uint64_t> Write(const void* local, size_t size, uint64_t remote_addr) = 0;
  // Waits until the puts up to `ticket` completed locally (their source may be reused).
  virtual absl::Status WaitFor(uint64_t ticket) = 0;
  // Puts issued on this stream after the fence land after those issued before it.
  virtual absl::Status Fence() = 0;
  // Every put issued so far is in the peer's memory on return; a put issued afterwards, on
  // any lane, lands after them. The stream stays open.
  virtual absl::Status Flush() = 0;
  // Flush, then close.
  virtual absl::Status Finish() = 0;
};

class PutLane {
 public:
  virtual ~PutLane() = default;
  // Whether puts may read device (CUDA) memory directly.
  virtual bool takes_device_memory() const = 0;
  // A stream to the region `rkey` of the peer worker `peer_address`; every wait in it ends by
  // `deadline`.
  virtual absl::StatusOr<std::unique_ptr<PutStream>> OpenPutStream(const std::string& peer_address,
                                                                   const std::string& rkey,
                                                                   absl::Time deadline) = 0;
};

}  // namespace replayssm::transfer

#endif  // REPLAYSSM_TRANSFER_PUT_LANE_H_
