// The cuBLAS MLP against two references on the same parameters and data:
//
// * the CPU MLP (OpenBLAS, fp32). For fp32 the products differ only in summation order (no
//   TF32): ~sqrt(k)·2^-24 typically for k-term dot products, so 1e-5 relative (in norm) on the
//   loss and every gradient leaves an order of magnitude of margin. The 16-bit precisions round
//   inputs, activations and output gradients to 8 (bf16) or 11 (f16) significant bits, at most
//   2^-8 / 2^-11 relative per rounding. On the last layer's gradients and the loss that gives a
//   few 1e-3 (bf16) and a few 1e-4 (f16): bounds 2e-2 and 3e-3. Deeper gradients also see ReLU
//   masks flip where a pre-activation is within rounding of zero, an error that grows like the
//   square root of the rounding (measured on an H100: 5% for bf16, 1.6% for f16 on the medium
//   MLP), so they are checked against the second reference instead;
// * a double-precision reference that rounds to the 16-bit type exactly where the GPU path does
//   (input, hidden activations, output gradients before the products). What is left is fp32
//   accumulation against double (~1e-6 relative): 1e-5 for fp32. In 16 bits that small
//   difference now and then tips a rounding to the neighbouring value (an error of 2^-8 or
//   2^-11), which moves the next layer's pre-activations enough to flip a few ReLU masks; in a
//   [256, 1024] layer a single flipped mask is already ~2e-3 of the gradient's norm. Measured
//   on an H100: 2.5e-3 for bf16, under 1e-3 for f16. Bounds 1e-2 and 3e-3: 4x above that, and
//   5x below the GPU's distance from plain fp32 (the 5% and 1.6% above), so a path that
//   rounded elsewhere would fail.
#include "worker/gpu/gpu_mlp.h"

#include <cmath>
#include <random>
#include <vector>

#include "common/dtype.h"
#include "common/mlp.h"
#include "gtest/gtest.h"
#include "tests/gpu/gpu_test_util.h"
#include "worker/gpu/kernels.h"

namespace shard {
namespace {

struct MlpCase {
  const char* name;
  std::vector<int64_t> widths;
  int64_t batch;
  DataType precision;
  double cpu_bound;       // loss and gradients (16-bit: the last layer's) against the CPU MLP
  double emulated_bound;  // every gradient against the rounding-emulating reference
};

void PrintTo(const MlpCase& c, std::ostream* os) { *os << c.name; }

// Rounds to the precision and back: what a 16-bit tensor holds.
float Representable(float value, DataType precision) {
  switch (precision) {
    case DataType::kBFloat16: return BFloat16ToFloat(FloatToBFloat16(value));
    case DataType::kFloat16: return HalfToFloat(FloatToHalf(value));
    default: return value;
  }
}

struct Reference {
  double loss = 0;
  std::vector<std::vector<float>> grads;  // manifest order
};

// The GPU path's arithmetic in double, rounding where it rounds (see the file comment). params
// are already representable in the precision.
Reference EmulatedReference(const std::vector<int64_t>& widths,
                            const std::vector<std::vector<float>>& params,
                            const std::vector<float>& x, const std::vector<int64_t>& y,
                            int64_t batch, float scale, DataType precision) {
  const int n = static_cast<int>(widths.size()) - 1;
  const auto round = [precision](float v) { return Representable(v, precision); };
  std::vector<std::vector<float>> inputs(n);  // each layer's input, as the GPU holds it
  std::vector<std::vector<float>> z(n);       // fp32 pre-activations
  inputs[0].resize(x.size());
  for (size_t i = 0; i < x.size(); ++i) inputs[0][i] = round(x[i]);
  for (int l = 0; l < n; ++l) {
    const int64_t in = widths[l], out = widths[l + 1];
    const std::vector<float>& w = params[Mlp::WeightIndex(l)];
    const std::vector<float>& b = params[Mlp::BiasIndex(l)];
    z[l].resize(batch * out);
    for (int64_t r = 0; r < batch; ++r) {
      for (int64_t j = 0; j < out; ++j) {
        double sum = b[j];
        for (int64_t k = 0; k < in; ++k) sum += double{inputs[l][r * in + k]} * w[j * in + k];
        z[l][r * out + j] = static_cast<float>(sum);
      }
    }
    if (l + 1 < n) {
      inputs[l + 1].resize(batch * out);
      for (size_t i = 0; i < z[l].size(); ++i) inputs[l + 1][i] = round(z[l][i] > 0 ? z[l][i] : 0);
    }
  }
  Reference ref;
  const int64_t classes = widths.back();
  std::vector<float> delta(batch * classes);
  for (int64_t r = 0; r < batch; ++r) {
    const float* row = z[n - 1].data() + r * classes;
    float top = row[0];
    for (int64_t c = 1; c < classes; ++c) top = std::max(top, row[c]);
    double sum = 0;
    for (int64_t c = 0; c < classes; ++c) sum += std::exp(static_cast<double>(row[c] - top));
    const double log_sum = std::log(sum) + top;
    ref.loss += log_sum - row[y[r]];
    for (int64_t c = 0; c < classes; ++c) {
      const float p = static_cast<float>(std::exp(row[c] - log_sum));
      delta[r * classes + c] = (p - (c == y[r] ? 1.0f : 0.0f)) * scale;
    }
  }
  ref.grads.resize(params.size());
  for (int l = n - 1; l >= 0; --l) {
    const int64_t in = widths[l], out = widths[l + 1];
    std::vector<float> rounded(delta.size());
    for (size_t i = 0; i < delta.size(); ++i) rounded[i] = round(delta[i]);
    std::vector<float>& db = ref.grads[Mlp::BiasIndex(l)];
    db.assign(out, 0.0f);
    for (int64_t r = 0; r < batch; ++r) {
      for (int64_t j = 0; j < out; ++j) db[j] += delta[r * out + j];
    }
    std::vector<double> dw(out * in, 0.0);
    for (int64_t r = 0; r < batch; ++r) {
      for (int64_t j = 0; j < out; ++j) {
        const double d = rounded[r * out + j];
        for (int64_t k = 0; k < in; ++k) dw[j * in + k] += d * inputs[l][r * in + k];
      }
    }
    ref.grads[Mlp::WeightIndex(l)].assign(dw.begin(), dw.end());
    if (l == 0) break;
    const std::vector<float>& w = params[Mlp::WeightIndex(l)];
    std::vector<double> da(batch * in, 0.0);
    for (int64_t r = 0; r < batch; ++r) {
      for (int64_t j = 0; j < out; ++j) {
        const double d = rounded[r * out + j];
        for (int64_t k = 0; k < in; ++k) da[r * in + k] += d * w[j * in + k];
      }
    }
    delta.assign(batch * in, 0.0f);
    for (size_t i = 0; i < da.size(); ++i) delta[i] = z[l - 1][i] <= 0 ? 0.0f : static_cast<float>(da[i]);
  }
  return ref;
}

class GpuMlpTest : public ::testing::TestWithParam<MlpCase> {};

TEST_P(GpuMlpTest, MatchesTheCpuMlpAndTheEmulatedReference) {
  SHARD_REQUIRE_GPU();
  const MlpCase& c = GetParam();
  const int64_t batch = c.batch;
  const int64_t in = c.widths.front();
  const int64_t classes = c.widths.back();
  const int layers = static_cast<int>(c.widths.size()) - 1;
  std::mt19937_64 rng(99);

  std::vector<std::vector<float>> params = InitMlpParameters(c.widths, 5);
  for (std::vector<float>& p : params) {
    for (float& v : p) v = Representable(v, c.precision);
  }
  const std::vector<float> x = RandomFloats(batch * in, rng, -2.0f, 2.0f);
  std::vector<int64_t> y(batch);
  for (int64_t& label : y) label = static_cast<int64_t>(rng() % classes);
  // The summed loss's gradient (a loss scale of `batch`): keeps output gradients well inside
  // f16's normal range, as loss scaling does in training.
  const float scale = 1.0f;

  // CPU MLP.
  Mlp cpu(c.widths);
  std::vector<const float*> cpu_params;
  std::vector<std::vector<float>> cpu_grads;
  std::vector<float*> cpu_grad_views;
  for (const std::vector<float>& p : params) {
    cpu_params.push_back(p.data());
    cpu_grads.emplace_back(p.size());
  }
  for (std::vector<float>& g : cpu_grads) cpu_grad_views.push_back(g.data());
  const absl::StatusOr<double> cpu_loss = cpu.Forward(cpu_params, x.data(), y.data(), batch);
  ASSERT_TRUE(cpu_loss.ok()) << cpu_loss.status();
  std::vector<int> cpu_order;
  ASSERT_TRUE(
      cpu.Backward(cpu_params, cpu_grad_views, scale, [&](int i) { cpu_order.push_back(i); })
          .ok());
  const Reference emulated =
      EmulatedReference(c.widths, params, x, y, batch, scale, c.precision);

  // GPU: parameters in the model's type, gradients poisoned before the backward pass.
  SHARD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<GpuMlp> gpu,
                             GpuMlp::Create(c.widths, batch, nullptr, {.precision = c.precision}));
  std::vector<DeviceBuffer> d_params;
  std::vector<DeviceBuffer> d_grads;
  std::vector<const void*> param_views;
  std::vector<float*> grad_views;
  for (const std::vector<float>& p : params) {
    SHARD_ASSERT_OK_AND_ASSIGN(DeviceBuffer fp32, ToDevice(p));
    if (c.precision == DataType::kFloat32) {
      d_params.push_back(std::move(fp32));
    } else {
      SHARD_ASSERT_OK_AND_ASSIGN(DeviceBuffer narrow, DeviceBuffer::Allocate(p.size() * 2));
      SHARD_ASSERT_OK(Cast(fp32.data(), DataType::kFloat32, narrow.data(), c.precision,
                           static_cast<int64_t>(p.size()), nullptr));
      d_params.push_back(std::move(narrow));
    }
    param_views.push_back(d_params.back().data());
    SHARD_ASSERT_OK_AND_ASSIGN(DeviceBuffer grad, ToDevice(std::vector<float>(p.size(), kPoison)));
    grad_views.push_back(grad.as<float>());
    d_grads.push_back(std::move(grad));
  }
  SHARD_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_x, ToDevice(x));
  SHARD_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_y, ToDevice(y));
  SHARD_ASSERT_OK(gpu->Forward(param_views, d_x.as<float>(), d_y.as<int64_t>(), batch));
  SHARD_ASSERT_OK_AND_ASSIGN(const double loss, gpu->Loss());
  EXPECT_NEAR(loss, *cpu_loss, c.cpu_bound * std::abs(*cpu_loss)) << "against the CPU MLP";
  EXPECT_NEAR(loss, emulated.loss, 1e-5 * std::abs(emulated.loss)) << "against the emulation";
  std::vector<int> gpu_order;
  SHARD_ASSERT_OK(
      gpu->Backward(param_views, grad_views, scale, [&](int i) { gpu_order.push_back(i); }));
  EXPECT_EQ(gpu_order, cpu_order);
  for (size_t i = 0; i < params.size(); ++i) {
    SHARD_ASSERT_OK_AND_ASSIGN(std::vector<float> grad,
                               ToHost<float>(grad_views[i], params[i].size()));
    for (float g : grad) ASSERT_FALSE(std::isnan(g)) << "gradient " << i << " not fully written";
    const bool last_layer = static_cast<int>(i) >= Mlp::WeightIndex(layers - 1);
    if (c.precision == DataType::kFloat32 || last_layer) {
      EXPECT_LE(RelativeError(grad, cpu_grads[i]), c.cpu_bound) << "gradient " << i << " vs CPU";
    }
    EXPECT_LE(RelativeError(grad, emulated.grads[i]), c.emulated_bound)
        << "gradient " << i << " vs the emulation";
  }
}

INSTANTIATE_TEST_SUITE_P(
    Precisions, GpuMlpTest,
    ::testing::Values(
        MlpCase{"Fp32Odd", {37, 64, 48, 10}, 29, DataType::kFloat32, 1e-5, 1e-5},
        MlpCase{"Fp32Medium", {512, 1024, 1024, 64}, 256, DataType::kFloat32, 1e-5, 1e-5},
        MlpCase{"Bf16Medium", {512, 1024, 1024, 64}, 256, DataType::kBFloat16, 2e-2, 1e-2},
        MlpCase{"Fp16Medium", {512, 1024, 1024, 64}, 256, DataType::kFloat16, 3e-3, 3e-3}),
    [](const ::testing::TestParamInfo<MlpCase>& info) { return info.param.name; });

TEST(GpuMlpErrorsTest, BadLabelsAndBatchesAreInvalidArguments) {
  SHARD_REQUIRE_GPU();
  const std::vector<int64_t> widths = {4, 8, 3};
  SHARD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<GpuMlp> gpu, GpuMlp::Create(widths, 4, nullptr));
  std::vector<DeviceBuffer> buffers;
  std::vector<const void*> views;
  for (const std::vector<float>& p : InitMlpParameters(widths, 1)) {
    SHARD_ASSERT_OK_AND_ASSIGN(DeviceBuffer b, ToDevice(p));
    views.push_back(b.data());
    buffers.push_back(std::move(b));
  }
  std::mt19937_64 rng(3);
  SHARD_ASSERT_OK_AND_ASSIGN(DeviceBuffer x, ToDevice(RandomFloats(16, rng, -1.0f, 1.0f)));
  SHARD_ASSERT_OK_AND_ASSIGN(DeviceBuffer y, ToDevice(std::vector<int64_t>{0, 2, 7, -1}));
  SHARD_ASSERT_OK(gpu->Forward(views, x.as<float>(), y.as<int64_t>(), 4));
  const absl::StatusOr<double> loss = gpu->Loss();
  EXPECT_EQ(loss.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(loss.status().message().find("label 7 of batch row 2"), absl::string_view::npos)
      << loss.status();
  EXPECT_EQ(gpu->Forward(views, x.as<float>(), y.as<int64_t>(), 5).code(),
            absl::StatusCode::kInvalidArgument);
  views.pop_back();
  EXPECT_EQ(gpu->Forward(views, x.as<float>(), y.as<int64_t>(), 4).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(GpuMlp::Create({4}, 4, nullptr).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(GpuMlp::Create(widths, 4, nullptr, {.precision = DataType::kInt64}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace shard
