#include "worker/data_path.h"

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/dataplane/cpu_device.h"
#include "worker/dataplane/gloo_communicator.h"

namespace shard {
namespace {

class HostDataPath final : public DataPath {
 public:
  HostDataPath(std::string host, absl::Duration timeout, absl::Duration link_timeout)
      : host_(std::move(host)), timeout_(timeout), link_timeout_(link_timeout) {}

  Device& device() override { return device_; }
  std::string backend() const override { return "gloo"; }
  std::vector<std::string> capabilities() const override { return {"gloo"}; }

  absl::StatusOr<std::unique_ptr<Communicator>> Connect(KeyValueStore* store, int rank,
                                                        int size) override {
    GlooOptions gloo;
    gloo.rank = rank;
    gloo.size = size;
    gloo.hostname = host_;
    gloo.timeout = timeout_;
    gloo.link_timeout = link_timeout_;
    // The agent's self-check follows at once: a collective it aborts when the generation ends
    // (soak seed 7301: a barrier here waited out its timeout for a peer SIGSTOPped just after
    // connecting, while the world had moved on).
    gloo.barrier_after_connect = false;
    SHARD_ASSIGN_OR_RETURN(std::unique_ptr<GlooCommunicator> created,
                           CreateGlooCommunicator(store, gloo));
    return std::unique_ptr<Communicator>(std::move(created));
  }

 private:
  CpuDevice device_;
  const std::string host_;
  const absl::Duration timeout_;
  const absl::Duration link_timeout_;
};

}  // namespace

std::unique_ptr<DataPath> CpuDataPath(std::string host, absl::Duration timeout,
                                      absl::Duration link_timeout) {
  return std::make_unique<HostDataPath>(std::move(host), timeout, link_timeout);
}

absl::StatusOr<std::string> ResolveBackend(const std::string& device, const std::string& backend,
                                           int* index) {
  const bool gpu = absl::StartsWith(device, "cuda:");
  int number = 0;
  const bool valid =
      device == "cpu" ||
      ((gpu || absl::StartsWith(device, "cpu:")) &&
       absl::SimpleAtoi(device.substr(device.find(':') + 1), &number) && number >= 0);
  if (!valid) {
    return absl::InvalidArgumentError(
        absl::StrCat("--device '", device, "' is not a device; use cpu, cpu:N or cuda:N"));
  }
  *index = gpu ? number : -1;
  if (backend == "auto") return std::string(gpu ? "nccl" : "gloo");
  if (backend == "gloo") return std::string("gloo");
  if (backend == "nccl") {
    if (!gpu) {
      return absl::InvalidArgumentError(
          absl::StrCat("--backend nccl needs a GPU device (--device cuda:N), not '", device, "'"));
    }
    return std::string("nccl");
  }
  return absl::InvalidArgumentError(
      absl::StrCat("--backend '", backend, "' is not a backend; use auto, gloo or nccl"));
}

}  // namespace shard
