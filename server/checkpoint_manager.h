// The job's checkpoints, on the coordinator's side: save requests, the commit (once every rank's
// shard is on disk the manifest is written, atomically, last), the catalog of committed
// checkpoints kept in the state directory (record "checkpoints"), keep-last-K retention, removal
// of checkpoints that never committed, deletion, and where each generation's training starts.
//
// Requests belong to a generation. A save request (an operator's, or the pausing save of a
// re-formation) is asked of the ranks of the generation it was made in; when that generation
// ends before the checkpoint commits, the request is cancelled (its progress says so) and the
// shards written for it are removed: no worker of a later generation acts on it.
//
// A save that fails (a rank could not write its shard: a full disk, EIO; or the manifest could
// not be written) is removed from disk, every shard of it, including those its other ranks
// report later; the committed checkpoints stay as they are (retention runs only after a
// commit), the request it answered fails with the error, and later saves go on as usual. Failed
// and skipped saves (SaveHealth) are shown in status and recorded as events (TakeNotices).
//
// No gRPC. Thread-safe.
#pragma once

#include <map>
#include <set>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/checkpoint.h"
#include "common/job_spec.h"
#include "server/checkpoint_storage.h"
#include "server/store/state_store.h"
#include "server/types.h"

namespace shard {

struct CheckpointOptions {
  std::string job;
  std::string root;  // checkpoints live in <root>/<job>/<id>/
  int keep_last = 3;
  int zero_stage = 1;
  // The job's; the ranks' reports say which state a kTorch optimizer keeps (SavedOptimizer).
  OptimizerConfig optimizer;
  // Take back where training stood (started, from which checkpoint, the pending requests) from
  // the state directory: a coordinator restarted on a live job. Otherwise training starts
  // afresh.
  bool recover = false;
};

// Saves since the newest commit that did not commit, for status and metrics.
struct SaveHealth {
  int64_t failures = 0;        // failed since the newest commit
  int64_t failures_total = 0;  // since this coordinator started
  std::string last_failure;    // "step-00000070-g1: rank 1 could not write its shard: ..."
  std::optional<absl::Time> last_failure_at;
  int64_t skipped = 0;  // periodic saves skipped since the newest commit (a slow disk)
  int64_t skipped_total = 0;
  std::string last_skip;
};

// Something about saves for the job's event history (the caller records it).
struct CheckpointNotice {
  v1::MembershipEventKind kind = v1::MEMBERSHIP_EVENT_KIND_UNSPECIFIED;
  std::string detail;
};

class CheckpointManager {
 public:
  // Loads the catalog, drops entries whose manifest is gone, and removes checkpoint
  // directories of this job that never committed. `generation` is the world's now; with
  // `options.recover`, `generation_kept` says whether it is the one the catalog was written
  // at (the world goes on training) or a new one (its requests are cancelled and training
  // restarts from the latest checkpoint).
  static absl::StatusOr<std::unique_ptr<CheckpointManager>> Create(CheckpointOptions options,
                                                                   StateStore* store,
                                                                   CheckpointStorage* storage,
                                                                   int64_t generation,
                                                                   bool generation_kept);

  // A new save request of `generation` (the world's current one), numbered from 1; its ranks
  // save at their next step boundary and, with `pause`, stop training after it (the world is
  // about to re-form). A pause `in_memory` is answered by a memory snapshot (SnapshotManager
  // knows when it is usable), not a disk checkpoint. FailedPrecondition for another generation.
  absl::StatusOr<int64_t> RequestSave(int64_t generation, bool pause = false,
                                      bool in_memory = false);
  // What the ranks of `generation` must do at their next step boundary: the newest request of
  // that generation not yet answered, and whether training pauses after it.
  StepOrders Orders(int64_t generation) const;
  // The current generation's unanswered save request (0: none).
  int64_t pending_request() const;
  // The re-formation that wanted the pausing `request` is over (done or dropped): nothing
  // pauses for it any more.
  void CancelPause(int64_t request);

  // Records a rank's shard (`report.rank` from the membership); once every rank of `plan`'s
  // world has reported, writes the manifest and records the checkpoint (true). Reports must be
  // of the current generation (Aborted otherwise) and plan.
  // A report of a save that failed, of a checkpoint that already failed, or of an ended
  // generation removes what that save left on disk (never a committed checkpoint). A report with
  // `skipped` set notes a periodic save that was not written.
  absl::StatusOr<bool> ReportShard(const ShardReport& report, const PlanView& plan,
                                   absl::Time now);
  SaveProgress Progress(int64_t request) const;
  SaveHealth health() const;
  // What happened to saves since the last call, for the event history: a save that failed (the
  // first few after a commit, then every power of two), a periodic save skipped (at most one a
  // minute), and the first commit after failures.
  std::vector<CheckpointNotice> TakeNotices();

  std::vector<v1::CheckpointRecord> List() const;
  // `id` or "latest".
  absl::StatusOr<v1::CheckpointRecord> Find(const std::string& id) const;
  absl::StatusOr<CheckpointManifest> ReadManifest(const v1::CheckpointRecord& record) const;
  absl::Status Delete(const std::string& id);

  // Training of every generation from now on starts from checkpoint `id` ("latest" allowed).
  absl::StatusOr<TrainingStartPoint> SetRestorePoint(const std::string& id);
  // The same from a snapshot in workers' memory (a pausing reshape's).
  TrainingStartPoint SetMemoryRestorePoint(MemoryRestorePoint point);
  TrainingStartPoint start() const;
  // Where the start's shards are when it is a memory snapshot.
  std::optional<MemoryRestorePoint> memory_start() const;

  // The world first runs at `generation`: unless its start was set for it (SetRestorePoint, or
  // the first generation), training restarts from the newest state there is, the latest
  // committed checkpoint or `memory` (the newest usable snapshot) when it is as new. Returns
  // what it chose, and why, for the history ("" when the start stays as it was).
  std::string ResolveStart(int64_t generation, std::optional<MemoryRestorePoint> memory,
                           const std::string& memory_why_not);

  // Rank `rank` of `generation` restored its start (the report's duration, bytes from peers);
  // true once every one of `world_size` ranks has, with a summary for the history. A report of
  // another generation, or a second of the same rank, changes nothing.
  struct RestoreSummary {
    TrainingStartPoint start;
    absl::Duration slowest;
    uint64_t bytes = 0;
    uint64_t bytes_from_peers = 0;
    int64_t steps_lost = 0;  // between the furthest step reached before and the start's
    std::vector<std::string> refused;  // copies that failed their checksums, read elsewhere
  };
  // `reached`: the furthest step training had reached before this generation.
  std::optional<RestoreSummary> NoteRestored(int64_t generation, int rank, int world_size,
                                             int64_t reached, const RestoreReport& report);
  // Restores completed by every rank since this coordinator started, by source, and the last.
  struct Restores {
    int64_t from_memory = 0;
    int64_t from_disk = 0;
    std::optional<RestoreSummary> last;
  };
  Restores restores() const;
  // Whether `worker_id` holds a shard of the current generation's start in memory that its ranks
  // have not all restored yet: it must not leave before they have.
  bool NeededForRestore(const std::string& worker_id) const;

  // A new generation. Requests and pending saves of the ended one can never complete: they are
  // cancelled, their files removed. If training had started, the new generation restarts from
  // the latest checkpoint, unless a restore point was set for it (SetRestorePoint).
  void OnGeneration(int64_t generation);
  // Training has started (a worker reported a step).
  void NoteTrainingStarted();
  bool training_started() const;

  const std::string& root() const { return options_.root; }
  // The whole catalog as kept in the state directory (for tests that compare it with disk).
  v1::CheckpointCatalog Catalog() const;

 private:
  struct Pending {
    int64_t step = 0;
    int64_t request = 0;
    std::string plan_hash;
    TrainingCounters counters;
    OptimizerStateKind state;  // what the first report's pieces hold; the others' must match
    std::vector<std::optional<ShardRecord>> shards;
    double max_pause_ms = 0;
    double max_write_ms = 0;
  };

  CheckpointManager(CheckpointOptions options, StateStore* store, CheckpointStorage* storage,
                    int64_t generation)
      : options_(std::move(options)), store_(store), storage_(storage), generation_(generation) {}
  std::string Directory(const std::string& id) const;
  absl::Status PersistLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<v1::CheckpointRecord> FindLocked(const std::string& id) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  void ApplyRetentionLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RestartFromLatestLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The world moved on from generation `ended` to generation_: cancels the ended one's
  // requests and sets where training starts.
  void BeginGenerationLocked(int64_t ended) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A request is answered once a checkpoint committed for it (or a later one) or it failed.
  bool AnsweredLocked(int64_t request) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  StepOrders OrdersLocked(int64_t generation) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Removes the directory of pending checkpoint `id` (`why`, for the log), unless it holds a
  // committed checkpoint: another run's.
  void DiscardLocked(const std::string& id, absl::string_view why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Fails the pending checkpoint `id` (and the requests it would answer) with `error`.
  void FailLocked(const std::string& id, const std::string& error, absl::Time now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A periodic save was skipped (report.skipped says why).
  void NoteSkippedLocked(const ShardReport& report, absl::Time now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The newest committed checkpoint, in words ("step-00000060-g1 (step 60)"), or "none".
  std::string LatestLocked() const ABSL_SHARED_LOCKS_REQUIRED(mu_);

  const CheckpointOptions options_;
  StateStore* const store_;
  CheckpointStorage* const storage_;
  mutable absl::Mutex mu_;
  int64_t generation_ ABSL_GUARDED_BY(mu_);
  v1::CheckpointCatalog catalog_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, Pending> pending_ ABSL_GUARDED_BY(mu_);
  std::map<int64_t, std::string> errors_ ABSL_GUARDED_BY(mu_);  // by request
  // Checkpoints of the current generation that failed: later shards of them are removed.
  std::set<std::string> failed_ ABSL_GUARDED_BY(mu_);
  SaveHealth health_ ABSL_GUARDED_BY(mu_);
  std::optional<absl::Time> last_skip_event_ ABSL_GUARDED_BY(mu_);
  std::vector<CheckpointNotice> notices_ ABSL_GUARDED_BY(mu_);
  TrainingStartPoint start_ ABSL_GUARDED_BY(mu_);
  bool training_started_ ABSL_GUARDED_BY(mu_) = false;
  bool restore_requested_ ABSL_GUARDED_BY(mu_) = false;  // SetRestorePoint awaiting a generation
  // The generation whose start is fixed: set for it (SetRestorePoint) or resolved there.
  int64_t start_fixed_generation_ ABSL_GUARDED_BY(mu_) = 0;
  std::optional<MemoryRestorePoint> memory_start_ ABSL_GUARDED_BY(mu_);
  // Ranks of restored_generation_ that restored its start, and what it took.
  int64_t restored_generation_ ABSL_GUARDED_BY(mu_) = 0;
  std::set<int> restored_ranks_ ABSL_GUARDED_BY(mu_);
  RestoreSummary restore_summary_ ABSL_GUARDED_BY(mu_);
  Restores restores_ ABSL_GUARDED_BY(mu_);
  bool all_restored_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace shard
