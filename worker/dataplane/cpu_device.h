// The host as a Device (device.h): arrays in ordinary memory, the optimizer's loops of
// optimizer.h, the MLP through OpenBLAS (common/mlp.h), collectives straight on host values.
#pragma once

#include "worker/dataplane/device.h"

namespace shard {

class CpuDevice final : public Device {
 public:
  std::string name() const override { return "cpu"; }
  bool host_memory() const override { return true; }
  absl::Status BindThread() override { return absl::OkStatus(); }

  absl::StatusOr<DeviceArray> Allocate(int64_t count) override;
  absl::Status Upload(const float* host, float* device, int64_t count) override;
  absl::Status Download(const float* device, float* host, int64_t count) override;
  absl::Status Copy(const float* from, float* to, int64_t count) override;
  absl::Status Zero(float* data, int64_t count) override;
  absl::Status Divide(float* data, int64_t count, float divisor) override;

  absl::StatusOr<std::unique_ptr<SpanKernels>> PrepareSpans(
      const OptimizerConfig& optimizer, std::vector<OwnedSpan> spans) override;
  absl::Status AllReduceHostValues(Communicator& communicator, void* values, size_t count,
                                   DataType dtype, ReduceOp op) override;
  // fp32 only: the CPU path has no 16-bit arithmetic.
  absl::StatusOr<std::unique_ptr<MlpRunner>> CreateMlp(const std::vector<int64_t>& widths,
                                                       int64_t max_rows,
                                                       DataType precision) override;
};

// The process's host device, for callers that name none.
Device& HostDevice();

}  // namespace shard
