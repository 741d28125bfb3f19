#include "worker/data_path.h"

#include <algorithm>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/dataplane/cpu_device.h"
#include "worker/dataplane/gloo_communicator.h"
#include "worker/dataplane/hierarchical_communicator.h"
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

// What the ranks connect over, decided the same way on every rank from what each published:
// its --transport and its shared-memory domain.
struct TransportChoice {
  enum Kind { kShm, kTcp, kHierarchical } kind = kTcp;
  HostLayout layout;  // the ranks' hosts, from their shared-memory domains
};

absl::StatusOr<TransportChoice> ChooseTransport(KeyValueStore* store, int rank, int size,
                                                const HostPathOptions& options) {
  const std::string domain = options.domain.empty() ? SharedMemoryDomain() : options.domain;
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
  TransportChoice choice;
  std::vector<std::string> domains;  // rank r's
  bool any_tcp = false;
  int shm_asked_by = -1;
  for (int r = 0; r < size; ++r) {
    SHARD_ASSIGN_OR_RETURN(const std::string value, store->Get(key(r)));
    const size_t bar = value.find('|');
    const std::string transport = value.substr(0, bar);
    any_tcp = any_tcp || transport == "tcp";
    if (transport == "shm" && shm_asked_by < 0) shm_asked_by = r;
    domains.push_back(bar == std::string::npos ? "" : value.substr(bar + 1));
  }
  choice.layout = HostLayout::FromDomains(domains);
  const HostLayout& layout = choice.layout;
  if (any_tcp) return choice;
  if (layout.hosts() == 1) {
    choice.kind = TransportChoice::kShm;
    return choice;
  }
  if (shm_asked_by >= 0) {
    const int elsewhere = static_cast<int>(
        std::find_if(layout.host.begin(), layout.host.end(), [](int h) { return h != 0; }) -
        layout.host.begin());
    return absl::FailedPreconditionError(absl::StrCat(
        "rank ", shm_asked_by, " asked for --transport shm, which needs every rank on one host, "
        "but rank ", elsewhere, " is elsewhere (shared-memory domain ", domains[elsewhere],
        "; rank 0's: ", domains[0], "): use --transport auto or tcp"));
  }
  // Several hosts: shared memory within those that have several ranks pays off.
  if (layout.hosts() < size) choice.kind = TransportChoice::kHierarchical;
  return choice;
}

absl::StatusOr<std::unique_ptr<Communicator>> ConnectGloo(KeyValueStore* store, int rank,
                                                          int size, const std::string& prefix,
                                                          const HostPathOptions& options) {
  GlooOptions gloo;
  gloo.rank = rank;
  gloo.size = size;
  gloo.hostname = options.host;
  gloo.timeout = options.timeout;
  gloo.link_timeout = options.link_timeout;
  gloo.key_prefix = prefix;
  // The agent's self-check follows at once: a collective it aborts when the generation ends
  // (soak seed 7301: a barrier here waited out its timeout for a peer SIGSTOPped just after
  // connecting, while the world had moved on).
  gloo.barrier_after_connect = false;
  SHARD_ASSIGN_OR_RETURN(std::unique_ptr<GlooCommunicator> created,
                         CreateGlooCommunicator(store, gloo));
  return std::unique_ptr<Communicator>(std::move(created));
}

absl::StatusOr<std::unique_ptr<Communicator>> ConnectShm(KeyValueStore* store, int rank, int size,
                                                         const std::string& prefix,
                                                         const HostPathOptions& options) {
  ShmOptions shm;
  shm.rank = rank;
  shm.size = size;
  shm.timeout = options.timeout;
  shm.key_prefix = prefix;
  return CreateShmCommunicator(store, shm);
}

}  // namespace

absl::StatusOr<HostTransport> ParseHostTransport(absl::string_view name) {
  for (HostTransport transport : {HostTransport::kAuto, HostTransport::kTcp, HostTransport::kShm}) {
    if (name == TransportName(transport)) return transport;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("--transport '", name, "' is not a transport; use auto, tcp or shm"));
}

absl::StatusOr<std::unique_ptr<Communicator>> ConnectHostCollectives(
    KeyValueStore* store, int rank, int size, const HostPathOptions& options) {
  SHARD_ASSIGN_OR_RETURN(TransportChoice choice, ChooseTransport(store, rank, size, options));
  switch (choice.kind) {
    case TransportChoice::kShm: return ConnectShm(store, rank, size, "shm/", options);
    case TransportChoice::kTcp: return ConnectGloo(store, rank, size, "gloo/", options);
    case TransportChoice::kHierarchical: break;
  }
  HostLayout& layout = choice.layout;
  const int host = layout.host[rank];
  const std::vector<int> local = layout.RanksOn(host);
  const int local_rank =
      static_cast<int>(std::find(local.begin(), local.end(), rank) - local.begin());
  SHARD_ASSIGN_OR_RETURN(
      std::unique_ptr<Communicator> within,
      ConnectShm(store, local_rank, static_cast<int>(local.size()),
                 absl::StrCat("shm/host", host, "/"), options));
  std::unique_ptr<Communicator> leaders;
  if (local_rank == 0) {
    SHARD_ASSIGN_OR_RETURN(leaders,
                           ConnectGloo(store, host, layout.hosts(), "gloo/leaders/", options));
  }
  return MakeHierarchicalCommunicator(rank, std::move(layout), std::move(within),
                                      std::move(leaders));
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
