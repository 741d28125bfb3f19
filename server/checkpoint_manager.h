// The job's checkpoints, on the coordinator's side: save requests, the commit (once every rank's
// shard is on disk the manifest is written, atomically, last), the catalog of committed
// checkpoints kept in the state directory (record "checkpoints"), keep-last-K retention, removal
// of checkpoints that never committed, deletion, and where each generation's training starts.
// No gRPC. Thread-safe.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/checkpoint.h"
#include "common/job_spec.h"
#include "server/plan_manager.h"
#include "server/store/state_store.h"
#include "shard/v1/state.pb.h"

namespace shard {

struct CheckpointOptions {
  std::string job;
  std::string root;  // checkpoints live in <root>/<job>/<id>/
  int keep_last = 3;
  int zero_stage = 1;
  OptimizerConfig optimizer;
  std::vector<std::string> state_names;
  // Take back where training stood (started, and from which checkpoint) from the state
  // directory: a coordinator restarted on a live job. Otherwise training starts afresh.
  bool recover = false;
};

struct ShardReport {
  std::string worker_id;
  int rank = 0;
  std::string id;
  int64_t step = 0;
  int64_t request = 0;
  int64_t plan_version = 0;
  std::string plan_hash;
  ShardRecord record;
  double pause_ms = 0;
  double write_ms = 0;
  std::string error;  // the rank could not write its shard
  TrainingCounters counters;
};

struct SaveProgress {
  int shards_done = 0;
  int world_size = 0;
  uint64_t bytes_done = 0;
  std::string committed_id;  // once a checkpoint satisfying the request is committed
  std::string error;
};

// Where a generation's training starts.
struct TrainingStartPoint {
  std::string checkpoint_id;  // empty: from the initial weights
  std::string dir;
  int64_t step = 0;
};

class CheckpointManager {
 public:
  // Loads the catalog, drops entries whose manifest is gone, and removes checkpoint
  // directories of this job that never committed.
  static absl::StatusOr<std::unique_ptr<CheckpointManager>> Create(CheckpointOptions options,
                                                                   StateStore* store);

  // A new save request, numbered from 1; workers save at their next step boundary, and with
  // `pause` stop training after it (the world is about to re-form).
  absl::StatusOr<int64_t> RequestSave(bool pause = false);
  // The newest request not yet answered by a commit or a failure; 0 when there is none.
  int64_t pending_request() const;
  // The pausing request not yet answered; 0 when there is none.
  int64_t pause_request() const;
  // The re-formation that wanted `request` is over (done or dropped): nothing pauses for it.
  void CancelPause(int64_t request);

  // Records a rank's shard; once every rank of `plan`'s world has reported, writes the
  // manifest and records the checkpoint (true). Reports must match the current plan.
  absl::StatusOr<bool> ReportShard(const ShardReport& report, const PlanView& plan);
  SaveProgress Progress(int64_t request) const;

  std::vector<v1::CheckpointRecord> List() const;
  // `id` or "latest".
  absl::StatusOr<v1::CheckpointRecord> Find(const std::string& id) const;
  absl::Status Delete(const std::string& id);

  // Training of every generation from now on starts from checkpoint `id` ("latest" allowed).
  absl::StatusOr<TrainingStartPoint> SetRestorePoint(const std::string& id);
  // After a membership change during training, the next generation restarts from the latest
  // committed checkpoint (or the initial weights if there is none).
  void RestartFromLatest();
  TrainingStartPoint start() const;

  // A new generation. Pending saves of the ended one can never complete: they are dropped with
  // their files. If training had started, the new generation restarts from the latest
  // checkpoint, unless an operator's restore asked for this re-formation.
  void OnGeneration(int64_t generation);
  // Training has started (a worker reported a step).
  void NoteTrainingStarted();
  bool training_started() const;

  const std::string& root() const { return options_.root; }

 private:
  struct Pending {
    int64_t step = 0;
    int64_t request = 0;
    std::string plan_hash;
    TrainingCounters counters;
    std::vector<std::optional<ShardRecord>> shards;
    double max_pause_ms = 0;
    double max_write_ms = 0;
    std::string error;
  };

  CheckpointManager(CheckpointOptions options, StateStore* store)
      : options_(std::move(options)), store_(store) {}
  std::string Directory(const std::string& id) const;
  absl::Status PersistLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<v1::CheckpointRecord> FindLocked(const std::string& id) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  void ApplyRetentionLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RestartFromLatestLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A request is answered once a checkpoint committed for it (or a later one) or it failed.
  bool AnsweredLocked(int64_t request) const ABSL_SHARED_LOCKS_REQUIRED(mu_);

  const CheckpointOptions options_;
  StateStore* const store_;
  mutable absl::Mutex mu_;
  v1::CheckpointCatalog catalog_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, Pending> pending_ ABSL_GUARDED_BY(mu_);
  std::map<int64_t, std::string> errors_ ABSL_GUARDED_BY(mu_);  // by request
  TrainingStartPoint start_ ABSL_GUARDED_BY(mu_);
  bool training_started_ ABSL_GUARDED_BY(mu_) = false;
  bool restore_requested_ ABSL_GUARDED_BY(mu_) = false;  // SetRestorePoint awaiting a generation
};

}  // namespace shard
