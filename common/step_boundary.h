// What every rank of a generation does at the boundary after a step, once the ranks agreed on
// the newest orders any of them knows (the trainer all-reduces them with max): save a disk
// checkpoint (periodic, or for a request newer than the last one saved), take an in-memory
// snapshot (periodic, or for a pause), and pause after it for a re-formation. One function, so
// the trainer and the control plane's simulation decide alike.
#pragma once

#include <cstdint>

#include "common/control_types.h"

namespace shard {

struct StepBoundaryRules {
  int64_t total_steps = 0;
  int64_t checkpoint_every = 0;  // disk checkpoints; 0: only when requested
  int64_t snapshot_every = 0;    // memory snapshots; 0: none
};

// What the ranks remember from one boundary to the next (the same on every rank).
struct StepBoundaryState {
  int64_t satisfied = 0;           // the newest save request a disk checkpoint was taken for
  int64_t last_snapshot_step = 0;  // the step of the last snapshot (or where training started)
  int64_t snapshotted_pause = 0;   // the newest pause request a snapshot was taken for
};

// What some rank still has in flight from earlier boundaries (agreed like the orders).
struct BoundaryWork {
  bool snapshots_busy = false;  // replicating its previous snapshot
  int64_t saving_step = 0;      // writing its shard of the disk checkpoint of this step; 0: none
};

struct StepBoundary {
  bool save = false;             // write a disk checkpoint
  int64_t request = 0;           // the newest save request it satisfies (0: periodic only)
  bool snapshot = false;         // take a memory snapshot
  int64_t snapshot_request = 0;  // the pause request it answers (0: periodic)
  bool pause = false;            // stop training after it: the world is about to re-form
  // A periodic disk checkpoint was due here but a rank still writes the previous one: skipped.
  bool save_skipped = false;
};

// `step`: steps completed (1-based, the one just finished). `snapshots_busy`: some rank is still
// replicating its previous snapshot (agreed like the orders): a periodic snapshot waits for the
// first boundary after its step at which none is, so training never waits for replication; a
// pausing one is taken anyway (the trainer waits). A pause in memory (orders.pause_in_memory) is
// answered by a snapshot, otherwise by a disk checkpoint. No pause after the last step: the job is
// done then anyway.
//
// A disk checkpoint is never started while a rank still writes the previous one
// (`work.saving_step`; the trainer first waits a bounded time for that write, then the ranks
// agree again): a periodic save due then is skipped (save_skipped; the next is due
// `checkpoint_every` steps later), and a requested one, or the pause after it, is taken at the
// first boundary at which no rank is writing. So saves never queue up behind a slow disk
// (docs/checkpoints.md, "When the disk fails").
StepBoundary DecideStepBoundary(int64_t step, const StepBoundaryRules& rules,
                                const StepOrders& agreed, const BoundaryWork& work,
                                StepBoundaryState* state);
// Whether a disk checkpoint is due at `step` (periodic, or a request not yet saved for).
bool SaveDue(int64_t step, const StepBoundaryRules& rules, const StepOrders& agreed,
             const StepBoundaryState& state);
// The same with no disk checkpoint in flight.
StepBoundary DecideStepBoundary(int64_t step, const StepBoundaryRules& rules,
                                const StepOrders& agreed, bool snapshots_busy,
                                StepBoundaryState* state);

}  // namespace shard
