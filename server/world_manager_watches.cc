// WorldManager's long-polls: which held heartbeats and event watches a change fires, their
// answers (delivered outside the lock, in chunks), expiry, and shutdown. The membership rules
// and the handlers that change the world are in world_manager.cc.
#include <utility>

#include "server/reachability.h"
#include "server/world_manager.h"

namespace shard {

bool WorldManager::WatchFires(const World& world, const Watch& watch) const {
  const shard::Member* member = membership_.Find(watch.worker_id);
  if (member == nullptr || member->role == Role::kDeparted ||
      (member->role == Role::kLeaving && !HeldLocked(*member)) || membership_.stop_requested()) {
    return true;
  }
  // While the world forms, its generation does not concern the waiting workers.
  return world.state != watch.known_state ||
         (Trains(world.state) && world.generation != watch.known_generation);
}

absl::StatusOr<HeartbeatOutcome> WorldManager::OutcomeLocked(const std::string& worker_id,
                                                             const World& world) const {
  const shard::Member* member = membership_.Find(worker_id);
  if (member == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("worker '", worker_id, "' is no longer a member (unknown); join again"));
  }
  if (member->role == Role::kDeparted) return DepartedStatus(*member);
  HeartbeatOutcome outcome;
  outcome.world = world;
  outcome.rank = member->rank;
  if (member->role == Role::kStandby && !member->unreachable.empty()) {
    outcome.probe = ProbeTargets(membership_, worker_id);
  }
  if (HeldLocked(*member)) {
    // Not yet: the new world still reads state this worker holds.
  } else if (member->role == Role::kLeaving) {
    outcome.stop = true;
    outcome.stop_reason = member->detail;
  } else if (membership_.stop_requested()) {
    outcome.stop = true;
    outcome.stop_reason = membership_.stop_reason;
  }
  return outcome;
}

WorldManager::Answers WorldManager::TakeChangedWatchesLocked(
    const World& before, const std::set<std::string>& touched) {
  Answers answers;
  const World world = WorldLocked();
  std::vector<Watch> fired;
  if (world.state != before.state || world.generation != before.generation ||
      membership_.stop_requested()) {
    fired = watches_.TakeIf([&](const Watch& watch) { return WatchFires(world, watch); });
    for (const Watch& watch : fired) {
      if (auto it = watch_of_.find(watch.worker_id);
          it != watch_of_.end() && !watches_.contains(it->second)) {
        watch_of_.erase(it);
      }
    }
  } else {
    // The world is the same: only a worker that left or was told to leave hears something new,
    // and only a member the change touched can be one (a join is O(1), not O(watches)).
    for (const std::string& id : touched) {
      const shard::Member* member = membership_.Find(id);
      if (member != nullptr && member->role != Role::kDeparted && member->role != Role::kLeaving) {
        continue;
      }
      auto it = watch_of_.find(id);
      if (it == watch_of_.end()) continue;
      if (std::optional<Watch> watch = watches_.Take(it->second)) {
        fired.push_back(std::move(*watch));
      }
      watch_of_.erase(it);
    }
  }
  FireLocked(std::move(fired));
  answers.events = events_.TakeAnswered();
  return answers;
}

void WorldManager::FireLocked(std::vector<Watch> fired) {
  for (Watch& watch : fired) fired_.push_back(std::move(watch));
}

void WorldManager::Deliver(Answers answers, size_t fired_at_most) {
  for (auto& [done, outcome] : answers.heartbeats) done(std::move(outcome));
  for (EventLog::Answer& answer : answers.events) answer.done(std::move(answer.events));
  AnswerFired(fired_at_most);
}

size_t WorldManager::AnswerFired(size_t at_most) {
  // In chunks, so that the lock is not held across thousands of answers.
  constexpr size_t kChunk = 256;
  size_t answered = 0;
  while (answered < at_most) {
    std::vector<std::pair<HeartbeatCallback, absl::StatusOr<HeartbeatOutcome>>> chunk;
    {
      absl::MutexLock lock(&mu_);
      const World world = WorldLocked();
      while (!fired_.empty() && chunk.size() < kChunk && answered + chunk.size() < at_most) {
        Watch& watch = fired_.front();
        absl::StatusOr<HeartbeatOutcome> outcome =
            watches_.closed().ok() ? OutcomeLocked(watch.worker_id, world)
                                   : absl::StatusOr<HeartbeatOutcome>(watches_.closed());
        chunk.emplace_back(std::move(watch.done), std::move(outcome));
        fired_.pop_front();
      }
      if (chunk.empty()) return fired_.size();
    }
    answered += chunk.size();
    for (auto& [done, outcome] : chunk) done(std::move(outcome));
  }
  absl::MutexLock lock(&mu_);
  return fired_.size();
}

void WorldManager::ExpireWatches(absl::Time now, size_t fired_at_most) {
  Answers answers;
  {
    absl::MutexLock lock(&mu_);
    std::vector<Watch> expired = watches_.TakeExpired(now);
    for (const Watch& watch : expired) {
      if (auto it = watch_of_.find(watch.worker_id);
          it != watch_of_.end() && !watches_.contains(it->second)) {
        watch_of_.erase(it);
      }
    }
    FireLocked(std::move(expired));
    answers.events = events_.TakeExpired(now);
  }
  Deliver(std::move(answers), fired_at_most);
}

void WorldManager::WakeWatches(size_t fired_at_most) {
  {
    absl::MutexLock lock(&mu_);
    FireLocked(watches_.TakeAll());
    watch_of_.clear();
  }
  AnswerFired(fired_at_most);
}

void WorldManager::CloseWatches(const absl::Status& reason) {
  Answers answers;
  {
    absl::MutexLock lock(&mu_);
    FireLocked(watches_.Close(reason));  // answered with `reason` by AnswerFired
    watch_of_.clear();
    answers.events = events_.Close(reason);
  }
  Deliver(std::move(answers));
}

void WorldManager::WatchEvents(int64_t after, absl::Time deadline, EventsCallback done) {
  Answers answers;
  {
    absl::MutexLock lock(&mu_);
    answers.events = events_.Watch(after, deadline, std::move(done));
  }
  Deliver(std::move(answers));
}

}  // namespace shard
