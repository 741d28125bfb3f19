// The progress lease (docs/recovery.md): a rank that heartbeats but finishes no step while its
// peers wait on it (a hung kernel, a deadlocked data loader, a stalled disk) is stuck, and is named
// and evicted like a dead worker. How long "no step" may last derives from the measured step time,
// as do the workers' collective timeouts: factor x the p99 step time, within a floor and a ceiling.
// Pure functions: the coordinator and the simulation decide alike.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "common/control_types.h"

namespace shard {

// The value at quantile `q` (0..1, nearest rank) of `values`; 0 for none.
double Quantile(std::vector<double> values, double q);

// factor x `typical_step`, within [floor, ceiling].
absl::Duration DerivedTimeout(absl::Duration typical_step, double factor, absl::Duration floor,
                              absl::Duration ceiling);

// What a rank of the world last said of its training, and when the coordinator heard it.
struct RankProgress {
  std::string worker_id;
  uint64_t incarnation = 0;
  int rank = 0;
  TrainingActivity activity;
  absl::Time reported;
};

struct Stall {
  // The ranks outside every collective while others wait in one for them: those holding the job
  // up. Empty when that cannot be told (every rank waits in a collective, or none does).
  std::vector<RankProgress> stuck;
  int64_t step = 0;        // the step not finished
  absl::Duration stalled;  // how long the job has finished no step
  // "rank 2 (worker w7) has not finished step 812 for 14s; median step 80 ms"
  std::string description;
};

// Whether the world of `generation` (`world_size` ranks, every one of them training in it, as
// `ranks` say) has finished no step for longer than `lease`, and who holds it up. `median_step`
// is for the description.
std::optional<Stall> FindStall(const std::vector<RankProgress>& ranks, int world_size,
                               int64_t generation, absl::Duration lease,
                               absl::Duration median_step, absl::Time now);

}  // namespace shard
