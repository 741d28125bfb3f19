// The vectorised reductions and averaging of the CPU collectives against one scalar IEEE
// operation per element, bit for bit (a NaN for a NaN), over special values and lengths that
// leave a vector tail.
#include "worker/dataplane/reduce.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace shard {
namespace {

// Random floats of every magnitude, with zeros of both signs, subnormals, infinities and NaN.
std::vector<float> Values(size_t count, uint32_t seed) {
  std::mt19937 random(seed);
  const float special[] = {0.0f,
                           -0.0f,
                           std::numeric_limits<float>::denorm_min(),
                           -std::numeric_limits<float>::denorm_min() * 3,
                           std::numeric_limits<float>::min(),
                           std::numeric_limits<float>::max(),
                           std::numeric_limits<float>::infinity(),
                           -std::numeric_limits<float>::infinity(),
                           std::numeric_limits<float>::quiet_NaN()};
  std::vector<float> values(count);
  for (size_t i = 0; i < count; ++i) {
    values[i] = random() % 8 == 0 ? special[random() % std::size(special)]
                                  : std::bit_cast<float>(static_cast<uint32_t>(random()));
  }
  return values;
}

// Scalar reference: `volatile` keeps the compiler from vectorising it.
float Scalar(ReduceOp op, float x, float y) {
  volatile float va = x;
  volatile float vb = y;
  const float a = va;
  const float b = vb;
  switch (op) {
    case ReduceOp::kSum: return a + b;
    case ReduceOp::kMax: return std::max(a, b);
    case ReduceOp::kMin: return std::min(a, b);
  }
  return 0;
}

void ExpectSameBits(const std::vector<float>& actual, const std::vector<float>& expected) {
  ASSERT_EQ(actual.size(), expected.size());
  for (size_t i = 0; i < actual.size(); ++i) {
    // Which NaN's payload an operation on two NaNs keeps is the compiler's choice (it may swap
    // the operands of a sum), in scalar code too.
    if (std::isnan(actual[i]) && std::isnan(expected[i])) continue;
    ASSERT_EQ(std::bit_cast<uint32_t>(actual[i]), std::bit_cast<uint32_t>(expected[i]))
        << "element " << i << " of " << actual.size() << ": " << actual[i] << " against "
        << expected[i];
  }
}

TEST(ReduceBuffersTest, FloatSumMaxMinMatchScalarCodeBitForBitAlsoInPlace) {
  for (const size_t count : {size_t{1}, size_t{7}, size_t{8}, size_t{1001}, size_t{65537}}) {
    const std::vector<float> a = Values(count, 1);
    const std::vector<float> b = Values(count, 2);
    for (const ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kMin}) {
      std::vector<float> expected(count);
      for (size_t i = 0; i < count; ++i) expected[i] = Scalar(op, a[i], b[i]);
      std::vector<float> out(count);
      ReduceBuffers(DataType::kFloat32, op, out.data(), a.data(), b.data(), count);
      ExpectSameBits(out, expected);
      std::vector<float> in_place = a;  // dst aliasing a, as the collectives' chains do
      ReduceBuffers(DataType::kFloat32, op, in_place.data(), in_place.data(), b.data(), count);
      ExpectSameBits(in_place, expected);
    }
  }
}

TEST(DivideBufferTest, MatchesScalarDivisionBitForBitForEveryWorldSize) {
  for (const size_t count : {size_t{3}, size_t{16}, size_t{100003}}) {
    const std::vector<float> values = Values(count, 3);
    for (const float divisor : {2.0f, 3.0f, 4.0f, 7.0f, 64.0f, 96.0f, 0.5f}) {
      std::vector<float> expected(count);
      for (size_t i = 0; i < count; ++i) {
        volatile float x = values[i];
        expected[i] = x / divisor;
      }
      std::vector<float> out = values;
      DivideBuffer(out.data(), count, divisor);
      ExpectSameBits(out, expected);
    }
  }
}

}  // namespace
}  // namespace shard
