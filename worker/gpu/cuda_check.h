// CUDA runtime, cuBLAS and NCCL results as absl::Status values. Every message names the call
// that failed, the library's own error text and, where there is an obvious remedy, what to do.
// No exceptions cross this library: failures are values, as everywhere in Shard.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "common/status_macros.h"

namespace shard {

// OK for cudaSuccess; otherwise "<what>: <cudaGetErrorName>: <cudaGetErrorString>" with a code
// that says how to react (ResourceExhausted for out-of-memory, FailedPrecondition for a missing
// driver or device or an unsupported GPU, Internal otherwise).
absl::Status CudaStatus(cudaError_t error, absl::string_view what);

// OK for CUBLAS_STATUS_SUCCESS; otherwise "<what>: <cublasGetStatusName>: <cublasGetStatusString>".
absl::Status CublasStatus(cublasStatus_t status, absl::string_view what);

// OK for ncclSuccess (and ncclInProgress, which is not a failure); otherwise
// "<what>: <ncclGetErrorString> (last NCCL error: <ncclGetLastError(comm)>)". `comm` may be null.
// Unavailable for remote and system errors (a peer or the network failed), InvalidArgument and
// FailedPrecondition for misuse, Internal otherwise.
absl::Status NcclStatus(ncclResult_t result, ncclComm_t comm, absl::string_view what);

// The error of the kernel launch just made (bad configuration, no machine code for this GPU),
// from cudaGetLastError, naming `kernel`.
absl::Status LaunchStatus(absl::string_view kernel);

// Number of CUDA devices this process can use; 0 when there is no driver or no device (the
// reason goes to `why` when it is not null), so callers can skip GPU work.
int CudaDeviceCount(std::string* why = nullptr);

}  // namespace shard

// Returns from the enclosing function when a CUDA runtime call fails; the message quotes the call.
#define SHARD_CUDA_RETURN_IF_ERROR(call) SHARD_RETURN_IF_ERROR(::shard::CudaStatus((call), #call))
#define SHARD_CUBLAS_RETURN_IF_ERROR(call) \
  SHARD_RETURN_IF_ERROR(::shard::CublasStatus((call), #call))
