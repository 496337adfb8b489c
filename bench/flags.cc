#include "bench/flags.h"

#include <cmath>
#include <cstdio>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace replayssm::bench {

namespace {

template <typename T>
absl::Status ParseInt(absl::string_view text, int64_t min, int64_t max, T* value) {
  int64_t x = 0;
  if (!absl::SimpleAtoi(text, &x)) return absl::InvalidArgumentError("expected an integer");
  if (x < min || x > max) {
    return absl::InvalidArgumentError(absl::StrCat("expected ", min, "..", max));
  }
  *value = static_cast<T>(x);
  return absl::OkStatus();
}

absl::Status ParseChoice(absl::string_view text, const std::vector<std::string>& choices,
                         std::string* value) {
  for (const std::string& c : choices) {
    if (text != c) continue;
    *value = c;
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat("expected one of ", absl::StrJoin(choices, ", ")));
}

// Applies `parse` to each comma-separated item of `text`, appending to `*out`.
template <typename T, typename Parse>
absl::Status ParseList(absl::string_view text, Parse parse, std::vector<T>* out) {
  std::vector<T> items;
  for (absl::string_view item : absl::StrSplit(text, ',')) {
    T x{};
    absl::Status s = parse(item, &x);
    if (!s.ok()) return absl::InvalidArgumentError(absl::StrCat(s.message(), ", comma-separated"));
    items.push_back(std::move(x));
  }
  *out = std::move(items);
  return absl::OkStatus();
}

}  // namespace

Flags::Flags(std::string program, std::string synopsis)
    : program_(std::move(program)), synopsis_(std::move(synopsis)) {}

void Flags::String(std::string name, std::string* value) {
  flags_.push_back({std::move(name), true, [value](absl::string_view v) {
                      *value = std::string(v);
                      return absl::OkStatus();
                    }});
}

void Flags::Choice(std::string name, std::vector<std::string> choices, std::string* value) {
  flags_.push_back({std::move(name), true, [choices, value](absl::string_view v) {
                      return ParseChoice(v, choices, value);
                    }});
}

void Flags::IntList(std::string name, int64_t min, int64_t max, std::vector<int64_t>* value) {
  flags_.push_back(
      {std::move(name), true, [=](absl::string_view v) {
         return ParseList(
             v, [=](absl::string_view item, int64_t* x) { return ParseInt(item, min, max, x); },
             value);
       }});
}

void Flags::ChoiceList(std::string name, std::vector<std::string> choices,
                       std::vector<std::string>* value) {
  flags_.push_back({std::move(name), true, [choices, value](absl::string_view v) {
                      return ParseList(
                          v,
                          [&choices](absl::string_view item, std::string* x) {
                            return ParseChoice(item, choices, x);
                          },
                          value);
                    }});
}

void Flags::Int(std::string name, int64_t min, int64_t max, int64_t* value) {
  flags_.push_back(
      {std::move(name), true, [=](absl::string_view v) { return ParseInt(v, min, max, value); }});
}

void Flags::Int(std::string name, int32_t min, int32_t max, int32_t* value) {
  flags_.push_back(
      {std::move(name), true, [=](absl::string_view v) { return ParseInt(v, min, max, value); }});
}

void Flags::PositiveSeconds(std::string name, double* value) {
  flags_.push_back({std::move(name), true, [value](absl::string_view v) {
                      double x = 0;
                      if (!absl::SimpleAtod(v, &x) || !std::isfinite(x) || x <= 0) {
                        return absl::InvalidArgumentError("expected seconds > 0");
                      }
                      *value = x;
                      return absl::OkStatus();
                    }});
}

void Flags::Switch(std::string name, bool* value) {
  flags_.push_back({std::move(name), false, [value](absl::string_view) {
                      *value = true;
                      return absl::OkStatus();
                    }});
}

const Flags::Flag* Flags::Find(absl::string_view name) const {
  for (const Flag& f : flags_) {
    if (f.name == name) return &f;
  }
  return nullptr;
}

absl::Status Flags::Parse(int argc, const char* const* argv) {
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      help_ = true;
      return absl::OkStatus();
    }
    if (!absl::ConsumePrefix(&arg, "--")) {
      return absl::InvalidArgumentError(absl::StrCat("unexpected argument '", arg, "'"));
    }
    const size_t eq = arg.find('=');
    const absl::string_view name = arg.substr(0, eq);
    const Flag* flag = Find(name);
    if (flag == nullptr) return absl::InvalidArgumentError(absl::StrCat("unknown flag --", name));
    absl::string_view value;
    if (!flag->takes_value) {
      if (eq != absl::string_view::npos) {
        return absl::InvalidArgumentError(absl::StrCat("--", name, " takes no value"));
      }
    } else if (eq != absl::string_view::npos) {
      value = arg.substr(eq + 1);
    } else if (i + 1 < argc && !absl::StartsWith(argv[i + 1], "--")) {
      value = argv[++i];
    } else {
      return absl::InvalidArgumentError(absl::StrCat("--", name, ": missing value"));
    }
    absl::Status s = flag->set(value);
    if (!s.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", name, ": ", s.message(), ", got '", value, "'"));
    }
  }
  return absl::OkStatus();
}

std::string Flags::Usage() const { return absl::StrCat("usage: ", program_, " ", synopsis_, "\n"); }

int Flags::ParseOrExitCode(int argc, const char* const* argv) {
  const absl::Status s = Parse(argc, argv);
  if (!s.ok()) {
    std::fprintf(stderr, "%s: %s\n%s", program_.c_str(), std::string(s.message()).c_str(),
                 Usage().c_str());
    return 2;
  }
  if (help_) {
    std::printf("%s", Usage().c_str());
    return 0;
  }
  return -1;
}

}  // namespace replayssm::bench
