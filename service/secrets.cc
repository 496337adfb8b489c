#include "service/secrets.h"

#include <sys/stat.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>

#include "absl/strings/str_cat.h"

namespace replayssm::service {

bool ConstantTimeEquals(absl::string_view a, absl::string_view b) {
  // Every byte of the longer one is looked at whatever the others hold; the accumulator is
  // volatile so that the compiler cannot stop at the first difference.
  volatile uint8_t diff = a.size() == b.size() ? 0 : 1;
  const size_t n = std::max(a.size(), b.size());
  for (size_t i = 0; i < n; ++i) {
    const uint8_t x = i < a.size() ? static_cast<uint8_t>(a[i]) : 0;
    const uint8_t y = i < b.size() ? static_cast<uint8_t>(b[i]) : 0;
    diff = diff | static_cast<uint8_t>(x ^ y);
  }
  return diff == 0;
}

std::optional<std::string> ExposureWarning(absl::string_view flag, const std::string& path) {
  struct stat st {};
  if (stat(path.c_str(), &st) != 0) return std::nullopt;
  const bool group = (st.st_mode & S_IRGRP) != 0, others = (st.st_mode & S_IROTH) != 0;
  if (!group && !others) return std::nullopt;
  char mode[8];
  std::snprintf(mode, sizeof(mode), "%04o", static_cast<unsigned>(st.st_mode & 07777));
  return absl::StrCat("--", flag, " ", path, " may be read by ",
                      group && others ? "its group and others"
                      : group         ? "its group"
                                      : "others",
                      " (mode ", mode, "): a secret should be readable by the server's user only "
                      "(chmod 600, or 400)");
}

}  // namespace replayssm::service
