// The CUDA kernels against the CPU implementation: the fused optimizer bit for bit against
// OptimizerKernel (the same fp32 operations in the same order, no FMA contraction, IEEE
// division and square root, so there is no rounding difference to allow for), casts bit for bit
// against common/dtype.h's conversions (both round to nearest even), gradient scaling bit for
// bit (one fp32 multiply), and the gradient norm within 1e-12 of a double sum (both accumulate
// in double, in different orders).
#include "worker/gpu/kernels.h"

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "common/dtype.h"
#include "gtest/gtest.h"
#include "tests/gpu/gpu_test_util.h"
#include "worker/dataplane/optimizer.h"

namespace shard {
namespace {

// Sizes with vector bodies and scalar tails, a chunk boundary (65536) and several chunks; the
// offsets put some tensors off 16-byte alignment so the scalar path runs too.
struct Layout {
  int64_t offset;
  int64_t count;
};
const std::vector<Layout> kLayouts = {{0, 1},      {4, 3},         {8, 4},      {13, 1000},
                                      {1020, 65536}, {66560, 65541}, {132104, 200003}};
constexpr int64_t kTotal = 332200;

// Index of the first element whose bits differ, or -1.
template <typename T>
int64_t FirstMismatch(const std::vector<T>& a, const std::vector<T>& b) {
  if (a.size() != b.size()) return 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::memcmp(&a[i], &b[i], sizeof(T)) != 0) return static_cast<int64_t>(i);
  }
  return -1;
}

struct OptimizerCase {
  const char* name;
  OptimizerConfig config;
  DataType model;
};

OptimizerConfig Adam(double lr, double beta1, double beta2, double eps, double weight_decay,
                     OptimizerKind kind = OptimizerKind::kAdam) {
  OptimizerConfig c;
  c.kind = kind;
  c.lr = lr;
  c.beta1 = beta1;
  c.beta2 = beta2;
  c.eps = eps;
  c.weight_decay = weight_decay;
  return c;
}

OptimizerConfig Sgd(double lr, double momentum, double weight_decay, bool nesterov) {
  OptimizerConfig c;
  c.kind = OptimizerKind::kSgd;
  c.lr = lr;
  c.momentum = momentum;
  c.weight_decay = weight_decay;
  c.nesterov = nesterov;
  return c;
}

void PrintTo(const OptimizerCase& c, std::ostream* os) { *os << c.name; }

class FusedOptimizerTest : public ::testing::TestWithParam<OptimizerCase> {};

TEST_P(FusedOptimizerTest, MatchesTheCpuOptimizerBitForBit) {
  SHARD_REQUIRE_GPU();
  const OptimizerCase& c = GetParam();
  const OptimizerKernel cpu(c.config);
  const FusedOptimizer gpu(c.config);
  const int states = gpu.states();
  ASSERT_EQ(static_cast<size_t>(states), cpu.state_names().size());
  std::mt19937_64 rng(1234);

  std::vector<float> params = RandomFloats(kTotal, rng, -1.0f, 1.0f);
  std::vector<std::vector<float>> state(2);
  state[0] = RandomFloats(kTotal, rng, -0.1f, 0.1f);
  state[1] = RandomFloats(kTotal, rng, 1e-6f, 1e-2f);  // exp_avg_sq is never negative
  SHARD_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_params, ToDevice(params));
  SHARD_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_state0, ToDevice(state[0]));
  SHARD_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_state1, ToDevice(state[1]));
  SHARD_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_grads, DeviceBuffer::Allocate(kTotal * sizeof(float)));
  const bool copies = c.model != DataType::kFloat32;
  SHARD_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_model, DeviceBuffer::Allocate(kTotal * 2));

  std::vector<TensorSlot> slots;
  for (const Layout& layout : kLayouts) {
    TensorSlot slot;
    slot.param = d_params.as<float>() + layout.offset;
    slot.grad = d_grads.as<float>() + layout.offset;
    if (states > 0) slot.state[0] = d_state0.as<float>() + layout.offset;
    if (states > 1) slot.state[1] = d_state1.as<float>() + layout.offset;
    if (copies) slot.model = d_model.as<uint16_t>() + layout.offset;
    slot.count = layout.count;
    slots.push_back(slot);
  }
  SHARD_ASSERT_OK_AND_ASSIGN(TensorList list, TensorList::Create(slots, c.model, nullptr));
  EXPECT_EQ(list.chunks(), 1 + 1 + 1 + 1 + 1 + 2 + 4);

  for (int64_t step = 1; step <= 3; ++step) {
    const std::vector<float> grads = RandomFloats(kTotal, rng, -0.5f, 0.5f);
    ASSERT_EQ(cudaMemcpy(d_grads.data(), grads.data(), kTotal * sizeof(float),
                         cudaMemcpyHostToDevice),
              cudaSuccess);
    ASSERT_EQ(cudaMemset(d_model.data(), 0xff, kTotal * 2), cudaSuccess);  // NaN in bf16 and f16
    SHARD_ASSERT_OK(gpu.Step(step, list, nullptr));
    for (const Layout& layout : kLayouts) {
      float* views[2] = {state[0].data() + layout.offset, state[1].data() + layout.offset};
      cpu.Update(step, params.data() + layout.offset, grads.data() + layout.offset, views,
                 static_cast<size_t>(layout.count));
    }
    SHARD_ASSERT_OK_AND_ASSIGN(std::vector<float> got, ToHost<float>(d_params.data(), kTotal));
    EXPECT_EQ(FirstMismatch(got, params), -1) << "params, step " << step;
    for (int k = 0; k < states; ++k) {
      SHARD_ASSERT_OK_AND_ASSIGN(
          std::vector<float> got_state,
          ToHost<float>((k == 0 ? d_state0 : d_state1).data(), kTotal));
      EXPECT_EQ(FirstMismatch(got_state, state[k]), -1) << "state " << k << ", step " << step;
    }
    if (copies) {
      SHARD_ASSERT_OK_AND_ASSIGN(std::vector<uint16_t> model,
                                 ToHost<uint16_t>(d_model.data(), kTotal));
      std::vector<uint16_t> expected(kTotal, 0xffff);  // gaps between tensors stay poisoned
      for (const Layout& layout : kLayouts) {
        for (int64_t i = layout.offset; i < layout.offset + layout.count; ++i) {
          expected[i] = c.model == DataType::kBFloat16 ? FloatToBFloat16(params[i])
                                                       : FloatToHalf(params[i]);
        }
      }
      EXPECT_EQ(FirstMismatch(model, expected), -1) << "model copy, step " << step;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Rules, FusedOptimizerTest,
    ::testing::Values(
        OptimizerCase{"Adam", Adam(1e-3, 0.9, 0.999, 1e-8, 0), DataType::kFloat32},
        OptimizerCase{"AdamL2", Adam(1e-3, 0.9, 0.999, 1e-8, 0.01), DataType::kFloat32},
        OptimizerCase{"AdamW", Adam(3e-4, 0.9, 0.95, 1e-8, 0.1, OptimizerKind::kAdamW),
                      DataType::kFloat32},
        // 1 - beta1 >= 0.5 takes torch's other lerp formula.
        OptimizerCase{"AdamLowBeta1", Adam(1e-2, 0.3, 0.9, 1e-6, 0), DataType::kFloat32},
        OptimizerCase{"AdamWBf16Copy", Adam(1e-3, 0.9, 0.999, 1e-8, 0.01, OptimizerKind::kAdamW),
                      DataType::kBFloat16},
        OptimizerCase{"AdamF16Copy", Adam(1e-3, 0.9, 0.999, 1e-8, 0), DataType::kFloat16},
        OptimizerCase{"Sgd", Sgd(0.1, 0, 0, false), DataType::kFloat32},
        OptimizerCase{"SgdWeightDecay", Sgd(0.1, 0, 1e-4, false), DataType::kBFloat16},
        OptimizerCase{"SgdMomentum", Sgd(0.05, 0.9, 1e-4, false), DataType::kFloat32},
        OptimizerCase{"SgdNesterov", Sgd(0.05, 0.9, 1e-4, true), DataType::kFloat16}),
    [](const ::testing::TestParamInfo<OptimizerCase>& info) { return info.param.name; });

TEST(TensorListTest, RejectsInconsistentModelCopiesWithoutTouchingTheGpu) {
  std::vector<float> host(8);
  TensorSlot slot;
  slot.param = host.data();
  slot.count = 8;
  const auto no_model = TensorList::Create({slot}, DataType::kBFloat16, nullptr);
  EXPECT_EQ(no_model.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(no_model.status().message().find("no model pointer"), absl::string_view::npos);
  const auto wrong_dtype = TensorList::Create({slot}, DataType::kFloat64, nullptr);
  EXPECT_EQ(wrong_dtype.status().code(), absl::StatusCode::kInvalidArgument);
  slot.count = -1;
  EXPECT_EQ(TensorList::Create({slot}, DataType::kFloat32, nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(FusedOptimizerStateTest, RefusesAListWithoutTheRulesState) {
  SHARD_REQUIRE_GPU();
  SHARD_ASSERT_OK_AND_ASSIGN(DeviceBuffer buffer, DeviceBuffer::Allocate(64 * sizeof(float)));
  SHARD_ASSERT_OK(FillUniform(buffer.as<float>(), 64, 1, -1.0f, 1.0f, nullptr));
  TensorSlot slot;
  slot.param = buffer.as<float>();
  slot.grad = buffer.as<float>() + 32;
  slot.count = 32;
  SHARD_ASSERT_OK_AND_ASSIGN(TensorList list,
                             TensorList::Create({slot}, DataType::kFloat32, nullptr));
  const absl::Status adam = FusedOptimizer(OptimizerConfig{}).Step(1, list, nullptr);
  EXPECT_EQ(adam.code(), absl::StatusCode::kFailedPrecondition) << adam;
  EXPECT_EQ(FusedOptimizer(OptimizerConfig{}).Step(0, list, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  SHARD_EXPECT_OK(FusedOptimizer(Sgd(0.1, 0, 0, false)).Step(1, list, nullptr));
}

// Values across the whole fp32 range: both normal ranges, the 16-bit types' subnormals,
// overflow to infinity, round-to-even ties, signed zeros, infinities, NaN.
std::vector<float> CastInputs(std::mt19937_64& rng) {
  std::vector<float> values = {0.0f,        -0.0f,     1.0f,       -1.0f,        65504.0f,
                               65519.0f,    65520.0f,  -65520.0f,  6.1035156e-5f, 5.96e-8f,
                               2.9e-8f,     1e-40f,    3.0e38f,    3.4028235e38f,
                               std::numeric_limits<float>::infinity(),
                               -std::numeric_limits<float>::infinity(),
                               std::numeric_limits<float>::quiet_NaN()};
  // Exact ties of both formats: mantissas ending in 1 followed by zeros.
  for (uint32_t bits : {0x3f808000u, 0x3f818000u, 0x3f801000u, 0x3f803000u}) {
    values.push_back(std::bit_cast<float>(bits));
  }
  std::uniform_int_distribution<int> exponent(-40, 40);
  std::uniform_real_distribution<float> mantissa(1.0f, 2.0f);
  while (values.size() < 100000) {
    const float v = std::ldexp(mantissa(rng), exponent(rng));
    values.push_back(rng() % 2 ? v : -v);
  }
  return values;
}

TEST(CastTest, ToSixteenBitsRoundsLikeTheHostConversions) {
  SHARD_REQUIRE_GPU();
  std::mt19937_64 rng(7);
  const std::vector<float> values = CastInputs(rng);
  SHARD_ASSERT_OK_AND_ASSIGN(DeviceBuffer in, ToDevice(values));
  SHARD_ASSERT_OK_AND_ASSIGN(DeviceBuffer out, DeviceBuffer::Allocate(values.size() * 2));
  for (DataType dtype : {DataType::kBFloat16, DataType::kFloat16}) {
    ASSERT_EQ(cudaMemset(out.data(), 0xff, values.size() * 2), cudaSuccess);
    SHARD_ASSERT_OK(Cast(in.data(), DataType::kFloat32, out.data(), dtype,
                         static_cast<int64_t>(values.size()), nullptr));
    SHARD_ASSERT_OK_AND_ASSIGN(std::vector<uint16_t> got,
                               ToHost<uint16_t>(out.data(), values.size()));
    for (size_t i = 0; i < values.size(); ++i) {
      if (std::isnan(values[i])) {
        const float back = dtype == DataType::kBFloat16 ? BFloat16ToFloat(got[i])
                                                        : HalfToFloat(got[i]);
        EXPECT_TRUE(std::isnan(back)) << DataTypeName(dtype);
        continue;
      }
      const uint16_t expected = dtype == DataType::kBFloat16 ? FloatToBFloat16(values[i])
                                                             : FloatToHalf(values[i]);
      ASSERT_EQ(got[i], expected) << DataTypeName(dtype) << " of " << values[i] << " (index "
                                  << i << ")";
    }
  }
}

TEST(CastTest, FromSixteenBitsIsExactForEveryBitPattern) {
  SHARD_REQUIRE_GPU();
  std::vector<uint16_t> patterns(65536);
  for (uint32_t i = 0; i < patterns.size(); ++i) patterns[i] = static_cast<uint16_t>(i);
  SHARD_ASSERT_OK_AND_ASSIGN(DeviceBuffer in, ToDevice(patterns));
  SHARD_ASSERT_OK_AND_ASSIGN(DeviceBuffer out,
                             DeviceBuffer::Allocate(patterns.size() * sizeof(float)));
  for (DataType dtype : {DataType::kBFloat16, DataType::kFloat16}) {
    ASSERT_EQ(cudaMemset(out.data(), 0xff, patterns.size() * sizeof(float)), cudaSuccess);
    SHARD_ASSERT_OK(Cast(in.data(), dtype, out.data(), DataType::kFloat32,
                         static_cast<int64_t>(patterns.size()), nullptr));
    SHARD_ASSERT_OK_AND_ASSIGN(std::vector<float> got,
                               ToHost<float>(out.data(), patterns.size()));
    for (size_t i = 0; i < patterns.size(); ++i) {
      const float expected = dtype == DataType::kBFloat16 ? BFloat16ToFloat(patterns[i])
                                                          : HalfToFloat(patterns[i]);
      if (std::isnan(expected)) {
        ASSERT_TRUE(std::isnan(got[i])) << DataTypeName(dtype) << " pattern " << i;
      } else {
        ASSERT_EQ(std::bit_cast<uint32_t>(got[i]), std::bit_cast<uint32_t>(expected))
            << DataTypeName(dtype) << " pattern " << i;
      }
    }
  }
  EXPECT_EQ(Cast(in.data(), DataType::kBFloat16, out.data(), DataType::kFloat16, 1, nullptr)
                .code(),
            absl::StatusCode::kInvalidArgument);
}

// A list over one device buffer of kTotal grads, laid out as kLayouts.
absl::StatusOr<TensorList> GradList(float* grads) {
  std::vector<TensorSlot> slots;
  for (const Layout& layout : kLayouts) {
    TensorSlot slot;
    slot.grad = grads + layout.offset;
    slot.count = layout.count;
    slots.push_back(slot);
  }
  return TensorList::Create(slots, DataType::kFloat32, nullptr);
}

TEST(ScaleGradientsTest, UnscalesExactlyAndFlagsInfAndNan) {
  SHARD_REQUIRE_GPU();
  std::mt19937_64 rng(11);
  const float inv_scale = 1.0f / 65536.0f * 3.0f;  // not a power of two: real rounding
  SHARD_ASSERT_OK_AND_ASSIGN(DeviceBuffer grads, DeviceBuffer::Allocate(kTotal * sizeof(float)));
  SHARD_ASSERT_OK_AND_ASSIGN(DeviceBuffer found_inf, DeviceBuffer::Allocate(sizeof(float)));
  SHARD_ASSERT_OK_AND_ASSIGN(TensorList list, GradList(grads.as<float>()));
  const float non_finite[] = {0.0f, std::numeric_limits<float>::infinity(),
                              -std::numeric_limits<float>::infinity(),
                              std::numeric_limits<float>::quiet_NaN()};
  for (float planted : non_finite) {
    std::vector<float> values = RandomFloats(kTotal, rng, -70000.0f, 70000.0f);
    // One bad element in the scalar tail of an unaligned tensor, or none (planted == 0).
    const int64_t at = kLayouts[3].offset + kLayouts[3].count - 1;
    if (planted != 0.0f) values[at] = planted;
    ASSERT_EQ(cudaMemcpy(grads.data(), values.data(), kTotal * sizeof(float),
                         cudaMemcpyHostToDevice),
              cudaSuccess);
    ASSERT_EQ(cudaMemset(found_inf.data(), 0, sizeof(float)), cudaSuccess);
    SHARD_ASSERT_OK(ScaleGradients(list, inv_scale, found_inf.as<float>(), nullptr));
    SHARD_ASSERT_OK_AND_ASSIGN(std::vector<float> got, ToHost<float>(grads.data(), kTotal));
    SHARD_ASSERT_OK_AND_ASSIGN(std::vector<float> flag, ToHost<float>(found_inf.data(), 1));
    EXPECT_EQ(flag[0], planted != 0.0f ? 1.0f : 0.0f) << "planted " << planted;
    std::vector<float> expected = values;
    for (const Layout& layout : kLayouts) {
      for (int64_t i = layout.offset; i < layout.offset + layout.count; ++i) {
        expected[i] = values[i] * inv_scale;
      }
    }
    if (planted != 0.0f) {
      EXPECT_EQ(std::isnan(got[at]), std::isnan(expected[at]));
      got[at] = expected[at] = 0;
    }
    EXPECT_EQ(FirstMismatch(got, expected), -1) << "planted " << planted;
  }
  SHARD_EXPECT_OK(ScaleGradients(list, 2.0f, nullptr, nullptr));  // no flag wanted
}

TEST(GradSquaredNormTest, MatchesADoubleSumAndIsDeterministic) {
  SHARD_REQUIRE_GPU();
  std::mt19937_64 rng(13);
  const std::vector<float> values = RandomFloats(kTotal, rng, -3.0f, 3.0f);
  SHARD_ASSERT_OK_AND_ASSIGN(DeviceBuffer grads, ToDevice(values));
  SHARD_ASSERT_OK_AND_ASSIGN(DeviceBuffer sum, DeviceBuffer::Allocate(2 * sizeof(double)));
  SHARD_ASSERT_OK_AND_ASSIGN(TensorList list, GradList(grads.as<float>()));
  long double expected = 0;
  for (const Layout& layout : kLayouts) {
    for (int64_t i = layout.offset; i < layout.offset + layout.count; ++i) {
      expected += static_cast<long double>(values[i]) * values[i];
    }
  }
  ASSERT_EQ(cudaMemset(sum.data(), 0xff, 2 * sizeof(double)), cudaSuccess);
  SHARD_ASSERT_OK(GradSquaredNorm(list, sum.as<double>(), nullptr));
  SHARD_ASSERT_OK(GradSquaredNorm(list, sum.as<double>() + 1, nullptr));
  SHARD_ASSERT_OK_AND_ASSIGN(std::vector<double> got, ToHost<double>(sum.data(), 2));
  EXPECT_NEAR(got[0], static_cast<double>(expected), 1e-12 * static_cast<double>(expected));
  EXPECT_EQ(std::bit_cast<uint64_t>(got[0]), std::bit_cast<uint64_t>(got[1]));
}

TEST(FillTest, FillAndFillUniformWriteEveryElement) {
  SHARD_REQUIRE_GPU();
  constexpr int64_t kCount = 1234567;  // more than the grid-stride grid covers at once
  SHARD_ASSERT_OK_AND_ASSIGN(DeviceBuffer a, DeviceBuffer::Allocate(kCount * sizeof(float)));
  SHARD_ASSERT_OK_AND_ASSIGN(DeviceBuffer b, DeviceBuffer::Allocate(kCount * sizeof(float)));
  ASSERT_EQ(cudaMemset(a.data(), 0xff, kCount * sizeof(float)), cudaSuccess);
  SHARD_ASSERT_OK(Fill(a.as<float>(), kCount, -2.5f, nullptr));
  SHARD_ASSERT_OK_AND_ASSIGN(std::vector<float> filled, ToHost<float>(a.data(), kCount));
  EXPECT_EQ(FirstMismatch(filled, std::vector<float>(kCount, -2.5f)), -1);

  SHARD_ASSERT_OK(FillUniform(a.as<float>(), kCount, 42, -1.0f, 3.0f, nullptr));
  SHARD_ASSERT_OK(FillUniform(b.as<float>(), kCount, 42, -1.0f, 3.0f, nullptr));
  SHARD_ASSERT_OK_AND_ASSIGN(std::vector<float> first, ToHost<float>(a.data(), kCount));
  SHARD_ASSERT_OK_AND_ASSIGN(std::vector<float> again, ToHost<float>(b.data(), kCount));
  EXPECT_EQ(FirstMismatch(first, again), -1) << "same seed, same values";
  double mean = 0;
  for (float v : first) {
    ASSERT_GE(v, -1.0f);
    ASSERT_LT(v, 3.0f);
    mean += v;
  }
  EXPECT_NEAR(mean / kCount, 1.0, 0.01);
  SHARD_ASSERT_OK(FillUniform(b.as<float>(), kCount, 43, -1.0f, 3.0f, nullptr));
  SHARD_ASSERT_OK_AND_ASSIGN(std::vector<float> other, ToHost<float>(b.data(), kCount));
  int64_t equal = 0;
  for (int64_t i = 0; i < kCount; ++i) equal += first[i] == other[i];
  EXPECT_LT(equal, kCount / 1000) << "another seed, other values";
}

}  // namespace
}  // namespace shard
