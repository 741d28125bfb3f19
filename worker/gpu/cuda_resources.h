// Owning handles for CUDA resources: device memory, pinned host memory, streams and events.
// Each is created by a factory that returns a Status instead of throwing, is move-only, and
// frees its resource in the destructor. The current device must be set (cudaSetDevice) by the
// caller before creating them.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "absl/status/statusor.h"

namespace shard {

enum class MemoryKind { kDevice, kPinnedHost };

// cudaMalloc'ed (kDevice) or cudaMallocHost'ed (kPinnedHost) bytes.
template <MemoryKind kKind>
class CudaBuffer {
 public:
  // An empty buffer for zero bytes; ResourceExhausted when the memory is not there.
  static absl::StatusOr<CudaBuffer> Allocate(size_t bytes);

  CudaBuffer() = default;
  CudaBuffer(CudaBuffer&& other) noexcept;
  CudaBuffer& operator=(CudaBuffer&& other) noexcept;
  ~CudaBuffer();

  void* data() const { return data_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  size_t bytes() const { return bytes_; }

 private:
  void Free();

  void* data_ = nullptr;
  size_t bytes_ = 0;
};

using DeviceBuffer = CudaBuffer<MemoryKind::kDevice>;
using PinnedBuffer = CudaBuffer<MemoryKind::kPinnedHost>;

// A stream that does not synchronise with the legacy default stream.
class CudaStream {
 public:
  static absl::StatusOr<CudaStream> Create();

  CudaStream() = default;
  CudaStream(CudaStream&& other) noexcept;
  CudaStream& operator=(CudaStream&& other) noexcept;
  ~CudaStream();

  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

// An event; without `timing` it is the cheap kind used only for ordering and completion.
class CudaEvent {
 public:
  static absl::StatusOr<CudaEvent> Create(bool timing = false);

  CudaEvent() = default;
  CudaEvent(CudaEvent&& other) noexcept;
  CudaEvent& operator=(CudaEvent&& other) noexcept;
  ~CudaEvent();

  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

}  // namespace shard
