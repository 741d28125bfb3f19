// The built-in MLP of common/mlp.h on the GPU: layer i computes x·W_iᵀ + b_i (W_i of
// shape [out, in]), ReLU between layers, softmax cross-entropy summed over rows. Matrix products
// go through cuBLAS (cublasGemmEx); bias, ReLU, softmax and their gradients are small kernels.
// Parameters and gradients are not owned: the caller passes device pointers in manifest order
// (Mlp::WeightIndex / BiasIndex), e.g. views into bucket buffers, so gradients land where they
// are reduced.
//
// Precision (GpuMlpOptions::precision):
//   f32       weights, activations and products in fp32. TF32 is off unless allow_tf32, so the
//             results agree with the CPU path to fp32 rounding (~1e-6 relative).
//   bf16/f16  weights (16-bit copies of the fp32 masters) and activations in the 16-bit type;
//             products accumulate in fp32 (CUBLAS_COMPUTE_32F) and write fp32 pre-activations,
//             so bias, ReLU masks, softmax and the loss are fp32; gradients are fp32 (like
//             Megatron's main_grad) for the reduction and the fp32 optimizer. The 16-bit
//             rounding of inputs, activations and output gradients costs ~1e-2 (bf16) and ~1e-3
//             (f16) relative error against fp32 (docs/gpu.md).
//
// Everything runs on the stream given at creation; Forward and Backward only enqueue. One
// instance per stream; thread-compatible.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "common/dtype.h"
#include "common/mlp.h"
#include "worker/gpu/cuda_resources.h"

namespace shard {

struct GpuMlpOptions {
  DataType precision = DataType::kFloat32;  // kFloat32, kBFloat16 or kFloat16
  bool allow_tf32 = false;                  // fp32 products on TF32 tensor cores (~1e-3 error)
};

class GpuMlp {
 public:
  // Scratch for batches of up to `max_batch` rows is allocated here. InvalidArgument for fewer
  // than two widths, a non-positive width or batch, or another precision.
  static absl::StatusOr<std::unique_ptr<GpuMlp>> Create(std::vector<int64_t> widths,
                                                        int64_t max_batch, cudaStream_t stream,
                                                        GpuMlpOptions options = {});
  ~GpuMlp();
  GpuMlp(const GpuMlp&) = delete;
  GpuMlp& operator=(const GpuMlp&) = delete;

  const std::vector<int64_t>& widths() const { return widths_; }
  int layers() const { return static_cast<int>(widths_.size()) - 1; }
  DataType precision() const { return options_.precision; }

  // Enqueues the forward pass of `batch` rows: x is fp32 [batch, widths[0]] and y int64 [batch]
  // (device); params[i] point at the precision's type. x and y must stay valid until Backward.
  // `before_layer` (may be empty) runs before each layer's work is enqueued, in forward and
  // backward alike; it may repoint that layer's entries of `params` (and, in backward, `grads`),
  // which are read after it (parameters gathered on demand, ZeRO stage 3).
  absl::Status Forward(const std::vector<const void*>& params, const float* x, const int64_t* y,
                       int64_t batch, const LayerHook& before_layer = nullptr);

  // The last Forward's loss summed over rows (waits for the stream). InvalidArgument naming
  // the row when a label is outside the classes.
  absl::StatusOr<double> Loss();

  // Enqueues the gradients of `scale` x the last Forward's summed loss into grads[i] (fp32,
  // device, overwritten). ready(i) is called as soon as the work that completes parameter i's
  // gradient is enqueued, last layer first: work enqueued on the stream after it sees it.
  absl::Status Backward(const std::vector<const void*>& params, const std::vector<float*>& grads,
                        float scale, const std::function<void(int)>& ready,
                        const LayerHook& before_layer = nullptr);

 private:
  GpuMlp(std::vector<int64_t> widths, int64_t max_batch, cudaStream_t stream,
         GpuMlpOptions options);
  absl::Status Allocate();
  absl::Status CheckParams(size_t params, size_t grads) const;
  // C (fp32, column-major m x n) = op(A) op(B) + beta C, A and B of the model's type.
  absl::Status Gemm(cublasOperation_t op_a, cublasOperation_t op_b, int64_t m, int64_t n,
                    int64_t k, const void* a, int64_t lda, const void* b, int64_t ldb, float beta,
                    float* c, int64_t ldc, const char* what);
  template <typename T>
  absl::Status ForwardAs(const std::vector<const void*>& params, const float* x, const int64_t* y,
                         const LayerHook& before_layer);
  template <typename T>
  absl::Status BackwardAs(const std::vector<const void*>& params,
                          const std::vector<float*>& grads, float scale,
                          const std::function<void(int)>& ready, const LayerHook& before_layer);

  const std::vector<int64_t> widths_;
  const int64_t max_batch_;
  const cudaStream_t stream_;
  const GpuMlpOptions options_;
  cublasHandle_t cublas_ = nullptr;

  int64_t batch_ = 0;
  const void* input_ = nullptr;  // the last Forward's first-layer input (x, or its cast)
  const int64_t* labels_ = nullptr;
  std::vector<DeviceBuffer> outputs_;  // fp32 pre-activation of each layer
  std::vector<DeviceBuffer> hidden_;   // ReLU of each output but the last, model type
  DeviceBuffer input_cast_;            // x in the model type (16-bit precisions)
  DeviceBuffer probabilities_;         // softmax of the last output
  DeviceBuffer row_losses_;            // double per row
  DeviceBuffer bad_row_;               // int: first row with a bad label, or INT_MAX
  DeviceBuffer delta_;                 // fp32 gradient of the current layer's output
  DeviceBuffer delta_input_;           // fp32 scratch for the layer below
  DeviceBuffer delta_cast_;            // delta_ in the model type (16-bit precisions)
  PinnedBuffer host_losses_;           // row losses, then the bad row
};

}  // namespace shard
