#include "service/caller.h"

#include <algorithm>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace replayssm::service {

namespace {

const char* Reason(AuthFailure f) {
  switch (f) {
    case AuthFailure::kMissing: return "missing";
    case AuthFailure::kMalformed: return "malformed";
    case AuthFailure::kUnknown: return "unknown";
  }
  return "unknown";
}

}  // namespace

absl::StatusOr<ServiceContext> CallerContext(const grpc::ServerContextBase& c,
                                             const ServiceContext& ctx) {
  if (ctx.tokens == nullptr) return ctx.ForTenant(kImplicitTenant);
  std::optional<absl::string_view> authorization;
  const auto& md = c.client_metadata();
  // Two headers: which one a proxy in front checked is unknown, so neither is taken.
  if (const size_t n = md.count(kAuthorizationKey); n > 1) {
    ctx.metrics->CountAuthFailure(Reason(AuthFailure::kMalformed));
    return absl::UnauthenticatedError(absl::StrCat(
        "authorization: expected one `authorization: Bearer <token>` header, got ", n));
  }
  if (auto it = md.find(kAuthorizationKey); it != md.end()) {
    authorization = absl::string_view(it->second.data(), it->second.size());
  }
  AuthFailure failure = AuthFailure::kUnknown;
  absl::StatusOr<TenantId> tenant = ctx.tokens->Authenticate(authorization, &failure);
  if (!tenant.ok()) {
    ctx.metrics->CountAuthFailure(Reason(failure));
    return tenant.status();
  }
  return ctx.ForTenant(*tenant);
}

absl::Status CheckStillAuthorized(const grpc::ServerContextBase& c, const ServiceContext& caller,
                                  uint64_t* checked) {
  if (caller.tokens == nullptr) return absl::OkStatus();
  const uint64_t generation = caller.tokens->generation();  // before the lookup: a reload
  if (generation == *checked) return absl::OkStatus();      // after it is looked at next time
  const auto& md = c.client_metadata();
  auto it = md.find(kAuthorizationKey);
  const std::optional<TenantId> now =
      it == md.end()
          ? std::nullopt
          : caller.tokens->LoadedTenantOf(absl::string_view(it->second.data(), it->second.size()));
  if (now == caller.tenant()) {
    *checked = generation;
    return absl::OkStatus();
  }
  caller.metrics->CountAuthFailure("revoked");
  return absl::UnauthenticatedError(
      "authorization: this stream's token is no longer in the server's token file (or names "
      "another tenant now): open a new stream with a current token");
}

ServiceContext ServiceContext::ForTenant(TenantId tenant) const {
  ServiceContext c = *this;
  c.slots = SlotCodec(slots.handles(), tenant);
  if (tenant_regions != nullptr) c.regions = tenant_regions->For(tenant, tokens->Name(tenant));
  return c;
}

absl::Status ServiceContext::CheckSlotQuota(int64_t adding) const {
  const int64_t max = limits.tenant_max_slots;
  if (tokens == nullptr || max <= 0) return absl::OkStatus();
  const int64_t held = slots.handles()->Held(tenant());
  if (held + adding <= max) return absl::OkStatus();
  return SlotQuotaError(tenant(), held);
}

absl::Status ServiceContext::ReserveIncomingSlot(TenantId owner) const {
  const int64_t max = tokens == nullptr ? 0 : limits.tenant_max_slots;
  if (slots.handles()->Reserve(owner, max)) return absl::OkStatus();
  return SlotQuotaError(owner, max);
}

absl::Status ServiceContext::SlotQuotaError(TenantId owner, int64_t held) const {
  const int64_t max = limits.tenant_max_slots;
  return absl::ResourceExhaustedError(absl::StrCat(
      "slots: tenant \"", tokens->Name(owner), "\" holds ", std::min(held, max),
      " live slots and incoming transfers, the most one tenant may (--tenant-max-slots ", max,
      "); free one (or let --slot-ttl expire it)"));
}

int32_t TenantRegions::ExpireIdle(absl::Time cutoff) {
  absl::MutexLock lock(&mu_);  // tables are never removed: their pointers stay valid
  int32_t n = 0;
  for (auto& [tenant, table] : tables_) n += table->ExpireIdle(cutoff);
  return n;
}

int64_t TenantRegions::held_unmaps() {
  absl::MutexLock lock(&mu_);
  int64_t n = 0;
  for (auto& [tenant, table] : tables_) n += table->held_unmaps();
  return n;
}

int64_t TenantRegions::forced_unmaps() {
  absl::MutexLock lock(&mu_);
  int64_t n = 0;
  for (auto& [tenant, table] : tables_) n += table->forced_unmaps();
  return n;
}

cache::RegionTable* TenantRegions::For(TenantId tenant, const std::string& name) {
  absl::MutexLock lock(&mu_);
  std::unique_ptr<cache::RegionTable>& t = tables_[tenant];
  if (t == nullptr) {
    cache::RegionLimits limits = limits_;
    limits.key_prefix = absl::StrCat("/", name, ":");
    t = std::make_unique<cache::RegionTable>(backend_, limits, device_quiet_);
  }
  return t.get();
}

}  // namespace replayssm::service
