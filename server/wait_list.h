// The one wait list behind every long-poll the coordinator holds: heartbeats waiting for the
// world to change, event watches, rank 1..n waiting for rank 0's gradient order, rendezvous
// waits for keys. An entry is answered when what it waits for happens (Take, TakeIf) or when its
// deadline passes (TakeExpired), or when the list closes at shutdown (Close): a closed list holds
// nothing more, so its owner answers new waits at once with the reason. Expiry pops a heap, so a pass costs O(expired · log n) however
// many entries wait (10,000 workers each hold a heartbeat). Order is deterministic: by deadline,
// then by the order entries were added.
//
// Not thread-safe: the owning manager guards it with its lock and runs the answers' callbacks
// after releasing that lock.
#pragma once

#include <cassert>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <queue>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace shard {

template <typename Entry>
class WaitList {
 public:
  using Id = uint64_t;

  // Only while open: once closed, answer with closed() instead (nothing would answer it).
  Id Add(absl::Time deadline, Entry entry) {
    assert(closed_.ok());
    const Id id = next_id_++;
    entries_.emplace(id, Slot{deadline, std::move(entry)});
    deadlines_.emplace(deadline, id);
    return id;
  }

  // The entry `id` if it still waits.
  std::optional<Entry> Take(Id id) {
    auto it = entries_.find(id);
    if (it == entries_.end()) return std::nullopt;
    Entry entry = std::move(it->second.entry);
    entries_.erase(it);
    return entry;
  }

  // Every waiting entry `match(const Entry&)` accepts, oldest first.
  template <typename Match>
  std::vector<Entry> TakeIf(Match match) {
    std::vector<Entry> taken;
    for (auto it = entries_.begin(); it != entries_.end();) {
      if (match(it->second.entry)) {
        taken.push_back(std::move(it->second.entry));
        it = entries_.erase(it);
      } else {
        ++it;
      }
    }
    return taken;
  }

  std::vector<Entry> TakeAll() {
    return TakeIf([](const Entry&) { return true; });
  }

  // The entries whose deadline is at or before `now`, earliest first.
  std::vector<Entry> TakeExpired(absl::Time now) {
    std::vector<Entry> expired;
    while (!deadlines_.empty() && deadlines_.top().first <= now) {
      const Id id = deadlines_.top().second;
      deadlines_.pop();
      // Entries answered early leave their heap node behind; it is dropped here.
      if (std::optional<Entry> entry = Take(id)) expired.push_back(std::move(*entry));
    }
    if (entries_.empty()) deadlines_ = {};
    return expired;
  }

  // Every waiting entry, to be answered with `reason`; from now on closed() is `reason` (not
  // OK) and the list holds nothing more.
  std::vector<Entry> Close(absl::Status reason) {
    closed_ = std::move(reason);
    return TakeAll();
  }
  // OK while the list is open; why it closed after.
  const absl::Status& closed() const { return closed_; }

  bool contains(Id id) const { return entries_.count(id) > 0; }
  size_t size() const { return entries_.size(); }
  bool empty() const { return entries_.empty(); }

 private:
  struct Slot {
    absl::Time deadline;
    Entry entry;
  };
  using Deadline = std::pair<absl::Time, Id>;

  std::map<Id, Slot> entries_;
  std::priority_queue<Deadline, std::vector<Deadline>, std::greater<Deadline>> deadlines_;
  Id next_id_ = 1;
  absl::Status closed_;
};

}  // namespace shard
