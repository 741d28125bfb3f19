// The snapshot shards a worker holds in memory (common/snapshot.h): its own and those its
// buddies sent it, of the newest snapshots only. The store outlives generations (it belongs to
// the worker process), so a new world can read from it whatever generation took a snapshot.
//
// A shard enters complete and verified and never changes; a reader keeps its bytes alive while it
// reads. Its bytes are one of the store's buffers, or, for a replica from a worker on this host,
// the shared buffer the snapshot server lent that worker (worker/dataplane/snapshot_peer.h).
// Keeping only the `kept` newest snapshots bounds the memory to about `kept` + 1 times
// (1 + replicas received over TCP) the rank's share of the job's state. Buffers of dropped shards
// are handed out again for the next snapshots: a snapshot buffer is as large as the rank's share
// of the state, and mapping a fresh one each time would cost a page fault per 4 KiB page in the
// training pause. A buffer whose pages a buddy on this host still keeps as its replica
// (StateBuffer::HeldElsewhere) waits until the buddy drops it, and one a buddy may keep without
// having said so (StateBuffer::retired) is never handed out again.
//
// Thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/types/span.h"
#include "absl/synchronization/mutex.h"
#include "absl/status/statusor.h"
#include "common/snapshot.h"
#include "worker/dataplane/state_buffer.h"

namespace shard {

using SnapshotBytes = std::shared_ptr<StateBuffer>;

class SnapshotStore {
 public:
  struct Held {
    SnapshotShard shard;
    absl::Span<const char> bytes;
    std::shared_ptr<const void> keep;  // keeps `bytes` alive
  };

  explicit SnapshotStore(int kept_snapshots = 2) : kept_(kept_snapshots) {}

  // A buffer of `bytes` bytes for a new shard: a dropped shard's when one is free (its pages
  // already mapped), else a new one. Its contents are whatever it held.
  absl::StatusOr<StateBuffer> TakeBuffer(uint64_t bytes);
  // Makes free buffers for shards of `bytes` bytes until `count` are ready (at most the store's
  // limit on free buffers, 4), their pages mapped, so that the TakeBuffer calls of a generation's
  // first snapshots, before any snapshot is dropped, fault no pages in the training pause (on a
  // VM, 30-55 ms for 16 MiB). Each has room for `bytes` plus 1/16: a plan rebuilt after the
  // first step moves the ranges a little, and the extras go after the state. Slow (it maps and
  // zeroes every page): call it off the training thread. Returns how many it made.
  int Prepare(uint64_t bytes, int count);
  // How many free buffers take a shard of `bytes` bytes without growing (and no buddy keeps).
  int ReadyBuffers(uint64_t bytes) const;
  // Adds a complete, verified shard (its bytes must match shard.record) and keeps only the
  // `kept` newest snapshots (common/snapshot.h NewerSnapshot): returns the ids of the snapshots
  // it no longer holds any shard of. A shard of a snapshot older than those kept is not added
  // (and its own id is returned).
  std::vector<std::string> Add(SnapshotShard shard, SnapshotBytes bytes);
  // The same for bytes that are not one of this store's buffers (a shared buffer a worker on
  // this host wrote), kept alive by `keep` until the shard is dropped and no reader holds it.
  std::vector<std::string> Add(SnapshotShard shard, absl::Span<const char> bytes,
                               std::shared_ptr<const void> keep);
  std::optional<Held> Find(const std::string& id, int rank) const;
  // Every shard held, newest snapshot first.
  std::vector<SnapshotShard> Holdings() const;
  uint64_t held_bytes() const;

 private:
  using Key = std::pair<std::string, int>;  // snapshot id, rank
  struct Entry {
    SnapshotShard shard;
    absl::Span<const char> bytes;
    std::shared_ptr<const void> keep;
    SnapshotBytes buffer;  // one of this store's buffers (handed out again once dropped), or null
  };
  std::vector<std::string> AddLocked(SnapshotShard shard, Entry entry)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The kept snapshots' ids, newest first.
  std::vector<std::string> SnapshotIdsLocked() const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  void RecycleLocked(SnapshotBytes bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  size_t ReadyBuffersLocked(uint64_t bytes) const ABSL_SHARED_LOCKS_REQUIRED(mu_);

  const int kept_;
  mutable absl::Mutex mu_;
  std::map<Key, Entry> shards_ ABSL_GUARDED_BY(mu_);
  std::vector<StateBuffer> free_ ABSL_GUARDED_BY(mu_);  // buffers of dropped shards
};

}  // namespace shard
