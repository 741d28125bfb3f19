// The control plane's value types: what the coordinator, the workers and shardctl say to each
// other, in domain terms. proto/control_convert.h is the one place that turns them into the
// wire messages of shard/v1/coordinator.proto and back; the coordinator's managers
// (server/types.h) and the worker's agent work with these.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/checkpoint.h"
#include "common/job_state.h"
#include "common/snapshot.h"

namespace shard {

enum class WorkerState { kJoining, kReady, kFailed, kLeft, kDead, kStandby, kLeaving };
enum class SelfCheckState { kPending, kPassed, kFailed };
// How a worker fails to reach a peer over the data path.
enum class LinkFailure { kConnect, kSend, kReceive };
// The job's bucket-rebuild state, as PyTorch's ZeroRedundancyOptimizer._OverlapStatus.
enum class OverlapStatus { kUninitialized, kRebuilt, kInitialized };

absl::string_view WorkerStateName(WorkerState state);
absl::string_view SelfCheckStateName(SelfCheckState state);
absl::string_view LinkFailureName(LinkFailure how);  // "connect", "send", "receive"
absl::string_view OverlapStatusName(OverlapStatus status);

// The world as the coordinator sees it now.
struct World {
  JobState state = JobState::kForming;
  int64_t generation = 0;
  int world_size = 0;           // live workers holding a rank
  int expected_world_size = 0;  // the target
  int ranks = 0;                // of this generation's world
  int min_world_size = 0;
  int standby = 0;
  std::string transition;  // what the world waits for, for people; empty when settled

  bool operator==(const World&) const = default;
};

// Where a generation's training starts: the job's initial weights (no checkpoint), a committed
// checkpoint on disk, or a snapshot live workers hold in memory (`in_memory`: checkpoint_id is
// the snapshot's, dir is empty), continuing with the step after its step.
struct TrainingStartPoint {
  std::string checkpoint_id;
  std::string dir;
  int64_t step = 0;
  bool in_memory = false;

  bool operator==(const TrainingStartPoint&) const = default;
};

// A live worker holding a snapshot shard, and where its peers fetch it.
struct SnapshotHolder {
  std::string worker_id;
  uint64_t incarnation = 0;
  std::string address;  // host:port of its snapshot server

  bool operator==(const SnapshotHolder&) const = default;
};

// A memory restore point: one shard per rank of the snapshot's world, and who holds each.
struct MemoryRestorePoint {
  std::vector<SnapshotShard> shards;               // by rank
  std::vector<std::vector<SnapshotHolder>> holders;  // by rank, the owner first when it holds it

  bool operator==(const MemoryRestorePoint&) const = default;
};

// A worker's news about the snapshot shards it holds.
struct SnapshotReport {
  std::string worker_id;
  uint64_t incarnation = 0;
  std::vector<SnapshotShard> held;   // newly held, verified
  std::vector<std::string> dropped;  // snapshot ids it no longer holds any shard of
  std::string failed_id;             // a snapshot this rank could not take its shard of
  std::string error;
  std::string snapshot_address;  // where peers fetch what it holds

  bool operator==(const SnapshotReport&) const = default;
};

// A rank restored its part of its generation's restore point (or failed to: `error`).
struct RestoreReport {
  std::string worker_id;
  uint64_t incarnation = 0;
  int64_t generation = 0;
  std::string checkpoint_id;
  bool in_memory = false;
  absl::Duration duration;
  uint64_t bytes_from_peers = 0;
  uint64_t bytes = 0;
  std::string error;
  // Copies of a memory snapshot's shards that failed their checksums and were read elsewhere.
  std::vector<std::string> refused;

  bool operator==(const RestoreReport&) const = default;
};

// What the ranks of one generation must do at their next step boundary. Requests belong to a
// generation: a worker acts only on the orders of the generation it trains in.
struct StepOrders {
  int64_t generation = 0;
  int64_t save_request = 0;   // the newest save request not yet answered (0: none)
  int64_t pause_request = 0;  // a save request after which training pauses (0: none)
  // The pause is answered by a memory snapshot (the job takes them), not a disk checkpoint;
  // save_request then never names it.
  bool pause_in_memory = false;

  bool operator==(const StepOrders&) const = default;
};

struct JoinParams {
  std::string worker_id;
  std::string host;
  std::string device;
  std::vector<std::string> capabilities;
  uint64_t incarnation = 0;
  std::optional<int> requested_rank;
  std::string snapshot_address;  // where peers fetch the snapshots it holds ("": none)
  std::vector<SnapshotShard> holdings;  // what it holds already (e.g. across a coordinator restart)

  bool operator==(const JoinParams&) const = default;
};

// What a rank's training is doing, as of when it said so (generation 0: it trains nothing).
struct TrainingActivity {
  int64_t generation = 0;   // the generation it trains in
  int64_t step = 0;         // steps done
  absl::Duration since_step;  // since its last step ended (or its training began)
  absl::Duration waiting;     // how long a collective has been in flight on it (0: none)

  bool operator==(const TrainingActivity&) const = default;
};

// A peer of a generation that a rank could not reach.
struct PeerFault {
  int peer_rank = -1;
  LinkFailure how = LinkFailure::kConnect;
  std::string detail;

  bool operator==(const PeerFault&) const = default;
};

// A worker to connect to (a connectivity probe), and how that went.
struct PeerProbe {
  std::string worker_id;
  std::string address;  // host:port
  bool reachable = false;
  std::string detail;   // why not

  bool operator==(const PeerProbe&) const = default;
};

// A rank's self-check of its generation's data path, or the failure of that data path later.
struct SelfCheckReport {
  std::string worker_id;
  uint64_t incarnation = 0;
  int64_t generation = 0;
  bool passed = false;
  std::string detail;
  std::vector<PeerFault> unreachable;  // the peers it could not reach

  bool operator==(const SelfCheckReport&) const = default;
};

// A heartbeat, which may wait for the world to change.
struct HeartbeatParams {
  std::string worker_id;
  uint64_t incarnation = 0;
  int64_t known_generation = 0;
  JobState known_state = JobState::kForming;
  absl::Duration wait;  // capped at a quarter lease; zero replies at once
  // The generation in which this worker's training paused for a re-formation (0: not paused).
  int64_t paused_generation = 0;
  TrainingActivity activity;
  std::vector<PeerProbe> probed;  // an isolated standby's answer to the probe it was asked for

  bool operator==(const HeartbeatParams&) const = default;
};

// A worker leaving the job, as its process ends.
struct LeaveParams {
  std::string worker_id;
  uint64_t incarnation = 0;
  std::string reason;
  // The process exits with an error (its training failed, say): counts towards the job's
  // --max-worker-failures.
  bool failed = false;

  bool operator==(const LeaveParams&) const = default;
};

struct JoinOutcome {
  int rank = -1;
  World world;

  bool operator==(const JoinOutcome&) const = default;
};

// The coordinator's answer to a join: the rank (-1: a standby) and the world, and how the
// worker keeps its lease.
struct JoinReply {
  JoinOutcome outcome;
  absl::Duration lease;
  absl::Duration heartbeat_interval;  // a quarter lease: how often to heartbeat
  TrainingStartPoint start;

  bool operator==(const JoinReply&) const = default;
};

struct HeartbeatOutcome {
  World world;
  int rank = -1;      // -1 for a standby
  bool stop = false;  // the job stops, or this worker was taken out: leave
  std::string stop_reason;
  // An isolated standby: the members to connect to, reported in the next heartbeat.
  std::vector<PeerProbe> probe;

  bool operator==(const HeartbeatOutcome&) const = default;
};

struct HeartbeatReply {
  HeartbeatOutcome outcome;
  StepOrders orders;  // of the reply's generation
  TrainingStartPoint start;

  bool operator==(const HeartbeatReply&) const = default;
};

// Timings of one training step on one rank.
struct StepReport {
  int64_t step = 0;
  double step_ms = 0;
  double backward_ms = 0;
  double communication_ms = 0;
  double hidden_ms = 0;
  std::vector<int64_t> bucket_bytes;
  double loss = 0;
  int64_t held_bytes = 0;  // model state the rank holds
  int gathered_units = 0;  // ZeRO-3: buckets gathered at once, at most
  double gather_wait_ms = 0;

  bool operator==(const StepReport&) const = default;
};

// A rank's shard of a checkpoint is on disk (or could not be written).
struct ShardReport {
  std::string worker_id;
  uint64_t incarnation = 0;
  int64_t generation = 0;  // of the world whose ranks saved it
  int rank = 0;            // filled in by the coordinator from the membership
  std::string id;
  int64_t step = 0;
  int64_t request = 0;  // the save request it satisfies (0: periodic)
  int64_t plan_version = 0;
  std::string plan_hash;
  ShardRecord record;
  double pause_ms = 0;
  double write_ms = 0;
  std::string error;  // the rank could not write its shard
  // Rank 0: the save was not written at all, and why (a periodic one skipped while the one
  // before was still being written); the rest of the report is the save's.
  std::string skipped;
  TrainingCounters counters;
  OptimizerStateKind state;

  bool operator==(const ShardReport&) const = default;
};

struct SaveProgress {
  int shards_done = 0;
  int world_size = 0;
  uint64_t bytes_done = 0;
  std::string committed_id;  // once a checkpoint satisfying the request is committed
  std::string error;         // the save failed or was cancelled

  bool operator==(const SaveProgress&) const = default;
};

struct SelfCheckRecord {
  SelfCheckState state = SelfCheckState::kPending;
  int64_t generation = 0;
  std::string detail;

  bool operator==(const SelfCheckRecord&) const = default;
};

// What an operator asks first about training (shardctl status): where it is, how fast it goes,
// what is saved.
struct TrainingProgress {
  int64_t step = 0;   // the latest step a rank finished (the restored checkpoint's before any)
  int64_t steps = 0;  // the job's total; 0 when the coordinator runs no job
  std::optional<double> loss;   // global loss at `step`, once this coordinator heard of a step
  double steps_per_second = 0;  // over the last reports of this generation; 0 until two
  std::optional<absl::Duration> eta;  // at that rate
  std::string last_checkpoint;        // the newest committed checkpoint; empty if none
  int64_t last_checkpoint_step = 0;
  std::optional<absl::Duration> last_checkpoint_age;
  double overlap_fraction = 0;  // communication hidden behind backward over the last steps
  // In-memory snapshots: the newest a restore could use now, the copies of its least-copied
  // shard, and how far the newest taken is from being fully replicated.
  std::string last_snapshot;
  int64_t last_snapshot_step = 0;
  std::optional<absl::Duration> last_snapshot_age;
  int last_snapshot_copies = 0;
  int64_t replica_lag_steps = 0;
  std::optional<absl::Duration> replica_lag;
  // Saves since the newest commit that failed (a full disk, EIO) or were skipped (a periodic
  // save while the previous one was still being written), and the latest of each: its
  // checkpoint id, what happened, and how long ago.
  int64_t checkpoint_failures = 0;
  std::string last_checkpoint_failure;
  std::optional<absl::Duration> last_checkpoint_failure_age;
  int64_t checkpoints_skipped = 0;
  std::string last_checkpoint_skip;

  bool operator==(const TrainingProgress&) const = default;
};

struct WorkerSnapshot {
  std::string id;
  int rank = -1;  // -1 once departed
  std::string host;
  std::string device;
  std::vector<std::string> capabilities;
  WorkerState state = WorkerState::kJoining;
  absl::Duration since_heartbeat;
  SelfCheckRecord self_check;
  int64_t joined_generation = 0;
  std::string unreachable;  // a standby kept out because peers could not reach it: why

  bool operator==(const WorkerSnapshot&) const = default;
};

}  // namespace shard
