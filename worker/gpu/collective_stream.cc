#include "worker/gpu/collective_stream.h"

#include <thread>

#include "absl/strings/str_cat.h"
#include "worker/gpu/cuda_check.h"

namespace shard {

absl::Status PollUntil(absl::Duration timeout, absl::string_view what,
                       absl::FunctionRef<absl::StatusOr<bool>()> poll) {
  const absl::Time start = absl::Now();
  const absl::Time deadline = start + timeout;
  for (;;) {
    SHARD_ASSIGN_OR_RETURN(const bool done, poll());
    if (done) return absl::OkStatus();
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat(what, " did not finish within ", absl::FormatDuration(timeout)));
    }
    if (now - start < absl::Microseconds(100)) {
      std::this_thread::yield();
    } else {
      absl::SleepFor(absl::Microseconds(50));
    }
  }
}

absl::StatusOr<CollectiveStream> CollectiveStream::Create(int device,
                                                          cudaStream_t compute_stream) {
  SHARD_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device), absl::StrCat("cudaSetDevice(", device,
                                                                       ")")));
  CollectiveStream result;
  result.compute_ = compute_stream;
  SHARD_ASSIGN_OR_RETURN(result.stream_, CudaStream::Create());
  SHARD_ASSIGN_OR_RETURN(result.compute_ready_, CudaEvent::Create());
  SHARD_ASSIGN_OR_RETURN(result.issued_, CudaEvent::Create());
  return result;
}

absl::Status CollectiveStream::AfterCompute() {
  SHARD_CUDA_RETURN_IF_ERROR(cudaEventRecord(compute_ready_.get(), compute_));
  SHARD_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream_.get(), compute_ready_.get(), 0));
  return absl::OkStatus();
}

absl::Status CollectiveStream::MarkIssued() {
  SHARD_CUDA_RETURN_IF_ERROR(cudaEventRecord(issued_.get(), stream_.get()));
  return absl::OkStatus();
}

absl::Status CollectiveStream::OrderCompute() {
  SHARD_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(compute_, issued_.get(), 0));
  return absl::OkStatus();
}

absl::Status CollectiveStream::Wait(absl::Duration timeout, absl::string_view what,
                                    absl::FunctionRef<absl::Status()> check,
                                    cudaEvent_t event) {
  if (event == nullptr) event = issued_.get();
  return PollUntil(timeout, what, [&]() -> absl::StatusOr<bool> {
    const cudaError_t state = cudaEventQuery(event);
    if (state == cudaSuccess) return true;
    if (state != cudaErrorNotReady) return CudaStatus(state, absl::StrCat(what, ": cudaEventQuery"));
    SHARD_RETURN_IF_ERROR(check());
    return false;
  });
}

}  // namespace shard
