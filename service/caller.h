// The caller of an RPC of a client-facing service: its bearer token authenticated against
// --auth-tokens (tenants.h), and the service context bound to its tenant (its slot handles,
// request ids, prefix cache and registered regions). One function so that every handler
// refuses alike: UNAUTHENTICATED, counted in replayssm_auth_failures_total{reason}.
#ifndef REPLAYSSM_SERVICE_CALLER_H_
#define REPLAYSSM_SERVICE_CALLER_H_

#include <functional>
#include <memory>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/grpcpp.h"
#include "replayssm/cache/regions.h"
#include "service/service_context.h"

namespace replayssm::service {

// The metadata key of the bearer token (gRPC keys are lower case).
inline constexpr char kAuthorizationKey[] = "authorization";

// `ctx` as the caller of `c` sees it: kImplicitTenant without a token store, else the tenant
// of its token. UNAUTHENTICATED (counted in ctx.metrics) when the token is missing or unknown.
absl::StatusOr<ServiceContext> CallerContext(const grpc::ServerContextBase& c,
                                             const ServiceContext& ctx);

// For a stream opened by `caller` (CallerContext): OK while the call's token still names
// the caller's tenant among the tokens loaded now; UNAUTHENTICATED (counted as an auth failure
// of reason "revoked") once the token file no longer holds it, or gives it to another tenant.
// `*checked` is the stream's: the token set generation it last found the token in (0 at
// first), so that the token is looked up only after a reload (TokenStore::generation). No
// I/O: a stream may check under its own lock. Without a token store, always OK.
absl::Status CheckStillAuthorized(const grpc::ServerContextBase& c, const ServiceContext& caller,
                                  uint64_t* checked);

// The registered regions of each tenant: a RegionTable of its own (so names never collide
// and --max-regions / --max-region-bytes bound each tenant), made on first use and kept. A
// tenant maps only POSIX shm objects named "/<tenant>:..." (tenant names never hold ':'), so
// it can neither read nor write another tenant's engine memory, nor learn whether such an
// object exists. Thread-safe.
class TenantRegions {
 public:
  // device_quiet: each table's (cache/regions.h).
  TenantRegions(int32_t backend, cache::RegionLimits limits, std::function<bool()> device_quiet)
      : backend_(backend), limits_(limits), device_quiet_(std::move(device_quiet)) {}
  // `name`: the tenant's name (its shm key prefix).
  cache::RegionTable* For(TenantId tenant, const std::string& name) ABSL_LOCKS_EXCLUDED(mu_);
  // RegionTable::ExpireIdle over every tenant's table (--region-ttl).
  int32_t ExpireIdle(absl::Time cutoff) ABSL_LOCKS_EXCLUDED(mu_);
  // RegionTable::held_unmaps and forced_unmaps over every tenant's table.
  int64_t held_unmaps() ABSL_LOCKS_EXCLUDED(mu_);
  int64_t forced_unmaps() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  const int32_t backend_;
  const cache::RegionLimits limits_;
  const std::function<bool()> device_quiet_;
  absl::Mutex mu_;
  absl::flat_hash_map<TenantId, std::unique_ptr<cache::RegionTable>> tables_ ABSL_GUARDED_BY(mu_);
};

}  // namespace replayssm::service

#endif  // REPLAYSSM_SERVICE_CALLER_H_
