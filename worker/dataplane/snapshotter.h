// A rank's in-memory snapshots, off the training thread (common/snapshot.h): the trainer copies
// what the rank owns into a buffer (at the step boundary, or for a periodic snapshot in host
// memory on the engine's communication thread while the next step computes) and hands it over;
// this thread checksums it (what a copy in the background did not checksum as it went), keeps it
// in the worker's SnapshotStore, reports it (on_held) and pushes it to the rank's buddies, one
// snapshot at a time. busy() is what the ranks agree on before a periodic snapshot, so that
// training never waits for replication.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/shard_hasher.h"
#include "common/snapshot.h"
#include "worker/dataplane/snapshot_peer.h"
#include "worker/dataplane/snapshot_store.h"

namespace shard {

class Snapshotter {
 public:
  struct Callbacks {
    // This rank holds its own shard of a snapshot now (and dropped the snapshots `dropped`).
    std::function<void(const SnapshotShard&, const std::vector<std::string>& dropped)> on_held;
    // A buddy did not take a replica (it is gone, or slow): the snapshot has one copy fewer.
    std::function<void(const SnapshotShard&, const std::string& buddy, const absl::Status&)>
        on_push_failed;
    // The first time a buddy on this host did not keep this rank's pages: the replica went over
    // TCP instead (a copy more), and why.
    std::function<void(const SnapshotShard&, const std::string& buddy, const absl::Status&)>
        on_pages_refused;
  };

  // Where this rank's replicas go and how the other ranks' arrive (ReplicationOf).
  struct Replication {
    // The snapshot servers of the ranks that keep this rank's replicas, nearest first.
    std::vector<std::string> buddies;
    // Those on this host keep the pages of this rank's copy (snapshot_peer.h); false: every
    // push goes over TCP.
    bool same_host_buffers = true;
    // The replicas of other ranks' shards this worker receives over TCP, into its store's own
    // buffers (one from the same host is the pusher's pages): the store has one ready for each.
    int received_over_tcp = 0;
  };

  Snapshotter(SnapshotStore* store, Replication replication, Callbacks callbacks,
              absl::Duration push_timeout_floor = absl::Seconds(10));
  // Cancels the pushes in flight and waits for the thread.
  ~Snapshotter();
  Snapshotter(const Snapshotter&) = delete;
  Snapshotter& operator=(const Snapshotter&) = delete;

  // Whether a snapshot is still being checksummed, kept or pushed.
  bool busy() const;
  // A snapshot's checksums: its blocks', which cover every byte (a restore checks each block it
  // reads), without the whole shard's, which would add a second hash of every byte and nothing
  // else. A snapshot's record has no whole-shard checksum.
  static std::shared_ptr<ShardHasher> NewHasher();
  // Starts on `shard` (its record is filled in here from `bytes`), once the snapshot in flight is
  // done: Aborted without starting if `abort()` turns true while it waits. `hashed`, if given,
  // is a NewHasher() that was handed the first hashed->bytes() of `bytes` already (as they were
  // copied); this thread hashes the rest.
  absl::Status Start(SnapshotShard shard, SnapshotBytes bytes, const std::function<bool()>& abort,
                     std::shared_ptr<ShardHasher> hashed = nullptr);
  // Waits until no snapshot is in flight; Aborted if `abort()` turns true first.
  absl::Status WaitIdle(const std::function<bool()>& abort);
  // Has this thread ready the store's buffers for the next snapshot of `bytes` bytes (its own
  // shard and one per replica it receives over TCP), whenever no snapshot is in flight, and again
  // after each snapshot for that snapshot's size: the first snapshots of a generation then find
  // their pages mapped (SnapshotStore::Prepare).
  void PrepareBuffers(uint64_t bytes);

 private:
  void Loop();

  SnapshotStore* const store_;
  const Replication replication_;
  const Callbacks callbacks_;
  const absl::Duration push_timeout_floor_;
  std::set<std::string> refused_by_;  // buddies on_pages_refused told of (the Loop thread's)
  std::atomic<bool> cancel_{false};
  mutable absl::Mutex mu_;
  bool busy_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t prepare_bytes_ ABSL_GUARDED_BY(mu_) = 0;  // 0: nothing to prepare
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  SnapshotShard shard_ ABSL_GUARDED_BY(mu_);
  SnapshotBytes bytes_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<ShardHasher> hashed_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

// Rank `rank`'s replication in a world whose ranks run on `hosts` with snapshot servers at
// `servers` (common/snapshot.h SnapshotBuddies and SnapshotSources): `same_host_buffers` as in
// Replication.
Snapshotter::Replication ReplicationOf(const std::vector<std::string>& hosts,
                                       const std::vector<std::string>& servers, int rank,
                                       int replicas, bool same_host_buffers);

}  // namespace shard
