// The job's membership history: events numbered from 1 over the job's life and stamped with
// the generation after them, the most recent `max_events` kept (and persisted with the
// membership), and the long-polls of `shardctl events --follow` waiting for the next one.
// Not thread-safe: WorldManager guards it with its lock and runs answers after releasing it.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <vector>

#include "absl/time/time.h"
#include "server/types.h"
#include "server/wait_list.h"

namespace shard {

class EventLog {
 public:
  // An answer to deliver once the lock is released.
  struct Answer {
    EventsCallback done;
    absl::StatusOr<std::vector<v1::MembershipEvent>> events;
  };

  explicit EventLog(size_t max_events) : max_events_(max_events) {}

  // Takes back the history kept in a membership record.
  void Restore(const v1::CoordinatorState& record);
  // Numbers `events`, stamps them with `generation`, keeps them; returns them as kept.
  std::vector<v1::MembershipEvent> Append(std::vector<v1::MembershipEvent> events,
                                          int64_t generation);
  // Events after sequence number `after`, oldest first.
  std::vector<v1::MembershipEvent> After(int64_t after) const;
  int64_t last_sequence() const { return last_sequence_; }
  const std::deque<v1::MembershipEvent>& events() const { return events_; }

  // Holds `done` until an event after `after` is recorded or `deadline` passes; answers at once
  // (returned) if there are such events already, or with Close's reason once closed.
  std::vector<Answer> Watch(int64_t after, absl::Time deadline, EventsCallback done);
  // The watches that have news now, and those whose deadline passed (with no events).
  std::vector<Answer> TakeAnswered();
  std::vector<Answer> TakeExpired(absl::Time now);
  // Every watch, answered with `reason` (at shutdown); later watches too.
  std::vector<Answer> Close(const absl::Status& reason);

 private:
  struct Watcher {
    int64_t after;
    EventsCallback done;
  };

  const size_t max_events_;
  std::deque<v1::MembershipEvent> events_;
  int64_t last_sequence_ = 0;
  WaitList<Watcher> watchers_;
};

}  // namespace shard
