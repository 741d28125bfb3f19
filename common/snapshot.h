// In-memory snapshots (docs/recovery.md): every few steps each rank copies what it owns into a
// snapshot buffer and sends it to its buddy ranks, so that after a death the new world, of any
// size, reads its new ranges from the ranks that still hold them instead of from disk. A
// snapshot's shards are laid out exactly as a checkpoint's (common/checkpoint.h): the same
// pieces, the same checksums, and a restore reads them through the same CheckpointReader.
//
// This file holds the pure parts: what a held shard is, who keeps a rank's replicas, the
// manifest a snapshot is read by, and the shard's description on the wire between peers.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/checkpoint.h"
#include "common/job_spec.h"
#include "common/manifest.h"
#include "common/plan.h"

namespace shard {

// One rank's shard of a snapshot, as its holders keep and report it (the bytes aside).
struct SnapshotShard {
  std::string id;          // SnapshotId(step, generation)
  int64_t generation = 0;  // of the world whose ranks took it
  int64_t step = 0;        // training steps done; a restore continues with step + 1
  int rank = 0;            // whose owned state it is, in a world of plan.world_size ranks
  PlanOptions plan;        // the plan it is laid out by (gradient order included)
  std::string plan_hash;
  TrainingCounters counters;
  ShardRecord record;    // size and XXH3 checksums of the bytes, and its extras
  int64_t request = 0;   // the pausing request it answers (0: a periodic snapshot)
  OptimizerStateKind state;  // what its pieces hold besides the parameter values

  bool operator==(const SnapshotShard&) const = default;
};

// A snapshot has the id a checkpoint of the same step and generation would have
// ("step-00000040-g3"), so a disk checkpoint written from it is recognisably the same state.
std::string SnapshotId(int64_t step, int64_t generation);

// Whether snapshot (generation_a, step_a) is newer than (generation_b, step_b): a later
// generation always is (after a restore to an earlier step, the new timeline's snapshots are the
// newer ones), then the later step.
bool NewerSnapshot(int64_t generation_a, int64_t step_a, int64_t generation_b, int64_t step_b);

// The ranks that keep replicas of `rank`'s shard, nearest first: its successors on a ring that
// alternates between hosts (ranks grouped by `hosts[rank]`, the groups interleaved), so that with
// more than one host a replica is on another host, and every rank keeps as many replicas as it
// sends. At most min(replicas, world - 1) of them.
std::vector<int> SnapshotBuddies(const std::vector<std::string>& hosts, int rank, int replicas);
// The ranks whose shards `rank` keeps replicas of (the inverse of SnapshotBuddies).
std::vector<int> SnapshotSources(const std::vector<std::string>& hosts, int rank, int replicas);

// The manifest a snapshot is read by, from one shard of each rank (`shards[r].rank == r`): the
// plan is remade from their plan options for `model` and must have their hash; every shard must
// be of the same snapshot (id, step, generation, plan, counters and optimizer state, which must
// be the job optimizer's: SavedOptimizer). FailedPrecondition naming what differs otherwise.
absl::StatusOr<CheckpointManifest> SnapshotManifest(const std::string& job, int zero_stage,
                                                    const Manifest& model,
                                                    const OptimizerConfig& optimizer,
                                                    const std::vector<SnapshotShard>& shards);

// The shard's description as peers exchange it (a JSON object), and back. The parser takes
// untrusted input: InvalidArgument naming the field for anything malformed, and the checks of
// ValidateSnapshotShard.
std::string SnapshotShardToJson(const SnapshotShard& shard);
absl::StatusOr<SnapshotShard> SnapshotShardFromJson(absl::string_view json);

// What every description of a shard must hold, however it arrived (a peer's JSON, a worker's
// report): an id that is its step's and generation's, a rank inside its world, parameter indices
// in its gradient order and extras, extras back to back inside the shard, a checksum per block,
// a valid file name and counters. InvalidArgument naming what is wrong.
absl::Status ValidateSnapshotShard(const SnapshotShard& shard);

}  // namespace shard
