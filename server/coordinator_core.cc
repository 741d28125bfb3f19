#include "server/coordinator_core.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "google/protobuf/util/message_differencer.h"
#include "proto/job_convert.h"
#include "spdlog/spdlog.h"

namespace shard {
namespace {

constexpr char kJobRecord[] = "job";

// The world's options as the job spec sets them.
void ApplyJob(const JobConfig& job, CoreOptions* options) {
  options->world.job = job.name;
  options->world.expected_world_size = job.world_size;
  options->world.min_world_size = job.min_world_size;
  const int64_t global_batch = job.global_batch;
  options->world.check_size = [global_batch](int world_size) {
    if (global_batch % world_size == 0) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat(
        "the job's global batch ", global_batch, " does not divide over ", world_size,
        " workers"));
  };
  options->plan.mode = job.shard_mode;
  options->plan.bucket_cap_bytes = job.bucket_cap_bytes;
  options->plan.first_bucket_cap_bytes = job.first_bucket_cap_bytes;
  options->plan.min_buckets = job.min_buckets;
}

// Decides between taking back a live job kept in the store (a restart after a crash) and
// starting a new world, and settles the job and world options accordingly.
absl::Status SettleJob(StateStore* store, CoreOptions* options) {
  SHARD_ASSIGN_OR_RETURN(const WorldManager::SavedWorld saved, WorldManager::FindSavedWorld(store));
  v1::JobSpec stored;
  SHARD_ASSIGN_OR_RETURN(const bool has_job, store->Load(kJobRecord, &stored));
  const bool same_job =
      !options->job.has_value() || (has_job && google::protobuf::util::MessageDifferencer::Equals(
                                                   ToProto(*options->job), stored));
  // A finished or failed job is taken back (to end at once) only when started again as it was;
  // another
  // job spec, or --restore, is a new run.
  const bool ended = saved == WorldManager::SavedWorld::kEnded && same_job;
  const bool recover = (saved == WorldManager::SavedWorld::kLive || ended) &&
                       options->restore.empty() && (has_job || !options->job.has_value());
  if (recover && has_job) {
    if (!same_job) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the state directory holds job '", stored.name(), "', still live (its workers may be "
          "running), with another job spec; start without --job (or with the same file) to take "
          "it back, pass --restore to start a new run from a checkpoint, or use another "
          "--state-dir"));
    }
    SHARD_ASSIGN_OR_RETURN(options->job, JobConfigFromProto(stored, ""));
  }
  if (options->job.has_value()) {
    ApplyJob(*options->job, options);
    if (!recover) {
      SHARD_RETURN_IF_ERROR(store->Save(kJobRecord, ToProto(*options->job)));
    }
  } else if (options->world.expected_world_size < 1) {
    return absl::InvalidArgumentError(
        "no job to run: give --job FILE or --world-size N (the state directory holds no live "
        "job to take back)");
  }
  options->world.recover = recover;
  return absl::OkStatus();
}

// A checkpoint `--restore` or `shardctl checkpoint restore` may start the job from. `registered`
// is the manifest the workers registered, if they have: an external model is known only by it
// (before that, a worker's restore refuses a checkpoint of another model).
absl::Status CheckRestorable(const JobConfig& job, const Manifest* registered,
                             const CheckpointManifest& manifest) {
  const std::optional<Manifest> model =
      job.external_model ? (registered != nullptr ? std::optional<Manifest>(*registered)
                                                  : std::nullopt)
                         : std::optional<Manifest>(MlpManifest(job.widths));
  if (model.has_value()) {
    if (absl::Status same =
            CompareManifests(*model, manifest.model(), absl::StrCat("checkpoint ", manifest.id));
        !same.ok()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "cannot restore checkpoint ", manifest.id, ": it is of a different model (",
          same.message(), ")"));
    }
  }
  // A script's own optimizer is known only to the workers, which check its class and state.
  if (job.optimizer.kind == OptimizerKind::kTorch
          ? manifest.optimizer.kind != OptimizerKind::kTorch
          : manifest.state_names != OptimizerStateNames(job.optimizer)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cannot restore checkpoint ", manifest.id, ": it holds ",
        OptimizerKindName(manifest.optimizer.kind), " state but the job uses ",
        OptimizerKindName(job.optimizer.kind)));
  }
  return absl::OkStatus();
}

absl::Status NoCheckpointsError() {
  return absl::FailedPreconditionError(
      "this coordinator runs no training job (started without --job), so it has no checkpoints");
}

}  // namespace

absl::StatusOr<std::unique_ptr<CoordinatorCore>> CoordinatorCore::Create(
    CoreOptions options, StateStore* store, CheckpointStorage* storage, absl::Time now) {
  SHARD_RETURN_IF_ERROR(SettleJob(store, &options));
  std::unique_ptr<CoordinatorCore> core(new CoordinatorCore(options, store));
  SHARD_ASSIGN_OR_RETURN(core->world_, WorldManager::Create(options.world, store, now));
  const int64_t generation = core->world_->world().generation;
  const bool recovered = core->world_->recovered();
  core->kv_ = std::make_unique<KvStoreManager>(options.world.job, generation);
  core->plan_ = std::make_unique<PlanManager>(options.plan, store);
  core->plan_->OnGeneration(generation);
  if (recovered) {
    SHARD_RETURN_IF_ERROR(core->plan_->Recover(generation));
  }
  SHARD_ASSIGN_OR_RETURN(
      core->elastic_, ElasticManager::Create(store, recovered && core->world_->kept_generation()));
  // A re-formation in flight was taken back with its generation: the world still reshapes.
  if (std::optional<InFlightReshape> in_flight = core->elastic_->in_flight()) {
    core->world_->BeginReshaping(in_flight->generation);
  }
  if (options.job.has_value()) {
    const JobConfig& job = *options.job;
    CheckpointOptions checkpoint_options;
    checkpoint_options.job = job.name;
    checkpoint_options.root = job.checkpoint_dir;
    checkpoint_options.keep_last = job.checkpoint_keep_last;
    checkpoint_options.zero_stage = job.zero_stage;
    checkpoint_options.optimizer = job.optimizer;
    checkpoint_options.recover = recovered;
    SHARD_ASSIGN_OR_RETURN(core->checkpoints_,
                           CheckpointManager::Create(checkpoint_options, store, storage, generation,
                                                     core->world_->kept_generation()));
    core->snapshots_ = std::make_unique<SnapshotManager>(SnapshotOptions{job.snapshot_replicas});
    if (!options.restore.empty()) {
      SHARD_ASSIGN_OR_RETURN(const v1::CheckpointRecord record,
                             core->checkpoints_->Find(options.restore));
      SHARD_ASSIGN_OR_RETURN(const CheckpointManifest manifest,
                             core->checkpoints_->ReadManifest(record));
      SHARD_RETURN_IF_ERROR(CheckRestorable(job, /*registered=*/nullptr, manifest));
      SHARD_RETURN_IF_ERROR(core->checkpoints_->SetRestorePoint(record.id()).status());
      core->plan_->SeedRebuiltOrder(manifest.plan.gradient_order);
    }
  } else if (!options.restore.empty()) {
    return absl::InvalidArgumentError("--restore needs --job");
  }
  KvStoreManager* kv = core->kv_.get();
  PlanManager* plan = core->plan_.get();
  CheckpointManager* checkpoint_manager = core->checkpoints_.get();
  core->world_->set_generation_listener([kv, plan, checkpoint_manager](int64_t next) {
    kv->SetCurrentGeneration(next);
    plan->OnGeneration(next);
    if (checkpoint_manager != nullptr) checkpoint_manager->OnGeneration(next);
  });
  if (checkpoint_manager != nullptr) {
    CoordinatorCore* self = core.get();
    core->world_->set_running_listener([self](int64_t generation, const IsLiveMember& live) {
      return self->OnWorldRunning(generation, live);
    });
    // A worker resized or drained out holds state the new world reads from memory: it stays
    // until the new world's ranks have restored.
    core->world_->set_leaver_hold([checkpoint_manager](const std::string& worker_id) {
      return checkpoint_manager->NeededForRestore(worker_id);
    });
  }
  return core;
}

void CoordinatorCore::Acknowledge(std::function<void()> done) {
  store_->WhenDurable(store_->last_sequence(), std::move(done));
}

// --- Workers ------------------------------------------------------------------------------------

void CoordinatorCore::Join(const JoinParams& params, absl::Time now,
                           Callback<absl::StatusOr<JoinReply>> done) {
  // What it holds counts before the join can make the world run (and choose its start).
  if (snapshots_ != nullptr && !params.snapshot_address.empty()) {
    snapshots_->OnJoin(params.worker_id, params.incarnation, params.snapshot_address,
                       params.holdings, now);
  }
  absl::StatusOr<JoinOutcome> outcome = world_->Join(params, now);
  absl::StatusOr<JoinReply> reply =
      outcome.ok() ? absl::StatusOr<JoinReply>(JoinReply{
                         *outcome, world_->options().lease, world_->options().lease / 4,
                         checkpoints_ != nullptr ? checkpoints_->start() : TrainingStartPoint{}})
                   : outcome.status();
  Acknowledge([done = std::move(done), reply = std::move(reply)]() mutable {
    done(std::move(reply));
  });
}

void CoordinatorCore::Heartbeat(const HeartbeatParams& params, absl::Time now,
                                Callback<absl::StatusOr<HeartbeatReply>> done) {
  world_->WatchHeartbeat(
      params, now, [this, done = std::move(done)](absl::StatusOr<HeartbeatOutcome> outcome) {
        absl::StatusOr<HeartbeatReply> reply = absl::UnknownError("unset");
        if (outcome.ok()) {
          HeartbeatReply filled;
          filled.orders.generation = outcome->world.generation;
          if (checkpoints_ != nullptr) {
            filled.orders = checkpoints_->Orders(outcome->world.generation);
            filled.start = checkpoints_->start();
          }
          filled.outcome = std::move(*outcome);
          reply = std::move(filled);
        } else {
          reply = outcome.status();
        }
        Acknowledge([done, reply = std::move(reply)]() mutable { done(std::move(reply)); });
      });
}

void CoordinatorCore::ReportSelfCheck(const SelfCheckReport& report, absl::Time now,
                                      Callback<absl::Status> done) {
  absl::Status reported =
      world_->ReportSelfCheck(report.worker_id, report.incarnation, report.generation,
                              report.passed, report.detail, now, report.unreachable);
  Acknowledge([done = std::move(done), reported] { done(reported); });
}

void CoordinatorCore::Leave(const LeaveParams& params, absl::Time now,
                            Callback<absl::Status> done) {
  absl::Status left = world_->Leave(params, now);
  Acknowledge([done = std::move(done), left] { done(left); });
}

absl::StatusOr<PlanView> CoordinatorCore::RegisterManifest(const std::string& worker_id,
                                                           uint64_t incarnation,
                                                           const Manifest& manifest) {
  SHARD_ASSIGN_OR_RETURN(const MemberRef member, world_->RunningMember(worker_id, incarnation));
  return plan_->RegisterManifest(member, manifest);
}

absl::StatusOr<PlanView> CoordinatorCore::AckPlan(const std::string& worker_id,
                                                  uint64_t incarnation, int64_t version,
                                                  const std::string& hash) {
  SHARD_ASSIGN_OR_RETURN(const MemberRef member, world_->RunningMember(worker_id, incarnation));
  return plan_->AckPlan(member, version, hash);
}

void CoordinatorCore::ReportGradientOrder(const std::string& worker_id, uint64_t incarnation,
                                          int64_t plan_version, std::vector<int> order,
                                          absl::Duration wait, absl::Time now,
                                          PlanManager::PlanCallback done) {
  absl::StatusOr<MemberRef> member = world_->RunningMember(worker_id, incarnation);
  if (!member.ok()) {
    done(member.status());
    return;
  }
  plan_->ReportGradientOrder(*member, plan_version, std::move(order), wait, now, std::move(done));
}

absl::Status CoordinatorCore::ReportStepStats(const std::string& worker_id, uint64_t incarnation,
                                              int64_t generation, StepReport report,
                                              absl::Time now) {
  SHARD_ASSIGN_OR_RETURN(MemberRef member, world_->RunningMember(worker_id, incarnation));
  if (generation != member.generation) {
    return absl::AbortedError(absl::StrCat("step ", report.step, " was trained in generation ",
                                           generation, "; the world is at generation ",
                                           member.generation));
  }
  if (checkpoints_ != nullptr) checkpoints_->NoteTrainingStarted();
  return plan_->ReportStepStats(member, std::move(report), now);
}

void CoordinatorCore::ReportTrainingDone(const std::string& worker_id, uint64_t incarnation,
                                         const std::string& summary, absl::Time now,
                                         Callback<absl::Status> done) {
  absl::Status reported = world_->ReportTrainingDone(worker_id, incarnation, summary, now);
  Acknowledge([done = std::move(done), reported] { done(reported); });
}

absl::StatusOr<bool> CoordinatorCore::ReportCheckpointShard(ShardReport report, absl::Time now) {
  SHARD_ASSIGN_OR_RETURN(CheckpointManager* const checkpoints, MutableCheckpoints());
  SHARD_ASSIGN_OR_RETURN(const MemberRef member,
                         world_->RunningMember(report.worker_id, report.incarnation));
  std::optional<PlanView> plan = plan_->Current();
  if (!plan.has_value()) {
    return absl::FailedPreconditionError("no plan in this generation");
  }
  report.rank = member.rank;
  report.record.rank = member.rank;
  absl::StatusOr<bool> committed = checkpoints->ReportShard(report, *plan, now);
  // Failed, skipped and recovered saves go into the history.
  for (CheckpointNotice& notice : checkpoints->TakeNotices()) {
    world_->RecordEvent(notice.kind, "", -1, std::move(notice.detail), now);
  }
  return committed;
}

absl::Status CoordinatorCore::ReportSnapshot(const SnapshotReport& report, absl::Time now) {
  if (snapshots_ == nullptr) {
    return absl::FailedPreconditionError("this coordinator runs no training job: no snapshots");
  }
  if (!world_->IsLive(report.worker_id, report.incarnation)) {
    return absl::NotFoundError(absl::StrCat("worker '", report.worker_id,
                                            "' is no longer a member; join again"));
  }
  return snapshots_->Report(report, now);
}

absl::StatusOr<RestoreSnapshotView> CoordinatorCore::GetRestoreSnapshot(
    const std::string& worker_id, uint64_t incarnation, int64_t generation) {
  SHARD_ASSIGN_OR_RETURN(CheckpointManager* const checkpoints, MutableCheckpoints());
  SHARD_ASSIGN_OR_RETURN(const MemberRef member, world_->RunningMember(worker_id, incarnation));
  if (member.generation != generation) {
    return absl::AbortedError(absl::StrCat("generation ", generation, " has ended (now ",
                                           member.generation, ")"));
  }
  const TrainingStartPoint start = checkpoints->start();
  const std::optional<MemoryRestorePoint> point = checkpoints->memory_start();
  if (!start.in_memory || !point.has_value()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "generation ", generation, " does not restore from memory (it starts from ",
        start.checkpoint_id.empty() ? "the initial weights" : start.checkpoint_id, ")"));
  }
  const std::optional<PlanView> plan = plan_->Current();
  if (!plan.has_value() || plan->manifest == nullptr) {
    return absl::FailedPreconditionError(
        "no manifest registered yet: register the model before restoring");
  }
  const JobConfig& job = *options_.job;
  SHARD_ASSIGN_OR_RETURN(
      const CheckpointManifest manifest,
      SnapshotManifest(job.name, job.zero_stage, *plan->manifest, job.optimizer, point->shards));
  RestoreSnapshotView view;
  view.id = start.checkpoint_id;
  view.manifest_json = CheckpointManifestToJson(manifest);
  const IsLiveMember live = world_->LiveNow();
  for (size_t rank = 0; rank < point->shards.size(); ++rank) {
    // Who holds it now (replicas reported since it was chosen count too), else who did then.
    std::vector<SnapshotHolder> holders =
        snapshots_->Holders(view.id, static_cast<int>(rank), live);
    if (holders.empty()) {
      for (const SnapshotHolder& holder : point->holders[rank]) {
        if (live(holder.worker_id, holder.incarnation)) holders.push_back(holder);
      }
    }
    view.holders.push_back(std::move(holders));
  }
  return view;
}

absl::Status CoordinatorCore::ReportRestore(const RestoreReport& report, absl::Time now) {
  SHARD_ASSIGN_OR_RETURN(CheckpointManager* const checkpoints, MutableCheckpoints());
  SHARD_ASSIGN_OR_RETURN(const MemberRef member,
                         world_->RunningMember(report.worker_id, report.incarnation));
  if (member.generation != report.generation) {
    return absl::AbortedError(absl::StrCat("generation ", report.generation, " has ended (now ",
                                           member.generation, ")"));
  }
  if (!report.error.empty()) {
    // It is not read again: the next generation restores from elsewhere (the worker's failed
    // data path ends this one).
    if (report.in_memory) snapshots_->Discard(report.checkpoint_id, report.error);
    world_->RecordEvent(v1::MEMBERSHIP_EVENT_KIND_RESTORED, report.worker_id, member.rank,
                        absl::StrCat("rank ", member.rank, " could not restore ",
                                     report.in_memory ? "memory snapshot " : "checkpoint ",
                                     report.checkpoint_id, ": ", report.error,
                                     report.in_memory ? "; it is not used again" : ""),
                        now);
    return absl::OkStatus();
  }
  // The new generation has trained no step yet: the furthest step reported is the old one's.
  const ProgressMeter meter = plan_->progress();
  const std::optional<CheckpointManager::RestoreSummary> summary = checkpoints->NoteRestored(
      member.generation, member.rank, member.world_size, meter.has_step() ? meter.step() : 0,
      report);
  if (!summary.has_value()) return absl::OkStatus();
  world_->RecordEvent(
      v1::MEMBERSHIP_EVENT_KIND_RESTORED, "", -1,
      absl::StrCat("generation ", member.generation, " restored ",
                   summary->start.in_memory ? "memory snapshot " : "checkpoint ",
                   summary->start.checkpoint_id, " (step ", summary->start.step, ") on ",
                   member.world_size, " ranks in ",
                   absl::StrFormat("%.0f", absl::ToDoubleMilliseconds(summary->slowest)),
                   " ms (slowest rank), from ",
                   summary->start.in_memory
                       ? absl::StrCat("memory (", summary->bytes_from_peers, " of ",
                                      summary->bytes, " bytes from peers)")
                       : std::string("disk"),
                   "; ", summary->steps_lost, " steps lost",
                   summary->refused.empty() ? "" : "; ", absl::StrJoin(summary->refused, "; ")),
      now);
  // Workers that stayed only to serve this restore may leave now.
  world_->WakeWatches();
  return absl::OkStatus();
}

std::vector<v1::MembershipEvent> CoordinatorCore::OnWorldRunning(int64_t generation,
                                                                 const IsLiveMember& live) {
  const SnapshotManager::Newest newest = snapshots_->NewestUsable(live);
  const std::string why = checkpoints_->ResolveStart(generation, newest.point, newest.why_not);
  if (why.empty()) return {};
  if (const std::optional<MemoryRestorePoint> point = checkpoints_->memory_start()) {
    // Snapshots newer than the one restored belong to a timeline that ends here.
    snapshots_->DiscardNewerThan(point->shards[0].generation, point->shards[0].step);
  }
  v1::MembershipEvent event;
  event.set_kind(v1::MEMBERSHIP_EVENT_KIND_RESTORE_POINT);
  event.set_rank(-1);
  event.set_detail(why);
  return {event};
}

SaveProgress CoordinatorCore::PauseProgress(int64_t request) const {
  if (options_.job->snapshot_every > 0) {
    return snapshots_->PauseProgress(request, world_->LiveNow());
  }
  return checkpoints_->Progress(request);
}

// --- Operators ----------------------------------------------------------------------------------

StatusSnapshot CoordinatorCore::Status(absl::Time now) const {
  StatusSnapshot snapshot = world_->Status(now);
  if (std::string transition = elastic_->transition(); !transition.empty()) {
    snapshot.world.transition = std::move(transition);
  }
  return snapshot;
}

TrainingProgress CoordinatorCore::Progress(absl::Time now) const {
  TrainingProgress progress;
  if (options_.job.has_value()) progress.steps = options_.job->steps;
  if (checkpoints_ != nullptr) {
    progress.step = checkpoints_->start().step;  // until a step is reported
    if (absl::StatusOr<v1::CheckpointRecord> latest = checkpoints_->Find("latest"); latest.ok()) {
      progress.last_checkpoint = latest->id();
      progress.last_checkpoint_step = latest->step();
      progress.last_checkpoint_age = now - absl::FromUnixMillis(latest->committed_unix_ms());
    }
    const SaveHealth health = checkpoints_->health();
    progress.checkpoint_failures = health.failures;
    if (health.failures > 0) {
      progress.last_checkpoint_failure = health.last_failure;
      if (health.last_failure_at.has_value()) {
        progress.last_checkpoint_failure_age = now - *health.last_failure_at;
      }
    }
    progress.checkpoints_skipped = health.skipped;
    if (health.skipped > 0) progress.last_checkpoint_skip = health.last_skip;
  }
  const ProgressMeter meter = plan_->progress();
  if (meter.has_step()) {
    progress.step = meter.step();
    progress.loss = meter.loss();
    progress.steps_per_second = meter.steps_per_second();
    if (progress.steps > 0) progress.eta = meter.Remaining(progress.steps);
  }
  progress.overlap_fraction = plan_->Stats().overlap_fraction;
  if (snapshots_ != nullptr) {
    const SnapshotSummary summary = snapshots_->Summary(world_->LiveNow(), now);
    progress.last_snapshot = summary.usable_id;
    progress.last_snapshot_step = summary.usable_step;
    if (summary.usable_since.has_value()) {
      progress.last_snapshot_age = now - *summary.usable_since;
    }
    progress.last_snapshot_copies = summary.usable_copies;
    progress.replica_lag_steps = summary.replica_lag_steps;
    progress.replica_lag = summary.replica_lag;
  }
  return progress;
}

void CoordinatorCore::Stop(const std::string& reason, absl::Time now, Callback<World> done) {
  const World world = world_->RequestStop(reason, now);
  Acknowledge([done = std::move(done), world] { done(world); });
}

void CoordinatorCore::Resize(int world_size, absl::Time now,
                             Callback<absl::StatusOr<World>> done) {
  absl::Status set = world_->SetTarget(world_size, now);
  absl::StatusOr<World> reply =
      set.ok() ? absl::StatusOr<World>(Status(now).world) : absl::StatusOr<World>(set);
  Acknowledge([done = std::move(done), reply = std::move(reply)]() mutable {
    done(std::move(reply));
  });
}

void CoordinatorCore::Drain(const std::string& worker_id, absl::Time now,
                            Callback<absl::StatusOr<World>> done) {
  absl::Status drained = world_->Drain(worker_id, now);
  absl::StatusOr<World> reply =
      drained.ok() ? absl::StatusOr<World>(Status(now).world) : absl::StatusOr<World>(drained);
  Acknowledge([done = std::move(done), reply = std::move(reply)]() mutable {
    done(std::move(reply));
  });
}

absl::StatusOr<CheckpointManager*> CoordinatorCore::MutableCheckpoints() {
  if (checkpoints_ != nullptr) return checkpoints_.get();
  return NoCheckpointsError();
}

absl::StatusOr<const CheckpointManager*> CoordinatorCore::Checkpoints() const {
  if (checkpoints_ != nullptr) return checkpoints_.get();
  return NoCheckpointsError();
}

absl::Status CoordinatorCore::DeleteCheckpoint(const std::string& id) {
  SHARD_ASSIGN_OR_RETURN(CheckpointManager* const checkpoints, MutableCheckpoints());
  return checkpoints->Delete(id);
}

absl::Status CoordinatorCore::KvSet(const KvScope& scope, const std::string& key,
                                    std::string value) {
  return kv_->Set(scope, key, std::move(value));
}

absl::StatusOr<std::string> CoordinatorCore::KvGet(const KvScope& scope,
                                                   const std::string& key) const {
  return kv_->Get(scope, key);
}

void CoordinatorCore::KvWait(const KvScope& scope, std::vector<std::string> keys,
                             absl::Duration timeout, absl::Time now,
                             KvStoreManager::WaitCallback done) {
  kv_->Wait(scope, std::move(keys), timeout, now, std::move(done));
}

absl::StatusOr<int64_t> CoordinatorCore::SaveCheckpoint() {
  SHARD_ASSIGN_OR_RETURN(CheckpointManager* const checkpoints, MutableCheckpoints());
  const World world = world_->world();
  if (!Trains(world.state)) {
    return absl::FailedPreconditionError(
        "the world is not running; a checkpoint is saved by its workers");
  }
  absl::StatusOr<int64_t> request = checkpoints->RequestSave(world.generation);
  if (request.ok()) world_->WakeWatches();  // workers learn of the request at once
  return request;
}

void CoordinatorCore::RestoreCheckpoint(
    const std::string& id, absl::Time now,
    Callback<absl::StatusOr<std::pair<TrainingStartPoint, World>>> done) {
  auto restore = [&]() -> absl::StatusOr<std::pair<TrainingStartPoint, World>> {
    SHARD_ASSIGN_OR_RETURN(CheckpointManager* const checkpoints, MutableCheckpoints());
    SHARD_ASSIGN_OR_RETURN(const v1::CheckpointRecord record, checkpoints->Find(id));
    SHARD_ASSIGN_OR_RETURN(const CheckpointManifest manifest, checkpoints->ReadManifest(record));
    const std::optional<PlanView> plan = plan_->Current();
    SHARD_RETURN_IF_ERROR(CheckRestorable(
        *options_.job, plan.has_value() && plan->manifest != nullptr ? plan->manifest.get() : nullptr,
        manifest));
    SHARD_ASSIGN_OR_RETURN(const TrainingStartPoint start,
                           checkpoints->SetRestorePoint(record.id()));
    snapshots_->DiscardAll(absl::StrCat("an operator restored checkpoint ", record.id()));
    plan_->SeedRebuiltOrder(manifest.plan.gradient_order);
    const World world = world_->Reform(absl::StrCat("restore from checkpoint ", record.id()), now);
    return std::make_pair(start, world);
  };
  absl::StatusOr<std::pair<TrainingStartPoint, World>> reply = restore();
  Acknowledge([done = std::move(done), reply = std::move(reply)]() mutable {
    done(std::move(reply));
  });
}

void CoordinatorCore::ListEvents(int64_t after, absl::Duration wait, absl::Time now,
                                 EventsCallback done) {
  auto durable = [this,
                  done = std::move(done)](absl::StatusOr<std::vector<v1::MembershipEvent>> events) {
    Acknowledge([done, events = std::move(events)]() mutable { done(std::move(events)); });
  };
  if (wait <= absl::ZeroDuration()) {
    durable(world_->Events(after));
  } else {
    world_->WatchEvents(after, now + wait, std::move(durable));
  }
}

}  // namespace shard
