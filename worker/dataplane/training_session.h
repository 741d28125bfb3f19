// One generation of a job's training on one rank, whatever the model: the engine over the job's
// optimizer and ZeRO stage, where training starts (a checkpoint, an init file, or the values the
// model holds), and the step boundary every trainer shares: the global loss, the checkpoint
// orders the ranks agree on, saving, pausing for a re-formation, and at the end the export.
// The built-in MLP (trainer.h) and a model that lives elsewhere (a PyTorch module through
// capi/) drive the same session:
//
//   session = TrainingSession::Create(job, manifest, communicator, plans, options);
//   if (!session->restored() && !session->LoadInitFile()) {
//     write initial values into engine.param(i); session->BroadcastInitialValues();
//   }
//   while (!session->finished()) {
//     forward, engine.StartBackward(), backward + MarkGradReady, engine.Step(&timings)
//     if (session->EndStep(loss share, timings, start) == kPaused) return session->result();
//   }
//   return session->Finish();
//
// Thread-compatible: one thread drives the session and its engine.
#pragma once

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/control_types.h"
#include "common/job_spec.h"
#include "common/manifest.h"
#include "common/step_boundary.h"
#include "worker/dataplane/checkpoint_saver.h"
#include "worker/dataplane/communicator.h"
#include "worker/dataplane/device.h"
#include "worker/dataplane/engine.h"
#include "worker/dataplane/plan_provider.h"
#include "worker/dataplane/snapshot_store.h"
#include "worker/dataplane/snapshotter.h"

namespace shard {

struct StepRecord {
  int64_t step = 0;       // 1-based
  // The mean loss over the global batch of step `loss_step`: this step's at the last step of a
  // run (or the one it pauses after), otherwise the step before's (0: none yet), whose loss the
  // ranks agreed on while this step computed.
  double loss = 0;
  int64_t loss_step = 0;
  double step_ms = 0;     // wall time of the whole step on this rank
  StepTimings timings;
  int64_t plan_version = 0;
  int64_t held_bytes = 0;  // the model state this rank holds (Engine::held_bytes)
  double checkpoint_pause_ms = 0;  // when this step ended with a checkpoint or a snapshot
  bool snapshot = false;           // this step ended with a memory snapshot
  // At the first step of a run whose buckets the collectives copy through the shared-memory
  // transport's slots rather than read in place: why (Engine::unshared_reason). Empty otherwise.
  std::string buckets_unshared;
};

struct TrainResult {
  int64_t start_step = 0;  // steps already done before this run (restored from a checkpoint)
  int64_t steps = 0;
  double first_loss = 0;
  double last_loss = 0;
  // Over steps 2..N (the first step also plans and rebuilds the buckets).
  double steps_per_second = 0;
  double hidden_fraction = 0;  // of gradient-reduction time that overlapped backward
  // Step efficiency: the mean step's time over its forward and backward time (1 when the
  // reductions, the update and the boundary cost nothing on top of the compute).
  double step_over_compute = 0;
  int64_t optimizer_state_bytes = 0;  // on this rank
  HeldBytes held_bytes;               // the model state this rank holds at the end
  std::string output_path;            // rank 0 only
  int checkpoints_saved = 0;
  int checkpoints_skipped = 0;  // periodic saves skipped while the one before was being written
  int64_t paused_at = 0;  // the step after which training paused for a re-formation; 0: it did not
  double max_checkpoint_pause_ms = 0;  // the longest training stall of a save or snapshot
  std::string unshared_reason;  // Engine::unshared_reason()
  int snapshots_taken = 0;
};

// What a training session tells whoever runs it, and the little it asks of them (the
// coordinator's orders, a checkpoint to restore that is not on disk). Every method has a default
// that does nothing, so an observer overrides only what it needs. The session calls it from the
// threads each method names: an observer that shares state between them guards it.
class TrainingObserver {
 public:
  virtual ~TrainingObserver() = default;

  // After every step (e.g. to log and report to the coordinator), on the training thread; see
  // StepRecord::loss.
  virtual void OnStep(const StepRecord& /*record*/) {}

  // Opens the checkpoint training restores from when TrainerOptions::restore_from_observer is
  // set (a memory snapshot's holders, say), on the training thread before the first step.
  virtual absl::StatusOr<std::unique_ptr<CheckpointReader>> OpenRestore() {
    return absl::UnimplementedError("this training's observer opens no checkpoint to restore");
  }
  // Called with the restore's outcome, how long it took and where the time went (on success), on
  // the training thread; what it returns is the outcome (e.g. a failed read of a memory snapshot
  // becomes the end of the generation, not of the process).
  virtual absl::Status OnRestored(const absl::Status& outcome, absl::Duration /*took*/,
                                  const RestoreTimings& /*timings*/) {
    return outcome;
  }

  // On the snapshot thread, once this rank holds its own shard of a snapshot (and dropped the
  // snapshots `dropped`).
  virtual void OnSnapshot(const SnapshotShard& /*shard*/,
                          const std::vector<std::string>& /*dropped*/) {}
  // On the snapshot thread, when a buddy did not take a replica (it is gone, or slow): the
  // snapshot has one copy fewer.
  virtual void OnSnapshotPushFailed(const SnapshotShard& /*shard*/, const std::string& /*buddy*/,
                                    const absl::Status& /*why*/) {}
  // On the snapshot thread, the first time a buddy on this host did not keep this rank's pages:
  // its replicas go over TCP instead, a copy more.
  virtual void OnSnapshotPagesRefused(const SnapshotShard& /*shard*/,
                                      const std::string& /*buddy*/, const absl::Status& /*why*/) {}

  // The orders from the coordinator this rank knows of now (common/control_types.h), polled on
  // the training thread at every step boundary; only orders of TrainerOptions::generation count.
  // All ranks save at the boundary after the first at which any of them knows a request newer
  // than the last one saved, and pause after a pausing one (they agree one step ahead, through
  // one small all-reduce per step that runs while the next step computes;
  // common/step_boundary.h decides). A pause returns with TrainResult::paused_at: the world is
  // about to re-form and restore that checkpoint. Periodic saves need no orders.
  virtual StepOrders Orders() { return StepOrders{}; }

  // From the writer thread when this rank's shard of a checkpoint is on disk (or failed), and on
  // rank 0 from another thread when a periodic save was skipped (SavedShard::skipped).
  virtual void OnCheckpoint(const SavedShard& /*saved*/) {}
};

struct TrainerOptions {
  // Where the model, its buffers and the update run (not owned; null: the host); the
  // communicator's buffers must be its memory. The job's precision must be one it runs.
  Device* device = nullptr;
  // Told about steps, restores, snapshots and checkpoints, and asked for orders (not owned;
  // null: nobody observes, and there are no orders).
  TrainingObserver* observer = nullptr;
  // Polled between steps; training stops with Cancelled once it is set.
  const std::atomic<bool>* stop = nullptr;

  // Checkpoints (see common/checkpoint.h). Restore from this committed checkpoint directory
  // before training: training continues with the step after the checkpoint's.
  std::string restore_dir;
  // Or, when set, from the checkpoint the observer opens (TrainingObserver::OpenRestore). Not a
  // question for the observer: the session must know before it opens anything whether it
  // restores (the "before-restore" stall point of common/fault.h, the restore's duration).
  bool restore_from_observer = false;
  // A restore gathers the parameters during its reads, not after them
  // (EngineOptions::gather_during_reads; the worker decides with GatherDuringReadsPays).
  bool gather_during_reads = false;
  // In-memory snapshots (the job's snapshot.every_steps; common/snapshot.h): the worker's store
  // (null: this rank takes none) and this rank's replication in this generation (ReplicationOf).
  SnapshotStore* snapshots = nullptr;
  Snapshotter::Replication snapshot_replication;
  // This training's generation: it names the snapshots, and only its orders count.
  int64_t generation = 0;
  // Appended to checkpoint ids (e.g. "g7"), so that a restored run never reuses an id.
  std::string checkpoint_tag;
  // After the last step: consolidate parameters and optimizer state onto this rank, which
  // writes them to `consolidate_path` (Engine::ConsolidateStateDict). -1: no.
  int consolidate_to_rank = -1;
  std::string consolidate_path;
};

class TrainingSession {
 public:
  enum class Boundary { kContinue, kPaused, kFinished };

  // Creates the engine for `manifest` with the job's optimizer, stage and clipping (and loss
  // scaling for fp16), and restores `options.restore_dir` if it is set (or the observer's
  // checkpoint, options.restore_from_observer).
  static absl::StatusOr<std::unique_ptr<TrainingSession>> Create(const JobConfig& job,
                                                                 Manifest manifest,
                                                                 Communicator& communicator,
                                                                 PlanProvider& plans,
                                                                 const TrainerOptions& options);
  // Gives up the checkpoint write in flight (CheckpointSaver::Cancel: training ended early, so it
  // can never commit), unless a stop was requested: then it waits for it.
  ~TrainingSession();

  Engine& engine() { return *engine_; }
  Communicator& communicator() { return communicator_; }
  Device& device() { return device_; }
  const JobConfig& job() const { return job_; }
  // Whether training starts from a checkpoint (options.restore_dir, or the observer's).
  bool restored() const { return restored_; }
  // Steps done so far: the 0-based index of the step to run next.
  int64_t next_step() const { return next_step_; }
  bool finished() const { return next_step_ >= job_.steps; }
  // Whether a stop was requested (options.stop).
  bool stop_requested() const;

  // Loads the job's init file (job.init_path) when it names one: its parameters, and with them
  // its optimizer state and step count when it holds them (an export with state, or a
  // consolidated file). False when the job has none: the caller writes initial values.
  absl::StatusOr<bool> LoadInitFile();
  // After the caller wrote initial values into the parameters: every rank takes rank 0's.
  absl::Status BroadcastInitialValues();

  // The boundary after engine().Step(): `loss_share` is this rank's share of the global batch's
  // mean loss (the ranks' shares are summed), `started` when the step began. Reports the step
  // (TrainingObserver::OnStep; the global loss it carries is the step before's, agreed while
  // this step computed, except at the last step of a run or the one it pauses after), saves when
  // a checkpoint is due or asked for, and says whether training goes on, paused for a
  // re-formation, or did its last step.
  absl::StatusOr<Boundary> EndStep(double loss_share, const StepTimings& timings,
                                   absl::Time started);
  // A training script's own optimizer (kTorch) keeps part of its state itself: at every save
  // (checkpoint or snapshot) `provider` returns the extras this rank saves (common/checkpoint.h
  // ShardExtra), by parameter (-1: the job's), appended to its shard after the pieces.
  using ExtrasProvider =
      std::function<absl::StatusOr<std::vector<std::pair<int, std::string>>>()>;
  void SetExtrasProvider(ExtrasProvider provider) { extras_provider_ = std::move(provider); }
  // What the restore read of those: the extras of every parameter this rank updates, and the
  // job's (-1). Empty when training did not start from a checkpoint or snapshot.
  const std::map<int, std::string>& restored_extras() const { return restored_extras_; }

  // After the last step: waits for checkpoint writes, consolidates if asked, and rank 0 writes
  // the parameters to job.output_dir/final.safetensors. Collective.
  absl::StatusOr<TrainResult> Finish();
  // What this run did so far (after a pause: paused_at is set).
  const TrainResult& result() const { return result_; }

 private:
  TrainingSession(const JobConfig& job, Communicator& communicator, Device& device,
                  const TrainerOptions& options);
  // Whether a wait of the step boundary must give up: the generation ended (the communicator
  // was aborted) or training was asked to stop.
  bool Interrupted() const;
  // The copy of what this rank owns for a snapshot and/or a disk checkpoint of step `step`
  // (after training `waited` for the previous save's write).
  absl::Status SaveState(int64_t step, const StepBoundary& boundary, absl::Duration waited,
                         StepRecord* record);
  // Hands the snapshot whose copy ran in the background (SaveState) to the snapshotter, once
  // the copy is done; nothing if there is none.
  absl::Status StartCopiedSnapshot();
  // The step boundary's agreement, one step ahead (EndStep): Post submits what this rank knows
  // at the end of step `step` (its orders, its saves in flight, its loss share) as one
  // all-reduce that runs while the next step computes; SettlePosted waits for it, puts the
  // step's global loss into `record`, and returns what the ranks agreed on.
  struct PostedAgreement {
    StepOrders orders;
    BoundaryWork work;
  };
  absl::Status Post(int64_t step, double loss_share);
  absl::StatusOr<PostedAgreement> SettlePosted(StepRecord* record);
  // Tells the coordinator (through TrainingObserver::OnCheckpoint) that the periodic checkpoint of
  // `step` was skipped while the one of step `writing` was still being written.
  void ReportSkippedSave(int64_t step, int64_t writing, absl::Duration waited);
  // A training script's own optimizer: FailedPrecondition unless every rank declared the same
  // class and per-element state (one small all-reduce).
  absl::Status CheckSameOptimizer();
  // Reads the extras of the parameters this rank updates and the job's from `checkpoint`.
  absl::Status ReadRestoredExtras(CheckpointReader& checkpoint);

  const JobConfig job_;
  Communicator& communicator_;
  Device& device_;
  const TrainerOptions options_;
  TrainingObserver& observer_;  // options_.observer, or one that does nothing
  std::unique_ptr<Engine> engine_;
  CheckpointSaver saver_;
  std::unique_ptr<Snapshotter> snapshotter_;  // with a snapshot store
  bool restored_ = false;
  bool unshared_told_ = false;  // a StepRecord said why the buckets are not shared
  int64_t next_step_ = 0;
  StepBoundaryState boundary_state_;
  // The agreement posted at the last boundary, in flight until the next one settles it.
  static constexpr size_t kPostedOrderValues = 5;  // then one loss share per rank
  struct Posted {
    std::shared_ptr<std::vector<int64_t>> values;  // shared with the collective in flight
    CommunicationQueue::Ticket ticket = 0;
    int64_t step = 0;  // 1-based
  };
  std::optional<Posted> posted_;
  // A periodic snapshot whose copy runs on the engine's communication thread while the next
  // step computes; the snapshotter gets it at the next boundary (StartCopiedSnapshot).
  struct CopiedSnapshot {
    SnapshotShard shard;
    SnapshotBytes bytes;
    CommunicationQueue::Ticket copied = 0;
    std::shared_ptr<ShardHasher> hashed;  // the copy hashes the state as it copies it
  };
  std::optional<CopiedSnapshot> copying_snapshot_;
  ExtrasProvider extras_provider_;
  std::map<int, std::string> restored_extras_;
  int64_t waited_for_save_ = 0;  // the step of the last in-flight save a boundary waited for
  TrainResult result_;
  absl::Time steady_start_;  // end of this run's first step
  double hidden_ms_ = 0;
  double reduction_ms_ = 0;
  double step_ms_ = 0;     // summed over steps 2..N, as the two below
  double compute_ms_ = 0;  // forward and backward
};

}  // namespace shard
