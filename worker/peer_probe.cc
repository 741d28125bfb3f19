#include "worker/peer_probe.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "spdlog/spdlog.h"

namespace shard {

PeerProber::PeerProber(absl::Duration max_timeout, const std::atomic<bool>* cancel)
    : max_timeout_(max_timeout), cancel_(cancel), timeout_(max_timeout) {}

std::vector<ConnectProbe> PeerProber::Probe(const std::vector<std::string>& addresses) {
  PeerCallOptions options;
  {
    absl::MutexLock lock(&mu_);
    options.timeout = timeout_;
  }
  options.cancel = cancel_;
  std::vector<ConnectProbe> probes = ProbeConnect(addresses, options);
  absl::Duration slowest;
  bool any = false;
  for (const ConnectProbe& probe : probes) {
    if (!probe.reachable) continue;
    slowest = std::max(slowest, probe.took);
    any = true;
  }
  if (any) {
    absl::MutexLock lock(&mu_);
    timeout_ = std::clamp(50 * slowest, absl::Seconds(1), max_timeout_);
  }
  return probes;
}

absl::StatusOr<std::vector<PeerFault>> PeerProber::ProbeRanks(KeyValueStore& store, int rank,
                                                              int world_size,
                                                              const std::string& address,
                                                              absl::Duration wait) {
  const auto probe_key = [](int peer) { return absl::StrCat("probe/", peer); };
  SHARD_RETURN_IF_ERROR(store.Set(probe_key(rank), address));
  std::vector<std::string> keys;
  for (int peer = 0; peer < world_size; ++peer) keys.push_back(probe_key(peer));
  SHARD_RETURN_IF_ERROR(store.Wait(keys, wait));
  std::vector<std::string> addresses;
  std::vector<int> ranks;
  for (int peer = 0; peer < world_size; ++peer) {
    if (peer == rank) continue;
    SHARD_ASSIGN_OR_RETURN(std::string peer_address, store.Get(probe_key(peer)));
    addresses.push_back(std::move(peer_address));
    ranks.push_back(peer);
  }
  const std::vector<ConnectProbe> probes = Probe(addresses);
  std::vector<PeerFault> faults;
  for (size_t i = 0; i < probes.size(); ++i) {
    if (probes[i].reachable) continue;
    faults.push_back(PeerFault{ranks[i], LinkFailure::kConnect, probes[i].detail});
  }
  return faults;
}

std::vector<PeerProbe> PeerProber::ProbeMembers(const std::vector<PeerProbe>& members) {
  std::vector<std::string> addresses;
  for (const PeerProbe& member : members) addresses.push_back(member.address);
  const std::vector<ConnectProbe> probes = Probe(addresses);
  std::vector<PeerProbe> probed;
  int reached = 0;
  for (size_t i = 0; i < members.size(); ++i) {
    probed.push_back(PeerProbe{members[i].worker_id, members[i].address, probes[i].reachable,
                               probes[i].detail});
    reached += probes[i].reachable ? 1 : 0;
  }
  spdlog::info("isolated standby: reached {} of the {} members of the world", reached,
               probed.size());
  return probed;
}

}  // namespace shard
