#include "service/tenants.h"

#include <sys/stat.h>

#include <fstream>
#include <iostream>
#include <sstream>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "service/secrets.h"

namespace replayssm::service {

namespace {

constexpr size_t kMaxTenantBytes = 64;
constexpr size_t kMinTokenBytes = 16;  // a guessable token is no authentication
constexpr size_t kMaxTokenBytes = 256;
constexpr absl::Duration kRecheck = absl::Seconds(1);  // how stale a removed token may be

bool TenantChar(char c) { return absl::ascii_isalnum(c) || c == '.' || c == '_' || c == '-'; }

bool ValidTenant(absl::string_view t) {
  if (t.empty() || t.size() > kMaxTenantBytes) return false;
  for (char c : t) {
    if (!TenantChar(c)) return false;
  }
  return true;
}

bool ValidToken(absl::string_view t) {
  if (t.size() < kMinTokenBytes || t.size() > kMaxTokenBytes) return false;
  for (char c : t) {
    if (c <= ' ' || c > '~') return false;
  }
  return true;
}

absl::Status LineError(absl::string_view where, int line, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(where, ":", line, ": ", what));
}

absl::Status Unauthenticated(AuthFailure why, AuthFailure* failure, absl::string_view text) {
  if (failure != nullptr) *failure = why;
  return absl::UnauthenticatedError(text);
}

}  // namespace

absl::StatusOr<std::vector<std::pair<std::string, std::string>>> TokenStore::Parse(
    absl::string_view text, absl::string_view where) {
  std::vector<std::pair<std::string, std::string>> out;
  absl::flat_hash_map<std::string, std::string> seen;  // token -> tenant
  int n = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++n;
    if (size_t hash = line.find('#'); hash != absl::string_view::npos) line = line.substr(0, hash);
    line = absl::StripAsciiWhitespace(line);
    if (line.empty()) continue;
    std::vector<absl::string_view> f =
        absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipWhitespace());
    if (f.size() != 2) {
      return LineError(where, n,
                       absl::StrCat("expected `tenant token`, got ", f.size(),
                                    f.size() == 1 ? " field" : " fields"));
    }
    if (!ValidTenant(f[0])) {
      return LineError(where, n,
                       absl::StrCat("tenant: expected 1..", kMaxTenantBytes,
                                    " of [A-Za-z0-9._-], got \"", f[0], "\""));
    }
    if (!ValidToken(f[1])) {  // the token itself is never echoed
      return LineError(
          where, n,
          absl::StrCat("token: expected ", kMinTokenBytes, "..", kMaxTokenBytes,
                       " printable ASCII characters, got ", f[1].size(), " characters or others"));
    }
    auto [it, fresh] = seen.emplace(std::string(f[1]), std::string(f[0]));
    if (!fresh) {
      return LineError(where, n,
                       absl::StrCat("token: expected a token no other line has, got "
                                    "the token of tenant \"",
                                    it->second, "\" again"));
    }
    out.emplace_back(std::string(f[0]), std::string(f[1]));
  }
  return out;
}

absl::StatusOr<std::unique_ptr<TokenStore>> TokenStore::Load(const std::string& path) {
  // A directory reads as nothing, as an empty file does: a server that took either refused
  // every call (an outside review). At start a token file must hold a token; a reload that
  // finds none keeps the loaded ones, as for any file that does not parse.
  struct stat st {};
  if (stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--auth-tokens: expected a token file, got ",
                     S_ISDIR(st.st_mode) ? "a directory" : "something else", " \"", path, "\""));
  }
  std::unique_ptr<TokenStore> store(new TokenStore(path));
  if (absl::Status s = store->Fetch(/*force=*/true); !s.ok()) return s;
  bool none = false;
  {
    absl::MutexLock lock(&store->mu_);
    none = store->tokens_.empty();
  }
  if (none) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--auth-tokens: expected at least one `tenant token` line in \"", path, "\", got none"));
  }
  return store;
}

TenantId TokenStore::IdLocked(const std::string& name) {
  auto [it, fresh] = ids_.emplace(name, static_cast<TenantId>(names_.size()));
  if (fresh) names_.push_back(name);
  return it->second;
}

absl::StatusOr<TokenStore::FileId> TokenStore::Identity() const {
  struct stat st {};
  if (stat(path_.c_str(), &st) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--auth-tokens: expected a readable token file, got \"", path_, "\""));
  }
  return FileId{st.st_ino, st.st_size, st.st_mtim};
}

absl::StatusOr<std::string> TokenStore::Read() const {
  std::ifstream in(path_);
  std::stringstream text;
  text << in.rdbuf();
  if (!in) {
    return absl::InvalidArgumentError(
        absl::StrCat("--auth-tokens: expected a readable token file, got \"", path_, "\""));
  }
  return text.str();
}

absl::Status TokenStore::Fetch(bool force) {
  // The file is looked at and read outside mu_: a slow file system (a hung mount) must not
  // hold up the calls and streams that check tokens meanwhile (LoadedTenantOf runs under the
  // cache event log's lock).
  absl::StatusOr<FileId> id = Identity();
  if (!id.ok()) return id.status();
  if (!force) {
    absl::MutexLock lock(&mu_);
    if (*id == file_ || *id == failed_) return absl::OkStatus();  // nothing new
  }
  absl::StatusOr<std::string> text = Read();
  if (!text.ok()) return text.status();
  absl::MutexLock lock(&mu_);
  return ApplyLocked(*id, *text);
}

absl::Status TokenStore::ApplyLocked(const FileId& id, const std::string& text) {
  absl::StatusOr<std::vector<std::pair<std::string, std::string>>> pairs = Parse(text, path_);
  if (!pairs.ok()) {
    failed_ = id;
    return pairs.status();
  }
  tokens_.clear();
  listed_.clear();
  for (const auto& [tenant, token] : *pairs) {
    tokens_.emplace_back(token, IdLocked(tenant));
    listed_[tenant] = true;
  }
  file_ = id;
  generation_.fetch_add(1, std::memory_order_release);
  return absl::OkStatus();
}

absl::Status TokenStore::Reload(bool force) {
  absl::Status s = Fetch(force);
  absl::MutexLock lock(&mu_);
  checked_ = absl::Now();
  if (s.ok()) {
    logged_failure_.clear();
    return s;
  }
  ++reload_failures_;
  if (s.message() != logged_failure_) {  // once per failure, not once per look (a second)
    logged_failure_ = std::string(s.message());
    std::cerr << "replayssm-server: token file not reloaded, the loaded tokens stay: "
              << s.message() << std::endl;
  }
  return s;
}

int64_t TokenStore::reload_failures() const {
  absl::MutexLock lock(&mu_);
  return reload_failures_;
}

absl::StatusOr<TenantId> TokenStore::Authenticate(std::optional<absl::string_view> authorization,
                                                  AuthFailure* failure) {
  if (!authorization.has_value()) {
    return Unauthenticated(AuthFailure::kMissing, failure,
                           "authorization: expected metadata `authorization: Bearer <token>` "
                           "(--auth-tokens is on), got none");
  }
  absl::string_view token = *authorization;
  if (!absl::ConsumePrefix(&token, "Bearer ") || token.empty()) {
    return Unauthenticated(AuthFailure::kMalformed, failure,
                           "authorization: expected `Bearer <token>`, got another form");
  }
  {
    absl::MutexLock lock(&mu_);
    std::optional<TenantId> t = FindLocked(token);
    if (t.has_value() && absl::Now() - checked_ < kRecheck) return *t;
  }
  Reload(/*force=*/false).IgnoreError();  // logged and counted there
  absl::MutexLock lock(&mu_);
  if (std::optional<TenantId> t = FindLocked(token); t.has_value()) return *t;
  return Unauthenticated(AuthFailure::kUnknown, failure,
                         "authorization: expected a token of the server's token file, got an "
                         "unknown token");
}

std::optional<TenantId> TokenStore::FindLocked(absl::string_view token) const {
  std::optional<TenantId> found;
  for (const auto& [known, tenant] : tokens_) {  // no early exit: every token is compared
    if (ConstantTimeEquals(known, token)) found = tenant;
  }
  return found;
}

std::optional<TenantId> TokenStore::LoadedTenantOf(absl::string_view authorization) const {
  absl::string_view token = authorization;
  if (!absl::ConsumePrefix(&token, "Bearer ") || token.empty()) return std::nullopt;
  absl::MutexLock lock(&mu_);
  return FindLocked(token);
}

std::optional<TenantId> TokenStore::Find(absl::string_view name) const {
  absl::MutexLock lock(&mu_);
  if (!listed_.contains(name)) return std::nullopt;
  return ids_.at(name);
}

std::string TokenStore::Name(TenantId id) const {
  absl::MutexLock lock(&mu_);
  return id < names_.size() ? names_[id] : std::string();
}

}  // namespace replayssm::service
