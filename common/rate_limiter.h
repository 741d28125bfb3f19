// A token bucket: up to `burst` events at once, refilled at `per_second`. Bounds how fast
// something hostile or broken can make the coordinator do expensive work (a join persists
// state with fsync). Thread-safe.
#pragma once

#include <algorithm>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace shard {

class RateLimiter {
 public:
  RateLimiter(double per_second, double burst)
      : per_second_(per_second), burst_(burst), tokens_(burst) {}

  // Takes one token if there is one.
  bool Allow(absl::Time now) {
    absl::MutexLock lock(&mu_);
    if (last_ != absl::InfinitePast() && now > last_) {
      tokens_ = std::min(burst_, tokens_ + absl::ToDoubleSeconds(now - last_) * per_second_);
    }
    last_ = std::max(last_, now);
    if (tokens_ < 1) return false;
    tokens_ -= 1;
    return true;
  }

 private:
  const double per_second_;
  const double burst_;
  absl::Mutex mu_;
  double tokens_ ABSL_GUARDED_BY(mu_);
  absl::Time last_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
};

}  // namespace shard
