#include "worker/dataplane/snapshot_store.h"

#include <algorithm>
#include <set>

namespace shard {
namespace {

// Buffers kept for reuse beyond those held: enough for the next snapshot's own shard and its
// replicas.
constexpr size_t kFreeBuffers = 4;

}  // namespace

absl::StatusOr<StateBuffer> SnapshotStore::TakeBuffer(uint64_t bytes) {
  StateBuffer buffer;
  {
    absl::MutexLock lock(&mu_);
    // The smallest free buffer that fits, else the largest (grown below); none a buddy keeps.
    auto fits = free_.end();
    auto largest = free_.end();
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->HeldElsewhere()) continue;
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
  if (absl::Status resized = buffer.Resize(bytes); !resized.ok()) return resized;
  return buffer;
}

size_t SnapshotStore::ReadyBuffersLocked(uint64_t bytes) const {
  return std::count_if(free_.begin(), free_.end(), [bytes](const StateBuffer& buffer) {
    return buffer.capacity() >= bytes && !buffer.HeldElsewhere();
  });
}

int SnapshotStore::ReadyBuffers(uint64_t bytes) const {
  absl::ReaderMutexLock lock(&mu_);
  return static_cast<int>(ReadyBuffersLocked(bytes));
}

int SnapshotStore::Prepare(uint64_t bytes, int count) {
  const size_t wanted = std::min(static_cast<size_t>(std::max(count, 0)), kFreeBuffers);
  int made = 0;
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      if (ReadyBuffersLocked(bytes) >= wanted) return made;
    }
    // Outside the lock: mapping the pages is the slow part, and TakeBuffer must not wait for it.
    absl::StatusOr<StateBuffer> buffer = StateBuffer::Make(bytes + bytes / 16);
    if (!buffer.ok()) return made;  // TakeBuffer says why, if it cannot make one either
    absl::MutexLock lock(&mu_);
    if (ReadyBuffersLocked(bytes) >= wanted) return made;
    if (free_.size() >= kFreeBuffers) {
      // Full of buffers too small for these shards: the smallest makes way.
      free_.erase(std::min_element(free_.begin(), free_.end(),
                                   [](const StateBuffer& a, const StateBuffer& b) {
                                     return a.capacity() < b.capacity();
                                   }));
    }
    free_.push_back(*std::move(buffer));
    ++made;
  }
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
  if (bytes.use_count() == 1 && !bytes->retired() && free_.size() < kFreeBuffers) {
    free_.push_back(std::move(*bytes));
  }
}

std::vector<std::string> SnapshotStore::Add(SnapshotShard shard, SnapshotBytes bytes) {
  const absl::Span<const char> span(bytes->data(), bytes->size());
  absl::MutexLock lock(&mu_);
  return AddLocked(std::move(shard), Entry{{}, span, nullptr, std::move(bytes)});
}

std::vector<std::string> SnapshotStore::Add(SnapshotShard shard, absl::Span<const char> bytes,
                                            std::shared_ptr<const void> keep) {
  absl::MutexLock lock(&mu_);
  return AddLocked(std::move(shard), Entry{{}, bytes, std::move(keep), nullptr});
}

std::vector<std::string> SnapshotStore::AddLocked(SnapshotShard shard, Entry entry) {
  const std::string id = shard.id;
  const int rank = shard.rank;
  entry.shard = std::move(shard);
  shards_[{id, rank}] = std::move(entry);
  std::vector<std::string> ids = SnapshotIdsLocked();
  std::vector<std::string> dropped;
  for (size_t i = kept_; i < ids.size(); ++i) {
    dropped.push_back(ids[i]);
    for (auto it = shards_.lower_bound({ids[i], -1});
         it != shards_.end() && it->first.first == ids[i];) {
      if (it->second.buffer != nullptr) RecycleLocked(std::move(it->second.buffer));
      it = shards_.erase(it);
    }
  }
  return dropped;
}

std::optional<SnapshotStore::Held> SnapshotStore::Find(const std::string& id, int rank) const {
  absl::ReaderMutexLock lock(&mu_);
  auto it = shards_.find({id, rank});
  if (it == shards_.end()) return std::nullopt;
  const Entry& entry = it->second;
  return Held{entry.shard, entry.bytes,
              entry.buffer != nullptr ? std::shared_ptr<const void>(entry.buffer) : entry.keep};
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
  for (const auto& [key, entry] : shards_) total += entry.bytes.size();
  return total;
}

}  // namespace shard
