// Helpers of the GPU tests: skipping without a GPU, moving vectors to and from the device,
// fresh random data, and Status assertions.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/status_macros.h"
#include "tests/support/status_assertions.h"
#include "gtest/gtest.h"
#include "worker/gpu/cuda_check.h"
#include "worker/gpu/cuda_resources.h"

// Every test that needs a GPU starts with this: without one (CI, the development machine) the
// test reports itself SKIPPED, which ctest shows as skipped rather than passed or failed.
#define SHARD_REQUIRE_GPU()                                            \
  do {                                                                 \
    std::string shard_why_;                                            \
    if (::shard::CudaDeviceCount(&shard_why_) == 0) {                  \
      GTEST_SKIP() << "needs a CUDA device; " << shard_why_;           \
    }                                                                  \
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);                          \
  } while (false)

namespace shard {

// A device copy of `values`.
template <typename T>
absl::StatusOr<DeviceBuffer> ToDevice(const std::vector<T>& values) {
  SHARD_ASSIGN_OR_RETURN(DeviceBuffer buffer, DeviceBuffer::Allocate(values.size() * sizeof(T)));
  SHARD_RETURN_IF_ERROR(CudaStatus(
      cudaMemcpy(buffer.data(), values.data(), values.size() * sizeof(T), cudaMemcpyHostToDevice),
      "cudaMemcpy to the device"));
  return buffer;
}

// `count` elements at `device` (waits for all work on the device first).
template <typename T>
absl::StatusOr<std::vector<T>> ToHost(const void* device, size_t count) {
  SHARD_RETURN_IF_ERROR(CudaStatus(cudaDeviceSynchronize(), "cudaDeviceSynchronize"));
  std::vector<T> values(count);
  SHARD_RETURN_IF_ERROR(CudaStatus(
      cudaMemcpy(values.data(), device, count * sizeof(T), cudaMemcpyDeviceToHost),
      "cudaMemcpy to the host"));
  return values;
}

// Uniform floats in [low, high): fresh data for every check, never zeros.
inline std::vector<float> RandomFloats(size_t count, std::mt19937_64& rng, float low,
                                       float high) {
  std::uniform_real_distribution<float> uniform(low, high);
  std::vector<float> values(count);
  for (float& v : values) v = uniform(rng);
  return values;
}

// The quiet NaN that poisons outputs before a kernel writes them: an element left unwritten
// shows up as NaN in every comparison.
inline constexpr float kPoison = std::numeric_limits<float>::quiet_NaN();

// ||a - b|| / ||b||, in double.
double RelativeError(const std::vector<float>& a, const std::vector<float>& b);

}  // namespace shard
