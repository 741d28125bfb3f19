// Trains the built-in MLP of a job on one rank: data slicing, forward, backward into the
// engine's buckets, the sharded step, the global loss, and at the end the consolidated
// parameters in output_dir/final.safetensors (written by rank 0).
#pragma once

#include <atomic>
#include <functional>
#include <string>

#include "absl/status/statusor.h"
#include "common/control_types.h"
#include "common/job_spec.h"
#include "worker/dataplane/checkpoint_saver.h"
#include "worker/dataplane/communicator.h"
#include "worker/dataplane/device.h"
#include "worker/dataplane/engine.h"
#include "worker/dataplane/plan_provider.h"

namespace shard {

struct StepRecord {
  int64_t step = 0;       // 1-based
  double loss = 0;        // mean cross-entropy over the global batch
  double step_ms = 0;     // wall time of the whole step on this rank
  StepTimings timings;
  int64_t plan_version = 0;
  double checkpoint_pause_ms = 0;  // when this step ended with a checkpoint
};

struct TrainResult {
  int64_t start_step = 0;  // steps already done before this run (restored from a checkpoint)
  int64_t steps = 0;
  double first_loss = 0;
  double last_loss = 0;
  // Over steps 2..N (the first step also plans and rebuilds the buckets).
  double steps_per_second = 0;
  double hidden_fraction = 0;  // of gradient-reduction time that overlapped backward
  int64_t optimizer_state_bytes = 0;  // on this rank
  std::string output_path;            // rank 0 only
  int checkpoints_saved = 0;
  int64_t paused_at = 0;  // the step after which training paused for a re-formation; 0: it did not
  double max_checkpoint_pause_ms = 0;  // the longest training stall of a save
};

struct TrainerOptions {
  // Where the model, its buffers and the update run (not owned; null: the host); the
  // communicator's buffers must be its memory. The job's precision must be one it runs.
  Device* device = nullptr;
  // Called after every step (e.g. to log and report to the coordinator).
  std::function<void(const StepRecord&)> on_step;
  // Polled between steps; training stops with Cancelled once it is set.
  const std::atomic<bool>* stop = nullptr;

  // Checkpoints (see common/checkpoint.h). Restore from this committed checkpoint directory
  // before training: training continues with the step after the checkpoint's.
  std::string restore_dir;
  // The orders from the coordinator this rank knows of now (common/control_types.h), polled at
  // every step boundary; only orders of `generation` count. All ranks save at the first
  // boundary at which any of them knows a request newer than the last one saved, and pause
  // after a pausing one (they agree through one small all-reduce per step; common/
  // step_boundary.h decides). A pause returns with TrainResult::paused_at: the world is about
  // to re-form and restore that checkpoint. Periodic saves need no orders.
  std::function<StepOrders()> orders;
  int64_t generation = 0;
  // Appended to checkpoint ids (e.g. "g7"), so that a restored run never reuses an id.
  std::string checkpoint_tag;
  // Called from the writer thread when this rank's shard is on disk (or failed).
  std::function<void(const SavedShard&)> on_checkpoint;
  // After the last step: consolidate parameters and optimizer state onto this rank, which
  // writes them to `consolidate_path` (Engine::ConsolidateStateDict). -1: no.
  int consolidate_to_rank = -1;
  std::string consolidate_path;
};

absl::StatusOr<TrainResult> TrainMlp(const JobConfig& job, Communicator& communicator,
                                     PlanProvider& plans, const TrainerOptions& options = {});

// Writes the model's parameters (full tensors, manifest names) as safetensors.
absl::Status WriteParameters(Engine& engine, const std::string& path);

}  // namespace shard
