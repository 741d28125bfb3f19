// A CUDA device as the data path's Device (worker/dataplane/device.h): buffers in device memory,
// every operation enqueued on one compute stream, the fused multi-tensor optimizer and gradient
// kernels of kernels.h over the owned spans, and the cuBLAS MLP (gpu_mlp.h) in fp32, bf16 or
// fp16 with 16-bit copies of the fp32 master weights cast before each forward pass.
//
// Communicators for its arrays are device communicators (NCCL, or Gloo staged through pinned
// memory) created with compute_stream = stream(), so collectives order after its work.
#pragma once

#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "worker/dataplane/device.h"
#include "worker/gpu/cuda_resources.h"

namespace shard {

class GpuDevice final : public Device {
 public:
  // Makes `index` current on the calling thread and creates the compute stream there.
  // FailedPrecondition naming the devices there are when `index` is not one of them.
  static absl::StatusOr<std::unique_ptr<GpuDevice>> Create(int index);

  int index() const { return index_; }
  cudaStream_t stream() const { return stream_.get(); }

  std::string name() const override;
  bool host_memory() const override { return false; }
  absl::Status BindThread() override;

  absl::StatusOr<DeviceArray> Allocate(int64_t count) override;
  absl::Status Upload(const float* host, float* device, int64_t count) override;
  absl::Status Download(const float* device, float* host, int64_t count) override;
  absl::Status Copy(const float* from, float* to, int64_t count) override;
  absl::Status Zero(float* data, int64_t count) override;
  absl::Status Divide(float* data, int64_t count, float divisor) override;
  // One event, recorded on one stream and waited on by the other (thread-safe).
  absl::Status WaitForStream(uintptr_t stream) override;
  absl::Status MakeStreamWait(uintptr_t stream) override;

  absl::StatusOr<std::unique_ptr<SpanKernels>> PrepareSpans(
      const OptimizerConfig& optimizer, std::vector<OwnedSpan> spans) override;
  // `communicator` must take device buffers (device_buffers()) on this device.
  absl::Status AllReduceHostValues(Communicator& communicator, void* values, size_t count,
                                   DataType dtype, ReduceOp op) override;
  absl::StatusOr<std::unique_ptr<MlpRunner>> CreateMlp(const std::vector<int64_t>& widths,
                                                       int64_t max_rows,
                                                       DataType precision) override;

 private:
  GpuDevice(int index, CudaStream stream, DeviceBuffer values, CudaEvent order)
      : index_(index), stream_(std::move(stream)), values_(std::move(values)),
        order_(std::move(order)) {}

  // Records `order_` on `from` and makes `to` wait for it.
  absl::Status Order(cudaStream_t from, cudaStream_t to);

  const int index_;
  CudaStream stream_;
  DeviceBuffer values_;  // AllReduceHostValues' staging
  absl::Mutex order_mu_;  // a record and its wait go together
  CudaEvent order_ ABSL_GUARDED_BY(order_mu_);
};

}  // namespace shard
