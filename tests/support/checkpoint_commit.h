// Tests that train without a coordinator play its part in checkpoints: once every rank's shard of
// a checkpoint is on disk (TrainingObserver::OnCheckpoint), the manifest is made and committed.
// Header-only, so the portable GPU test binary uses it too.
#pragma once

#include <algorithm>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "common/checkpoint.h"
#include "common/job_spec.h"
#include "gtest/gtest.h"
#include "tests/support/status_assertions.h"
#include "worker/dataplane/checkpoint_saver.h"
#include "worker/dataplane/training_session.h"

namespace shard {

// Checkpoint shards by id, as OnCheckpoint reports them (any rank order).
using SavedShards = std::map<std::string, std::vector<SavedShard>>;

// Collects the checkpoint shards the ranks write, as an observer of every rank's training (or
// part of one). Thread-safe: each rank's writer thread reports its own.
class SavedShardCollector : public TrainingObserver {
 public:
  void OnCheckpoint(const SavedShard& shard) override {
    if (!shard.skipped.empty()) return;  // a periodic save skipped: nothing to commit
    absl::MutexLock lock(&mu_);
    saved_[shard.id].push_back(shard);
  }
  // What was collected, once training is over.
  SavedShards Take() {
    absl::MutexLock lock(&mu_);
    return std::move(saved_);
  }

 private:
  absl::Mutex mu_;
  SavedShards saved_ ABSL_GUARDED_BY(mu_);
};

// Commits every checkpoint of `saved` (its shards sorted by rank), each of which must have a
// shard from every rank of `job`.
inline void CommitSavedCheckpoints(const JobConfig& job, SavedShards saved) {
  for (auto& [id, shards] : saved) {
    ASSERT_EQ(static_cast<int>(shards.size()), job.world_size) << id;
    std::sort(shards.begin(), shards.end(),
              [](const SavedShard& a, const SavedShard& b) { return a.rank < b.rank; });
    std::vector<ShardRecord> records;
    for (const SavedShard& shard : shards) {
      SHARD_ASSERT_OK(shard.record.status());
      records.push_back(*shard.record);
    }
    SHARD_ASSERT_OK_AND_ASSIGN(
        CheckpointManifest manifest,
        MakeCheckpointManifest(job.name, id, shards[0].step, job.zero_stage,
                               MlpManifest(job.widths), *shards[0].plan, job.optimizer,
                               OptimizerStateNames(job.optimizer), records));
    manifest.counters = shards[0].counters;
    SHARD_ASSERT_OK(CommitCheckpoint(shards[0].dir, manifest));
  }
}

}  // namespace shard
