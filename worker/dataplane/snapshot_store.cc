#include "worker/dataplane/snapshot_store.h"

#include <algorithm>
#include <set>

namespace shard {
namespace {

// Buffers kept for reuse beyond those held: enough for the next snapshot's own shard and its
// replicas.
constexpr size_t kFreeBuffers = 4;

}  // namespace

std::vector<char> SnapshotStore::TakeBuffer(uint64_t bytes) {
  std::vector<char> buffer;
  {
    absl::MutexLock lock(&mu_);
    // The smallest free buffer that fits, else the largest (grown below).
    auto fits = free_.end();
    auto largest = free_.end();
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->capacity() >= bytes && (fits == free_.end() || it->capacity() < fits->capacity())) {
        fits = it;
      }
      if (largest == free_.end() || it->capacity() > largest->capacity()) largest = it;
    }
    const auto best = fits != free_.end() ? fits : largest;
    if (best != free_.end()) {
      buffer = std::move(*best);
      free_.erase(best);
    }
  }
  buffer.resize(bytes);
  return buffer;
}

std::vector<std::string> SnapshotStore::SnapshotIdsLocked() const {
  std::vector<const SnapshotShard*> newest;  // one shard per snapshot id
  std::set<std::string> seen;
  for (const auto& [key, entry] : shards_) {
    if (seen.insert(key.first).second) newest.push_back(&entry.shard);
  }
  std::sort(newest.begin(), newest.end(), [](const SnapshotShard* a, const SnapshotShard* b) {
    return NewerSnapshot(a->generation, a->step, b->generation, b->step);
  });
  std::vector<std::string> ids;
  for (const SnapshotShard* shard : newest) ids.push_back(shard->id);
  return ids;
}

void SnapshotStore::RecycleLocked(SnapshotBytes bytes) {
  // Only a buffer nobody reads any more can be handed out again; a reader's copy of the
  // pointer frees it when it is done.
  if (bytes.use_count() == 1 && free_.size() < kFreeBuffers) free_.push_back(std::move(*bytes));
}

std::vector<std::string> SnapshotStore::Add(SnapshotShard shard, SnapshotBytes bytes) {
  absl::MutexLock lock(&mu_);
  const std::string id = shard.id;
  const int rank = shard.rank;
  shards_[{id, rank}] = Entry{std::move(shard), std::move(bytes)};
  std::vector<std::string> ids = SnapshotIdsLocked();
  std::vector<std::string> dropped;
  for (size_t i = kept_; i < ids.size(); ++i) {
    dropped.push_back(ids[i]);
    for (auto it = shards_.lower_bound({ids[i], -1});
         it != shards_.end() && it->first.first == ids[i];) {
      RecycleLocked(std::move(it->second.bytes));
      it = shards_.erase(it);
    }
  }
  return dropped;
}

std::optional<SnapshotStore::Held> SnapshotStore::Find(const std::string& id, int rank) const {
  absl::ReaderMutexLock lock(&mu_);
  auto it = shards_.find({id, rank});
  if (it == shards_.end()) return std::nullopt;
  return Held{it->second.shard, it->second.bytes};
}

std::vector<SnapshotShard> SnapshotStore::Holdings() const {
  absl::ReaderMutexLock lock(&mu_);
  std::vector<SnapshotShard> held;
  for (const std::string& id : SnapshotIdsLocked()) {
    for (auto it = shards_.lower_bound({id, -1}); it != shards_.end() && it->first.first == id;
         ++it) {
      held.push_back(it->second.shard);
    }
  }
  return held;
}

uint64_t SnapshotStore::held_bytes() const {
  absl::ReaderMutexLock lock(&mu_);
  uint64_t total = 0;
  for (const auto& [key, entry] : shards_) total += entry.bytes->size();
  return total;
}

}  // namespace shard
