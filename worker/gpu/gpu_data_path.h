// The data path of a GPU worker (worker/data_path.h): a GpuDevice, and per generation either an
// NCCL communicator whose unique id goes through the generation's rendezvous store (rank 0
// publishes it, the others wait for it), or Gloo staged through pinned memory (backend "gloo",
// e.g. several ranks sharing one GPU). Aborting the communicator (the agent does when the
// generation ends) calls ncclCommAbort.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "worker/data_path.h"

namespace shard {

// `backend` is "nccl" or "gloo" (ResolveBackend's answer); the gloo backend stages through host
// collectives connected as `host` says (ConnectHostCollectives). Connecting and every
// collective time out after `host.timeout`. FailedPrecondition when cuda:`device` is not there.
absl::StatusOr<std::unique_ptr<DataPath>> GpuDataPath(int device, const std::string& backend,
                                                      HostPathOptions host);

}  // namespace shard
