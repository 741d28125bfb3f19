// The coordinator without its transport: the managers of one job wired together, the handlers
// the gRPC services call (in domain types), and the housekeeping pass that runs the job-level
// state machine (docs/control-plane.md). CoordinatorServer serves it over gRPC; the
// deterministic simulation test (tests/sim/) drives the same object with a fake clock,
// simulated workers and coordinator restarts.
//
// Every handler that acknowledges a membership change answers only once the change is durable
// in the state store, so no restart forgets what a worker or an operator was told.
//
// Thread-safe. Callbacks may run on the caller's thread or on the state store's writer thread.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/job_spec.h"
#include "server/checkpoint_manager.h"
#include "server/checkpoint_storage.h"
#include "server/elastic_manager.h"
#include "server/kv_store_manager.h"
#include "server/plan_manager.h"
#include "server/snapshot_manager.h"
#include "server/store/state_store.h"
#include "server/types.h"
#include "server/world_manager.h"

namespace shard {

struct CoreOptions {
  // expected_world_size 0: the job's (or, with neither a job nor a size, the live world's kept
  // in the state store).
  WorldOptions world;
  PlanConfig plan;
  // Handed to every joining worker. Unset: the job kept in the state store if one is still
  // live there, else a world without training.
  std::optional<JobConfig> job;
  // With a job: restore the training from this checkpoint ("latest" allowed) when it starts.
  std::string restore;
  // The progress lease (common/progress_lease.h): a rank of a running world that finishes no
  // step for max(floor, factor x p99 step time) (at most ceiling) while its peers wait on it is
  // stuck: evicted, or with `evict_stuck` false only reported. A zero floor turns it off.
  struct ProgressLease {
    absl::Duration floor = absl::Seconds(30);
    double factor = 10;
    absl::Duration ceiling = absl::Minutes(30);
    bool evict_stuck = true;
  } progress;
};

template <typename T>
using Callback = std::function<void(T)>;

class CoordinatorCore {
 public:
  // Loads the store (taking back a live job after a restart, or starting a new world) and
  // creates the managers.
  static absl::StatusOr<std::unique_ptr<CoordinatorCore>> Create(CoreOptions options,
                                                                 StateStore* store,
                                                                 CheckpointStorage* storage,
                                                                 absl::Time now);

  // --- Workers ---
  void Join(const JoinParams& params, absl::Time now, Callback<absl::StatusOr<JoinReply>> done);
  void Heartbeat(const HeartbeatParams& params, absl::Time now,
                 Callback<absl::StatusOr<HeartbeatReply>> done);
  void ReportSelfCheck(const SelfCheckReport& report, absl::Time now,
                       Callback<absl::Status> done);
  void Leave(const LeaveParams& params, absl::Time now, Callback<absl::Status> done);
  absl::StatusOr<PlanView> RegisterManifest(const std::string& worker_id, uint64_t incarnation,
                                            const Manifest& manifest);
  absl::StatusOr<PlanView> AckPlan(const std::string& worker_id, uint64_t incarnation,
                                   int64_t version, const std::string& hash);
  void ReportGradientOrder(const std::string& worker_id, uint64_t incarnation,
                           int64_t plan_version, std::vector<int> order, absl::Duration wait,
                           absl::Time now, PlanManager::PlanCallback done);
  // `generation`: the step's; a report that outlived it (queued across a re-formation) is
  // refused, so that a restore's earlier steps are not hidden by the old generation's.
  absl::Status ReportStepStats(const std::string& worker_id, uint64_t incarnation,
                               int64_t generation, StepReport report, absl::Time now);
  void ReportTrainingDone(const std::string& worker_id, uint64_t incarnation,
                          const std::string& summary, absl::Time now, Callback<absl::Status> done);
  absl::StatusOr<bool> ReportCheckpointShard(ShardReport report, absl::Time now);
  // In-memory snapshots (docs/recovery.md): what a live worker holds and dropped; where the
  // shards of its generation's memory restore point are; and that it restored (or could not).
  absl::Status ReportSnapshot(const SnapshotReport& report, absl::Time now);
  absl::StatusOr<RestoreSnapshotView> GetRestoreSnapshot(const std::string& worker_id,
                                                         uint64_t incarnation, int64_t generation);
  absl::Status ReportRestore(const RestoreReport& report, absl::Time now);

  // --- Operators ---
  StatusSnapshot Status(absl::Time now) const;
  TrainingProgress Progress(absl::Time now) const;
  void Stop(const std::string& reason, absl::Time now, Callback<World> done);
  void Resize(int world_size, absl::Time now, Callback<absl::StatusOr<World>> done);
  void Drain(const std::string& worker_id, absl::Time now, Callback<absl::StatusOr<World>> done);
  absl::StatusOr<int64_t> SaveCheckpoint();
  // Training restarts from checkpoint `id` ("latest" allowed) at a new generation.
  void RestoreCheckpoint(const std::string& id, absl::Time now,
                         Callback<absl::StatusOr<std::pair<TrainingStartPoint, World>>> done);
  void ListEvents(int64_t after, absl::Duration wait, absl::Time now, EventsCallback done);
  // The catalog, to read; FailedPrecondition when the coordinator runs no job (and so keeps no
  // checkpoints).
  absl::StatusOr<const CheckpointManager*> Checkpoints() const;
  absl::Status DeleteCheckpoint(const std::string& id);

  // --- Rendezvous (the current generation's store) ---
  absl::Status KvSet(const KvScope& scope, const std::string& key, std::string value);
  absl::StatusOr<std::string> KvGet(const KvScope& scope, const std::string& key) const;
  void KvWait(const KvScope& scope, std::vector<std::string> keys, absl::Duration timeout,
              absl::Time now, KvStoreManager::WaitCallback done);

  // --- Housekeeping ---
  // Declares silent workers dead, runs the job's state machine (re-formations, pauses and
  // their way out), and answers the long-polls whose wait ran out. True if heartbeats it fired
  // still wait for their answer: run it again at once.
  bool Housekeep(absl::Time now);
  // Answers every long-poll with `reason` and refuses later rendezvous calls (at shutdown).
  void Close(const absl::Status& reason);

  // Whether Create took back a live job, and kept its generation.
  bool recovered() const { return world_->recovered(); }
  bool kept_generation() const { return world_->kept_generation(); }
  const CoreOptions& options() const { return options_; }
  // Read-only views of the managers (status, metrics, tests, the simulation's invariants):
  // every change goes through the handlers above.
  const WorldManager& world() const { return *world_; }
  const KvStoreManager& kv() const { return *kv_; }
  const PlanManager& plan() const { return *plan_; }
  const CheckpointManager* checkpoints() const { return checkpoints_.get(); }
  const SnapshotManager* snapshots() const { return snapshots_.get(); }
  const ElasticManager& elastic() const { return *elastic_; }

 private:
  CoordinatorCore(CoreOptions options, StateStore* store) : options_(std::move(options)), store_(store) {}
  // Runs `done` once everything recorded so far is durable.
  void Acknowledge(std::function<void()> done);
  // The job-level state machine's step; true if the workers must hear of it at once.
  bool Reconcile(absl::Time now);
  // The world first runs at `generation`: where its training starts (memory or disk), for the
  // history.
  std::vector<v1::MembershipEvent> OnWorldRunning(int64_t generation, const IsLiveMember& live);
  // How far the pausing save `request` is: a memory snapshot's or a disk checkpoint's.
  SaveProgress PauseProgress(int64_t request) const;
  // The progress lease's pass: names (and evicts) a rank that holds the world up, once per step.
  void CheckProgress(absl::Time now);
  absl::StatusOr<CheckpointManager*> MutableCheckpoints();


  const CoreOptions options_;
  StateStore* const store_;
  std::unique_ptr<WorldManager> world_;
  std::unique_ptr<KvStoreManager> kv_;
  std::unique_ptr<PlanManager> plan_;
  std::unique_ptr<CheckpointManager> checkpoints_;  // with a job only
  std::unique_ptr<SnapshotManager> snapshots_;      // with a job only
  // The (generation, step) the progress lease last acted on: it acts once per stall.
  std::pair<int64_t, int64_t> stall_handled_ = {0, 0};
  std::unique_ptr<ElasticManager> elastic_;
};

}  // namespace shard
