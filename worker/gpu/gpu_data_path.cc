#include "worker/gpu/gpu_data_path.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/gpu/gpu_device.h"
#include "worker/gpu/nccl_communicator.h"
#include "worker/gpu/staged_communicator.h"

namespace shard {
namespace {

class CudaDataPath final : public DataPath {
 public:
  CudaDataPath(std::unique_ptr<GpuDevice> device, std::string backend, HostPathOptions host)
      : device_(std::move(device)), backend_(std::move(backend)), timeout_(host.timeout),
        host_(std::move(host)) {}

  Device& device() override { return *device_; }
  std::string backend() const override { return backend_ == "nccl" ? "nccl" : "gloo+staged"; }
  std::vector<std::string> capabilities() const override { return {backend_}; }

  absl::StatusOr<std::unique_ptr<Communicator>> Connect(KeyValueStore* store, int rank,
                                                        int size) override {
    SHARD_RETURN_IF_ERROR(device_->BindThread());
    if (backend_ == "nccl") {
      NcclOptions options;
      options.device = device_->index();
      options.compute_stream = device_->stream();
      options.wait_timeout = timeout_;
      options.init_timeout = timeout_;
      SHARD_ASSIGN_OR_RETURN(
          std::unique_ptr<NcclCommunicator> nccl,
          NcclCommunicator::Create(rank, size, KeyValueIdExchange(store, timeout_), options));
      // Connect's contract: every rank is connected on return (the self-check follows).
      SHARD_RETURN_IF_ERROR(nccl->WaitReady());
      return std::unique_ptr<Communicator>(std::move(nccl));
    }
    SHARD_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> host,
                           ConnectHostCollectives(store, rank, size, host_));
    SHARD_ASSIGN_OR_RETURN(
        std::unique_ptr<StagedCommunicator> staged,
        StagedCommunicator::Create(
            std::move(host),
            {.device = device_->index(), .compute_stream = device_->stream(),
             .wait_timeout = timeout_}));
    return std::unique_ptr<Communicator>(std::move(staged));
  }

 private:
  std::unique_ptr<GpuDevice> device_;
  const std::string backend_;
  const absl::Duration timeout_;
  const HostPathOptions host_;  // the host collectives the staged backend wraps
};

}  // namespace

absl::StatusOr<std::unique_ptr<DataPath>> GpuDataPath(int device, const std::string& backend,
                                                      HostPathOptions host) {
  if (backend != "nccl" && backend != "gloo") {
    return absl::InvalidArgumentError(
        absl::StrCat("a GPU worker runs the nccl or gloo backend, not '", backend, "'"));
  }
  SHARD_ASSIGN_OR_RETURN(std::unique_ptr<GpuDevice> gpu, GpuDevice::Create(device));
  return std::unique_ptr<DataPath>(
      new CudaDataPath(std::move(gpu), backend, std::move(host)));
}

}  // namespace shard
