#include "worker/gpu/cuda_resources.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "worker/gpu/cuda_check.h"

namespace shard {

template <MemoryKind kKind>
absl::StatusOr<CudaBuffer<kKind>> CudaBuffer<kKind>::Allocate(size_t bytes) {
  CudaBuffer buffer;
  if (bytes == 0) return buffer;
  const cudaError_t error = kKind == MemoryKind::kDevice ? cudaMalloc(&buffer.data_, bytes)
                                                         : cudaMallocHost(&buffer.data_, bytes);
  if (error != cudaSuccess) {
    buffer.data_ = nullptr;
    return CudaStatus(error, absl::StrCat(kKind == MemoryKind::kDevice ? "cudaMalloc"
                                                                       : "cudaMallocHost",
                                          " of ", bytes, " bytes"));
  }
  buffer.bytes_ = bytes;
  return buffer;
}

template <MemoryKind kKind>
CudaBuffer<kKind>::CudaBuffer(CudaBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}

template <MemoryKind kKind>
CudaBuffer<kKind>& CudaBuffer<kKind>::operator=(CudaBuffer&& other) noexcept {
  if (this != &other) {
    Free();
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

template <MemoryKind kKind>
CudaBuffer<kKind>::~CudaBuffer() {
  Free();
}

template <MemoryKind kKind>
void CudaBuffer<kKind>::Free() {
  if (data_ == nullptr) return;
  // Errors here are those of earlier asynchronous work, already reported where it was waited on.
  if constexpr (kKind == MemoryKind::kDevice) {
    cudaFree(data_);
  } else {
    cudaFreeHost(data_);
  }
  data_ = nullptr;
  bytes_ = 0;
}

template class CudaBuffer<MemoryKind::kDevice>;
template class CudaBuffer<MemoryKind::kPinnedHost>;

absl::StatusOr<CudaStream> CudaStream::Create() {
  CudaStream stream;
  SHARD_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream.stream_, cudaStreamNonBlocking));
  return stream;
}

CudaStream::CudaStream(CudaStream&& other) noexcept
    : stream_(std::exchange(other.stream_, nullptr)) {}

CudaStream& CudaStream::operator=(CudaStream&& other) noexcept {
  if (this != &other) {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    stream_ = std::exchange(other.stream_, nullptr);
  }
  return *this;
}

CudaStream::~CudaStream() {
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

absl::StatusOr<CudaEvent> CudaEvent::Create(bool timing) {
  CudaEvent event;
  SHARD_CUDA_RETURN_IF_ERROR(
      cudaEventCreateWithFlags(&event.event_, timing ? cudaEventDefault : cudaEventDisableTiming));
  return event;
}

CudaEvent::CudaEvent(CudaEvent&& other) noexcept : event_(std::exchange(other.event_, nullptr)) {}

CudaEvent& CudaEvent::operator=(CudaEvent&& other) noexcept {
  if (this != &other) {
    if (event_ != nullptr) cudaEventDestroy(event_);
    event_ = std::exchange(other.event_, nullptr);
  }
  return *this;
}

CudaEvent::~CudaEvent() {
  if (event_ != nullptr) cudaEventDestroy(event_);
}

}  // namespace shard
