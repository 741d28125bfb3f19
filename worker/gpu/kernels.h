// CUDA kernels of the GPU data path: the fused multi-tensor optimizer step (Adam, AdamW, SGD with
// momentum, PyTorch's rules with exactly the CPU path's arithmetic), gradient scaling with
// inf/NaN detection for loss scaling, the global gradient norm, casts between fp32 and the
// 16-bit types, and fills. Everything is enqueued on the caller's stream and returns at once;
// errors are those of the launch (asynchronous failures surface at the next synchronisation).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "common/dtype.h"
#include "common/job_spec.h"
#include "common/param_groups.h"
#include "worker/gpu/cuda_resources.h"

namespace shard {

// One tensor of a TensorList: device pointers to `count` elements each. Which pointers an
// operation uses is said where it is declared; the others may be null.
struct TensorSlot {
  float* param = nullptr;                // fp32 master weights
  float* grad = nullptr;                 // fp32 gradients
  float* state[2] = {nullptr, nullptr};  // optimizer state in OptimizerStateNames order
  void* model = nullptr;  // 16-bit model weights (the list's model_dtype), written from param
  int64_t count = 0;
};

struct DeviceChunk;  // one entry of the device-side chunk table (kernels.cu)

// A fixed list of tensors cut into chunks of at most kChunkElements, with the chunk table in
// device memory, so that each multi-tensor operation is one launch however many tensors there
// are (PyTorch's and apex's multi_tensor_apply, except that the table is built once, not on
// every call). Build one per set of buffers, e.g. the owned shards of every bucket, and reuse
// it every step. Use a list from one stream at a time: GradSquaredNorm writes its scratch.
class TensorList {
 public:
  static constexpr int64_t kChunkElements = 65536;

  // `model_dtype` is kFloat32 when there are no 16-bit model copies (every model pointer null),
  // or kBFloat16 / kFloat16 with a model pointer in every slot. Copies the table to the device
  // on `stream` and waits for that copy. InvalidArgument for a negative count, a missing model
  // pointer or another model dtype.
  static absl::StatusOr<TensorList> Create(const std::vector<TensorSlot>& tensors,
                                           DataType model_dtype, cudaStream_t stream);

  int64_t elements() const { return elements_; }
  int64_t chunks() const { return chunks_; }
  DataType model_dtype() const { return model_dtype_; }
  // Whether every slot has a param / grad pointer, and how many leading state pointers every
  // slot has.
  bool has_params() const { return has_params_; }
  bool has_grads() const { return has_grads_; }
  int states() const { return states_; }

  const DeviceChunk* table() const { return table_.as<const DeviceChunk>(); }
  double* partials() const { return partials_.as<double>(); }

 private:
  DeviceBuffer table_;
  DeviceBuffer partials_;  // one double per chunk, for reductions
  int64_t elements_ = 0;
  int64_t chunks_ = 0;
  DataType model_dtype_ = DataType::kFloat32;
  bool has_params_ = false;
  bool has_grads_ = false;
  int states_ = 0;
};

// torch.optim.Adam / AdamW / SGD (momentum, dampening 0, optional Nesterov) over every tensor of
// a list in one launch. Element for element the same fp32 operations in the same order as
// OptimizerKernel::Update (worker/dataplane/optimizer.h), with the step's scalars computed in
// double on the host and rounded to fp32, so results are bitwise equal to the CPU path's.
class FusedOptimizer {
 public:
  explicit FusedOptimizer(OptimizerConfig config) : config_(config) {}

  // State tensors each slot needs: 2 for Adam/AdamW (exp_avg, exp_avg_sq), 1 for SGD with
  // momentum (momentum_buffer), 0 for plain SGD.
  int states() const;

  // Applies update number `step` (1-based; SGD's momentum buffer starts as the gradient at
  // step 1) to every tensor. Slots need param, grad and states() state pointers; with 16-bit
  // model copies those are written from the updated fp32 parameters (round to nearest even) in
  // the same pass. FailedPrecondition when the list lacks what the rule needs.
  absl::Status Step(int64_t step, const TensorList& tensors, cudaStream_t stream) const {
    return Step(step, StepHyperParameters{config_.lr, config_.weight_decay}, tensors, stream);
  }
  // The same with the learning rate and weight decay of `hyper` (a param group's at a step of
  // the schedule) instead of the config's.
  absl::Status Step(int64_t step, const StepHyperParameters& hyper, const TensorList& tensors,
                    cudaStream_t stream) const;

  const OptimizerConfig& config() const { return config_; }

 private:
  OptimizerConfig config_;
};

// grad *= factor for every tensor. With `found_inf` (device float) not null, sets *found_inf to
// 1 if any gradient was inf or NaN before scaling, and leaves it alone otherwise: with
// factor = 1 / loss_scale this is torch's _amp_foreach_non_finite_check_and_unscale_.
absl::Status ScaleGradients(const TensorList& tensors, float factor, float* found_inf,
                            cudaStream_t stream);

// *sum_of_squares (one device double) = the sum of grad² over every tensor. Squares and sums are
// in double, per chunk and then over chunks in a fixed order, so the result is deterministic and
// within a few double ulps of the exact sum (fp32 accumulation would lose ~1e-4 relative over
// 1e8 elements). Ranks then all-reduce it and take the square root for clipping.
absl::Status GradSquaredNorm(const TensorList& tensors, double* sum_of_squares,
                             cudaStream_t stream);

// data[0, count) = value.
absl::Status Fill(float* data, int64_t count, float value, cudaStream_t stream);

// data[i] /= divisor for i < count, rounded as the host's division (__fdiv_rn).
absl::Status Divide(float* data, int64_t count, float divisor, cudaStream_t stream);

// data[i] uniform in [low, high) from a counter-based hash of (seed, i): the same values for
// the same seed on every GPU, without a generator state. For tests and benchmarks.
absl::Status FillUniform(float* data, int64_t count, uint64_t seed, float low, float high,
                         cudaStream_t stream);

// out[i] = in[i] converted, between kFloat32 and kBFloat16 / kFloat16 either way (to 16 bits:
// round to nearest even, as common/dtype.h's FloatToBFloat16 / FloatToHalf). InvalidArgument for
// other pairs.
absl::Status Cast(const void* in, DataType in_dtype, void* out, DataType out_dtype,
                  int64_t count, cudaStream_t stream);

}  // namespace shard
