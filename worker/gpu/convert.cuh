// Device conversions between fp32 and the model types (float, __nv_bfloat16, __half), shared by
// the kernels. To 16 bits: round to nearest even, as common/dtype.h's FloatToBFloat16 and
// FloatToHalf on the host.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

namespace shard {

__device__ __forceinline__ float ToFloat(float x) { return x; }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float ToFloat(__half x) { return __half2float(x); }

template <typename T>
__device__ __forceinline__ T FromFloat(float x) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __float2bfloat16_rn(x);
  } else if constexpr (std::is_same_v<T, __half>) {
    return __float2half_rn(x);
  } else {
    static_assert(std::is_same_v<T, float>);
    return x;
  }
}

}  // namespace shard
