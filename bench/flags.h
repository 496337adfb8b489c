// The command line of the benchmark binaries. Each binary registers its flags (`--name value`
// or `--name=value`; switches take no value), then parses argv once. Anything else is an error
// that names the argument: an unknown flag, a stray positional argument, a missing value, a
// value that is not of the flag's type, outside its range or not one of its choices.
#ifndef REPLAYSSM_BENCH_FLAGS_H_
#define REPLAYSSM_BENCH_FLAGS_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace replayssm::bench {

class Flags {
 public:
  // `synopsis`: the usage line after the program name, e.g. "[--slots N] [--json PATH]".
  Flags(std::string program, std::string synopsis);

  // Each flag writes into `*value`, which keeps its default when the flag is absent.
  void String(std::string name, std::string* value);
  // One of `choices`.
  void Choice(std::string name, std::vector<std::string> choices, std::string* value);
  void Int(std::string name, int64_t min, int64_t max, int64_t* value);
  void Int(std::string name, int32_t min, int32_t max, int32_t* value);
  // Comma-separated: "1,64,256", each in [min, max]; "host,device", each one of `choices`.
  void IntList(std::string name, int64_t min, int64_t max, std::vector<int64_t>* value);
  void ChoiceList(std::string name, std::vector<std::string> choices,
                  std::vector<std::string>* value);
  // A finite number > 0.
  void PositiveSeconds(std::string name, double* value);
  // Takes no value: present means true.
  void Switch(std::string name, bool* value);

  // Parses argv[1..argc). `--help` / `-h` sets help() and stops.
  absl::Status Parse(int argc, const char* const* argv);
  bool help() const { return help_; }
  std::string Usage() const;

  // Parse, then: on an error prints it and the usage to stderr and returns 2; on --help
  // prints the usage to stdout and returns 0; otherwise returns -1 (go on).
  int ParseOrExitCode(int argc, const char* const* argv);

 private:
  struct Flag {
    std::string name;
    bool takes_value;
    std::function<absl::Status(absl::string_view)> set;  // OK or why the value is wrong
  };
  const Flag* Find(absl::string_view name) const;

  std::string program_, synopsis_;
  std::vector<Flag> flags_;
  bool help_ = false;
};

}  // namespace replayssm::bench

#endif  // REPLAYSSM_BENCH_FLAGS_H_
