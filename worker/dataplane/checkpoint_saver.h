// Writes a rank's checkpoint shard off the training thread: the trainer copies the owned state
// into a buffer (the only pause training sees) and hands it over; this thread writes, hashes,
// fsyncs and renames the shard file, then reports. One save is in flight at a time; a new one
// first waits for the previous. The buffer may be shared with a memory snapshot of the same step
// (worker/dataplane/snapshotter.h): both only read it.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
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
};

class CheckpointSaver {
 public:
  explicit CheckpointSaver(std::function<void(const SavedShard&)> on_saved);
  ~CheckpointSaver();  // waits for the save in flight

  // Blocks until no save is in flight (and returns how long that took).
  absl::Duration WaitIdle();
  // Waits for the save in flight and hands back its buffer when nothing else holds it (else an
  // empty one), so that the next copy goes into memory that is already mapped.
  std::vector<char> TakeBuffer();
  // Starts writing `bytes` as shard `saved.rank` of `saved.dir`.
  void Start(SavedShard saved, int world_size, SnapshotBytes bytes);

 private:
  void Loop();

  std::function<void(const SavedShard&)> on_saved_;
  absl::Mutex mu_;
  bool busy_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  SavedShard job_ ABSL_GUARDED_BY(mu_);
  int world_size_ ABSL_GUARDED_BY(mu_) = 0;
  SnapshotBytes bytes_ ABSL_GUARDED_BY(mu_);       // to write
  std::vector<char> kept_ ABSL_GUARDED_BY(mu_);    // written, for the next copy
  std::thread thread_;
};

}  // namespace shard
