// The re-formation in flight: a resize, a drain or standbys folded in that pauses training at a
// checkpoint of one generation, so that the next generation starts exactly there. It belongs to
// that generation and ends with it (committed and applied, failed, or cancelled because the
// world changed first). Kept in the state directory (record "reshape"), so a coordinator that
// restarts and keeps the generation finishes it. CoordinatorCore::Reconcile drives it
// (docs/control-plane.md has the state machine).
//
// No gRPC. Thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/store/state_store.h"

namespace shard {

struct InFlightReshape {
  int64_t generation = 0;  // of the world that pauses
  int64_t request = 0;     // the pausing save request
  std::string description;
  absl::Time since;
};

class ElasticManager {
 public:
  // With `recover`, takes back the re-formation in flight when the coordinator stopped.
  static absl::StatusOr<std::unique_ptr<ElasticManager>> Create(StateStore* store, bool recover);

  std::optional<InFlightReshape> in_flight() const;
  absl::Status Start(InFlightReshape reshape);
  // The re-formation is over; `outcome` says how, for the log.
  void Finish(const std::string& outcome);

  // What the change in progress waits for, for status ("" when none is in progress).
  std::string transition() const;

 private:
  explicit ElasticManager(StateStore* store) : store_(store) {}
  absl::Status PersistLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  StateStore* const store_;
  mutable absl::Mutex mu_;
  std::optional<InFlightReshape> in_flight_ ABSL_GUARDED_BY(mu_);
};

}  // namespace shard
