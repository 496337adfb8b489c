// The committed fuzz corpus as regression tests: every file under fuzz/corpus/<target>/ (the
// seeds and every input that once crashed a target) runs through the same body the libFuzzer
// binary runs, built by the normal compiler (and under ASan/UBSan by the asan preset).
#include <filesystem>
#include <fstream>
#include <iterator>
#include <ostream>
#include <string>
#include <vector>

#include "fuzz/fuzz_targets.h"
#include "gtest/gtest.h"

namespace replayssm::fuzz {
namespace {

namespace fs = std::filesystem;

struct Target {
  const char* name;  // its corpus directory
  int (*body)(const uint8_t*, size_t);
};

void PrintTo(const Target& t, std::ostream* os) { *os << t.name; }

class FuzzCorpus : public ::testing::TestWithParam<Target> {};

TEST_P(FuzzCorpus, EveryCorpusFileRunsCleanly) {
  const fs::path dir = fs::path(REPLAYSSM_FUZZ_CORPUS_DIR) / GetParam().name;
  ASSERT_TRUE(fs::is_directory(dir)) << dir;
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(dir)) files.push_back(e.path());
  ASSERT_FALSE(files.empty()) << dir << " holds no seed";
  for (const fs::path& f : files) {
    SCOPED_TRACE(f.string());
    std::ifstream in(f, std::ios::binary);
    const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    EXPECT_EQ(GetParam().body(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()), 0);
  }
}

INSTANTIATE_TEST_SUITE_P(Targets, FuzzCorpus,
                         ::testing::Values(Target{"server_config", FuzzServerConfig},
                                           Target{"hf_config", FuzzHfConfig},
                                           Target{"safetensors", FuzzSafetensors},
                                           Target{"requests", FuzzRequests}),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace replayssm::fuzz
