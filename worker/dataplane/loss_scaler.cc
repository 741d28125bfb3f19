#include "worker/dataplane/loss_scaler.h"

#include <cmath>

#include "absl/strings/str_cat.h"

namespace shard {

absl::StatusOr<LossScaler> LossScaler::Create(LossScalerOptions options) {
  if (!(options.init_scale > 0) || !std::isfinite(options.init_scale)) {
    return absl::InvalidArgumentError(
        absl::StrCat("loss scaler: init_scale must be positive and finite, got ",
                     options.init_scale));
  }
  if (!(options.growth_factor > 1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "loss scaler: growth_factor must be greater than 1, got ", options.growth_factor));
  }
  if (!(options.backoff_factor > 0 && options.backoff_factor < 1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "loss scaler: backoff_factor must be in (0, 1), got ", options.backoff_factor));
  }
  if (options.growth_interval < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "loss scaler: growth_interval must be at least 1, got ", options.growth_interval));
  }
  return LossScaler(options);
}

bool LossScaler::Update(bool found_inf) {
  if (found_inf) {
    scale_ = scale_ * options_.backoff_factor;
    growth_tracker_ = 0;
    return false;
  }
  if (++growth_tracker_ == options_.growth_interval) {
    const float grown = scale_ * options_.growth_factor;
    if (std::isfinite(grown)) scale_ = grown;
    growth_tracker_ = 0;
  }
  return true;
}

absl::Status LossScaler::Restore(float scale, int64_t growth_tracker) {
  if (!(scale > 0) || !std::isfinite(scale) || growth_tracker < 0 ||
      growth_tracker >= options_.growth_interval) {
    return absl::InvalidArgumentError(absl::StrCat(
        "loss scaler: cannot continue from scale ", scale, " with ", growth_tracker,
        " clean steps (growth interval ", options_.growth_interval, ")"));
  }
  scale_ = scale;
  growth_tracker_ = growth_tracker;
  return absl::OkStatus();
}

}  // namespace shard
