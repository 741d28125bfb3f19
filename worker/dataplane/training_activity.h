// What a rank's training is doing, for the coordinator's progress lease (common/progress_lease.h):
// the generation it trains in, the step it finished last and when, and how long a collective has
// been in flight on it. A rank stuck outside its collectives (a hung kernel, a deadlocked data
// loader, a stalled disk) shows no collective in flight while its peers show one: that is how the
// coordinator tells it from them.
//
// Thread-safe: the training and communication threads update it, the heartbeat thread reads it.
#pragma once

#include <cstdint>
#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/control_types.h"
#include "worker/dataplane/communicator.h"

namespace shard {

class ActivityTracker {
 public:
  // Training of `generation` begins (before its restore), `step` steps done.
  void Begin(int64_t generation, int64_t step);
  void StepDone(int64_t step);
  // It ended (finished, paused or failed): nothing to report.
  void End();
  void CollectiveStarted();
  void CollectiveEnded();
  // As of now.
  TrainingActivity Read() const;

 private:
  mutable absl::Mutex mu_;
  int64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t step_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time step_at_ ABSL_GUARDED_BY(mu_);
  int in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time in_flight_since_ ABSL_GUARDED_BY(mu_);
};

// `inner`, with every collective (and the wait for them) told to `tracker` as in flight.
std::shared_ptr<Communicator> TrackCollectives(std::shared_ptr<Communicator> inner,
                                               ActivityTracker* tracker);

}  // namespace shard
