// Which network interface of this host an address is on: the UCX data path (transfers) is
// bound to the interface of the gRPC address unless --transfer-interface says otherwise, so
// that a server listening on loopback does not open UCX listeners on every interface.
//
// Thread safety: thread-safe (reads the host's interfaces on each call).
#ifndef REPLAYSSM_SERVICE_INTERFACES_H_
#define REPLAYSSM_SERVICE_INTERFACES_H_

#include <optional>
#include <string>

#include "absl/strings/string_view.h"

namespace replayssm::service {

// The host part of host:port ("[::1]:50051" -> "::1", "127.0.0.1:0" -> "127.0.0.1").
std::string HostOfAddress(absl::string_view address);

// The name of the interface that holds `host` (an IPv4 or IPv6 literal, or "localhost"); a
// loopback address no interface holds (127.0.0.2) is the loopback interface's. nullopt for a
// wildcard (0.0.0.0, ::, ""), a name, or an address of no interface here.
std::optional<std::string> InterfaceHolding(absl::string_view host);

}  // namespace replayssm::service

#endif  // REPLAYSSM_SERVICE_INTERFACES_H_
