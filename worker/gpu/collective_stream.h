// The stream discipline the device communicators share (see device_communicator.h): a stream of
// their own, an event that orders it after the compute stream, an event that marks what has been
// issued, and host waits that poll instead of blocking in the driver, so that an abort from
// another thread ends them at once.
#pragma once

#include <cuda_runtime_api.h>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "worker/gpu/cuda_resources.h"

namespace shard {

// Calls `poll` until it returns true (OK), fails (its error), or `timeout` passes
// (DeadlineExceeded naming `what`). Yields between polls for the first ~100 µs, then sleeps
// 50 µs, so short waits stay short without burning a core on long ones.
absl::Status PollUntil(absl::Duration timeout, absl::string_view what,
                       absl::FunctionRef<absl::StatusOr<bool>()> poll);

class CollectiveStream {
 public:
  // Makes `device` current on the calling thread and creates the stream and events there.
  static absl::StatusOr<CollectiveStream> Create(int device, cudaStream_t compute_stream);

  cudaStream_t get() const { return stream_.get(); }
  cudaStream_t compute() const { return compute_; }

  // This stream waits for everything enqueued on the compute stream so far.
  absl::Status AfterCompute();
  // Marks everything enqueued on this stream so far as issued (the point Wait and
  // OrderCompute refer to).
  absl::Status MarkIssued();
  // The compute stream waits for everything issued so far.
  absl::Status OrderCompute();
  // Waits on the host for `event` (default: everything issued so far); `check` runs between
  // polls and its error ends the wait (aborts, asynchronous errors).
  absl::Status Wait(absl::Duration timeout, absl::string_view what,
                    absl::FunctionRef<absl::Status()> check, cudaEvent_t event = nullptr);

 private:
  cudaStream_t compute_ = nullptr;
  CudaStream stream_;
  CudaEvent compute_ready_;
  CudaEvent issued_;
};

}  // namespace shard
