#include "worker/gpu/gpu_device.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "worker/gpu/cuda_check.h"
#include "worker/gpu/gpu_mlp.h"
#include "worker/gpu/kernels.h"

namespace shard {
namespace {

// The largest AllReduceHostValues: the step boundary's, a few orders and one loss share per
// rank (training_session.cc), for worlds of up to about 8,000 ranks.
constexpr size_t kHostValueBytes = 64 << 10;

void FreeDevice(float* data) { cudaFree(data); }

absl::Status WaitFor(cudaStream_t stream, absl::string_view what) {
  return CudaStatus(cudaStreamSynchronize(stream), what);
}

// The spans of one param group (common/param_groups.h), updated with its settings.
struct GroupTensors {
  int group = -1;
  TensorList tensors;
};

class GpuSpanKernels final : public SpanKernels {
 public:
  // `tensors` holds every span. `groups` holds the spans of each param group when they are of
  // more than one; otherwise it is empty and `tensors` are all of `only_group`.
  GpuSpanKernels(const OptimizerConfig& config, TensorList tensors,
                 std::vector<GroupTensors> groups, int only_group, DeviceBuffer scalars,
                 cudaStream_t stream)
      : optimizer_(config), tensors_(std::move(tensors)), groups_(std::move(groups)),
        only_group_(only_group), scalars_(std::move(scalars)), stream_(stream) {}

  absl::Status OptimizerStep(int64_t step) override {
    const OptimizerConfig& config = optimizer_.config();
    if (groups_.empty()) {
      return optimizer_.Step(step, GroupHyperParameters(config, only_group_, step), tensors_,
                             stream_);
    }
    for (const GroupTensors& group : groups_) {
      SHARD_RETURN_IF_ERROR(optimizer_.Step(
          step, GroupHyperParameters(config, group.group, step), group.tensors, stream_));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<double> GradSquaredSum() override {
    double* sum = scalars_.as<double>();
    SHARD_RETURN_IF_ERROR(GradSquaredNorm(tensors_, sum, stream_));
    double host = 0;
    SHARD_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(&host, sum, sizeof(double), cudaMemcpyDeviceToHost, stream_));
    SHARD_RETURN_IF_ERROR(WaitFor(stream_, "the gradient norm"));
    return host;
  }

  absl::StatusOr<bool> ScaleGradients(float factor, bool check_finite) override {
    float* found = check_finite ? scalars_.as<float>() : nullptr;
    if (found != nullptr) SHARD_RETURN_IF_ERROR(Fill(found, 1, 0.0f, stream_));
    SHARD_RETURN_IF_ERROR(shard::ScaleGradients(tensors_, factor, found, stream_));
    if (found == nullptr) return false;
    float host = 0;
    SHARD_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(&host, found, sizeof(float), cudaMemcpyDeviceToHost, stream_));
    SHARD_RETURN_IF_ERROR(WaitFor(stream_, "the inf/NaN check of the gradients"));
    return host != 0;
  }

 private:
  const FusedOptimizer optimizer_;
  const TensorList tensors_;
  const std::vector<GroupTensors> groups_;
  const int only_group_;
  DeviceBuffer scalars_;  // the norm (double) or the inf/NaN flag (float)
  const cudaStream_t stream_;
};

class GpuMlpRunner final : public MlpRunner {
 public:
  static absl::StatusOr<std::unique_ptr<GpuMlpRunner>> Create(const std::vector<int64_t>& widths,
                                                             int64_t max_rows, DataType precision,
                                                             cudaStream_t stream) {
    SHARD_ASSIGN_OR_RETURN(std::unique_ptr<GpuMlp> model,
                           GpuMlp::Create(widths, max_rows, stream, {.precision = precision}));
    std::unique_ptr<GpuMlpRunner> runner(new GpuMlpRunner(std::move(model), stream));
    SHARD_ASSIGN_OR_RETURN(runner->x_,
                           DeviceBuffer::Allocate(max_rows * widths.front() * sizeof(float)));
    SHARD_ASSIGN_OR_RETURN(runner->y_, DeviceBuffer::Allocate(max_rows * sizeof(int64_t)));
    if (precision != DataType::kFloat32) {
      // Manifest order (Mlp::WeightIndex / BiasIndex): layer l's weight, then its bias.
      for (size_t l = 0; l + 1 < widths.size(); ++l) {
        for (int64_t numel : {widths[l + 1] * widths[l], widths[l + 1]}) {
          SHARD_ASSIGN_OR_RETURN(DeviceBuffer copy,
                                 DeviceBuffer::Allocate(numel * DataTypeSize(precision)));
          runner->copies_.push_back(std::move(copy));
          runner->numels_.push_back(numel);
        }
      }
    }
    return runner;
  }

  absl::Status Forward(const std::vector<const float*>& params, const float* x, const int64_t* y,
                       int64_t rows, const LayerHook& before_layer) override {
    if (before_layer && !copies_.empty()) return LayerByLayerUnimplemented();
    const int64_t inputs = rows * model_->widths().front();
    SHARD_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(x_.data(), x, inputs * sizeof(float),
                                               cudaMemcpyHostToDevice, stream_));
    SHARD_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(y_.data(), y, rows * sizeof(int64_t),
                                               cudaMemcpyHostToDevice, stream_));
    if (before_layer) {
      current_.assign(params.begin(), params.end());
      return model_->Forward(current_, x_.as<float>(), y_.as<int64_t>(), rows,
                             Refreshing(params, before_layer));
    }
    SHARD_ASSIGN_OR_RETURN(std::vector<const void*> weights, ModelWeights(params));
    return model_->Forward(weights, x_.as<float>(), y_.as<int64_t>(), rows);
  }

  absl::Status Backward(const std::vector<const float*>& params, const std::vector<float*>& grads,
                        float scale, const std::function<void(int)>& ready,
                        const LayerHook& before_layer) override {
    if (before_layer && !copies_.empty()) return LayerByLayerUnimplemented();
    if (before_layer) {
      current_.assign(params.begin(), params.end());
      return model_->Backward(current_, grads, scale, ready, Refreshing(params, before_layer));
    }
    return model_->Backward(Views(params), grads, scale, ready);
  }

  absl::StatusOr<double> LossSum() override { return model_->Loss(); }

 private:
  // In 16-bit precisions the model casts every parameter up front (ModelWeights).
  static absl::Status LayerByLayerUnimplemented() {
    return absl::UnimplementedError(
        "the built-in MLP on a GPU gathers parameters layer by layer (ZeRO stage 3) in fp32 "
        "only: its 16-bit copies are cast for the whole model before the forward pass; use "
        "precision fp32 at zeroStage 3, or zeroStage 2");
  }

  // `before_layer`, then the model's view of that layer's parameters follows where the hook
  // put them (current_ is what the model reads).
  LayerHook Refreshing(const std::vector<const float*>& params, const LayerHook& before_layer) {
    return [this, &params, &before_layer](int layer, bool backward) -> absl::Status {
      SHARD_RETURN_IF_ERROR(before_layer(layer, backward));
      for (int index : {Mlp::WeightIndex(layer), Mlp::BiasIndex(layer)}) {
        current_[index] = params[index];
      }
      return absl::OkStatus();
    };
  }

  GpuMlpRunner(std::unique_ptr<GpuMlp> model, cudaStream_t stream)
      : model_(std::move(model)), stream_(stream) {}

  // What the model computes with: the fp32 masters, or their 16-bit copies (the copy-back cast
  // of mixed precision, done once per forward pass for every parameter).
  absl::StatusOr<std::vector<const void*>> ModelWeights(const std::vector<const float*>& params) {
    if (copies_.empty()) return std::vector<const void*>(params.begin(), params.end());
    if (params.size() != copies_.size()) {
      return absl::InvalidArgumentError(absl::StrCat("the MLP has ", copies_.size(),
                                                     " parameters, got ", params.size()));
    }
    for (size_t i = 0; i < params.size(); ++i) {
      SHARD_RETURN_IF_ERROR(Cast(params[i], DataType::kFloat32, copies_[i].data(),
                                 model_->precision(), numels_[i], stream_));
    }
    return Views(params);
  }

  std::vector<const void*> Views(const std::vector<const float*>& params) const {
    std::vector<const void*> views(params.begin(), params.end());
    for (size_t i = 0; i < copies_.size() && i < views.size(); ++i) views[i] = copies_[i].data();
    return views;
  }

  std::unique_ptr<GpuMlp> model_;
  const cudaStream_t stream_;
  DeviceBuffer x_;
  DeviceBuffer y_;
  std::vector<DeviceBuffer> copies_;  // 16-bit weights, manifest order (16-bit precisions)
  std::vector<const void*> current_;  // the parameters the model reads, layer by layer
  std::vector<int64_t> numels_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<GpuDevice>> GpuDevice::Create(int index) {
  std::string why;
  const int devices = CudaDeviceCount(&why);
  if (index < 0 || index >= devices) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cuda:", index, " is not a device of this machine: it has ", devices, " CUDA device(s)",
        why.empty() ? "" : absl::StrCat(" (", why, ")"),
        "; use cuda:0..cuda:N-1 or --device cpu"));
  }
  SHARD_CUDA_RETURN_IF_ERROR(cudaSetDevice(index));
  SHARD_ASSIGN_OR_RETURN(CudaStream stream, CudaStream::Create());
  SHARD_ASSIGN_OR_RETURN(DeviceBuffer values, DeviceBuffer::Allocate(kHostValueBytes));
  SHARD_ASSIGN_OR_RETURN(CudaEvent order, CudaEvent::Create());
  return std::unique_ptr<GpuDevice>(
      new GpuDevice(index, std::move(stream), std::move(values), std::move(order)));
}

std::string GpuDevice::name() const { return absl::StrCat("cuda:", index_); }

absl::Status GpuDevice::BindThread() {
  return CudaStatus(cudaSetDevice(index_), absl::StrCat("cudaSetDevice(", index_, ")"));
}

absl::StatusOr<DeviceArray> GpuDevice::Allocate(int64_t count) {
  if (count == 0) return DeviceArray();
  void* data = nullptr;
  SHARD_RETURN_IF_ERROR(CudaStatus(cudaMalloc(&data, count * sizeof(float)),
                                   absl::StrCat("cudaMalloc of ", count * sizeof(float),
                                                " bytes on ", name())));
  DeviceArray array(static_cast<float*>(data), count, &FreeDevice);
  SHARD_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(data, 0, count * sizeof(float), stream()));
  return array;
}

absl::Status GpuDevice::Upload(const float* host, float* device, int64_t count) {
  // From pageable memory the copy returns once `host` has been staged, so it may be reused.
  return CudaStatus(cudaMemcpyAsync(device, host, count * sizeof(float), cudaMemcpyHostToDevice,
                                    stream()),
                    "copying to the GPU");
}

absl::Status GpuDevice::Download(const float* device, float* host, int64_t count) {
  SHARD_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(host, device, count * sizeof(float),
                                             cudaMemcpyDeviceToHost, stream()));
  return WaitFor(stream(), "copying from the GPU");
}

absl::Status GpuDevice::Copy(const float* from, float* to, int64_t count) {
  return CudaStatus(cudaMemcpyAsync(to, from, count * sizeof(float), cudaMemcpyDeviceToDevice,
                                    stream()),
                    "copying on the GPU");
}

absl::Status GpuDevice::Zero(float* data, int64_t count) {
  if (count == 0) return absl::OkStatus();
  return CudaStatus(cudaMemsetAsync(data, 0, count * sizeof(float), stream()), "zeroing on the GPU");
}

absl::Status GpuDevice::Divide(float* data, int64_t count, float divisor) {
  return shard::Divide(data, count, divisor, stream());
}

absl::Status GpuDevice::WaitForStream(uintptr_t stream) {
  return Order(reinterpret_cast<cudaStream_t>(stream), this->stream());
}

absl::Status GpuDevice::MakeStreamWait(uintptr_t stream) {
  return Order(this->stream(), reinterpret_cast<cudaStream_t>(stream));
}

absl::Status GpuDevice::Order(cudaStream_t from, cudaStream_t to) {
  absl::MutexLock lock(&order_mu_);
  SHARD_CUDA_RETURN_IF_ERROR(cudaEventRecord(order_.get(), from));
  return CudaStatus(cudaStreamWaitEvent(to, order_.get(), 0), "ordering two CUDA streams");
}

absl::StatusOr<std::unique_ptr<SpanKernels>> GpuDevice::PrepareSpans(
    const OptimizerConfig& optimizer, std::vector<OwnedSpan> spans) {
  // Slots of every span, and of each param group's spans.
  const int group_count = static_cast<int>(optimizer.param_groups.size());
  std::vector<TensorSlot> slots;
  std::vector<std::vector<TensorSlot>> group_slots(group_count + 1);  // by group + 1
  for (const OwnedSpan& span : spans) {
    if (span.group < -1 || span.group >= group_count) {
      return absl::InvalidArgumentError(absl::StrCat("an owned span names param group ",
                                                     span.group, " of ", group_count));
    }
    TensorSlot slot;
    slot.param = span.param;
    slot.grad = span.grad;
    for (size_t k = 0; k < span.state.size() && k < 2; ++k) slot.state[k] = span.state[k];
    slot.count = span.count;
    slots.push_back(slot);
    group_slots[span.group + 1].push_back(slot);
  }
  SHARD_ASSIGN_OR_RETURN(TensorList tensors,
                         TensorList::Create(slots, DataType::kFloat32, stream()));
  int present = 0;
  int only_group = -1;
  for (int g = -1; g < group_count; ++g) {
    if (group_slots[g + 1].empty()) continue;
    ++present;
    only_group = g;
  }
  // Spans of one group only (no param groups at all, say): `tensors` is the one list.
  std::vector<GroupTensors> groups;
  for (int g = -1; g < group_count && present > 1; ++g) {
    if (group_slots[g + 1].empty()) continue;
    SHARD_ASSIGN_OR_RETURN(TensorList list,
                           TensorList::Create(group_slots[g + 1], DataType::kFloat32, stream()));
    groups.push_back(GroupTensors{g, std::move(list)});
  }
  SHARD_ASSIGN_OR_RETURN(DeviceBuffer scalars, DeviceBuffer::Allocate(sizeof(double)));
  return std::make_unique<GpuSpanKernels>(optimizer, std::move(tensors), std::move(groups),
                                          only_group, std::move(scalars), stream());
}

absl::Status GpuDevice::AllReduceHostValues(Communicator& communicator, void* values,
                                            size_t count, DataType dtype, ReduceOp op) {
  // Asked of the communicator, not of its type: the worker wraps it (TrackCollectives).
  if (!communicator.device_buffers()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the ", communicator.backend(), " communicator works on host memory, not on ", name()));
  }
  const size_t bytes = count * DataTypeSize(dtype);
  if (bytes > values_.bytes()) {
    return absl::InvalidArgumentError(
        absl::StrCat("AllReduceHostValues takes up to ", values_.bytes(), " bytes, got ", bytes));
  }
  SHARD_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(values_.data(), values, bytes, cudaMemcpyHostToDevice, stream()));
  SHARD_RETURN_IF_ERROR(
      communicator.AllReduce(values_.data(), values_.data(), count, dtype, op));
  SHARD_RETURN_IF_ERROR(communicator.OrderComputeAfterCollectives());
  SHARD_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(values, values_.data(), bytes, cudaMemcpyDeviceToHost, stream()));
  SHARD_RETURN_IF_ERROR(WaitFor(stream(), "an all-reduce of host values"));
  // ncclCommAbort ends a collective's kernels early, after which the stream completes as if
  // nothing happened: values read then are garbage, never a result to agree on.
  if (communicator.aborted()) {
    return absl::AbortedError(absl::StrCat("the ", communicator.backend(),
                                           " communicator was aborted during an all-reduce"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<MlpRunner>> GpuDevice::CreateMlp(const std::vector<int64_t>& widths,
                                                                int64_t max_rows,
                                                                DataType precision) {
  SHARD_ASSIGN_OR_RETURN(std::unique_ptr<GpuMlpRunner> runner,
                         GpuMlpRunner::Create(widths, max_rows, precision, stream()));
  return runner;
}

}  // namespace shard
