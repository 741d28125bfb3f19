#include "worker/data_path.h"

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/dataplane/cpu_device.h"
#include "worker/dataplane/gloo_communicator.h"
#include "worker/dataplane/shm_communicator.h"

namespace shard {
namespace {

class HostDataPath final : public DataPath {
 public:
  explicit HostDataPath(HostPathOptions options) : options_(std::move(options)) {}

  Device& device() override { return device_; }
  std::string backend() const override {
    switch (options_.transport) {
      case HostTransport::kTcp: return "gloo";
      case HostTransport::kShm: return "shm";
      case HostTransport::kAuto: break;
    }
    return "shm or gloo (auto)";
  }
  std::vector<std::string> capabilities() const override { return {"gloo"}; }

  absl::StatusOr<std::unique_ptr<Communicator>> Connect(KeyValueStore* store, int rank,
                                                        int size) override {
    return ConnectHostCollectives(store, rank, size, options_);
  }

 private:
  CpuDevice device_;
  const HostPathOptions options_;
};

absl::string_view TransportName(HostTransport transport) {
  switch (transport) {
    case HostTransport::kAuto: return "auto";
    case HostTransport::kTcp: return "tcp";
    case HostTransport::kShm: return "shm";
  }
  return "auto";
}

// Whether every rank takes shared memory, decided the same way on every rank from what each
// published: its --transport and its shared-memory domain.
absl::StatusOr<bool> EveryRankOnThisHost(KeyValueStore* store, int rank, int size,
                                         const HostPathOptions& options) {
  const std::string domain = SharedMemoryDomain();
  const auto key = [](int r) { return absl::StrCat("transport/", r); };
  SHARD_RETURN_IF_ERROR(
      store->Set(key(rank), absl::StrCat(TransportName(options.transport), "|", domain)));
  std::vector<std::string> keys;
  for (int r = 0; r < size; ++r) keys.push_back(key(r));
  if (absl::Status arrived = store->Wait(keys, options.timeout); !arrived.ok()) {
    return absl::Status(arrived.code(),
                        absl::StrCat("rank ", rank, " of ", size,
                                     ": waiting for the peers' transports: ", arrived.message()));
  }
  bool any_tcp = false;
  int shm_asked_by = -1;
  int elsewhere = -1;
  std::string elsewhere_domain;
  for (int r = 0; r < size; ++r) {
    SHARD_ASSIGN_OR_RETURN(const std::string value, store->Get(key(r)));
    const size_t bar = value.find('|');
    const std::string transport = value.substr(0, bar);
    const std::string peer_domain = bar == std::string::npos ? "" : value.substr(bar + 1);
    any_tcp = any_tcp || transport == "tcp";
    if (transport == "shm" && shm_asked_by < 0) shm_asked_by = r;
    if (peer_domain != domain && elsewhere < 0) {
      elsewhere = r;
      elsewhere_domain = peer_domain;
    }
  }
  if (any_tcp) return false;
  if (elsewhere < 0) return true;
  if (shm_asked_by >= 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "rank ", shm_asked_by, " asked for --transport shm, which needs every rank on one host, "
        "but rank ", elsewhere, " is elsewhere (shared-memory domain ", elsewhere_domain,
        "; rank ", rank, "'s: ", domain, "): use --transport auto or tcp"));
  }
  return false;
}

}  // namespace

absl::StatusOr<HostTransport> ParseHostTransport(absl::string_view name) {
  if (name == "auto") return HostTransport::kAuto;
  if (name == "tcp") return HostTransport::kTcp;
  if (name == "shm") return HostTransport::kShm;
  return absl::InvalidArgumentError(
      absl::StrCat("--transport '", name, "' is not a transport; use auto, tcp or shm"));
}

absl::StatusOr<std::unique_ptr<Communicator>> ConnectHostCollectives(
    KeyValueStore* store, int rank, int size, const HostPathOptions& options) {
  SHARD_ASSIGN_OR_RETURN(const bool shared_memory,
                         EveryRankOnThisHost(store, rank, size, options));
  if (shared_memory) {
    ShmOptions shm;
    shm.rank = rank;
    shm.size = size;
    shm.timeout = options.timeout;
    return CreateShmCommunicator(store, shm);
  }
  GlooOptions gloo;
  gloo.rank = rank;
  gloo.size = size;
  gloo.hostname = options.host;
  gloo.timeout = options.timeout;
  gloo.link_timeout = options.link_timeout;
  // The agent's self-check follows at once: a collective it aborts when the generation ends
  // (soak seed 7301: a barrier here waited out its timeout for a peer SIGSTOPped just after
  // connecting, while the world had moved on).
  gloo.barrier_after_connect = false;
  SHARD_ASSIGN_OR_RETURN(std::unique_ptr<GlooCommunicator> created,
                         CreateGlooCommunicator(store, gloo));
  return std::unique_ptr<Communicator>(std::move(created));
}

std::unique_ptr<DataPath> CpuDataPath(HostPathOptions options) {
  return std::make_unique<HostDataPath>(std::move(options));
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
