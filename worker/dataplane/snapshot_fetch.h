// A memory snapshot's shards as a CheckpointReader reads them (common/checkpoint.h
// ShardStorage): a shard this worker holds is read from its own SnapshotStore, any other from the
// first of its holders' snapshot servers that serves it. The reader checks every block against the
// snapshot's checksums: bytes that fail them (a copy garbled in a holder's memory) are refused,
// that source is not read again, and the shard is read from the next holder (ShardStorage::
// Refuse); only when no holder is left does the read fail.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "common/checkpoint.h"
#include "worker/dataplane/snapshot_peer.h"
#include "worker/dataplane/snapshot_store.h"

namespace shard {

struct SnapshotHolderAddress {
  std::string worker_id;
  std::string address;  // host:port of its snapshot server
};

// Bytes read, how many of them came over the network, and the copies refused.
struct SnapshotReadStats {
  std::atomic<uint64_t> bytes{0};
  std::atomic<uint64_t> bytes_from_peers{0};

  // A source's copy of a shard failed its checksums and was refused (what, in words).
  void AddRefusal(std::string what);
  std::vector<std::string> refusals() const;

 private:
  mutable absl::Mutex mu_;
  std::vector<std::string> refusals_ ABSL_GUARDED_BY(mu_);
};

// `holders[r]`: where rank r's shard of snapshot `id` is, in the order to try. `local` (may be
// null) is this worker's own store. Reads from peers time out at TransferTimeout(bytes,
// `timeout_floor`) and end once `cancel` is set. Unavailable, naming every holder tried and why,
// when none serves a range.
std::unique_ptr<ShardStorage> SnapshotShards(std::string id,
                                             std::vector<std::vector<SnapshotHolderAddress>> holders,
                                             const SnapshotStore* local,
                                             absl::Duration timeout_floor,
                                             const std::atomic<bool>* cancel,
                                             SnapshotReadStats* stats);

}  // namespace shard
