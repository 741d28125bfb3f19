// What every rank of a generation does at the boundary after a step, once the ranks agreed on
// the newest orders any of them knows (the trainer all-reduces them with max): save a
// checkpoint (periodic, or for a request newer than the last one saved) and pause after it for
// a re-formation. One function, so the trainer and the control plane's simulation decide alike.
#pragma once

#include <cstdint>

#include "common/control_types.h"

namespace shard {

struct StepBoundary {
  bool save = false;
  int64_t request = 0;  // the newest request the save satisfies (0: periodic only)
  bool pause = false;   // stop training after the save: the world is about to re-form
};

// `step`: steps completed (1-based, the one just finished) of `total_steps`; `every`: the job's
// periodic checkpoint interval (0: none); `satisfied`: the newest request this run saved for,
// updated. No pause after the last step: the job is done then anyway.
StepBoundary DecideStepBoundary(int64_t step, int64_t total_steps, int64_t every,
                                const StepOrders& agreed, int64_t* satisfied);

}  // namespace shard
