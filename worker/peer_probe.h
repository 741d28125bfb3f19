// Connect probes of a worker's peers, each within a deadline derived from the connect times
// measured so far: 50 x the slowest, at least 1s and at most a ceiling. At the rendezvous of a
// generation every rank probes every peer before its data path connects; an isolated standby
// probes the members of the world. Thread-safe.
#pragma once

#include <atomic>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/control_types.h"
#include "worker/dataplane/key_value_store.h"
#include "worker/dataplane/snapshot_peer.h"

namespace shard {

class PeerProber {
 public:
  // `max_timeout`: the ceiling of the derived deadline, and the deadline until a probe reached
  // someone. `cancel` (not owned): once set, probes end at once.
  PeerProber(absl::Duration max_timeout, const std::atomic<bool>* cancel);

  // Connects to `addresses`, by address.
  std::vector<ConnectProbe> Probe(const std::vector<std::string>& addresses);
  // The probe of a generation's rendezvous: publishes this rank's `address` in `store`, waits up
  // to `wait` for every rank's, and probes the others. The ranks it could not reach.
  absl::StatusOr<std::vector<PeerFault>> ProbeRanks(KeyValueStore& store, int rank,
                                                    int world_size, const std::string& address,
                                                    absl::Duration wait);
  // An isolated standby's probe of the members its last heartbeat reply named.
  std::vector<PeerProbe> ProbeMembers(const std::vector<PeerProbe>& members);

 private:
  const absl::Duration max_timeout_;
  const std::atomic<bool>* const cancel_;
  absl::Mutex mu_;
  absl::Duration timeout_ ABSL_GUARDED_BY(mu_);
};

}  // namespace shard
