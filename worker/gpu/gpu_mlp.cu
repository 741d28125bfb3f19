#include "worker/gpu/gpu_mlp.h"

#include <algorithm>
#include <climits>
#include <cstring>
#include <type_traits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/mlp.h"
#include "worker/gpu/convert.cuh"
#include "worker/gpu/cuda_check.h"
#include "worker/gpu/kernels.h"

namespace shard {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 4096;

int Blocks(int64_t threads) {
  const int64_t blocks = (threads + kThreads - 1) / kThreads;
  return static_cast<int>(blocks < kMaxBlocks ? blocks : kMaxBlocks);
}

#define SHARD_GRID_STRIDE(i, n)                                                   \
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < (n); \
       i += int64_t{gridDim.x} * blockDim.x)

// z[r, j] = bias[j]: the accumulator the forward product adds to (beta = 1), as the CPU path.
template <typename T>
__global__ void BroadcastBiasKernel(const T* __restrict__ bias, float* __restrict__ z,
                                    int64_t rows, int64_t cols) {
  SHARD_GRID_STRIDE(i, rows * cols) { z[i] = ToFloat(bias[i % cols]); }
}

template <typename T>
__global__ void ReluKernel(const float* __restrict__ z, T* __restrict__ h, int64_t count) {
  SHARD_GRID_STRIDE(i, count) { h[i] = FromFloat<T>(z[i] > 0 ? z[i] : 0.0f); }
}

__device__ __forceinline__ float WarpMax(float v) {
  for (int offset = 16; offset > 0; offset /= 2) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  }
  return v;
}

__device__ __forceinline__ double WarpSum(double v) {
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// One warp per row: softmax with the row's maximum subtracted, exponentials and their sum in
// double as on the CPU; the row's loss is log(sum exp) - logit[label].
__global__ void SoftmaxCrossEntropyKernel(const float* __restrict__ logits,
                                          const int64_t* __restrict__ labels, int64_t rows,
                                          int64_t classes, float* __restrict__ probabilities,
                                          double* __restrict__ row_losses, int* bad_row) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = int64_t{gridDim.x} * blockDim.x / 32;
  for (int64_t row = (blockIdx.x * int64_t{blockDim.x} + threadIdx.x) / 32; row < rows;
       row += warps) {
    const int64_t label = labels[row];
    if (label < 0 || label >= classes) {
      if (lane == 0) {
        atomicMin(bad_row, static_cast<int>(row));
        row_losses[row] = 0;
      }
      continue;
    }
    const float* z = logits + row * classes;
    float top = -INFINITY;
    for (int64_t c = lane; c < classes; c += 32) top = fmaxf(top, z[c]);
    top = WarpMax(top);
    double sum = 0;
    for (int64_t c = lane; c < classes; c += 32) sum += exp(static_cast<double>(z[c] - top));
    sum = WarpSum(sum);
    const double log_sum = log(sum) + top;
    for (int64_t c = lane; c < classes; c += 32) {
      probabilities[row * classes + c] = static_cast<float>(exp(z[c] - log_sum));
    }
    if (lane == 0) row_losses[row] = log_sum - z[label];
  }
}

// delta = (softmax - onehot) * scale, and its copy in the model type for the products.
template <typename T>
__global__ void OutputDeltaKernel(const float* __restrict__ probabilities,
                                  const int64_t* __restrict__ labels, int64_t rows,
                                  int64_t classes, float scale, float* __restrict__ delta,
                                  T* __restrict__ delta_cast) {
  SHARD_GRID_STRIDE(i, rows * classes) {
    const float target = i % classes == labels[i / classes] ? 1.0f : 0.0f;
    const float d = __fmul_rn(__fsub_rn(probabilities[i], target), scale);
    delta[i] = d;
    if constexpr (!std::is_same_v<T, float>) delta_cast[i] = FromFloat<T>(d);
  }
}

// bias_grad[j] = sum over rows of delta[r, j], rows in order in fp32: the CPU path's sum, so
// equal deltas give equal bias gradients bit for bit.
__global__ void BiasGradKernel(const float* __restrict__ delta, int64_t rows, int64_t cols,
                               float* __restrict__ bias_grad) {
  SHARD_GRID_STRIDE(j, cols) {
    float sum = 0.0f;
    for (int64_t r = 0; r < rows; ++r) sum = __fadd_rn(sum, delta[r * cols + j]);
    bias_grad[j] = sum;
  }
}

// Back through the ReLU: the gradient is 0 where the pre-activation was <= 0.
template <typename T>
__global__ void ReluBackwardKernel(const float* __restrict__ z, float* __restrict__ delta,
                                   T* __restrict__ delta_cast, int64_t count) {
  SHARD_GRID_STRIDE(i, count) {
    const float d = z[i] <= 0 ? 0.0f : delta[i];
    delta[i] = d;
    if constexpr (!std::is_same_v<T, float>) delta_cast[i] = FromFloat<T>(d);
  }
}

#undef SHARD_GRID_STRIDE

cudaDataType_t CublasType(DataType dtype) {
  switch (dtype) {
    case DataType::kBFloat16: return CUDA_R_16BF;
    case DataType::kFloat16: return CUDA_R_16F;
    default: return CUDA_R_32F;
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<GpuMlp>> GpuMlp::Create(std::vector<int64_t> widths,
                                                       int64_t max_batch, cudaStream_t stream,
                                                       GpuMlpOptions options) {
  if (widths.size() < 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("GPU MLP: needs at least an input and an output width, got ",
                     widths.size(), " widths"));
  }
  for (int64_t width : widths) {
    if (width < 1 || width > INT_MAX) {
      return absl::InvalidArgumentError(absl::StrCat("GPU MLP: width ", width,
                                                     " is not in [1, 2^31)"));
    }
  }
  if (max_batch < 1 || max_batch > INT_MAX) {
    return absl::InvalidArgumentError(
        absl::StrCat("GPU MLP: max_batch ", max_batch, " is not in [1, 2^31)"));
  }
  if (options.precision != DataType::kFloat32 && options.precision != DataType::kBFloat16 &&
      options.precision != DataType::kFloat16) {
    return absl::InvalidArgumentError(absl::StrCat("GPU MLP: precision must be f32, bf16 or f16, not ",
                                                   DataTypeName(options.precision)));
  }
  std::unique_ptr<GpuMlp> mlp(new GpuMlp(std::move(widths), max_batch, stream, options));
  SHARD_CUBLAS_RETURN_IF_ERROR(cublasCreate(&mlp->cublas_));
  SHARD_CUBLAS_RETURN_IF_ERROR(cublasSetStream(mlp->cublas_, stream));
  SHARD_RETURN_IF_ERROR(mlp->Allocate());
  return mlp;
}

GpuMlp::GpuMlp(std::vector<int64_t> widths, int64_t max_batch, cudaStream_t stream,
               GpuMlpOptions options)
    : widths_(std::move(widths)), max_batch_(max_batch), stream_(stream), options_(options) {}

GpuMlp::~GpuMlp() {
  if (cublas_ != nullptr) cublasDestroy(cublas_);
}

absl::Status GpuMlp::Allocate() {
  const size_t model_size = DataTypeSize(options_.precision);
  const bool cast = options_.precision != DataType::kFloat32;
  int64_t widest = 0;
  for (int64_t width : widths_) widest = std::max(widest, width);
  const int n = layers();
  outputs_.resize(n);
  hidden_.resize(n - 1);
  for (int l = 0; l < n; ++l) {
    const int64_t elements = max_batch_ * widths_[l + 1];
    SHARD_ASSIGN_OR_RETURN(outputs_[l], DeviceBuffer::Allocate(elements * sizeof(float)));
    if (l + 1 < n) {
      SHARD_ASSIGN_OR_RETURN(hidden_[l], DeviceBuffer::Allocate(elements * model_size));
    }
  }
  if (cast) {
    SHARD_ASSIGN_OR_RETURN(input_cast_,
                           DeviceBuffer::Allocate(max_batch_ * widths_[0] * model_size));
    SHARD_ASSIGN_OR_RETURN(delta_cast_, DeviceBuffer::Allocate(max_batch_ * widest * model_size));
  }
  SHARD_ASSIGN_OR_RETURN(probabilities_,
                         DeviceBuffer::Allocate(max_batch_ * widths_.back() * sizeof(float)));
  SHARD_ASSIGN_OR_RETURN(row_losses_, DeviceBuffer::Allocate(max_batch_ * sizeof(double)));
  SHARD_ASSIGN_OR_RETURN(bad_row_, DeviceBuffer::Allocate(sizeof(int)));
  SHARD_ASSIGN_OR_RETURN(delta_, DeviceBuffer::Allocate(max_batch_ * widest * sizeof(float)));
  SHARD_ASSIGN_OR_RETURN(delta_input_, DeviceBuffer::Allocate(max_batch_ * widest * sizeof(float)));
  SHARD_ASSIGN_OR_RETURN(host_losses_,
                         PinnedBuffer::Allocate(max_batch_ * sizeof(double) + sizeof(int)));
  return absl::OkStatus();
}

absl::Status GpuMlp::CheckParams(size_t params, size_t grads) const {
  const size_t expected = 2 * static_cast<size_t>(layers());
  if (params != expected || grads != expected) {
    return absl::InvalidArgumentError(absl::StrCat("GPU MLP: ", layers(), " layers take ",
                                                   expected, " parameters and gradients, got ",
                                                   params, " and ", grads));
  }
  return absl::OkStatus();
}

absl::Status GpuMlp::Gemm(cublasOperation_t op_a, cublasOperation_t op_b, int64_t m, int64_t n,
                          int64_t k, const void* a, int64_t lda, const void* b, int64_t ldb,
                          float beta, float* c, int64_t ldc, const char* what) {
  const float one = 1.0f;
  const cudaDataType_t type = CublasType(options_.precision);
  // Plain CUBLAS_COMPUTE_32F never rounds fp32 inputs to TF32 (the handle's default math mode).
  const cublasComputeType_t compute =
      options_.allow_tf32 && options_.precision == DataType::kFloat32
          ? CUBLAS_COMPUTE_32F_FAST_TF32
          : CUBLAS_COMPUTE_32F;
  return CublasStatus(
      cublasGemmEx(cublas_, op_a, op_b, static_cast<int>(m), static_cast<int>(n),
                   static_cast<int>(k), &one, a, type, static_cast<int>(lda), b, type,
                   static_cast<int>(ldb), &beta, c, CUDA_R_32F, static_cast<int>(ldc), compute,
                   CUBLAS_GEMM_DEFAULT),
      absl::StrCat("cublasGemmEx for ", what, " (m=", m, ", n=", n, ", k=", k, ")"));
}

absl::Status GpuMlp::Forward(const std::vector<const void*>& params, const float* x,
                             const int64_t* y, int64_t batch, const LayerHook& before_layer) {
  SHARD_RETURN_IF_ERROR(CheckParams(params.size(), params.size()));
  if (batch < 1 || batch > max_batch_) {
    return absl::InvalidArgumentError(absl::StrCat("GPU MLP: batch of ", batch,
                                                   " rows is not in [1, ", max_batch_,
                                                   "] (the max_batch it was created for)"));
  }
  batch_ = batch;
  labels_ = y;
  switch (options_.precision) {
    case DataType::kBFloat16: return ForwardAs<__nv_bfloat16>(params, x, y, before_layer);
    case DataType::kFloat16: return ForwardAs<__half>(params, x, y, before_layer);
    default: return ForwardAs<float>(params, x, y, before_layer);
  }
}

template <typename T>
absl::Status GpuMlp::ForwardAs(const std::vector<const void*>& params, const float* x,
                               const int64_t* y, const LayerHook& before_layer) {
  const int n = layers();
  const int64_t batch = batch_;
  if constexpr (std::is_same_v<T, float>) {
    input_ = x;
  } else {
    SHARD_RETURN_IF_ERROR(Cast(x, DataType::kFloat32, input_cast_.data(), options_.precision,
                               batch * widths_[0], stream_));
    input_ = input_cast_.data();
  }
  const void* a = input_;
  for (int l = 0; l < n; ++l) {
    if (before_layer) SHARD_RETURN_IF_ERROR(before_layer(l, /*backward=*/false));
    const int64_t in = widths_[l];
    const int64_t out = widths_[l + 1];
    float* z = outputs_[l].as<float>();
    BroadcastBiasKernel<<<Blocks(batch * out), kThreads, 0, stream_>>>(
        static_cast<const T*>(params[Mlp::BiasIndex(l)]), z, batch, out);
    SHARD_RETURN_IF_ERROR(LaunchStatus("BroadcastBiasKernel"));
    // z[batch, out] += a[batch, in] · Wᵀ; in cuBLAS's column-major terms zᵀ = W · aᵀ.
    SHARD_RETURN_IF_ERROR(Gemm(CUBLAS_OP_T, CUBLAS_OP_N, out, batch, in,
                               params[Mlp::WeightIndex(l)], in, a, in, 1.0f, z, out,
                               "a layer's forward product"));
    if (l + 1 < n) {
      ReluKernel<<<Blocks(batch * out), kThreads, 0, stream_>>>(z, hidden_[l].as<T>(),
                                                               batch * out);
      SHARD_RETURN_IF_ERROR(LaunchStatus("ReluKernel"));
      a = hidden_[l].data();
    }
  }
  // 0x7f7f7f7f, above any row: no bad label seen yet (the kernel keeps the smallest bad row).
  SHARD_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(bad_row_.data(), 0x7f, sizeof(int), stream_));
  const int64_t classes = widths_.back();
  SoftmaxCrossEntropyKernel<<<Blocks(batch * 32), kThreads, 0, stream_>>>(
      outputs_.back().as<float>(), y, batch, classes, probabilities_.as<float>(),
      row_losses_.as<double>(), bad_row_.as<int>());
  return LaunchStatus("SoftmaxCrossEntropyKernel");
}

absl::StatusOr<double> GpuMlp::Loss() {
  if (batch_ == 0) return absl::FailedPreconditionError("GPU MLP: Loss() before Forward()");
  char* host = host_losses_.as<char>();
  const size_t loss_bytes = batch_ * sizeof(double);
  SHARD_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(host, row_losses_.data(), loss_bytes,
                                             cudaMemcpyDeviceToHost, stream_));
  SHARD_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(host + loss_bytes, bad_row_.data(), sizeof(int),
                                             cudaMemcpyDeviceToHost, stream_));
  SHARD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  int bad_row;
  std::memcpy(&bad_row, host + loss_bytes, sizeof(int));
  if (bad_row < batch_) {
    int64_t label = 0;
    SHARD_CUDA_RETURN_IF_ERROR(cudaMemcpy(&label, labels_ + bad_row, sizeof(label),
                                          cudaMemcpyDeviceToHost));
    return absl::InvalidArgumentError(absl::StrCat("label ", label, " of batch row ", bad_row,
                                                   " is outside the ", widths_.back(),
                                                   " classes of the model's output"));
  }
  // Rows in order, as the CPU path sums them.
  const double* losses = host_losses_.as<double>();
  double loss = 0;
  for (int64_t r = 0; r < batch_; ++r) loss += losses[r];
  return loss;
}

absl::Status GpuMlp::Backward(const std::vector<const void*>& params,
                              const std::vector<float*>& grads, float scale,
                              const std::function<void(int)>& ready,
                              const LayerHook& before_layer) {
  SHARD_RETURN_IF_ERROR(CheckParams(params.size(), grads.size()));
  if (batch_ == 0) return absl::FailedPreconditionError("GPU MLP: Backward() before Forward()");
  switch (options_.precision) {
    case DataType::kBFloat16:
      return BackwardAs<__nv_bfloat16>(params, grads, scale, ready, before_layer);
    case DataType::kFloat16: return BackwardAs<__half>(params, grads, scale, ready, before_layer);
    default: return BackwardAs<float>(params, grads, scale, ready, before_layer);
  }
}

template <typename T>
absl::Status GpuMlp::BackwardAs(const std::vector<const void*>& params,
                                const std::vector<float*>& grads, float scale,
                                const std::function<void(int)>& ready,
                                const LayerHook& before_layer) {
  const int n = layers();
  const int64_t batch = batch_;
  const int64_t classes = widths_.back();
  // The products read the output gradient in the model's type (the fp32 one itself for f32).
  T* delta_cast = std::is_same_v<T, float> ? nullptr : delta_cast_.as<T>();
  const auto delta_operand = [&]() -> const void* {
    return std::is_same_v<T, float> ? delta_.data() : delta_cast_.data();
  };
  OutputDeltaKernel<T><<<Blocks(batch * classes), kThreads, 0, stream_>>>(
      probabilities_.as<float>(), labels_, batch, classes, scale, delta_.as<float>(), delta_cast);
  SHARD_RETURN_IF_ERROR(LaunchStatus("OutputDeltaKernel"));
  for (int l = n - 1; l >= 0; --l) {
    if (before_layer) SHARD_RETURN_IF_ERROR(before_layer(l, /*backward=*/true));
    const int64_t in = widths_[l];
    const int64_t out = widths_[l + 1];
    const void* a = l == 0 ? input_ : hidden_[l - 1].data();
    BiasGradKernel<<<Blocks(out), kThreads, 0, stream_>>>(delta_.as<float>(), batch, out,
                                                          grads[Mlp::BiasIndex(l)]);
    SHARD_RETURN_IF_ERROR(LaunchStatus("BiasGradKernel"));
    ready(Mlp::BiasIndex(l));
    // dW[out, in] = deltaᵀ · a; column-major: dWᵀ[in, out] = aᵀ[in, batch] · delta[batch, out].
    SHARD_RETURN_IF_ERROR(Gemm(CUBLAS_OP_N, CUBLAS_OP_T, in, out, batch, a, in, delta_operand(),
                               out, 0.0f, grads[Mlp::WeightIndex(l)], in,
                               "a weight gradient"));
    ready(Mlp::WeightIndex(l));
    if (l == 0) break;
    // d(a)[batch, in] = delta[batch, out] · W[out, in]; column-major: W_cm[in, out] · delta_cm.
    SHARD_RETURN_IF_ERROR(Gemm(CUBLAS_OP_N, CUBLAS_OP_N, in, batch, out,
                               params[Mlp::WeightIndex(l)], in, delta_operand(), out, 0.0f,
                               delta_input_.as<float>(), in, "an input gradient"));
    ReluBackwardKernel<T><<<Blocks(batch * in), kThreads, 0, stream_>>>(
        outputs_[l - 1].as<float>(), delta_input_.as<float>(), delta_cast, batch * in);
    SHARD_RETURN_IF_ERROR(LaunchStatus("ReluBackwardKernel"));
    std::swap(delta_, delta_input_);
  }
  return absl::OkStatus();
}

}  // namespace shard
