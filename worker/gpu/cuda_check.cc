#include "worker/gpu/cuda_check.h"

#include <string>

#include "absl/strings/str_cat.h"

namespace shard {

absl::Status CudaStatus(cudaError_t error, absl::string_view what) {
  if (error == cudaSuccess) return absl::OkStatus();
  std::string message =
      absl::StrCat(what, ": ", cudaGetErrorName(error), ": ", cudaGetErrorString(error));
  switch (error) {
    case cudaErrorMemoryAllocation:
      return absl::ResourceExhaustedError(absl::StrCat(
          message, "; the GPU is out of memory: use a smaller batch or model, or a free GPU"));
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorInvalidDevice:
      return absl::FailedPreconditionError(absl::StrCat(
          message, "; check that the NVIDIA driver is loaded (nvidia-smi) and the device "
                   "index is one of CUDA_VISIBLE_DEVICES"));
    case cudaErrorNoKernelImageForDevice:
    case cudaErrorUnsupportedPtxVersion:
      return absl::FailedPreconditionError(absl::StrCat(
          message, "; this build has no code for this GPU: rebuild with its architecture in "
                   "CMAKE_CUDA_ARCHITECTURES, or update the driver for the PTX fallback"));
    case cudaErrorInvalidValue:
      return absl::InvalidArgumentError(message);
    default:
      return absl::InternalError(message);
  }
}

absl::Status CublasStatus(cublasStatus_t status, absl::string_view what) {
  if (status == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  std::string message = absl::StrCat(what, ": ", cublasGetStatusName(status), ": ",
                                     cublasGetStatusString(status));
  switch (status) {
    case CUBLAS_STATUS_ALLOC_FAILED:
      return absl::ResourceExhaustedError(message);
    case CUBLAS_STATUS_INVALID_VALUE:
      return absl::InvalidArgumentError(message);
    case CUBLAS_STATUS_NOT_INITIALIZED:
    case CUBLAS_STATUS_ARCH_MISMATCH:
    case CUBLAS_STATUS_NOT_SUPPORTED:
      return absl::FailedPreconditionError(message);
    default:
      return absl::InternalError(message);
  }
}

absl::Status NcclStatus(ncclResult_t result, ncclComm_t comm, absl::string_view what) {
  if (result == ncclSuccess || result == ncclInProgress) return absl::OkStatus();
  const char* last = ncclGetLastError(comm);
  std::string message = absl::StrCat(what, ": ", ncclGetErrorString(result),
                                     " (last NCCL error: ", last && *last ? last : "none", ")");
  switch (result) {
    case ncclRemoteError:
    case ncclSystemError:
      return absl::UnavailableError(absl::StrCat(
          message, "; a peer or the network failed: the world must be re-formed"));
    case ncclInvalidArgument:
      return absl::InvalidArgumentError(message);
    case ncclInvalidUsage:
      return absl::FailedPreconditionError(message);
    default:
      return absl::InternalError(message);
  }
}

absl::Status LaunchStatus(absl::string_view kernel) {
  return CudaStatus(cudaGetLastError(), absl::StrCat("launch of ", kernel));
}

int CudaDeviceCount(std::string* why) {
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess) {
    if (why != nullptr) *why = CudaStatus(error, "cudaGetDeviceCount").ToString();
    cudaGetLastError();  // reset the runtime's last error so later calls start clean
    return 0;
  }
  if (count == 0 && why != nullptr) *why = "cudaGetDeviceCount: no CUDA device";
  return count;
}

}  // namespace shard
