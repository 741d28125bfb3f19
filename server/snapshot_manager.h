// The job's in-memory snapshots, on the coordinator's side (common/snapshot.h, docs/recovery.md):
// which live worker holds which shard of which snapshot, and so which snapshot a new world can
// restore from memory. Workers report what they hold (their own shard once they copied it, a
// buddy's once it arrived and checked) and what they dropped; a worker that joins says what it
// already holds. A snapshot is usable once every one of its shards has a live holder; it is fully
// replicated once every shard has 1 + replicas of them.
//
// Only verified holdings are reported, so a shard cut off in transfer is never listed. What is
// listed can still fail to read (a holder died since, or dropped it): the reader then says so,
// the snapshot is discarded here, and the next generation restores from elsewhere.
//
// The catalog is in memory: after a coordinator restart it fills again from what workers report
// and what joining workers hold. Liveness is the caller's (the membership): every query takes a
// predicate on (worker id, incarnation), called under this manager's lock, so it must not wait
// for another manager's (WorldManager::LiveNow is a copy).
//
// No gRPC. Thread-safe; it calls nothing of the other managers.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/control_types.h"
#include "common/snapshot.h"
#include "server/types.h"

namespace shard {

struct SnapshotOptions {
  int replicas = 1;          // the job's snapshot.replicas
  size_t max_snapshots = 16;  // catalog entries kept (the newest)
};

using IsLive = IsLiveMember;

// What status and metrics show about snapshots.
struct SnapshotSummary {
  std::string usable_id;  // the newest usable snapshot ("" if none)
  int64_t usable_step = 0;
  std::optional<absl::Time> usable_since;  // when it became usable
  int usable_copies = 0;                   // live holders of its least-held shard
  int64_t replica_lag_steps = 0;  // newest taken minus newest fully replicated, in steps
  std::optional<absl::Duration> replica_lag;  // how long the newest taken has waited for replicas
};

class SnapshotManager {
 public:
  explicit SnapshotManager(SnapshotOptions options) : options_(options) {}

  // A worker (re)joined with `holdings`, serving them at `address`: what an earlier incarnation
  // of it held is forgotten (a restarted process holds nothing of it).
  void OnJoin(const std::string& worker_id, uint64_t incarnation, const std::string& address,
              const std::vector<SnapshotShard>& holdings, absl::Time now);
  // A member's news (the caller checked it is one); an earlier incarnation's holdings are
  // forgotten. A shard whose description differs from what another holder reported for it is not
  // listed: FailedPrecondition naming both checksums.
  absl::Status Report(const SnapshotReport& report, absl::Time now);

  // The newest snapshot every shard of which a live worker holds (with its live holders), if any;
  // `why_not` says why a newer one is not usable ("" when the newest is).
  struct Newest {
    std::optional<MemoryRestorePoint> point;
    std::string why_not;
  };
  Newest NewestUsable(const IsLive& live) const;
  // Snapshot `id` with its live holders, if every shard has one.
  std::optional<MemoryRestorePoint> Usable(const std::string& id, const IsLive& live) const;
  // The pausing snapshot of `request`: committed_id once it is usable, error once a rank could
  // not take its shard, else how many shards are held.
  SaveProgress PauseProgress(int64_t request, const IsLive& live) const;
  // The live holders of rank `rank`'s shard of `id` now (the owner first when it reported first).
  std::vector<SnapshotHolder> Holders(const std::string& id, int rank, const IsLive& live) const;

  // Never to be used again: `id` (a read of it failed), every snapshot newer than (generation,
  // step) (a restore began another timeline there), or all of them (an operator's restore).
  void Discard(const std::string& id, const std::string& why);
  void DiscardNewerThan(int64_t generation, int64_t step);
  void DiscardAll(const std::string& why);

  SnapshotSummary Summary(const IsLive& live, absl::Time now) const;

 private:
  struct Entry {
    int64_t generation = 0;
    int64_t step = 0;
    int64_t request = 0;
    std::vector<std::optional<SnapshotShard>> shards;  // by rank: as first reported
    std::vector<std::vector<SnapshotHolder>> holders;  // by rank, in report order
    std::vector<std::set<std::string>> ever_held_by;   // by rank, for messages
    absl::Time first_seen;
    std::optional<absl::Time> usable_since;
    std::string failure;  // a rank could not take its shard
  };

  // Adds `holder` for `shard`; FailedPrecondition if it contradicts an earlier description.
  absl::Status AddLocked(const SnapshotShard& shard, const SnapshotHolder& holder, absl::Time now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ForgetWorkerLocked(const std::string& worker_id, const std::string& id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void PruneLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ids, newest first.
  std::vector<std::string> OrderLocked() const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  std::optional<MemoryRestorePoint> UsableLocked(const std::string& id, const Entry& entry,
                                                 const IsLive& live) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // The fewest live holders of any shard of `entry` (0 when a shard has none or is unknown).
  int CopiesLocked(const Entry& entry, const IsLive& live) const ABSL_SHARED_LOCKS_REQUIRED(mu_);

  const SnapshotOptions options_;
  mutable absl::Mutex mu_;
  std::map<std::string, Entry> entries_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> discarded_ ABSL_GUARDED_BY(mu_);
  // Where each worker's snapshot server is: worker id -> (incarnation, host:port).
  std::map<std::string, std::pair<uint64_t, std::string>> addresses_ ABSL_GUARDED_BY(mu_);
};

}  // namespace shard
