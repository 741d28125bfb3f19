#include "server/event_log.h"

#include <utility>

namespace shard {

void EventLog::Restore(const v1::CoordinatorState& record) {
  events_.assign(record.events().begin(), record.events().end());
  last_sequence_ = record.last_event_sequence();
  while (events_.size() > max_events_) events_.pop_front();
}

std::vector<v1::MembershipEvent> EventLog::Append(std::vector<v1::MembershipEvent> events,
                                                  int64_t generation) {
  for (v1::MembershipEvent& event : events) {
    event.set_generation(generation);
    event.set_sequence(++last_sequence_);
    events_.push_back(event);
  }
  while (events_.size() > max_events_) events_.pop_front();
  return events;
}

std::vector<v1::MembershipEvent> EventLog::After(int64_t after) const {
  std::vector<v1::MembershipEvent> events;
  for (const v1::MembershipEvent& event : events_) {
    if (event.sequence() > after) events.push_back(event);
  }
  return events;
}

std::vector<EventLog::Answer> EventLog::Watch(int64_t after, absl::Time deadline,
                                              EventsCallback done) {
  if (!watchers_.closed().ok()) return {Answer{std::move(done), watchers_.closed()}};
  if (after < last_sequence_) return {Answer{std::move(done), After(after)}};
  watchers_.Add(deadline, Watcher{after, std::move(done)});
  return {};
}

std::vector<EventLog::Answer> EventLog::TakeAnswered() {
  std::vector<Answer> answers;
  for (Watcher& watcher :
       watchers_.TakeIf([this](const Watcher& w) { return w.after < last_sequence_; })) {
    answers.push_back(Answer{std::move(watcher.done), After(watcher.after)});
  }
  return answers;
}

std::vector<EventLog::Answer> EventLog::TakeExpired(absl::Time now) {
  std::vector<Answer> answers;
  for (Watcher& watcher : watchers_.TakeExpired(now)) {
    answers.push_back(Answer{std::move(watcher.done), std::vector<v1::MembershipEvent>()});
  }
  return answers;
}

std::vector<EventLog::Answer> EventLog::Close(const absl::Status& reason) {
  std::vector<Answer> answers;
  for (Watcher& watcher : watchers_.Close(reason)) {
    answers.push_back(Answer{std::move(watcher.done), reason});
  }
  return answers;
}

}  // namespace shard
