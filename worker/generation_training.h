// The training of one generation of a job on its connected communicator, as shard-worker runs it:
// restore where the coordinator says, train, report every restore, step, checkpoint shard and
// snapshot shard to the coordinator, and at the end the result. The worker agent (agent.h)
// connects and self-checks the generation before, and decides after what its end means.
//
// Used from the agent's thread, one generation at a time.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/control_types.h"
#include "common/job_spec.h"
#include "common/snapshot.h"
#include "worker/coordinator_client.h"
#include "worker/dataplane/communicator.h"
#include "worker/dataplane/device.h"
#include "worker/dataplane/plan_provider.h"
#include "worker/dataplane/snapshot_store.h"
#include "worker/dataplane/training_activity.h"
#include "worker/dataplane/training_session.h"

namespace shard {

// What the ranks of a generation published when they connected, by rank.
struct GenerationPeers {
  std::vector<std::string> hosts;             // each one's --host
  std::vector<std::string> snapshot_servers;  // empty without snapshots
};

class GenerationTraining {
 public:
  // Trains one generation (WorkerOptions::trainer): trained, paused or an error.
  using Trainer = std::function<absl::StatusOr<TrainResult>(
      const JobConfig&, Communicator&, PlanProvider&, const TrainerOptions&)>;

  // What stays the same from one generation to the next. Pointers are not owned and outlive
  // this object.
  struct Options {
    CoordinatorClient* client = nullptr;
    std::string worker_id;
    uint64_t incarnation = 0;
    // How long to keep reporting the end of training while the coordinator is unreachable.
    absl::Duration coordinator_timeout;
    // The bounds of the collective timeout derived from the step times (WorkerOptions); the
    // ceiling is also how long a rank waits for a rebuilt plan.
    absl::Duration collective_timeout;
    absl::Duration collective_timeout_floor;
    Trainer trainer;  // unset: the built-in MLP (TrainMlp)
    Device* device = nullptr;
    SnapshotStore* snapshots = nullptr;  // what this process holds of the job's snapshots
    // Replicas for buddies on this host are copied into buffers they lend (snapshot_peer.h).
    bool snapshot_same_host = true;
    ActivityTracker* activity = nullptr;  // for the coordinator's progress lease
    const std::atomic<bool>* stop = nullptr;  // set once the worker stops
    // Set once the generation being trained ends: cancels reads of a snapshot from peers.
    const std::atomic<bool>* generation_over = nullptr;
    // The coordinator's orders for the step boundaries, as this worker knows them now.
    std::function<StepOrders()> orders;
    // Tells the coordinator about a snapshot shard this worker now holds and those it dropped.
    std::function<void(const SnapshotShard&, const std::vector<std::string>& dropped)> on_snapshot;
  };

  // One generation to train: this rank's, on its connected communicator.
  struct Generation {
    int64_t generation = 0;
    int rank = 0;
    Communicator* communicator = nullptr;
    v1::TrainingStart start;  // where the coordinator says training starts
    const GenerationPeers* peers = nullptr;
  };

  enum class End { kFinished, kPaused };

  explicit GenerationTraining(Options options);

  // FailedPrecondition unless this worker trains the kind of model `job` names: a model the
  // workers bring (the training script's, through Options::trainer) or the built-in MLP.
  absl::Status CheckModel(const JobConfig& job) const;

  // Trains `job` in `generation`. kFinished once the coordinator has the result; kPaused when the
  // world re-forms from the checkpoint just saved. Errors: Cancelled once the worker stops,
  // Aborted when the generation ended, else what failed (training, or reporting its end).
  absl::StatusOr<End> Train(const JobConfig& job, const Generation& generation);

 private:
  // Reports the finished training, waiting for a coordinator that is restarting.
  absl::Status ReportDone(const TrainResult& result);

  const Options options_;
};

}  // namespace shard
