#include "worker/dataplane/cpu_device.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/files.h"
#include "common/mlp.h"
#include "common/param_groups.h"
#include "worker/dataplane/optimizer.h"

namespace shard {
namespace {

// Copies with streaming (non-temporal) stores: memcpy streams only copies larger than a share of
// the last-level cache (glibc: 3/4 of it), and below that it reads every destination line into
// the cache before overwriting it, a third memory pass. A snapshot is downloaded piece by piece,
// each below that size: streamed, the pause went from 1.6-1.9x to 1.0-1.1x a memcpy of the whole
// snapshot on the 2-core VM (AMD EPYC; docs/checkpoints.md, "Benchmark"). Linearly: glibc's own
// pattern, four pages interleaved, ran 3.5x slower there.
void StreamCopy(char* to, const char* src, size_t bytes) {
#if defined(__SSE2__)
  constexpr size_t kLine = 64;
  const size_t head = std::min(bytes, (kLine - reinterpret_cast<uintptr_t>(to) % kLine) % kLine);
  std::memcpy(to, src, head);
  src += head;
  to += head;
  bytes -= head;
  for (; bytes >= kLine; bytes -= kLine, src += kLine, to += kLine) {
    const __m128i* in = reinterpret_cast<const __m128i*>(src);
    __m128i* stream = reinterpret_cast<__m128i*>(to);
    const __m128i a = _mm_loadu_si128(in), b = _mm_loadu_si128(in + 1);
    const __m128i c = _mm_loadu_si128(in + 2), d = _mm_loadu_si128(in + 3);
    _mm_stream_si128(stream, a);
    _mm_stream_si128(stream + 1, b);
    _mm_stream_si128(stream + 2, c);
    _mm_stream_si128(stream + 3, d);
  }
  _mm_sfence();  // streamed stores are weakly ordered: the writer thread reads the copy next
#endif
  std::memcpy(to, src, bytes);
}

void FreeHost(float* data) { std::free(data); }

class CpuSpanKernels final : public SpanKernels {
 public:
  CpuSpanKernels(const OptimizerConfig& config, std::vector<OwnedSpan> spans)
      : optimizer_(config), spans_(std::move(spans)) {}

  absl::Status OptimizerStep(int64_t step) override {
    const OptimizerConfig& config = optimizer_.config();
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
                       int64_t rows) override {
    loss_ = model_.Forward(params, x, y, rows);
    return loss_.status();
  }

  absl::Status Backward(const std::vector<const float*>& params, const std::vector<float*>& grads,
                        float scale, const std::function<void(int)>& ready) override {
    if (!loss_.ok()) return loss_.status();
    model_.Backward(params, grads, scale, ready);
    return absl::OkStatus();
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
  float* data = static_cast<float*>(AllocatePageAligned(bytes));
  if (data == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot allocate ", bytes, " bytes of host memory"));
  }
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
  for (int64_t i = 0; i < count; ++i) data[i] /= divisor;
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
