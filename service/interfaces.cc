#include "service/interfaces.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>

#include <cstring>

#include "absl/strings/strip.h"

namespace replayssm::service {
namespace {

struct Address {
  int family = AF_UNSPEC;
  in_addr v4{};
  in6_addr v6{};
};

std::optional<Address> Parse(absl::string_view host) {
  const std::string h(host == "localhost" ? "127.0.0.1" : host);
  Address a;
  if (inet_pton(AF_INET, h.c_str(), &a.v4) == 1) {
    a.family = AF_INET;
  } else if (inet_pton(AF_INET6, h.c_str(), &a.v6) == 1) {
    a.family = AF_INET6;
  } else {
    return std::nullopt;
  }
  return a;
}

bool Wildcard(const Address& a) {
  return a.family == AF_INET ? a.v4.s_addr == htonl(INADDR_ANY)
                             : IN6_IS_ADDR_UNSPECIFIED(&a.v6);
}

bool Loopback(const Address& a) {
  return a.family == AF_INET ? (ntohl(a.v4.s_addr) >> 24) == 127 : IN6_IS_ADDR_LOOPBACK(&a.v6);
}

bool Holds(const ifaddrs& i, const Address& a) {
  if (i.ifa_addr == nullptr || i.ifa_addr->sa_family != a.family) return false;
  if (a.family == AF_INET) {
    return reinterpret_cast<const sockaddr_in*>(i.ifa_addr)->sin_addr.s_addr == a.v4.s_addr;
  }
  return std::memcmp(&reinterpret_cast<const sockaddr_in6*>(i.ifa_addr)->sin6_addr, &a.v6,
                     sizeof(a.v6)) == 0;
}

}  // namespace

std::string HostOfAddress(absl::string_view address) {
  const size_t colon = address.rfind(':');
  absl::string_view host = colon == absl::string_view::npos ? address : address.substr(0, colon);
  absl::ConsumePrefix(&host, "[");
  absl::ConsumeSuffix(&host, "]");
  return std::string(host);
}

std::optional<std::string> InterfaceHolding(absl::string_view host) {
  const std::optional<Address> a = Parse(host);
  if (!a.has_value() || Wildcard(*a)) return std::nullopt;
  ifaddrs* all = nullptr;
  if (getifaddrs(&all) != 0) return std::nullopt;
  std::optional<std::string> exact, loopback;
  for (const ifaddrs* i = all; i != nullptr; i = i->ifa_next) {
    if (Holds(*i, *a) && !exact.has_value()) exact = i->ifa_name;
    if ((i->ifa_flags & IFF_LOOPBACK) != 0 && !loopback.has_value()) loopback = i->ifa_name;
  }
  freeifaddrs(all);
  if (exact.has_value()) return exact;
  return Loopback(*a) ? loopback : std::nullopt;
}

}  // namespace replayssm::service
