// CoordinatorCore's housekeeping: the job-level state machine's step (Reconcile: re-formations,
// pauses and their way out), the progress lease, and the expiry of leases and long-polls. The
// handlers are in coordinator_core.cc.
#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/progress_lease.h"
#include "server/coordinator_core.h"
#include "spdlog/spdlog.h"

namespace shard {

bool CoordinatorCore::Reconcile(absl::Time now) {
  const World world = world_->world();
  if (std::optional<InFlightReshape> in_flight = elastic_->in_flight()) {
    if (world.generation != in_flight->generation || world.state != JobState::kReshaping) {
      // A death, a restart or a stop ended the generation first: the pause went with it (the
      // checkpoint manager cancelled its request), and the world is re-planned once it settles.
      elastic_->Finish(absl::StrCat("interrupted: the world changed (now ",
                                    JobStateName(world.state), " at generation ",
                                    world.generation, ")"));
      return true;
    }
    const SaveProgress progress = PauseProgress(in_flight->request);
    std::string failure = progress.error;
    if (progress.committed_id.empty() && failure.empty()) {
      if (!world_->AllPausedAt(world.generation)) return false;
      // Every rank reported its shard before it paused, so reports are missing only if the
      // coordinator lost them (it restarted): the checkpoint cannot commit any more.
      failure = absl::StrCat("every rank paused but only ", progress.shards_done, " of ",
                             world.world_size, " shard reports arrived (the coordinator "
                             "restarted?)");
    }
    checkpoints_->CancelPause(in_flight->request);
    if (!progress.committed_id.empty()) {
      // Training paused right after this checkpoint (or snapshot): the next generation starts
      // from it.
      if (options_.job->snapshot_every > 0) {
        std::optional<MemoryRestorePoint> point =
            snapshots_->Usable(progress.committed_id, world_->LiveNow());
        if (point.has_value()) checkpoints_->SetMemoryRestorePoint(*std::move(point));
      } else if (absl::StatusOr<TrainingStartPoint> start =
                     checkpoints_->SetRestorePoint(progress.committed_id);
                 !start.ok()) {
        spdlog::error("cannot restart from checkpoint {}: {}", progress.committed_id,
                      start.status().message());
      }
    } else {
      spdlog::error("the checkpoint for the re-formation (request {}) failed: {}; re-forming "
                    "from the latest committed checkpoint instead",
                    in_flight->request, failure);
    }
    const std::optional<Reshape> pending = world_->PendingReshape();
    absl::StatusOr<World> reformed =
        pending.has_value() ? world_->ApplyReshape(*pending, now)
                            : absl::StatusOr<World>(absl::FailedPreconditionError(
                                  "nothing to change any more"));
    if (!reformed.ok()) {
      // The workers paused for nothing: let them go on from the checkpoint they just wrote.
      world_->Reform(absl::StrCat("resume after the re-formation was dropped (",
                                  reformed.status().message(), ")"),
                     now);
    }
    elastic_->Finish(progress.committed_id.empty() ? absl::StrCat("failed: ", failure)
                                                   : absl::StrCat("done at checkpoint ",
                                                                  progress.committed_id));
    return true;
  }
  if (checkpoints_ != nullptr && world_->AllPausedAt(world.generation)) {
    // The way out of a pause nobody holds any more: every rank waits for a next generation.
    world_->Reform(absl::StrCat("every rank paused at generation ", world.generation,
                                " with no re-formation in progress; resuming from the latest "
                                "checkpoint"),
                   now);
    return true;
  }
  const std::optional<Reshape> pending = world_->PendingReshape();
  if (!pending.has_value()) return false;
  if (checkpoints_ == nullptr || !checkpoints_->training_started()) {
    if (absl::StatusOr<World> reformed = world_->ApplyReshape(*pending, now); !reformed.ok()) {
      spdlog::warn("re-formation not applied: {}", reformed.status().message());
    }
    return true;
  }
  absl::StatusOr<int64_t> request =
      checkpoints_->RequestSave(pending->generation, /*pause=*/true,
                                /*in_memory=*/options_.job->snapshot_every > 0);
  if (!request.ok()) {
    spdlog::error("cannot ask for the checkpoint of a re-formation: {}",
                  request.status().message());
    return false;
  }
  const std::string description =
      absl::StrCat("re-forming from ", pending->from_size, " to ", pending->to_size,
                   " workers (", pending->reason, ")");
  if (absl::Status started =
          elastic_->Start(InFlightReshape{pending->generation, *request, description, now});
      !started.ok()) {
    spdlog::error("cannot record the re-formation in flight: {}", started.message());
    checkpoints_->CancelPause(*request);
    return false;
  }
  world_->BeginReshaping(pending->generation);
  return true;
}

void CoordinatorCore::CheckProgress(absl::Time now) {
  const CoreOptions::ProgressLease& lease_options = options_.progress;
  if (checkpoints_ == nullptr || lease_options.floor <= absl::ZeroDuration()) return;
  const World world = world_->world();
  if (!Trains(world.state)) return;
  const std::vector<double> step_ms = plan_->RecentStepMs();
  const absl::Duration lease =
      DerivedTimeout(absl::Milliseconds(Quantile(step_ms, 0.99)), lease_options.factor,
                     lease_options.floor, lease_options.ceiling);
  const std::optional<Stall> stall =
      FindStall(world_->Progress(), world.ranks, world.generation, lease,
                absl::Milliseconds(Quantile(step_ms, 0.5)), now);
  if (!stall.has_value() || stall_handled_ == std::make_pair(world.generation, stall->step)) {
    return;
  }
  stall_handled_ = {world.generation, stall->step};
  if (stall->stuck.empty() || !lease_options.evict_stuck) {
    spdlog::warn("{}", stall->description);
    world_->RecordEvent(v1::MEMBERSHIP_EVENT_KIND_STUCK, "", -1,
                        absl::StrCat(stall->description,
                                     stall->stuck.empty() ? "" : "; not evicted (--stuck-policy warn)"),
                        now);
    return;
  }
  for (const RankProgress& rank : stall->stuck) {
    if (absl::Status evicted = world_->Evict(rank.worker_id, rank.incarnation,
                                             stall->description, now);
        !evicted.ok()) {
      spdlog::warn("could not evict worker {}: {}", rank.worker_id, evicted.message());
    }
  }
}

bool CoordinatorCore::Housekeep(absl::Time now) {
  // What this pass fires is answered in one batch at its end (see WorldManager::AnswerFired).
  world_->ExpireLeases(now, /*fired_at_most=*/0);
  CheckProgress(now);
  if (Reconcile(now)) world_->WakeWatches(/*fired_at_most=*/0);
  world_->ExpireWatches(now, /*fired_at_most=*/0);
  plan_->ExpireWaits(now);
  kv_->ExpireWaiters(now);
  return world_->AnswerFired(WorldManager::kAnswersPerPass) > 0;
}

void CoordinatorCore::Close(const absl::Status& reason) {
  kv_->Close(reason);
  world_->CloseWatches(reason);
  plan_->CloseWaits(reason);
}

}  // namespace shard
