// Carries out the world changes that must not lose a step: a resize, a drain, standbys folded
// into a world smaller than its target. WorldManager says what must change (PendingReshape);
// this asks the workers for a checkpoint that pauses training at the next step boundary, and
// once it is committed re-forms the world (WorldManager::ApplyReshape) with that checkpoint as
// the next generation's starting point, so training continues exactly where it paused. Before
// training starts (or without a training job) the change is applied at once.
//
// No gRPC; the coordinator calls Reconcile from its housekeeping and after admin calls.
// Thread-safe.
#pragma once

#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/checkpoint_manager.h"
#include "server/world_manager.h"

namespace shard {

class ElasticManager {
 public:
  // `checkpoints` is null when the coordinator runs no training job.
  ElasticManager(WorldManager* world, CheckpointManager* checkpoints)
      : world_(world), checkpoints_(checkpoints) {}

  // Starts or finishes the pending change, if any. Returns true if it changed something the
  // workers must hear about at once (a pause request, a re-formation).
  bool Reconcile(absl::Time now);

  // What the change in progress waits for, for status ("" when none is in progress).
  std::string transition() const;

 private:
  struct InFlight {
    Reshape reshape;
    int64_t request = 0;  // the pausing save request
    absl::Time since;
  };

  WorldManager* const world_;
  CheckpointManager* const checkpoints_;
  mutable absl::Mutex mu_;
  std::optional<InFlight> in_flight_ ABSL_GUARDED_BY(mu_);
};

}  // namespace shard
