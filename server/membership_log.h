// How the membership survives the coordinator: the state store's journaled record "membership"
// holds a snapshot (v1::CoordinatorState: the job-level fields, every live member, the recent
// events) and deltas of the same message type that carry the job-level fields, the members a
// change touched (upserted; departed ones listed in removed_members) and the change's events.
// A change costs O(what it touched); a snapshot is written again once the deltas outgrow it, so
// the journal stays proportional to the world. Not thread-safe (WorldManager's lock).
#pragma once

#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/event_log.h"
#include "server/membership.h"
#include "server/store/state_store.h"

namespace shard {

class MembershipLog {
 public:
  static constexpr int kFormatVersion = 2;

  MembershipLog(StateStore* store, std::string job) : store_(store), job_(std::move(job)) {}

  // The saved record (its snapshot with every durable delta applied, keeping the newest
  // `max_events` events as the coordinator does), or nullopt if the job was never saved. Also
  // reads a format-1 record ("membership.json" of earlier releases).
  static absl::StatusOr<std::optional<v1::CoordinatorState>> Load(StateStore* store,
                                                                 size_t max_events);

  // Records a change: the job-level fields of `membership` at `generation`, the members in
  // `dirty` and `events` (as the event log numbered them). Returns the store's sequence number
  // to wait for before acknowledging the change.
  uint64_t Record(const Membership& membership, int64_t generation,
                  const std::set<std::string>& dirty,
                  const std::vector<v1::MembershipEvent>& events, const EventLog& log);
  // Writes the whole record as a new snapshot.
  uint64_t Compact(const Membership& membership, int64_t generation, const EventLog& log);

  // The whole record.
  v1::CoordinatorState Snapshot(const Membership& membership, int64_t generation,
                                const EventLog& log) const;

 private:
  StateStore* const store_;
  const std::string job_;
  size_t delta_bytes_ = 0;     // appended since the last snapshot
  size_t snapshot_bytes_ = 0;  // of the last snapshot
};

// Why the recorded job stops (kNone: it does not); also for records of earlier releases, which
// kept only the stop's reason.
StopKind SavedStopKind(const v1::CoordinatorState& record);

// The record's live members as a membership (a restarted coordinator takes them back), each
// with its lease starting at `heartbeat`.
Membership RestoreMembership(const v1::CoordinatorState& record, int default_target,
                             absl::Time heartbeat, absl::Time now);

}  // namespace shard
