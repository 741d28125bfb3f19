#include "server/elastic_manager.h"

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "spdlog/spdlog.h"

namespace shard {

bool ElasticManager::Reconcile(absl::Time now) {
  const std::optional<Reshape> pending = world_->PendingReshape();
  absl::MutexLock lock(&mu_);
  if (in_flight_.has_value()) {
    const World world = world_->world();
    if (world.generation != in_flight_->reshape.generation || world.state != JobState::kRunning) {
      // A failure (or a stop) came first; the world is re-planned once it settles.
      spdlog::warn("re-formation from {} to {} workers interrupted at generation {}: the world "
                   "changed",
                   in_flight_->reshape.from_size, in_flight_->reshape.to_size, world.generation);
      checkpoints_->CancelPause(in_flight_->request);
      in_flight_.reset();
      return true;
    }
    const SaveProgress progress = checkpoints_->Progress(in_flight_->request);
    if (progress.committed_id.empty() && progress.error.empty()) return false;
    const int64_t request = in_flight_->request;
    in_flight_.reset();
    if (!progress.committed_id.empty()) {
      // Training paused right after this checkpoint: the next generation starts from it.
      if (absl::StatusOr<TrainingStartPoint> start =
              checkpoints_->SetRestorePoint(progress.committed_id);
          !start.ok()) {
        spdlog::error("cannot restart from checkpoint {}: {}", progress.committed_id,
                      start.status().message());
      }
    } else {
      spdlog::error("the checkpoint for the re-formation (request {}) failed: {}; re-forming from "
                    "the latest committed checkpoint instead",
                    request, progress.error);
    }
    checkpoints_->CancelPause(request);
    absl::StatusOr<World> reformed =
        pending.has_value() ? world_->ApplyReshape(*pending, now)
                            : absl::StatusOr<World>(absl::FailedPreconditionError("nothing to change"));
    if (!reformed.ok()) {
      // The workers paused for nothing: let them go on from the checkpoint they just wrote.
      world_->Reform(absl::StrCat("resume after the re-formation was dropped (",
                                  reformed.status().message(), ")"),
                     now);
    }
    return true;
  }
  if (!pending.has_value()) return false;
  if (checkpoints_ == nullptr || !checkpoints_->training_started()) {
    if (absl::StatusOr<World> reformed = world_->ApplyReshape(*pending, now); !reformed.ok()) {
      spdlog::warn("re-formation not applied: {}", reformed.status().message());
    }
    return true;
  }
  absl::StatusOr<int64_t> request = checkpoints_->RequestSave(/*pause=*/true);
  if (!request.ok()) {
    spdlog::error("cannot ask for the checkpoint of a re-formation: {}", request.status().message());
    return false;
  }
  in_flight_ = InFlight{*pending, *request, now};
  spdlog::info("re-forming from {} to {} workers ({}): checkpoint requested (request {}); "
               "training pauses at the next step boundary",
               pending->from_size, pending->to_size, pending->reason, *request);
  return true;
}

std::string ElasticManager::transition() const {
  absl::MutexLock lock(&mu_);
  if (!in_flight_.has_value()) return "";
  return absl::StrCat("re-forming from ", in_flight_->reshape.from_size, " to ",
                      in_flight_->reshape.to_size, " workers (", in_flight_->reshape.reason,
                      "): waiting for the checkpoint of request ", in_flight_->request);
}

}  // namespace shard
