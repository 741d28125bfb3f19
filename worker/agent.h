// The worker process's life: the I/O shell around WorkerCore (common/worker_core.h), which
// decides the protocol. It sends the core's calls over gRPC on its threads (the heartbeat
// chain, the coordinator's lease watch, the generations), and builds, self-checks and trains
// the data path of each generation the core hands it.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/control_types.h"
#include "common/job_spec.h"
#include "common/manifest.h"
#include "common/worker_core.h"
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
#include "worker/snapshot_reporter.h"

namespace shard {

struct WorkerOptions {
  std::string worker_id;
  std::string host = "127.0.0.1";  // where peers reach this worker's data path
  std::string device = "cpu";  // as announced to the coordinator; the data path runs it
  std::optional<int> rank;          // unset: the coordinator picks
  // Where this worker serves the snapshots it holds to its peers (on `host`; 0: any free port).
  int snapshot_port = 0;
  // Replicas for buddies on this host are copied into shared buffers they lend, not sent over
  // TCP (false with --transport tcp: everything between ranks over TCP, as across hosts).
  bool snapshot_same_host = true;
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
  // Joins (again), from the core's `step`; the step after it: kHeartbeat once joined, kEnd.
  WorkerStep Join(WorkerStep step);
  // The core's join and heartbeat chain, and after it the isolated standby's probes.
  void HeartbeatLoop(WorkerStep step);
  // One generation for this rank: Connect, Check, Train. Aborted if the generation moved on.
  absl::Status RunGeneration(const GenerationAssignment& generation);
  // What connecting a generation yields.
  struct Connected {
    std::optional<JobConfig> job;  // the coordinator's, as it was when connecting
    GenerationPeers peers;
  };
  // Rendezvous: publishes this rank's host and snapshot server, probes the peers, creates the
  // communicator (communicator_) and collects what the peers published.
  absl::StatusOr<Connected> Connect(const GenerationAssignment& generation);
  // Self-checks the communicator and reports the outcome to the coordinator.
  absl::Status Check(const GenerationAssignment& generation);
  // Trains the job on the checked communicator (training_), or without a job applies the plan
  // of options_.manifest.
  absl::Status Train(const GenerationAssignment& generation, const Connected& connected);
  // Registers the manifest, applies the plan, and after the first iteration the rebuilt one.
  absl::Status ApplyPlan();
  // After a generation ended: what the core makes of it, and the coordinator asked whether it
  // is still this worker's where the core needs to know.
  void GenerationEnded(const GenerationAssignment& generation, const absl::Status& status);
  // Tells the coordinator which snapshot shards this worker now holds and dropped; if it cannot,
  // everything held is told again before the next heartbeat.
  void ReportHeld(const std::vector<SnapshotShard>& held, const std::vector<std::string>& dropped);
  // After the coordinator was away (it may have restarted and lost what it knew): everything
  // this worker holds, told again before its next heartbeat.
  void ReportAllHeldIfNeeded();
  // Probes every peer of `generation` (their addresses from the rendezvous store) before the
  // data path connects: Unavailable, with the peers it could not reach in link_faults_, if any.
  absl::Status ProbePeers(const GenerationAssignment& generation, RendezvousClient& rendezvous);
  // Stops training once the coordinator has not answered for a lease (WorkerCore::LeaseExpiry).
  void CoordinatorLeaseWatch();
  // Carries out what the core decided that needs no call: aborts the data path of ended
  // generations, and a stop. The caller sends step.report_failure (SendFailureReport).
  void Apply(const WorkerStep& step) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Feeds the core an event (`event` calls one of its On... methods), applies the step it
  // returns and logs the world if the event changed it.
  WorkerStep Feed(absl::FunctionRef<WorkerStep()> event) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A heartbeat, its reply in domain terms.
  absl::StatusOr<HeartbeatReply> Heartbeat(const v1::HeartbeatRequest& request);
  void SendFailureReport(const std::optional<SelfCheckReport>& report);
  bool Ended() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return core_.ended(); }
  void Leave();

  const WorkerOptions options_;
  const std::unique_ptr<CoordinatorClient> client_;
  const std::unique_ptr<DataPath> data_path_;
  const uint64_t incarnation_;

  absl::Mutex mu_;
  // The protocol: what the coordinator said, and what to do about it.
  WorkerCore core_ ABSL_GUARDED_BY(mu_);
  std::string job_name_ ABSL_GUARDED_BY(mu_);  // names the rendezvous scope of a generation
  // The peers this rank could not connect to at the generation it connects (its probe).
  std::vector<PeerFault> link_faults_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<Communicator> communicator_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<RendezvousClient> rendezvous_ ABSL_GUARDED_BY(mu_);  // while connecting
  int64_t rendezvous_generation_ ABSL_GUARDED_BY(mu_) = 0;            // the one it connects
  std::optional<JobConfig> job_ ABSL_GUARDED_BY(mu_);  // from the coordinator, at join
  std::atomic<bool> stop_requested_{false};  // the core ended, for the training loop
  // Probes the peers (at a rendezvous; as an isolated standby); a stop cancels its probes.
  PeerProber prober_;
  int64_t communicator_generation_ ABSL_GUARDED_BY(mu_) = 0;
  // What this process holds of the job's snapshots (its own shards and its buddies'), across
  // generations, and the server its peers read them from.
  SnapshotStore snapshots_;
  std::string snapshot_address_;  // snapshot_server_'s, set before anything is reported
  // What this worker holds, told to the coordinator (ReportHeld) in merged reports. It outlives
  // the server and the training, which report to it, and sends what is pending when destroyed.
  SnapshotReporter held_reports_{[this](const std::vector<SnapshotShard>& held,
                                        const std::vector<std::string>& dropped) {
    ReportHeld(held, dropped);
  }};
  std::unique_ptr<SnapshotServer> snapshot_server_;
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
