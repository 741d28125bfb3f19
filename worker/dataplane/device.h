// Where the data path's arrays live and the arithmetic over them runs: host memory (CpuDevice,
// cpu_device.h) or a CUDA device (GpuDevice, worker/gpu/gpu_device.h). The engine's logic
// (bucket layouts, ZeRO stages, checkpoints, consolidation) is written once against this
// interface; only memory, the optimizer's arithmetic and the model differ.
//
// A GPU device enqueues on its compute stream: Allocate, Upload and Copy may return before the
// work is done (Upload once `host` may be reused), and work enqueued later sees it. Download
// returns once the host has the data.
// Collectives on a device's arrays need a communicator whose buffers are that device's memory
// (Gloo for the host, NCCL or the staged communicator for a GPU), ordered as
// communicator.h's OrderComputeAfterCollectives says.
//
// Thread-compatible, except BindThread, which every thread that uses the device calls first.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/dtype.h"
#include "common/job_spec.h"
#include "common/mlp.h"
#include "worker/dataplane/communicator.h"

namespace shard {

// Host arrays of at least this many bytes start whole pages of an anonymous mapping of their
// own (CpuDevice::Allocate): what Communicator::ShareHostBuffer takes.
inline constexpr size_t kHostArrayPagesFrom = size_t{1} << 20;

// `size` fp32 elements of a device's memory, freed by the device's deleter. Move-only.
class DeviceArray {
 public:
  using Deleter = void (*)(float*);

  DeviceArray() = default;
  DeviceArray(float* data, int64_t size, Deleter deleter) : data_(data, deleter), size_(size) {}

  float* data() const { return data_.get(); }
  int64_t size() const { return size_; }

 private:
  std::unique_ptr<float, Deleter> data_{nullptr, nullptr};
  int64_t size_ = 0;
};

// What a rank updates in one bucket: `count` parameters, their gradients and the optimizer's
// state tensors (device pointers), all of one parameter group. An owned range of a bucket that
// covers parameters of different groups is cut into one span per run of a group.
struct OwnedSpan {
  float* param = nullptr;
  float* grad = nullptr;
  std::vector<float*> state;
  int64_t count = 0;
  int group = -1;  // index into the optimizer's param_groups; -1: the optimizer's own settings
};

// The per-step arithmetic over every owned span of a layout, prepared once per layout (a GPU
// builds its multi-tensor launch table there, so each operation is one launch).
class SpanKernels {
 public:
  virtual ~SpanKernels() = default;
  // Update number `step` (1-based) with the optimizer's rule (optimizer.h's arithmetic), each
  // span with its group's learning rate and weight decay at that step (common/param_groups.h
  // GroupHyperParameters).
  virtual absl::Status OptimizerStep(int64_t step) = 0;
  // The sum over every owned gradient of grad², in double. Waits for the device.
  virtual absl::StatusOr<double> GradSquaredSum() = 0;
  // grad *= factor. Returns whether any gradient was inf or NaN before scaling (waits for the
  // device then); without `check_finite`, false.
  virtual absl::StatusOr<bool> ScaleGradients(float factor, bool check_finite) = 0;
};

// The built-in MLP (common/mlp.h's model) on a device. Parameters are fp32 device
// views (the engine's master weights); a 16-bit precision computes with 16-bit copies of them.
class MlpRunner {
 public:
  virtual ~MlpRunner() = default;
  // Runs `rows` rows of x (host, [rows, widths[0]]) with labels y (host) through the network.
  // `before_layer` (may be null; common/mlp.h LayerHook) runs before each layer and may repoint
  // its parameters; a runner that cannot follow it returns Unimplemented.
  virtual absl::Status Forward(const std::vector<const float*>& params, const float* x,
                               const int64_t* y, int64_t rows, const LayerHook& before_layer) = 0;
  // Gradients of `scale` x the last Forward's summed loss into grads (device, overwritten);
  // ready(i) once the work completing parameter i's gradient is issued, last layer first.
  virtual absl::Status Backward(const std::vector<const float*>& params,
                                const std::vector<float*>& grads, float scale,
                                const std::function<void(int)>& ready,
                                const LayerHook& before_layer) = 0;
  // The last Forward's loss summed over its rows. InvalidArgument for a label outside the
  // classes. May wait for the device.
  virtual absl::StatusOr<double> LossSum() = 0;
};

class Device {
 public:
  virtual ~Device() = default;

  // "cpu" or "cuda:N".
  virtual std::string name() const = 0;
  // Whether arrays are host memory the caller may read and write directly.
  virtual bool host_memory() const = 0;
  // Makes this device current on the calling thread (CUDA's current device is per thread).
  virtual absl::Status BindThread() = 0;

  // `count` zeroed fp32 elements. ResourceExhausted when the memory is not there.
  virtual absl::StatusOr<DeviceArray> Allocate(int64_t count) = 0;
  virtual absl::Status Upload(const float* host, float* device, int64_t count) = 0;
  virtual absl::Status Download(const float* device, float* host, int64_t count) = 0;
  virtual absl::Status Copy(const float* from, float* to, int64_t count) = 0;
  // data[0, count) = 0.
  virtual absl::Status Zero(float* data, int64_t count) = 0;
  // data[i] /= divisor for i < count (IEEE division, as torch's div_).
  virtual absl::Status Divide(float* data, int64_t count, float divisor) = 0;

  // Ordering with a stream of the caller's own (a CUDA stream handle, 0 for the legacy default
  // stream; libshard's callers compute on the device arrays there): this device's later work
  // waits for what `stream` has enqueued so far (WaitForStream), or `stream`'s later work waits
  // for what this device has enqueued so far (MakeStreamWait). Neither waits on the host. The
  // host finishes its work before returning, so a host device has nothing to order.
  virtual absl::Status WaitForStream(uintptr_t /*stream*/) { return absl::OkStatus(); }
  virtual absl::Status MakeStreamWait(uintptr_t /*stream*/) { return absl::OkStatus(); }

  // Arithmetic over `spans` with `optimizer`'s rule; the spans' arrays must outlive the result.
  virtual absl::StatusOr<std::unique_ptr<SpanKernels>> PrepareSpans(
      const OptimizerConfig& optimizer, std::vector<OwnedSpan> spans) = 0;

  // An all-reduce of a few host values (a loss, checkpoint requests, a gradient norm) through
  // `communicator`, staged through device memory where collectives need it. Returns with the
  // result in `values`.
  virtual absl::Status AllReduceHostValues(Communicator& communicator, void* values, size_t count,
                                           DataType dtype, ReduceOp op) = 0;

  // The built-in MLP for batches of up to `max_rows` rows computing in `precision` (kFloat32,
  // kBFloat16 or kFloat16). InvalidArgument for a precision this device does not run.
  virtual absl::StatusOr<std::unique_ptr<MlpRunner>> CreateMlp(const std::vector<int64_t>& widths,
                                                               int64_t max_rows,
                                                               DataType precision) = 0;
};

}  // namespace shard
