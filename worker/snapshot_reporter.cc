#include "worker/snapshot_reporter.h"

#include <algorithm>
#include <utility>

namespace shard {

SnapshotReporter::SnapshotReporter(Send send, absl::Duration window)
    : send_(std::move(send)), window_(window), thread_([this] { Loop(); }) {}

SnapshotReporter::~SnapshotReporter() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  thread_.join();
}

void SnapshotReporter::Report(const std::vector<SnapshotShard>& held,
                              const std::vector<std::string>& dropped) {
  absl::MutexLock lock(&mu_);
  for (const std::string& id : dropped) {
    held_.erase(std::remove_if(held_.begin(), held_.end(),
                               [&](const SnapshotShard& shard) { return shard.id == id; }),
                held_.end());
    dropped_.push_back(id);
  }
  held_.insert(held_.end(), held.begin(), held.end());
}

void SnapshotReporter::Loop() {
  while (true) {
    std::vector<SnapshotShard> held;
    std::vector<std::string> dropped;
    {
      absl::MutexLock lock(&mu_);
      auto pending = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stopping_ || !held_.empty() || !dropped_.empty();
      };
      mu_.Await(absl::Condition(&pending));
      // The window: what else is reported meanwhile goes in the same call. A stop ends it.
      auto stopping = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_; };
      mu_.AwaitWithTimeout(absl::Condition(&stopping), window_);
      held.swap(held_);
      dropped.swap(dropped_);
      if (held.empty() && dropped.empty()) return;  // stopping, and everything was sent
    }
    send_(held, dropped);
  }
}

}  // namespace shard
