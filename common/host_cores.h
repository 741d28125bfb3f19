// How many processor cores this process may use, for choices that pay only where a rank has
// cores of its own (Engine's gather during a restore's reads).
#pragma once

#include <optional>

#include "absl/strings/string_view.h"

namespace shard {

// The cores in this process's CPU affinity, capped by its cgroup v2 CPU quota when it has one (a
// container's CPU limit: /sys/fs/cgroup/cpu.max), rounded up; at least 1.
int UsableCores();

// The cores a cgroup v2 `cpu.max` line allows ("200000 100000": 2; "150000 100000": 1.5);
// nullopt for "max ..." (no limit) and for anything else it cannot read.
std::optional<double> CoresInCpuMax(absl::string_view line);

}  // namespace shard
