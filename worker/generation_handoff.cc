#include "worker/generation_handoff.h"

#include "absl/strings/str_cat.h"

namespace shard {

absl::StatusOr<TrainResult> GenerationHandoff::Train(const JobConfig& job,
                                                     Communicator& communicator,
                                                     PlanProvider& plans,
                                                     const TrainerOptions& options) {
  absl::MutexLock lock(&mu_);
  if (closed_.has_value()) {
    return absl::CancelledError(absl::StrCat("the training loop is gone: ", closed_->message()));
  }
  offered_ = Generation{&job, &communicator, &plans, &options};
  taken_ = false;
  returned_.reset();
  auto answered = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return returned_.has_value() || closed_.has_value();
  };
  mu_.Await(absl::Condition(&answered));
  offered_.reset();
  if (!returned_.has_value()) {
    return absl::CancelledError(absl::StrCat("the training loop is gone: ", closed_->message()));
  }
  absl::StatusOr<TrainResult> result = std::move(*returned_);
  returned_.reset();
  return result;
}

absl::StatusOr<std::optional<GenerationHandoff::Generation>> GenerationHandoff::Next() {
  absl::MutexLock lock(&mu_);
  auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return (offered_.has_value() && !taken_) || closed_.has_value();
  };
  mu_.Await(absl::Condition(&ready));
  if (offered_.has_value() && !taken_) {
    taken_ = true;
    return offered_;
  }
  if (!closed_->ok()) return *closed_;
  return std::optional<Generation>();
}

void GenerationHandoff::Return(absl::StatusOr<TrainResult> result) {
  absl::MutexLock lock(&mu_);
  if (offered_.has_value() && taken_) returned_ = std::move(result);
}

void GenerationHandoff::Close(absl::Status why) {
  absl::MutexLock lock(&mu_);
  if (!closed_.has_value()) closed_ = std::move(why);
}

}  // namespace shard
