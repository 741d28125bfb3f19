// Writes a rank's checkpoint shard off the training thread: the trainer copies the owned state
// into a buffer (the only pause training sees) and hands it over; this thread writes, hashes,
// fsyncs and renames the shard file, then reports. One save is in flight at a time: the trainer
// starts the next only once no rank is writing (common/step_boundary.h), so a slow disk makes
// saves fall behind, never queue up. A write that fails (a full disk, EIO) or is cancelled leaves
// no file behind and is reported with its error. The buffer may be shared with a memory snapshot
// of the same step (worker/dataplane/snapshotter.h): both only read it.
//
// Thread-safe; `on_saved` runs on the writer thread for a save, and on a thread of its own for
// a skipped save's report, so it must be safe to call from both.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/checkpoint.h"
#include "worker/dataplane/snapshot_store.h"

namespace shard {

struct SavedShard {
  std::string id;
  std::string dir;
  int64_t step = 0;
  int64_t request = 0;  // the save request this checkpoint satisfies (0: periodic)
  int rank = 0;
  std::shared_ptr<const Plan> plan;  // the plan the shard is laid out by
  int64_t plan_version = 0;
  TrainingCounters counters;
  OptimizerStateKind state;          // what the pieces hold besides the parameter values
  std::vector<ShardExtra> extras;    // where the bytes after the pieces belong
  double pause_ms = 0;               // training was held this long (copy, and a previous save)
  double write_ms = 0;
  absl::StatusOr<ShardRecord> record = absl::UnknownError("not written");
  // Not written at all, and why: a periodic save skipped because a rank still wrote the one
  // before (record then holds the same reason as an error).
  std::string skipped;
};

class CheckpointSaver {
 public:
  explicit CheckpointSaver(std::function<void(const SavedShard&)> on_saved);
  ~CheckpointSaver();  // waits for the save in flight (Cancel() first not to)

  // The step of the save in flight; 0 when none is.
  int64_t writing_step() const;
  // Blocks until no save is in flight (and returns how long that took).
  absl::Duration WaitIdle();
  // The same for at most `timeout`; whether no save is in flight now.
  bool WaitIdleFor(absl::Duration timeout);
  // Waits for the save in flight and hands back its buffer when nothing else holds it, in this
  // process or another (else an empty one), so that the next copy goes into memory that is
  // already mapped.
  StateBuffer TakeBuffer();
  // Starts writing `bytes` as shard `saved.rank` of `saved.dir` (waits for the save in flight).
  void Start(SavedShard saved, int world_size, SnapshotBytes bytes);
  // Gives up the save in flight, if any (nobody will commit it: its generation ended): its write
  // stops within one 16 MiB window (or one MiB of SHARD_SLOW_WRITE_MS), its file is removed, and
  // it is not reported (the coordinator removes the files of an ended generation's saves).
  void Cancel();
  // Reports `saved`, which was not written (saved.skipped says why), through `on_saved` on a
  // thread of its own, so that the report does not hold up training. One report waits at a
  // time: a newer one replaces it.
  void ReportSkipped(SavedShard saved);

 private:
  void Loop();
  void ReportLoop();

  std::function<void(const SavedShard&)> on_saved_;
  mutable absl::Mutex mu_;
  bool busy_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  SavedShard job_ ABSL_GUARDED_BY(mu_);
  int64_t writing_step_ ABSL_GUARDED_BY(mu_) = 0;
  int world_size_ ABSL_GUARDED_BY(mu_) = 0;
  SnapshotBytes bytes_ ABSL_GUARDED_BY(mu_);       // to write
  StateBuffer kept_ ABSL_GUARDED_BY(mu_);          // written, for the next copy
  std::optional<SavedShard> skipped_ ABSL_GUARDED_BY(mu_);  // to report
  std::atomic<bool> cancel_{false};                // the save in flight is given up
  std::thread thread_;
  std::thread reporter_;
};

}  // namespace shard
