// The fuzz targets' bodies: each takes arbitrary bytes and runs one of the server's parsers or
// checks on them, exactly as the server does. fuzz_main.cc makes each a libFuzzer binary (the
// `fuzz` preset); corpus_test.cc feeds every committed corpus file to them in the normal test
// suite. A body returns normally for any input; a broken invariant aborts (Check below).
#ifndef REPLAYSSM_FUZZ_FUZZ_TARGETS_H_
#define REPLAYSSM_FUZZ_FUZZ_TARGETS_H_

#include <cstddef>
#include <cstdint>

namespace replayssm::fuzz {

// Command-line flags and a --config file's text (service/config.h). Input: flags, one per
// line, then a NUL byte, then the config text.
int FuzzServerConfig(const uint8_t* data, size_t size);
// A model's config.json (service/hf_config.h).
int FuzzHfConfig(const uint8_t* data, size_t size);
// A *.safetensors file beside a tiny-gdn and a tiny-kda model (service/safetensors.h).
int FuzzSafetensors(const uint8_t* data, size_t size);
// A request message and the checks the service runs on it (service/request_checks.h). Input:
// a byte choosing the message, a byte choosing the model and dtypes, the serialized message.
int FuzzRequests(const uint8_t* data, size_t size);

// Aborts with `what` when `ok` is false: an invariant the parsers promise was broken.
void Check(bool ok, const char* what);

}  // namespace replayssm::fuzz

#endif  // REPLAYSSM_FUZZ_FUZZ_TARGETS_H_
