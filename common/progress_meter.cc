#include "common/progress_meter.h"

#include <algorithm>

namespace shard {

void ProgressMeter::Note(int64_t generation, int64_t step, double loss, absl::Time now) {
  if (generation != generation_) {
    generation_ = generation;
    samples_.clear();
  } else if (!samples_.empty() && step <= samples_.back().second) {
    return;  // another rank's report of a step already counted
  }
  samples_.emplace_back(now, step);
  loss_ = loss;
  while (samples_.size() > 2 && samples_.back().first - samples_[1].first >= window_) {
    samples_.pop_front();
  }
}

double ProgressMeter::steps_per_second() const {
  if (samples_.size() < 2) return 0;
  const absl::Duration elapsed = samples_.back().first - samples_.front().first;
  if (elapsed <= absl::ZeroDuration()) return 0;
  return static_cast<double>(samples_.back().second - samples_.front().second) /
         absl::ToDoubleSeconds(elapsed);
}

std::optional<absl::Duration> ProgressMeter::Remaining(int64_t total_steps) const {
  const double rate = steps_per_second();
  if (rate <= 0) return std::nullopt;
  return absl::Seconds(static_cast<double>(std::max<int64_t>(0, total_steps - step())) / rate);
}

}  // namespace shard
