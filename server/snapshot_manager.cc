#include "server/snapshot_manager.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "spdlog/spdlog.h"

namespace shard {

void SnapshotManager::OnJoin(const std::string& worker_id, uint64_t incarnation,
                             const std::string& address,
                             const std::vector<SnapshotShard>& holdings, absl::Time now) {
  absl::MutexLock lock(&mu_);
  auto known = addresses_.find(worker_id);
  if (known != addresses_.end() && known->second.first != incarnation) {
    for (const auto& [id, entry] : entries_) ForgetWorkerLocked(worker_id, id);
  }
  addresses_[worker_id] = {incarnation, address};
  const SnapshotHolder holder{worker_id, incarnation, address};
  for (const SnapshotShard& shard : holdings) {
    if (absl::Status added = AddLocked(shard, holder, now); !added.ok()) {
      spdlog::warn("{}", std::string(added.message()));
    }
  }
  PruneLocked();
}

absl::Status SnapshotManager::Report(const SnapshotReport& report, absl::Time now) {
  absl::MutexLock lock(&mu_);
  auto known = addresses_.find(report.worker_id);
  if (known != addresses_.end() && known->second.first != report.incarnation) {
    for (const auto& [id, entry] : entries_) ForgetWorkerLocked(report.worker_id, id);
  }
  std::string address = report.snapshot_address;
  if (address.empty() && known != addresses_.end() && known->second.first == report.incarnation) {
    address = known->second.second;
  }
  if (address.empty() && !report.held.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "worker ", report.worker_id, " reports snapshot shards but no address to fetch them at"));
  }
  addresses_[report.worker_id] = {report.incarnation, address};
  for (const std::string& id : report.dropped) ForgetWorkerLocked(report.worker_id, id);
  if (!report.failed_id.empty()) {
    if (auto it = entries_.find(report.failed_id); it != entries_.end()) {
      it->second.failure = absl::StrCat("worker ", report.worker_id, ": ", report.error);
    }
    spdlog::warn("worker {} could not take its shard of snapshot {}: {}", report.worker_id,
                 report.failed_id, report.error);
  }
  absl::Status result;
  const SnapshotHolder holder{report.worker_id, report.incarnation, address};
  for (const SnapshotShard& shard : report.held) {
    if (absl::Status added = AddLocked(shard, holder, now); !added.ok() && result.ok()) {
      result = added;
    }
  }
  PruneLocked();
  return result;
}

absl::Status SnapshotManager::AddLocked(const SnapshotShard& shard, const SnapshotHolder& holder,
                                        absl::Time now) {
  if (discarded_.count(shard.id) > 0) return absl::OkStatus();  // never to be used again
  auto [it, created] = entries_.try_emplace(shard.id);
  Entry& entry = it->second;
  const int world = shard.plan.world_size;
  if (created) {
    entry.generation = shard.generation;
    entry.step = shard.step;
    entry.shards.resize(world);
    entry.holders.resize(world);
    entry.ever_held_by.resize(world);
    entry.first_seen = now;
  }
  if (static_cast<int>(entry.shards.size()) != world || shard.rank >= world) {
    return absl::FailedPreconditionError(absl::StrCat(
        "worker ", holder.worker_id, " reports rank ", shard.rank, "'s shard of snapshot ",
        shard.id, " in a world of ", world, "; others reported a world of ",
        entry.shards.size()));
  }
  std::optional<SnapshotShard>& known = entry.shards[shard.rank];
  if (known.has_value() && (known->record != shard.record || known->plan_hash != shard.plan_hash ||
                            known->counters != shard.counters)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "worker ", holder.worker_id, " reports rank ", shard.rank, "'s shard of snapshot ",
        shard.id, " with other checksums, plan or counters than it was reported with before; "
        "not listing it"));
  }
  if (!known.has_value()) known = shard;
  entry.request = std::max(entry.request, shard.request);
  std::vector<SnapshotHolder>& holders = entry.holders[shard.rank];
  holders.erase(std::remove_if(holders.begin(), holders.end(),
                               [&](const SnapshotHolder& h) {
                                 return h.worker_id == holder.worker_id;
                               }),
                holders.end());
  holders.push_back(holder);
  entry.ever_held_by[shard.rank].insert(holder.worker_id);
  if (!entry.usable_since.has_value() &&
      std::all_of(entry.holders.begin(), entry.holders.end(),
                  [](const std::vector<SnapshotHolder>& h) { return !h.empty(); })) {
    entry.usable_since = now;
  }
  return absl::OkStatus();
}

void SnapshotManager::ForgetWorkerLocked(const std::string& worker_id, const std::string& id) {
  auto it = entries_.find(id);
  if (it == entries_.end()) return;
  for (std::vector<SnapshotHolder>& holders : it->second.holders) {
    holders.erase(std::remove_if(holders.begin(), holders.end(),
                                 [&](const SnapshotHolder& h) { return h.worker_id == worker_id; }),
                  holders.end());
  }
}

void SnapshotManager::PruneLocked() {
  // Snapshots nobody holds any more go; beyond the cap, the oldest go.
  for (auto it = entries_.begin(); it != entries_.end();) {
    const bool held = std::any_of(it->second.holders.begin(), it->second.holders.end(),
                                  [](const std::vector<SnapshotHolder>& h) { return !h.empty(); });
    it = held ? std::next(it) : entries_.erase(it);
  }
  const std::vector<std::string> order = OrderLocked();
  for (size_t i = options_.max_snapshots; i < order.size(); ++i) entries_.erase(order[i]);
}

std::vector<std::string> SnapshotManager::OrderLocked() const {
  std::vector<std::string> ids;
  for (const auto& [id, entry] : entries_) ids.push_back(id);
  std::sort(ids.begin(), ids.end(), [this](const std::string& a, const std::string& b) {
    const Entry& x = entries_.at(a);
    const Entry& y = entries_.at(b);
    return NewerSnapshot(x.generation, x.step, y.generation, y.step);
  });
  return ids;
}

std::optional<MemoryRestorePoint> SnapshotManager::UsableLocked(const std::string& id,
                                                                const Entry& entry,
                                                                const IsLive& live) const {
  if (discarded_.count(id) > 0) return std::nullopt;
  MemoryRestorePoint point;
  for (size_t rank = 0; rank < entry.shards.size(); ++rank) {
    if (!entry.shards[rank].has_value()) return std::nullopt;
    std::vector<SnapshotHolder> holders;
    for (const SnapshotHolder& holder : entry.holders[rank]) {
      if (live(holder.worker_id, holder.incarnation)) holders.push_back(holder);
    }
    if (holders.empty()) return std::nullopt;
    point.shards.push_back(*entry.shards[rank]);
    point.holders.push_back(std::move(holders));
  }
  return point;
}

namespace {

int LiveCount(const std::vector<SnapshotHolder>& holders, const IsLive& live) {
  return static_cast<int>(std::count_if(holders.begin(), holders.end(), [&](const SnapshotHolder& h) {
    return live(h.worker_id, h.incarnation);
  }));
}

}  // namespace

int SnapshotManager::CopiesLocked(const Entry& entry, const IsLive& live) const {
  int copies = std::numeric_limits<int>::max();
  for (const std::vector<SnapshotHolder>& holders : entry.holders) {
    copies = std::min(copies, LiveCount(holders, live));
  }
  return entry.holders.empty() ? 0 : copies;
}

SnapshotManager::Newest SnapshotManager::NewestUsable(const IsLive& live) const {
  absl::ReaderMutexLock lock(&mu_);
  Newest newest;
  for (const std::string& id : OrderLocked()) {
    const Entry& entry = entries_.at(id);
    if (std::optional<MemoryRestorePoint> point = UsableLocked(id, entry, live)) {
      newest.point = std::move(point);
      return newest;
    }
    if (!newest.why_not.empty()) continue;
    // Why the newest snapshot is not usable, for the event that says where training restarts.
    for (size_t rank = 0; rank < entry.shards.size() && newest.why_not.empty(); ++rank) {
      if (!entry.shards[rank].has_value()) {
        newest.why_not = absl::StrCat("rank ", rank, "'s shard of ", id, " was never taken");
      } else if (LiveCount(entry.holders[rank], live) == 0) {
        const std::set<std::string>& had = entry.ever_held_by[rank];
        newest.why_not = absl::StrCat("rank ", rank, "'s shard of ", id,
                                      " is held by no live worker (it was on ",
                                      absl::StrJoin(had, ", "), ")");
      }
    }
  }
  return newest;
}

std::optional<MemoryRestorePoint> SnapshotManager::Usable(const std::string& id,
                                                          const IsLive& live) const {
  absl::ReaderMutexLock lock(&mu_);
  auto it = entries_.find(id);
  if (it == entries_.end()) return std::nullopt;
  return UsableLocked(id, it->second, live);
}

SaveProgress SnapshotManager::PauseProgress(int64_t request, const IsLive& live) const {
  absl::ReaderMutexLock lock(&mu_);
  SaveProgress progress;
  for (const auto& [id, entry] : entries_) {
    if (entry.request != request) continue;
    progress.world_size = static_cast<int>(entry.shards.size());
    for (size_t rank = 0; rank < entry.shards.size(); ++rank) {
      if (!entry.shards[rank].has_value()) continue;
      ++progress.shards_done;
      progress.bytes_done += entry.shards[rank]->record.bytes;
    }
    if (!entry.failure.empty()) {
      progress.error = absl::StrCat("snapshot ", id, " failed: ", entry.failure);
    } else if (UsableLocked(id, entry, live).has_value()) {
      progress.committed_id = id;
    }
    return progress;
  }
  return progress;
}

std::vector<SnapshotHolder> SnapshotManager::Holders(const std::string& id, int rank,
                                                     const IsLive& live) const {
  absl::ReaderMutexLock lock(&mu_);
  std::vector<SnapshotHolder> holders;
  auto it = entries_.find(id);
  if (it == entries_.end() || rank < 0 || rank >= static_cast<int>(it->second.holders.size())) {
    return holders;
  }
  for (const SnapshotHolder& holder : it->second.holders[rank]) {
    if (live(holder.worker_id, holder.incarnation)) holders.push_back(holder);
  }
  return holders;
}

void SnapshotManager::Discard(const std::string& id, const std::string& why) {
  absl::MutexLock lock(&mu_);
  if (!discarded_.insert(id).second) return;
  entries_.erase(id);
  spdlog::warn("memory snapshot {} is not used again: {}", id, why);
}

void SnapshotManager::DiscardNewerThan(int64_t generation, int64_t step) {
  absl::MutexLock lock(&mu_);
  for (auto it = entries_.begin(); it != entries_.end();) {
    if (NewerSnapshot(it->second.generation, it->second.step, generation, step)) {
      discarded_.insert(it->first);
      it = entries_.erase(it);
    } else {
      ++it;
    }
  }
}

void SnapshotManager::DiscardAll(const std::string& why) {
  absl::MutexLock lock(&mu_);
  if (entries_.empty()) return;
  for (const auto& [id, entry] : entries_) discarded_.insert(id);
  spdlog::info("{} memory snapshots are not used again: {}", entries_.size(), why);
  entries_.clear();
}

SnapshotSummary SnapshotManager::Summary(const IsLive& live, absl::Time now) const {
  absl::ReaderMutexLock lock(&mu_);
  SnapshotSummary summary;
  const std::vector<std::string> order = OrderLocked();
  for (const std::string& id : order) {
    const Entry& entry = entries_.at(id);
    if (!UsableLocked(id, entry, live).has_value()) continue;
    summary.usable_id = id;
    summary.usable_step = entry.step;
    summary.usable_since = entry.usable_since;
    summary.usable_copies = CopiesLocked(entry, live);
    break;
  }
  // How far the newest snapshot taken is from being fully replicated.
  for (const std::string& id : order) {
    const Entry& entry = entries_.at(id);
    const int wanted = std::min<int>(1 + options_.replicas, static_cast<int>(entry.shards.size()));
    const bool replicated =
        std::all_of(entry.shards.begin(), entry.shards.end(),
                    [](const std::optional<SnapshotShard>& s) { return s.has_value(); }) &&
        CopiesLocked(entry, live) >= wanted;
    if (replicated) {
      summary.replica_lag_steps = entries_.at(order.front()).step - entry.step;
      return summary;
    }
    if (id == order.front()) summary.replica_lag = now - entry.first_seen;
  }
  // None is: the newest taken is that many steps ahead of nothing.
  if (!order.empty()) summary.replica_lag_steps = entries_.at(order.front()).step;
  return summary;
}

}  // namespace shard
