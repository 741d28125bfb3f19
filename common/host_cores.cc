#include "common/host_cores.h"

#include <sched.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace shard {

std::optional<double> CoresInCpuMax(absl::string_view line) {
  const std::vector<absl::string_view> fields =
      absl::StrSplit(absl::StripAsciiWhitespace(line), ' ', absl::SkipEmpty());
  if (fields.size() != 2) return std::nullopt;
  double quota = 0;
  double period = 0;
  if (!absl::SimpleAtod(fields[0], &quota) || !absl::SimpleAtod(fields[1], &period) ||
      quota <= 0 || period <= 0) {
    return std::nullopt;  // "max" is no limit
  }
  return quota / period;
}

int UsableCores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  int cores = ::sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 1;
  std::ifstream cpu_max("/sys/fs/cgroup/cpu.max");
  std::string line;
  if (cpu_max && std::getline(cpu_max, line)) {
    if (const std::optional<double> quota = CoresInCpuMax(line)) {
      cores = std::min(cores, static_cast<int>(std::ceil(*quota)));
    }
  }
  return std::max(cores, 1);
}

}  // namespace shard
