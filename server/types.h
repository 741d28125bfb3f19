// Value types the coordinator's managers share. Managers are peers: each includes this header
// (and common/), never another manager's; CoordinatorCore wires them together.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/control_types.h"
#include "common/manifest.h"
#include "common/plan.h"
#include "shard/v1/state.pb.h"

namespace shard {

// A member of the running world, as the plan and checkpoint managers need to know it.
struct MemberRef {
  std::string worker_id;
  int rank = -1;
  int64_t generation = 0;
  int world_size = 0;
};

using HeartbeatCallback = std::function<void(absl::StatusOr<HeartbeatOutcome>)>;

struct StatusSnapshot {
  std::string job;
  World world;
  absl::Duration lease;
  std::vector<WorkerSnapshot> workers;  // by rank, then standbys, leaving, departed (latest first)
};

// A change of the world's members that a reshape proposes and ApplyReshape carries out.
struct Reshape {
  int64_t generation = 0;             // of the world it was computed for
  std::vector<std::string> leavers;   // active workers taken out
  std::vector<std::string> promoted;  // standbys folded in
  std::vector<std::string> demoted;   // active workers that become standbys (no allowed size
                                      // holds them)
  int from_size = 0;
  int to_size = 0;
  std::string reason;  // resize, drain, standbys
};

// Whether worker `id` with incarnation `incarnation` is a live member now.
using IsLiveMember = std::function<bool(const std::string& id, uint64_t incarnation)>;

// The events after a watch's sequence number (none if its wait ran out), or why the watch ended.
using EventsCallback = std::function<void(absl::StatusOr<std::vector<v1::MembershipEvent>>)>;

// Where the shards of a generation's memory restore point are, as its workers ask.
struct RestoreSnapshotView {
  std::string id;
  std::string manifest_json;  // common/checkpoint.h CheckpointManifest
  std::vector<std::vector<SnapshotHolder>> holders;  // by rank of the snapshot's world
};

// The current plan of a generation, as workers and checkpoints use it.
struct PlanView {
  std::shared_ptr<const Plan> plan;
  std::shared_ptr<const Manifest> manifest;
  int64_t version = 0;
  int64_t generation = 0;
  OverlapStatus status = OverlapStatus::kUninitialized;
};

}  // namespace shard
