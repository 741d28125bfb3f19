#include "worker/dataplane/reduce.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace shard {
namespace {

// Inlined into each of ReduceBuffers' clones, so that the AVX2 one vectorises them with AVX2.
template <typename T, typename Op>
[[gnu::always_inline]] inline void Apply(void* dst, const void* a, const void* b, size_t count,
                                         Op op) {
  T* out = static_cast<T*>(dst);
  const T* x = static_cast<const T*>(a);
  const T* y = static_cast<const T*>(b);
  for (size_t i = 0; i < count; ++i) out[i] = op(x[i], y[i]);
}

template <typename T>
[[gnu::always_inline]] inline void ApplyOp(ReduceOp op, void* dst, const void* a, const void* b,
                                           size_t count) {
  switch (op) {
    case ReduceOp::kSum: return Apply<T>(dst, a, b, count, [](T x, T y) { return x + y; });
    case ReduceOp::kMax: return Apply<T>(dst, a, b, count, [](T x, T y) { return std::max(x, y); });
    case ReduceOp::kMin: return Apply<T>(dst, a, b, count, [](T x, T y) { return std::min(x, y); });
  }
}

template <float (*ToFloat)(uint16_t), uint16_t (*FromFloat)(float)>
[[gnu::always_inline]] inline void ApplyOp16(ReduceOp op, void* dst, const void* a, const void* b,
                                             size_t count) {
  uint16_t* out = static_cast<uint16_t*>(dst);
  const uint16_t* x = static_cast<const uint16_t*>(a);
  const uint16_t* y = static_cast<const uint16_t*>(b);
  for (size_t i = 0; i < count; ++i) {
    const float fx = ToFloat(x[i]);
    const float fy = ToFloat(y[i]);
    float r = fx + fy;
    if (op == ReduceOp::kMax) r = std::max(fx, fy);
    if (op == ReduceOp::kMin) r = std::min(fx, fy);
    out[i] = FromFloat(r);
  }
}

}  // namespace

// These loops must vectorise to keep up with memory (this file is built with -O3), for AVX2
// where the CPU has it: each element is one IEEE operation, so wider vectors change no bit.
__attribute__((target_clones("avx2", "default")))
void ReduceBuffers(DataType dtype, ReduceOp op, void* dst, const void* a, const void* b,
                   size_t count) {
  switch (dtype) {
    case DataType::kFloat32: return ApplyOp<float>(op, dst, a, b, count);
    case DataType::kInt64: return ApplyOp<int64_t>(op, dst, a, b, count);
    case DataType::kFloat64: return ApplyOp<double>(op, dst, a, b, count);
    case DataType::kFloat16: return ApplyOp16<HalfToFloat, FloatToHalf>(op, dst, a, b, count);
    case DataType::kBFloat16:
      return ApplyOp16<BFloat16ToFloat, FloatToBFloat16>(op, dst, a, b, count);
  }
}

__attribute__((target_clones("avx2", "default")))
void DivideBuffer(float* data, size_t count, float divisor) {
  // By a power of two, x / d and x * (1 / d) are the same real number rounded once, so the same
  // float; a multiplication is many times cheaper than a division.
  int exponent = 0;
  const float reciprocal = 1.0f / divisor;
  if (std::frexp(divisor, &exponent) == 0.5f && std::isnormal(reciprocal)) {
    for (size_t i = 0; i < count; ++i) data[i] *= reciprocal;
    return;
  }
  for (size_t i = 0; i < count; ++i) data[i] /= divisor;
}

std::vector<Block> BalancedBlocks(int ranks, size_t count) {
  std::vector<Block> blocks(ranks);
  const size_t base = count / ranks;
  const size_t extra = count % ranks;
  size_t offset = 0;
  for (int i = 0; i < ranks; ++i) {
    blocks[i] = Block{offset, base + (static_cast<size_t>(i) < extra ? 1 : 0)};
    offset += blocks[i].count;
  }
  return blocks;
}

}  // namespace shard
