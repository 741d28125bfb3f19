// Tests that train without a coordinator play its part in checkpoints: once every rank's shard of
// a checkpoint is on disk (TrainerOptions::on_checkpoint), the manifest is made and committed.
// Header-only, so the portable GPU test binary uses it too.
#pragma once

#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "common/checkpoint.h"
#include "common/job_spec.h"
#include "gtest/gtest.h"
#include "tests/support/status_assertions.h"
#include "worker/dataplane/checkpoint_saver.h"

namespace shard {

// Checkpoint shards by id, as on_checkpoint reports them (any rank order).
using SavedShards = std::map<std::string, std::vector<SavedShard>>;

// Commits every checkpoint of `saved` (its shards sorted by rank), each of which must have a
// shard from every rank of `job`.
inline void CommitSavedCheckpoints(const JobConfig& job, SavedShards& saved) {
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
