// Tenants and bearer tokens (--auth-tokens). Every call of the client-facing services
// (ReplaySsm, Regions, SlotTransfer's TransferSlot and PullSlot) names its tenant by the
// metadata `authorization: Bearer <token>`; TokenStore maps tokens to tenants. Without a token
// file every call is the implicit tenant (kImplicitTenant): the server behaves as it did before
// tenants (localhost and trusted networks only).
//
// The token file: one `tenant token` pair per line; `#` starts a comment; blank lines are
// skipped. A tenant is 1..64 of [A-Za-z0-9._-]; a token is 16..256 printable ASCII characters
// without spaces. A tenant may have several tokens (rotation); a token names one tenant. The
// file is read again when its identity (inode, size, modification time) changes: looked at
// on an unknown token at once, else at most once a second, so a new token works at its first
// use and a removed one stops within a second. A file that no longer parses keeps the tokens
// that were loaded (logged once on stderr).
//
// Tenant ids are small integers given in order of first appearance and kept for the process's
// life (a tenant removed from the file keeps its id; its slots are reachable again if it comes
// back). They are local to this process: between servers a tenant is its name.
//
// Thread safety: thread-safe.
#ifndef REPLAYSSM_SERVICE_TENANTS_H_
#define REPLAYSSM_SERVICE_TENANTS_H_

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <ctime>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace replayssm::service {

using TenantId = uint32_t;
// The one tenant of a server without --auth-tokens; never a token's tenant.
inline constexpr TenantId kImplicitTenant = 0;

// How a call was refused, for replayssm_auth_failures_total{reason}.
enum class AuthFailure { kMissing, kMalformed, kUnknown };

class TokenStore {
 public:
  // Reads `path`; INVALID_ARGUMENT `<path>:<line>: ...` naming what is wrong.
  static absl::StatusOr<std::unique_ptr<TokenStore>> Load(const std::string& path);
  // Parses the file's text (`where` names it in errors): tenant name -> tokens.
  static absl::StatusOr<std::vector<std::pair<std::string, std::string>>> Parse(
      absl::string_view text, absl::string_view where);

  // The tenant of an `authorization` metadata value (nullopt: none came). UNAUTHENTICATED
  // with a message that says which of missing / malformed / unknown, never whose; `failure`
  // (optional) gets the reason. The token is compared with every known one in a time that
  // does not depend on which matches or how much of one.
  absl::StatusOr<TenantId> Authenticate(std::optional<absl::string_view> authorization,
                                        AuthFailure* failure = nullptr) ABSL_LOCKS_EXCLUDED(mu_);
  // The tenant of an `authorization` value among the tokens loaded now, the file not looked
  // at (no I/O: for callers under other locks); nullopt when it names none. Open streams
  // check their token with it (CheckStillAuthorized, caller.h) when generation() changed
  // since they last did; the server calls Reload once a second, so a removed token stops
  // them within it.
  std::optional<TenantId> LoadedTenantOf(absl::string_view authorization) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // Counts the token sets loaded (1 after Load): a stream that checked its token at one
  // generation need not look again until it changes (an atomic load per forward, not a lock).
  uint64_t generation() const { return generation_.load(std::memory_order_acquire); }
  // The id of the tenant named `name` when the file names it now.
  std::optional<TenantId> Find(absl::string_view name) const ABSL_LOCKS_EXCLUDED(mu_);
  // The name of tenant `id` ("" for kImplicitTenant or an id never given).
  std::string Name(TenantId id) const ABSL_LOCKS_EXCLUDED(mu_);
  // Reads the file again if it changed (`force`: whatever its identity); a file that does not
  // parse leaves the loaded tokens and returns the error.
  absl::Status Reload(bool force) ABSL_LOCKS_EXCLUDED(mu_);
  int64_t reload_failures() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct FileId {
    ino_t inode = 0;
    off_t size = -1;
    timespec mtime{};
    bool operator==(const FileId& o) const {
      return inode == o.inode && size == o.size && mtime.tv_sec == o.mtime.tv_sec &&
             mtime.tv_nsec == o.mtime.tv_nsec;
    }
  };
  explicit TokenStore(std::string path) : path_(std::move(path)) {}
  // Reads the file if its identity changed (`force`: whatever it is) and takes its tokens;
  // the file system calls are made outside mu_. Reload's and Load's one path.
  absl::Status Fetch(bool force) ABSL_LOCKS_EXCLUDED(mu_);
  // The file's identity and text (no lock: file system calls).
  absl::StatusOr<FileId> Identity() const;
  absl::StatusOr<std::string> Read() const;
  // Parses `text` (of the file `id`) and takes its tokens; a text that does not parse leaves
  // the loaded ones and marks `id` failed (not read again until it changes).
  absl::Status ApplyLocked(const FileId& id, const std::string& text)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  TenantId IdLocked(const std::string& name) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The tenant of `token`, every known token compared (constant time).
  std::optional<TenantId> FindLocked(absl::string_view token) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string path_;
  mutable absl::Mutex mu_;
  FileId file_ ABSL_GUARDED_BY(mu_);    // loaded
  FileId failed_ ABSL_GUARDED_BY(mu_);  // the last that did not parse (not read again)
  absl::Time checked_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  // token -> tenant, compared one by one in constant time (a hash lookup's time depends on
  // the token).
  std::vector<std::pair<std::string, TenantId>> tokens_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, TenantId> ids_ ABSL_GUARDED_BY(mu_);     // every name seen
  absl::flat_hash_map<std::string, bool> listed_ ABSL_GUARDED_BY(mu_);      // names in the file
  std::vector<std::string> names_ ABSL_GUARDED_BY(mu_) = {""};              // by id
  int64_t reload_failures_ ABSL_GUARDED_BY(mu_) = 0;
  std::string logged_failure_ ABSL_GUARDED_BY(mu_);  // the last failure logged ("": none since)
  std::atomic<uint64_t> generation_{0};
};

}  // namespace replayssm::service

#endif  // REPLAYSSM_SERVICE_TENANTS_H_
