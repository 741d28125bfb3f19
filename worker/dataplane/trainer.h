// Trains the built-in MLP of a job on one rank: data slicing, forward, and backward into the
// engine's buckets, over a TrainingSession (the sharded step, the global loss, checkpoints, and
// at the end the parameters in output_dir/final.safetensors, written by rank 0).
#pragma once

#include "absl/status/statusor.h"
#include "common/job_spec.h"
#include "worker/dataplane/communicator.h"
#include "worker/dataplane/plan_provider.h"
#include "worker/dataplane/training_session.h"

namespace shard {

absl::StatusOr<TrainResult> TrainMlp(const JobConfig& job, Communicator& communicator,
                                     PlanProvider& plans, const TrainerOptions& options = {});

}  // namespace shard
