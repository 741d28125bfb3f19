// The data-path self-check a worker runs after its communicator is built: collectives whose
// results are known in closed form, so a wrong answer is caught before training starts.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "worker/dataplane/communicator.h"
#include "worker/dataplane/cpu_device.h"
#include "worker/dataplane/device.h"

namespace shard {

struct SelfCheckResult {
  absl::Duration elapsed;
  std::string summary;  // e.g. "all-reduce + all-gather of 65536 f32 over 4 ranks in 3.2ms"
};

// An f32 all-reduce where rank r contributes (r%128+1)*(i%64+1) at index i, checked against
// the closed-form sum, then an f32 all-gather checked block by block. Every value is an exact
// integer in f32, so the comparison is exact. The error names the first wrong element. The
// buffers are `device`'s memory (the communicator's), so a GPU data path checks itself on the
// GPU, through the same collectives and streams training uses.
absl::StatusOr<SelfCheckResult> RunSelfCheck(Communicator& communicator, size_t elements,
                                             Device& device = HostDevice());

}  // namespace shard
