// Retrying a call: which errors a retry may cure, and how long to wait before each retry. A
// value type with no clock of its own: the caller does the waiting (and decides when to give
// up), so the sequence is the same in a test, the simulator and a worker.
#pragma once

#include <algorithm>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace shard {

// Unavailable or DeadlineExceeded: the other side may answer if asked again.
inline bool IsTransient(const absl::Status& status) {
  return absl::IsUnavailable(status) || absl::IsDeadlineExceeded(status);
}

class Backoff {
 public:
  Backoff(absl::Duration initial, absl::Duration max, double factor = 2)
      : initial_(initial), max_(max), factor_(factor), next_(initial) {}

  // The delay before the next retry: `initial` first, then `factor` times the previous one; at
  // most `max` (the one set when it is asked for).
  absl::Duration Next() {
    const absl::Duration delay = std::min(next_, max_);
    next_ = delay * factor_;
    return delay;
  }
  // After a success: the next delay is `initial` again.
  void Reset() { next_ = initial_; }
  // A new cap for the delays from now on (a heartbeat interval the coordinator changed, say).
  void set_max(absl::Duration max) { max_ = max; }

 private:
  absl::Duration initial_;
  absl::Duration max_;
  double factor_;
  absl::Duration next_;
};

}  // namespace shard
