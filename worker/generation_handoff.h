// Hands each generation of a job from the worker agent's thread to the thread that runs the
// model's own training loop (a PyTorch script through capi/), and its result back: the agent
// connects and self-checks a generation as always, then, instead of training the built-in MLP,
// offers the generation here and waits until the training thread returns it trained, paused or
// failed (Aborted when the generation ended under it: the agent then waits for the next one).
//
//   agent thread:     WorkerOptions::trainer = [&](...) { return handoff.Train(...); }
//   training thread:  while (auto generation = handoff.Next(); ...) { train; handoff.Return(r); }
//
// Thread-safe.
#pragma once

#include <optional>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/job_spec.h"
#include "worker/dataplane/communicator.h"
#include "worker/dataplane/plan_provider.h"
#include "worker/dataplane/training_session.h"

namespace shard {

class GenerationHandoff {
 public:
  // One generation as the training thread sees it: valid until it is returned.
  struct Generation {
    const JobConfig* job = nullptr;
    Communicator* communicator = nullptr;
    PlanProvider* plans = nullptr;
    const TrainerOptions* options = nullptr;
  };

  // The agent's side (its WorkerOptions::trainer): offers the generation and waits until the
  // training thread returns it, or until Close (then Cancelled, with Close's reason).
  absl::StatusOr<TrainResult> Train(const JobConfig& job, Communicator& communicator,
                                    PlanProvider& plans, const TrainerOptions& options);

  // The training thread's side: waits for the next generation. Once the agent ended (Close),
  // nullopt when it ended well (the job is over) and its error otherwise.
  absl::StatusOr<std::optional<Generation>> Next();
  // Hands the generation taken by Next back to the agent.
  void Return(absl::StatusOr<TrainResult> result);

  // No more generations: the agent ended with `why` (OK: the job is over), or the training
  // thread gives up. Wakes both sides.
  void Close(absl::Status why);

 private:
  absl::Mutex mu_;
  std::optional<Generation> offered_ ABSL_GUARDED_BY(mu_);
  bool taken_ ABSL_GUARDED_BY(mu_) = false;
  std::optional<absl::StatusOr<TrainResult>> returned_ ABSL_GUARDED_BY(mu_);
  std::optional<absl::Status> closed_ ABSL_GUARDED_BY(mu_);
};

}  // namespace shard
