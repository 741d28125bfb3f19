#include "worker/gpu/kernels.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "worker/gpu/convert.cuh"
#include "worker/gpu/cuda_check.h"

namespace shard {

// Pointers are already offset to the chunk's first element.
struct DeviceChunk {
  float* param;
  float* grad;
  float* state0;
  float* state1;
  void* model;
  int32_t count;
  int32_t all_aligned;   // every pointer allows 16-byte float4 (8-byte model) accesses
  int32_t grad_aligned;  // the grad pointer does
};

namespace {

constexpr int kThreads = 256;
constexpr int kMaxGridStrideBlocks = 4096;

// No contraction into FMA, IEEE division and square root: the _rn intrinsics round every
// operation on its own, as the CPU path's scalar and AVX2 loops do (no -ffast-math, no FMA).
__device__ __forceinline__ float Mul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float Add(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ float Sub(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ float Div(float a, float b) { return __fdiv_rn(a, b); }

// Adam and AdamW: one functor, the difference is where the weight decay goes (as on the CPU).
struct AdamUpdate {
  static constexpr int kStates = 2;
  float step_size_neg;
  float bias_correction2_sqrt;
  float one_minus_beta1;
  float lerp_complement;
  float beta2;
  float one_minus_beta2;
  float eps;
  float l2;     // Adam's weight decay folded into the gradient (0 for AdamW)
  float decay;  // AdamW's 1 - lr * weight_decay
  bool lerp_from_self;
  bool decoupled;

  __device__ __forceinline__ void operator()(float& param, float grad, float& exp_avg,
                                             float& exp_avg_sq) const {
    float p = param;
    if (decoupled) p = Mul(p, decay);                    // param.mul_(1 - lr * weight_decay)
    const float g = l2 != 0 ? Add(grad, Mul(l2, p)) : grad;  // grad.add(param, alpha=wd)
    const float m0 = exp_avg;
    // exp_avg.lerp_(grad, 1 - beta1), torch's two-sided lerp formula.
    const float m = lerp_from_self ? Add(m0, Mul(one_minus_beta1, Sub(g, m0)))
                                   : Sub(g, Mul(Sub(g, m0), lerp_complement));
    // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    const float v = Add(Mul(exp_avg_sq, beta2), Mul(Mul(one_minus_beta2, g), g));
    // denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    const float denom = Add(Div(__fsqrt_rn(v), bias_correction2_sqrt), eps);
    // param.addcdiv_(exp_avg, denom, value=-step_size)
    param = Add(p, Div(Mul(step_size_neg, m), denom));
    exp_avg = m;
    exp_avg_sq = v;
  }
};

template <bool kMomentum>
struct SgdUpdate {
  static constexpr int kStates = kMomentum ? 1 : 0;
  float weight_decay;
  float momentum;
  float neg_lr;
  bool first;  // torch: buf = clone(d_p) on the first step
  bool nesterov;

  __device__ __forceinline__ void operator()(float& param, float grad, float& buffer,
                                             float& /*unused*/) const {
    float d = weight_decay != 0 ? Add(grad, Mul(weight_decay, param)) : grad;
    if constexpr (kMomentum) {
      const float b = first ? d : Add(Mul(buffer, momentum), d);
      buffer = b;
      d = nesterov ? Add(d, Mul(momentum, b)) : b;
    }
    param = Add(param, Mul(neg_lr, d));
  }
};

struct NoModelCopy {};

__device__ __forceinline__ void Load4(const float* p, float (&v)[4]) {
  const float4 x = *reinterpret_cast<const float4*>(p);
  v[0] = x.x;
  v[1] = x.y;
  v[2] = x.z;
  v[3] = x.w;
}
__device__ __forceinline__ void Store4(float* p, const float (&v)[4]) {
  *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
}
template <typename T>
__device__ __forceinline__ void StoreModel4(T* p, const float (&v)[4]) {
  static_assert(sizeof(T) == 2);
  struct alignas(8) Four {
    T x[4];
  } out;
#pragma unroll
  for (int k = 0; k < 4; ++k) out.x[k] = FromFloat<T>(v[k]);
  *reinterpret_cast<Four*>(p) = out;
}

// One block per chunk: float4 accesses where the chunk's pointers allow them, then a scalar tail
// (or scalar throughout for unaligned tensors). Every element is independent, so there is no
// shared memory and no synchronisation.
template <typename Update, typename Model>
__global__ void __launch_bounds__(kThreads)
    OptimizerKernel(const DeviceChunk* __restrict__ chunks, Update update) {
  const DeviceChunk c = chunks[blockIdx.x];
  constexpr bool kCopy = !std::is_same_v<Model, NoModelCopy>;
  const int vector_end = c.all_aligned ? (c.count & ~3) : 0;
  for (int i = threadIdx.x * 4; i < vector_end; i += kThreads * 4) {
    float p[4], g[4], s0[4] = {}, s1[4] = {};
    Load4(c.param + i, p);
    Load4(c.grad + i, g);
    if constexpr (Update::kStates > 0) Load4(c.state0 + i, s0);
    if constexpr (Update::kStates > 1) Load4(c.state1 + i, s1);
#pragma unroll
    for (int k = 0; k < 4; ++k) update(p[k], g[k], s0[k], s1[k]);
    Store4(c.param + i, p);
    if constexpr (Update::kStates > 0) Store4(c.state0 + i, s0);
    if constexpr (Update::kStates > 1) Store4(c.state1 + i, s1);
    if constexpr (kCopy) StoreModel4(static_cast<Model*>(c.model) + i, p);
  }
  for (int i = vector_end + threadIdx.x; i < c.count; i += kThreads) {
    float p = c.param[i];
    float s0 = Update::kStates > 0 ? c.state0[i] : 0.0f;
    float s1 = Update::kStates > 1 ? c.state1[i] : 0.0f;
    update(p, c.grad[i], s0, s1);
    c.param[i] = p;
    if constexpr (Update::kStates > 0) c.state0[i] = s0;
    if constexpr (Update::kStates > 1) c.state1[i] = s1;
    if constexpr (kCopy) static_cast<Model*>(c.model)[i] = FromFloat<Model>(p);
  }
}

__global__ void __launch_bounds__(kThreads)
    ScaleKernel(const DeviceChunk* __restrict__ chunks, float factor, float* found_inf) {
  const DeviceChunk c = chunks[blockIdx.x];
  bool non_finite = false;
  const int vector_end = c.grad_aligned ? (c.count & ~3) : 0;
  for (int i = threadIdx.x * 4; i < vector_end; i += kThreads * 4) {
    float g[4];
    Load4(c.grad + i, g);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      non_finite |= !isfinite(g[k]);
      g[k] = Mul(g[k], factor);
    }
    Store4(c.grad + i, g);
  }
  for (int i = vector_end + threadIdx.x; i < c.count; i += kThreads) {
    non_finite |= !isfinite(c.grad[i]);
    c.grad[i] = Mul(c.grad[i], factor);
  }
  // Every writer stores the same value, so the unordered stores are benign.
  if (found_inf != nullptr && non_finite) *found_inf = 1.0f;
}

// Sum of a block's values, in a fixed order (so the result does not change from run to run).
// Returns the sum in thread 0. Call it once per kernel: its shared array is not re-synchronised.
__device__ double BlockSum(double value) {
  __shared__ double warp_sums[kThreads / 32];
  for (int offset = 16; offset > 0; offset /= 2) {
    value += __shfl_down_sync(0xffffffffu, value, offset);
  }
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  if (lane == 0) warp_sums[warp] = value;
  __syncthreads();
  value = threadIdx.x < kThreads / 32 ? warp_sums[threadIdx.x] : 0.0;
  if (warp == 0) {
    for (int offset = 16; offset > 0; offset /= 2) {
      value += __shfl_down_sync(0xffffffffu, value, offset);
    }
  }
  return value;
}

__global__ void __launch_bounds__(kThreads)
    SquaredNormKernel(const DeviceChunk* __restrict__ chunks, double* __restrict__ partials) {
  const DeviceChunk c = chunks[blockIdx.x];
  double sum = 0;
  const int vector_end = c.grad_aligned ? (c.count & ~3) : 0;
  for (int i = threadIdx.x * 4; i < vector_end; i += kThreads * 4) {
    float g[4];
    Load4(c.grad + i, g);
#pragma unroll
    for (int k = 0; k < 4; ++k) sum += static_cast<double>(g[k]) * g[k];
  }
  for (int i = vector_end + threadIdx.x; i < c.count; i += kThreads) {
    const double g = c.grad[i];
    sum += g * g;
  }
  sum = BlockSum(sum);
  if (threadIdx.x == 0) partials[blockIdx.x] = sum;
}

__global__ void __launch_bounds__(kThreads)
    SumPartialsKernel(const double* __restrict__ partials, int64_t count, double* out) {
  double sum = 0;
  for (int64_t i = threadIdx.x; i < count; i += kThreads) sum += partials[i];
  sum = BlockSum(sum);
  if (threadIdx.x == 0) *out = sum;
}

__global__ void FillKernel(float* data, int64_t count, float value) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count;
       i += int64_t{gridDim.x} * blockDim.x) {
    data[i] = value;
  }
}

__global__ void DivideKernel(float* data, int64_t count, float divisor) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count;
       i += int64_t{gridDim.x} * blockDim.x) {
    data[i] = __fdiv_rn(data[i], divisor);
  }
}

__device__ __forceinline__ uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

__global__ void FillUniformKernel(float* data, int64_t count, uint64_t seed, float low,
                                  float width) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count;
       i += int64_t{gridDim.x} * blockDim.x) {
    const uint64_t bits = SplitMix64(seed ^ SplitMix64(static_cast<uint64_t>(i)));
    const float unit = static_cast<float>(bits >> 40) * (1.0f / 16777216.0f);  // [0, 1)
    data[i] = low + width * unit;
  }
}

template <typename In, typename Out>
__global__ void CastKernel(const In* __restrict__ in, Out* __restrict__ out, int64_t count) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count;
       i += int64_t{gridDim.x} * blockDim.x) {
    out[i] = FromFloat<Out>(ToFloat(in[i]));
  }
}

int GridStrideBlocks(int64_t count) {
  const int64_t blocks = (count + kThreads - 1) / kThreads;
  return static_cast<int>(blocks < kMaxGridStrideBlocks ? blocks : kMaxGridStrideBlocks);
}

bool Aligned(const void* p, uintptr_t alignment) {
  return reinterpret_cast<uintptr_t>(p) % alignment == 0;
}

template <typename Update>
absl::Status LaunchOptimizer(const TensorList& tensors, const Update& update,
                             cudaStream_t stream) {
  if (tensors.chunks() == 0) return absl::OkStatus();
  const unsigned blocks = static_cast<unsigned>(tensors.chunks());
  switch (tensors.model_dtype()) {
    case DataType::kBFloat16:
      OptimizerKernel<Update, __nv_bfloat16><<<blocks, kThreads, 0, stream>>>(tensors.table(),
                                                                              update);
      break;
    case DataType::kFloat16:
      OptimizerKernel<Update, __half><<<blocks, kThreads, 0, stream>>>(tensors.table(), update);
      break;
    default:
      OptimizerKernel<Update, NoModelCopy><<<blocks, kThreads, 0, stream>>>(tensors.table(),
                                                                            update);
      break;
  }
  return LaunchStatus("the fused optimizer kernel");
}

}  // namespace

absl::StatusOr<TensorList> TensorList::Create(const std::vector<TensorSlot>& tensors,
                                              DataType model_dtype, cudaStream_t stream) {
  if (model_dtype != DataType::kFloat32 && model_dtype != DataType::kBFloat16 &&
      model_dtype != DataType::kFloat16) {
    return absl::InvalidArgumentError(
        absl::StrCat("TensorList: model copies must be bf16 or f16 (or f32 for none), not ",
                     DataTypeName(model_dtype)));
  }
  TensorList list;
  list.model_dtype_ = model_dtype;
  list.has_params_ = list.has_grads_ = true;
  list.states_ = 2;
  std::vector<DeviceChunk> table;
  const bool copies = model_dtype != DataType::kFloat32;
  for (size_t t = 0; t < tensors.size(); ++t) {
    const TensorSlot& slot = tensors[t];
    if (slot.count < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("TensorList: tensor ", t, " has a negative count ", slot.count));
    }
    if (copies != (slot.model != nullptr)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "TensorList: tensor ", t, copies ? " has no" : " has a", " model pointer, but the "
          "list's model dtype is ", DataTypeName(model_dtype)));
    }
    list.has_params_ &= slot.param != nullptr;
    list.has_grads_ &= slot.grad != nullptr;
    int states = 0;
    while (states < 2 && slot.state[states] != nullptr) ++states;
    if (states < list.states_) list.states_ = states;
    const bool all_aligned = Aligned(slot.param, 16) && Aligned(slot.grad, 16) &&
                             Aligned(slot.state[0], 16) && Aligned(slot.state[1], 16) &&
                             Aligned(slot.model, 8);
    const size_t model_size = copies ? DataTypeSize(model_dtype) : 0;
    // Chunks start at multiples of kChunkElements (a multiple of 4), so they keep the
    // alignment of their tensor's pointers.
    for (int64_t begin = 0; begin < slot.count; begin += kChunkElements) {
      const auto at = [begin](float* p) { return p == nullptr ? nullptr : p + begin; };
      DeviceChunk chunk{};
      chunk.param = at(slot.param);
      chunk.grad = at(slot.grad);
      chunk.state0 = at(slot.state[0]);
      chunk.state1 = at(slot.state[1]);
      chunk.model = copies ? static_cast<char*>(slot.model) + begin * model_size : nullptr;
      chunk.count = static_cast<int32_t>(std::min(kChunkElements, slot.count - begin));
      chunk.all_aligned = all_aligned;
      chunk.grad_aligned = Aligned(slot.grad, 16);
      table.push_back(chunk);
    }
    list.elements_ += slot.count;
  }
  if (table.size() > static_cast<size_t>(INT_MAX)) {
    return absl::InvalidArgumentError(absl::StrCat("TensorList: ", table.size(),
                                                   " chunks exceed one launch's grid"));
  }
  list.chunks_ = static_cast<int64_t>(table.size());
  if (table.empty()) return list;
  SHARD_ASSIGN_OR_RETURN(list.table_, DeviceBuffer::Allocate(table.size() * sizeof(DeviceChunk)));
  SHARD_ASSIGN_OR_RETURN(list.partials_, DeviceBuffer::Allocate(table.size() * sizeof(double)));
  SHARD_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(list.table_.data(), table.data(),
                                             table.size() * sizeof(DeviceChunk),
                                             cudaMemcpyHostToDevice, stream));
  // `table` dies with this function: the copy must be done before.
  SHARD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  return list;
}

int FusedOptimizer::states() const {
  switch (config_.kind) {
    case OptimizerKind::kSgd: return config_.momentum > 0 ? 1 : 0;
    case OptimizerKind::kTorch: return 0;  // the script's optimizer updates, not this one
    default: return 2;
  }
}

absl::Status FusedOptimizer::Step(int64_t step, const StepHyperParameters& hyper,
                                  const TensorList& tensors, cudaStream_t stream) const {
  if (step < 1) {
    return absl::InvalidArgumentError(absl::StrCat("optimizer step must be >= 1, got ", step));
  }
  if (config_.kind == OptimizerKind::kTorch) {
    return absl::FailedPreconditionError(
        "the training script's own optimizer updates the parameters; the fused one has no rule");
  }
  if (tensors.chunks() > 0 &&
      (!tensors.has_params() || !tensors.has_grads() || tensors.states() < states())) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the fused optimizer needs a param, a grad and ", states(),
        " state pointer(s) in every tensor of the list; the list has params: ",
        tensors.has_params(), ", grads: ", tensors.has_grads(), ", states: ", tensors.states()));
  }
  const OptimizerConfig& c = config_;
  // The scalars exactly as OptimizerKernel::Update computes them (double, then fp32).
  if (c.kind == OptimizerKind::kSgd) {
    const float weight_decay = static_cast<float>(hyper.weight_decay);
    const float momentum = static_cast<float>(c.momentum);
    const float neg_lr = static_cast<float>(-hyper.lr);
    if (c.momentum <= 0) {
      return LaunchOptimizer(tensors,
                             SgdUpdate<false>{weight_decay, momentum, neg_lr, false, false},
                             stream);
    }
    return LaunchOptimizer(
        tensors, SgdUpdate<true>{weight_decay, momentum, neg_lr, step == 1, c.nesterov}, stream);
  }
  const double bias_correction1 = 1.0 - std::pow(c.beta1, static_cast<double>(step));
  const double bias_correction2 = 1.0 - std::pow(c.beta2, static_cast<double>(step));
  AdamUpdate update;
  update.step_size_neg = static_cast<float>(-(hyper.lr / bias_correction1));
  update.bias_correction2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
  update.one_minus_beta1 = static_cast<float>(1.0 - c.beta1);
  update.lerp_from_self = update.one_minus_beta1 < 0.5f;
  update.lerp_complement = 1.0f - update.one_minus_beta1;
  update.beta2 = static_cast<float>(c.beta2);
  update.one_minus_beta2 = static_cast<float>(1.0 - c.beta2);
  update.eps = static_cast<float>(c.eps);
  update.decoupled = c.kind == OptimizerKind::kAdamW;
  update.l2 = update.decoupled ? 0.0f : static_cast<float>(hyper.weight_decay);
  update.decay = static_cast<float>(1.0 - hyper.lr * hyper.weight_decay);
  return LaunchOptimizer(tensors, update, stream);
}

absl::Status ScaleGradients(const TensorList& tensors, float factor, float* found_inf,
                            cudaStream_t stream) {
  if (tensors.chunks() == 0) return absl::OkStatus();
  if (!tensors.has_grads()) {
    return absl::FailedPreconditionError("ScaleGradients: a tensor of the list has no grad");
  }
  ScaleKernel<<<static_cast<unsigned>(tensors.chunks()), kThreads, 0, stream>>>(
      tensors.table(), factor, found_inf);
  return LaunchStatus("ScaleKernel");
}

absl::Status GradSquaredNorm(const TensorList& tensors, double* sum_of_squares,
                             cudaStream_t stream) {
  if (tensors.chunks() == 0) {
    return CudaStatus(cudaMemsetAsync(sum_of_squares, 0, sizeof(double), stream),
                      "cudaMemsetAsync of the gradient norm");
  }
  if (!tensors.has_grads()) {
    return absl::FailedPreconditionError("GradSquaredNorm: a tensor of the list has no grad");
  }
  SquaredNormKernel<<<static_cast<unsigned>(tensors.chunks()), kThreads, 0, stream>>>(
      tensors.table(), tensors.partials());
  SHARD_RETURN_IF_ERROR(LaunchStatus("SquaredNormKernel"));
  SumPartialsKernel<<<1, kThreads, 0, stream>>>(tensors.partials(), tensors.chunks(),
                                                sum_of_squares);
  return LaunchStatus("SumPartialsKernel");
}

absl::Status Fill(float* data, int64_t count, float value, cudaStream_t stream) {
  if (count <= 0) return absl::OkStatus();
  FillKernel<<<GridStrideBlocks(count), kThreads, 0, stream>>>(data, count, value);
  return LaunchStatus("FillKernel");
}

absl::Status Divide(float* data, int64_t count, float divisor, cudaStream_t stream) {
  if (count <= 0) return absl::OkStatus();
  DivideKernel<<<GridStrideBlocks(count), kThreads, 0, stream>>>(data, count, divisor);
  return LaunchStatus("DivideKernel");
}

absl::Status FillUniform(float* data, int64_t count, uint64_t seed, float low, float high,
                         cudaStream_t stream) {
  if (count <= 0) return absl::OkStatus();
  FillUniformKernel<<<GridStrideBlocks(count), kThreads, 0, stream>>>(data, count, seed, low,
                                                                      high - low);
  return LaunchStatus("FillUniformKernel");
}

absl::Status Cast(const void* in, DataType in_dtype, void* out, DataType out_dtype,
                  int64_t count, cudaStream_t stream) {
  if (count <= 0) return absl::OkStatus();
  const int blocks = GridStrideBlocks(count);
  const auto launch = [&](auto* typed_in, auto* typed_out) {
    CastKernel<<<blocks, kThreads, 0, stream>>>(typed_in, typed_out, count);
    return LaunchStatus(absl::StrCat("CastKernel ", DataTypeName(in_dtype), " to ",
                                     DataTypeName(out_dtype)));
  };
  const auto* f32_in = static_cast<const float*>(in);
  auto* f32_out = static_cast<float*>(out);
  if (in_dtype == DataType::kFloat32 && out_dtype == DataType::kBFloat16) {
    return launch(f32_in, static_cast<__nv_bfloat16*>(out));
  }
  if (in_dtype == DataType::kFloat32 && out_dtype == DataType::kFloat16) {
    return launch(f32_in, static_cast<__half*>(out));
  }
  if (in_dtype == DataType::kBFloat16 && out_dtype == DataType::kFloat32) {
    return launch(static_cast<const __nv_bfloat16*>(in), f32_out);
  }
  if (in_dtype == DataType::kFloat16 && out_dtype == DataType::kFloat32) {
    return launch(static_cast<const __half*>(in), f32_out);
  }
  return absl::InvalidArgumentError(absl::StrCat("Cast: no conversion from ",
                                                 DataTypeName(in_dtype), " to ",
                                                 DataTypeName(out_dtype),
                                                 "; supported: f32 <-> bf16, f32 <-> f16"));
}

}  // namespace shard
