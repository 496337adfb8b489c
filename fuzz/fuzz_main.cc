// One libFuzzer binary per target: REPLAYSSM_FUZZ_ENTRY names its body (fuzz_targets.h).
#include "fuzz/fuzz_targets.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return replayssm::fuzz::REPLAYSSM_FUZZ_ENTRY(data, size);
}
