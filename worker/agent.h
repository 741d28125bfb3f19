// The worker process's life: join the coordinator, keep the lease alive, build the data path
// for each generation of the world, self-check it, and leave cleanly when told to.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/control_types.h"
#include "common/job_spec.h"
#include "common/manifest.h"
#include "worker/coordinator_client.h"
#include "worker/data_path.h"
#include "worker/dataplane/communicator.h"
#include "worker/dataplane/plan_provider.h"
#include "worker/dataplane/snapshot_peer.h"
#include "worker/dataplane/snapshot_store.h"
#include "worker/dataplane/training_activity.h"
#include "worker/dataplane/training_session.h"
#include "worker/generation_training.h"
#include "worker/peer_probe.h"

namespace shard {

struct WorkerOptions {
  std::string worker_id;
  std::string host = "127.0.0.1";  // where peers reach this worker's data path
  std::string device = "cpu";  // as announced to the coordinator; the data path runs it
  std::optional<int> rank;          // unset: the coordinator picks
  // Where this worker serves the snapshots it holds to its peers (on `host`; 0: any free port).
  int snapshot_port = 0;
  // How long to keep trying while the coordinator cannot be reached (at start and later).
  absl::Duration coordinator_timeout = absl::Seconds(60);
  // A collective waiting longer than this for a peer fails: the ceiling of the timeout derived
  // from the measured step times (20 x p99), whose floor is collective_timeout_floor.
  absl::Duration collective_timeout = absl::Seconds(60);
  absl::Duration collective_timeout_floor = absl::Seconds(30);
  // The most a connect probe to a peer may take (at rendezvous, every rank probes every peer
  // before its data path connects; an isolated standby probes the world's members). The
  // deadline is derived from the connect times measured: 50 x the slowest, at least 1s and at
  // most this.
  absl::Duration connect_probe_timeout = absl::Seconds(5);
  size_t self_check_elements = 1 << 16;
  // Without a training job from the coordinator: a parameter manifest to plan for. No model
  // runs, so the gradient order reported after the "first iteration" is that of a sequential
  // backward.
  std::optional<Manifest> manifest;
  // Trains one generation of a job on the agent's thread and returns trained, paused (with
  // TrainResult::paused_at) or an error (Aborted: the generation ended). Unset: the built-in MLP
  // (TrainMlp). A job whose model is external (model.external) needs one: GenerationHandoff
  // (worker/generation_handoff.h) hands the generation to the thread that runs the model.
  GenerationTraining::Trainer trainer;
};

class WorkerAgent {
 public:
  WorkerAgent(WorkerOptions options, std::unique_ptr<CoordinatorClient> client,
              std::unique_ptr<DataPath> data_path);

  // Runs until the coordinator orders a stop or RequestStop() is called (then OK, after
  // leaving), or until an unrecoverable error (returned).
  absl::Status Run();

  // Thread-safe; e.g. from a signal thread.
  void RequestStop(const std::string& reason);

 private:
  struct WorldSnapshot {
    int64_t generation = 0;
    int rank = -1;
    int world_size = 0;
    v1::JobState state = v1::JOB_STATE_UNSPECIFIED;
    bool running = false;
    v1::RendezvousScope scope;
  };

  absl::Status JoinWithRetry();
  void HeartbeatLoop();
  // Applies a world seen in a join or heartbeat reply.
  void UpdateWorld(const v1::WorldView& world, int rank) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // One generation of `world` for this rank: Connect, Check, Train. Aborted if the generation
  // moved on.
  absl::Status RunGeneration(const WorldSnapshot& world);
  // What connecting a generation yields.
  struct Connected {
    std::optional<JobConfig> job;  // the coordinator's, as it was when connecting
    GenerationPeers peers;
  };
  // Rendezvous: publishes this rank's host and snapshot server, probes the peers, creates the
  // communicator (communicator_) and collects what the peers published.
  absl::StatusOr<Connected> Connect(const WorldSnapshot& world);
  // Self-checks the communicator and reports the outcome to the coordinator.
  absl::Status Check(const WorldSnapshot& world);
  // Trains the job on the checked communicator (training_), or without a job applies the plan
  // of options_.manifest.
  absl::Status Train(const WorldSnapshot& world, const Connected& connected);
  // Registers the manifest, applies the plan, and after the first iteration the rebuilt one.
  absl::Status ApplyPlan();
  // Tells the coordinator which snapshot shards this worker now holds and dropped; if it cannot,
  // everything held is told again before the next heartbeat.
  void ReportHeld(const std::vector<SnapshotShard>& held, const std::vector<std::string>& dropped);
  // After the coordinator was away (it may have restarted and lost what it knew): everything
  // this worker holds, told again before its next heartbeat.
  void ReportAllHeldIfNeeded();
  // Tells the coordinator that the data path of `world`'s generation failed with `why`, and the
  // peers this rank could not reach, so that it ends the generation (a failed self-check does);
  // nothing if it is over already.
  void ReportGenerationFailed(const WorldSnapshot& world, const absl::Status& why);
  // Probes every peer of `world` (their addresses from the rendezvous store) before the data
  // path connects: Unavailable, with the peers it could not reach in link_faults_, if any.
  absl::Status ProbePeers(const WorldSnapshot& world, RendezvousClient& rendezvous);
  // The coordinator answered a call sent at `sent_at`: the lease runs from there.
  void NoteContact(absl::Time sent_at) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Stops training once the coordinator has not answered for a lease: by then it counts this
  // worker dead (if it is there at all), so whatever this rank trains can never be committed,
  // and a world that replaced it may be training already.
  void CoordinatorLeaseWatch();
  // Whether `generation` is still this worker's, asked of the coordinator now (a heartbeat that
  // does not wait): right after a long SIGSTOP the heartbeat thread may not have heard yet that
  // the worker was declared dead and the world moved on. While the coordinator does not answer
  // it asks again, until it does or the heartbeat thread gives up on it.
  bool GenerationStillMine(int64_t generation);
  void SetStop(const std::string& reason) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Fail(absl::Status status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Leave();

  const WorkerOptions options_;
  const std::unique_ptr<CoordinatorClient> client_;
  const std::unique_ptr<DataPath> data_path_;
  const uint64_t incarnation_;

  absl::Mutex mu_;
  WorldSnapshot world_ ABSL_GUARDED_BY(mu_);
  absl::Duration heartbeat_interval_ ABSL_GUARDED_BY(mu_) = absl::Seconds(1);
  absl::Duration lease_ ABSL_GUARDED_BY(mu_) = absl::Seconds(10);  // the coordinator's
  // When the last call the coordinator answered was sent; whether it has been silent for a
  // lease since (training stopped), and how many times it came back after that.
  absl::Time last_contact_ ABSL_GUARDED_BY(mu_);
  bool cut_off_ ABSL_GUARDED_BY(mu_) = false;
  int64_t contact_epoch_ ABSL_GUARDED_BY(mu_) = 0;
  // The peers this rank could not connect to at the generation it connects (its probe).
  std::vector<PeerFault> link_faults_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::string stop_reason_ ABSL_GUARDED_BY(mu_);
  absl::Status fatal_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<Communicator> communicator_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<RendezvousClient> rendezvous_ ABSL_GUARDED_BY(mu_);  // while connecting
  int64_t rendezvous_generation_ ABSL_GUARDED_BY(mu_) = 0;            // the one it connects
  std::optional<JobConfig> job_ ABSL_GUARDED_BY(mu_);  // from the coordinator, at join
  std::atomic<bool> stop_requested_{false};             // stop_, for the training loop
  // Probes the peers (at a rendezvous; as an isolated standby); a stop cancels its probes.
  PeerProber prober_;
  // The coordinator's orders for the step boundaries of the world's generation.
  StepOrders orders_ ABSL_GUARDED_BY(mu_);
  // The generation in which training paused for a re-formation (0: not paused): heartbeats
  // say so, and the coordinator ends that generation.
  int64_t paused_generation_ ABSL_GUARDED_BY(mu_) = 0;
  v1::TrainingStart start_ ABSL_GUARDED_BY(mu_);         // where this generation's training starts
  int64_t communicator_generation_ ABSL_GUARDED_BY(mu_) = 0;
  // What this process holds of the job's snapshots (its own shards and its buddies'), across
  // generations, and the server its peers read them from.
  SnapshotStore snapshots_;
  std::unique_ptr<SnapshotServer> snapshot_server_;
  bool report_all_held_ ABSL_GUARDED_BY(mu_) = false;
  // Set when the generation being trained ends (or a stop): cancels reads from peers.
  std::atomic<bool> generation_over_{false};
  // What this rank's training is doing, for the coordinator's progress lease.
  ActivityTracker activity_;
  // Set once Run returns: a forced exit for a hung training thread is off then.
  std::shared_ptr<std::atomic<bool>> finished_ = std::make_shared<std::atomic<bool>>(false);
  // Trains each generation of the job; its options point at the members above.
  GenerationTraining training_;
};

}  // namespace shard
