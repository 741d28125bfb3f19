#include "worker/dataplane/cpu_device.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include <sys/mman.h>

#include "absl/strings/str_cat.h"
#include "common/files.h"
#include "common/mlp.h"
#include "common/param_groups.h"
#include "common/stream_copy.h"
#include "worker/dataplane/optimizer.h"
#include "worker/dataplane/reduce.h"

namespace shard {
namespace {

void FreeHost(float* data) { std::free(data); }

// Large arrays are anonymous mappings: page-aligned and zero already, so that memory nobody has
// written yet is not resident (as calloc's). A stage-3 rebuild allocates the new layout's
// optimizer state while the old layout is still held; the first update, after the old layout
// is gone, is what makes it resident. The mapping's length sits in the page before the array.
constexpr size_t kPage = 4096;

float* MapZeroed(size_t bytes) {
  const size_t length = kPage + (bytes + kPage - 1) / kPage * kPage;
  void* base = ::mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (base == MAP_FAILED) return nullptr;
  *static_cast<size_t*>(base) = length;
  return reinterpret_cast<float*>(static_cast<char*>(base) + kPage);
}

void UnmapZeroed(float* data) {
  char* base = reinterpret_cast<char*>(data) - kPage;
  ::munmap(base, *reinterpret_cast<size_t*>(base));
}

class CpuSpanKernels final : public SpanKernels {
 public:
  CpuSpanKernels(const OptimizerConfig& config, std::vector<OwnedSpan> spans)
      : optimizer_(config), spans_(std::move(spans)) {}

  absl::Status OptimizerStep(int64_t step) override {
    const OptimizerConfig& config = optimizer_.config();
    if (config.kind == OptimizerKind::kTorch) {
      return absl::FailedPreconditionError(
          "the training script's own optimizer updates the parameters; the engine has no rule");
    }
    // Index 0 is the optimizer's own settings (group -1), g + 1 group g's.
    hyper_.clear();
    for (int g = -1; g < static_cast<int>(config.param_groups.size()); ++g) {
      hyper_.push_back(GroupHyperParameters(config, g, step));
    }
    for (const OwnedSpan& span : spans_) {
      optimizer_.Update(step, hyper_[span.group + 1], span.param, span.grad, span.state.data(),
                        static_cast<size_t>(span.count));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<double> GradSquaredSum() override {
    double sum = 0;
    for (const OwnedSpan& span : spans_) {
      for (int64_t i = 0; i < span.count; ++i) {
        sum += static_cast<double>(span.grad[i]) * span.grad[i];
      }
    }
    return sum;
  }

  absl::StatusOr<bool> ScaleGradients(float factor, bool check_finite) override {
    bool found = false;
    for (const OwnedSpan& span : spans_) {
      for (int64_t i = 0; i < span.count; ++i) {
        if (check_finite && !std::isfinite(span.grad[i])) found = true;
        span.grad[i] *= factor;
      }
    }
    return found;
  }

 private:
  const OptimizerKernel optimizer_;
  const std::vector<OwnedSpan> spans_;
  std::vector<StepHyperParameters> hyper_;  // this step's, by group + 1
};

class CpuMlpRunner final : public MlpRunner {
 public:
  explicit CpuMlpRunner(const std::vector<int64_t>& widths) : model_(widths) {}

  absl::Status Forward(const std::vector<const float*>& params, const float* x, const int64_t* y,
                       int64_t rows, const LayerHook& before_layer) override {
    loss_ = model_.Forward(params, x, y, rows, before_layer);
    return loss_.status();
  }

  absl::Status Backward(const std::vector<const float*>& params, const std::vector<float*>& grads,
                        float scale, const std::function<void(int)>& ready,
                        const LayerHook& before_layer) override {
    if (!loss_.ok()) return loss_.status();
    return model_.Backward(params, grads, scale, ready, before_layer);
  }

  absl::StatusOr<double> LossSum() override { return loss_; }

 private:
  Mlp model_;
  absl::StatusOr<double> loss_ = absl::FailedPreconditionError("no forward pass yet");
};

}  // namespace

absl::StatusOr<DeviceArray> CpuDevice::Allocate(int64_t count) {
  if (count == 0) return DeviceArray();
  // Page-aligned: restores read into these arrays straight from the page cache, and the
  // kernel's copy is slow into memory 1-31 bytes past a page, where malloc puts large blocks
  // (see AlignedBuffer).
  const size_t bytes = static_cast<size_t>(count) * sizeof(float);
  const bool mapped = bytes >= kHostArrayPagesFrom;
  float* data = mapped ? MapZeroed(bytes) : static_cast<float*>(AllocatePageAligned(bytes));
  if (data == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot allocate ", bytes, " bytes of host memory"));
  }
  if (mapped) return DeviceArray(data, count, &UnmapZeroed);
  std::memset(data, 0, bytes);
  return DeviceArray(data, count, &FreeHost);
}

absl::Status CpuDevice::Upload(const float* host, float* device, int64_t count) {
  if (count > 0 && host != device) std::memcpy(device, host, count * sizeof(float));
  return absl::OkStatus();
}

absl::Status CpuDevice::Download(const float* device, float* host, int64_t count) {
  // What is downloaded is kept, not computed with next (a snapshot, an export): streamed.
  if (count > 0 && host != device) {
    StreamCopy(reinterpret_cast<char*>(host), reinterpret_cast<const char*>(device),
               static_cast<size_t>(count) * sizeof(float));
  }
  return absl::OkStatus();
}

absl::Status CpuDevice::Copy(const float* from, float* to, int64_t count) {
  return Upload(from, to, count);
}

absl::Status CpuDevice::Zero(float* data, int64_t count) {
  std::fill(data, data + count, 0.0f);
  return absl::OkStatus();
}

absl::Status CpuDevice::Divide(float* data, int64_t count, float divisor) {
  DivideBuffer(data, static_cast<size_t>(count), divisor);
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<SpanKernels>> CpuDevice::PrepareSpans(
    const OptimizerConfig& optimizer, std::vector<OwnedSpan> spans) {
  for (const OwnedSpan& span : spans) {
    if (span.group < -1 || span.group >= static_cast<int>(optimizer.param_groups.size())) {
      return absl::InvalidArgumentError(absl::StrCat("an owned span names param group ",
                                                     span.group, " of ",
                                                     optimizer.param_groups.size()));
    }
  }
  return std::make_unique<CpuSpanKernels>(optimizer, std::move(spans));
}

absl::Status CpuDevice::AllReduceHostValues(Communicator& communicator, void* values,
                                            size_t count, DataType dtype, ReduceOp op) {
  return communicator.AllReduce(values, values, count, dtype, op);
}

absl::StatusOr<std::unique_ptr<MlpRunner>> CpuDevice::CreateMlp(const std::vector<int64_t>& widths,
                                                                int64_t /*max_rows*/,
                                                                DataType precision) {
  if (precision != DataType::kFloat32) {
    return absl::InvalidArgumentError(
        absl::StrCat("precision ", DataTypeName(precision),
                     " needs a GPU worker (--device cuda:N); the CPU path computes in f32"));
  }
  return std::make_unique<CpuMlpRunner>(widths);
}

Device& HostDevice() {
  static CpuDevice* device = new CpuDevice();
  return *device;
}

}  // namespace shard
