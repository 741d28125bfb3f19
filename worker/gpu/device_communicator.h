// Communicators whose buffers are device memory and whose collectives are ordered on CUDA
// streams rather than on the calling thread.
//
// A collective (the Communicator methods) is ordered after all work the caller enqueued on its
// compute stream before the call (an event recorded there, waited on by the communicator's own
// stream), runs on the communicator's stream, and the call returns once it is enqueued: the
// compute thread goes on with the backward pass while it runs. To use the results:
//   OrderComputeAfterCollectives()  compute-stream work enqueued afterwards waits for every
//                                   collective issued so far (no host wait), or
//   Synchronize()                   the calling thread waits for them.
// Barrier() is the exception: it returns after every rank reached it, like Gloo's.
// Nothing here synchronises the whole device.
#pragma once

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "worker/dataplane/communicator.h"

namespace shard {

struct DeviceCommunicatorOptions {
  int device = 0;  // CUDA device of every buffer passed in
  // The stream that produces the inputs and consumes the outputs (null: the legacy default
  // stream).
  cudaStream_t compute_stream = nullptr;
  // Longest host wait in Synchronize() and Barrier() before DeadlineExceeded.
  absl::Duration wait_timeout = absl::Minutes(5);
};

class DeviceCommunicator : public Communicator {
 public:
  bool device_buffers() const final { return true; }

  // The stream the collectives run on.
  virtual cudaStream_t stream() const = 0;

  // Makes work enqueued on the compute stream from now on wait for every collective issued so
  // far. Cheap and non-blocking; call it before the optimizer reads reduced gradients.
  absl::Status OrderComputeAfterCollectives() override = 0;

  // Blocks the calling thread until every collective issued so far has finished. Aborted at
  // once when Abort() is called from another thread, DeadlineExceeded after the wait timeout,
  // the backend's error when a collective failed.
  virtual absl::Status Synchronize() = 0;
};

}  // namespace shard
