// How fast training goes, from the steps the ranks report: the latest step and its loss, the
// rate over a recent window, the time left at that rate. Pure (times are given), so the
// coordinator's status and the simulation see the same arithmetic.
#pragma once

#include <cstdint>
#include <deque>
#include <optional>
#include <utility>

#include "absl/time/time.h"

namespace shard {

class ProgressMeter {
 public:
  explicit ProgressMeter(absl::Duration window = absl::Seconds(30)) : window_(window) {}

  // A rank finished `step` of `generation` with global loss `loss` at `now`. The first report of
  // a new generation starts over (a restore may go back to an earlier step); within one
  // generation only later steps count, as every rank reports every step.
  void Note(int64_t generation, int64_t step, double loss, absl::Time now);

  bool has_step() const { return !samples_.empty(); }
  int64_t step() const { return samples_.empty() ? 0 : samples_.back().second; }
  double loss() const { return loss_; }
  // Steps per second over the reports of this generation within `window` of the latest one;
  // 0 until there are two.
  double steps_per_second() const;
  // Time to reach `total_steps` at that rate; unset without a rate.
  std::optional<absl::Duration> Remaining(int64_t total_steps) const;

 private:
  const absl::Duration window_;
  int64_t generation_ = -1;
  std::deque<std::pair<absl::Time, int64_t>> samples_;  // (when, step), steps increasing
  double loss_ = 0;
};

}  // namespace shard
