#include "worker/dataplane/snapshotter.h"

#include "absl/strings/str_cat.h"
#include "common/shard_hasher.h"
#include "worker/dataplane/snapshot_peer.h"

namespace shard {
namespace {

// How often a wait looks at its abort condition.
constexpr absl::Duration kAbortPoll = absl::Milliseconds(50);

}  // namespace

Snapshotter::Replication ReplicationOf(const std::vector<std::string>& hosts,
                                       const std::vector<std::string>& servers, int rank,
                                       int replicas, bool same_host_buffers) {
  Snapshotter::Replication replication;
  replication.same_host_buffers = same_host_buffers;
  for (int buddy : SnapshotBuddies(hosts, rank, replicas)) {
    replication.buddies.push_back(servers[buddy]);
  }
  for (int source : SnapshotSources(hosts, rank, replicas)) {
    if (!same_host_buffers || hosts[source] != hosts[rank]) ++replication.received_over_tcp;
  }
  return replication;
}

Snapshotter::Snapshotter(SnapshotStore* store, Replication replication, Callbacks callbacks,
                         absl::Duration push_timeout_floor)
    : store_(store),
      replication_(std::move(replication)),
      callbacks_(std::move(callbacks)),
      push_timeout_floor_(push_timeout_floor),
      thread_([this] { Loop(); }) {}

Snapshotter::~Snapshotter() {
  cancel_ = true;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  thread_.join();
}

bool Snapshotter::busy() const {
  absl::MutexLock lock(&mu_);
  return busy_;
}

absl::Status Snapshotter::WaitIdle(const std::function<bool()>& abort) {
  absl::MutexLock lock(&mu_);
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !busy_; };
  while (!mu_.AwaitWithTimeout(absl::Condition(&idle), kAbortPoll)) {
    if (abort && abort()) {
      return absl::AbortedError("stopped waiting for the snapshot in flight: training ended");
    }
  }
  return absl::OkStatus();
}

std::shared_ptr<ShardHasher> Snapshotter::NewHasher() {
  return std::make_shared<ShardHasher>(ShardHasher::Sums::kBlocksOnly);
}

absl::Status Snapshotter::Start(SnapshotShard shard, SnapshotBytes bytes,
                                const std::function<bool()>& abort,
                                std::shared_ptr<ShardHasher> hashed) {
  if (hashed != nullptr && hashed->bytes() > bytes->size()) {
    return absl::InternalError(absl::StrCat("a snapshot of ", bytes->size(), " bytes of which ",
                                            hashed->bytes(), " were hashed: a bug, report it"));
  }
  absl::Status idle = WaitIdle(abort);
  if (!idle.ok()) return idle;
  absl::MutexLock lock(&mu_);
  shard_ = std::move(shard);
  bytes_ = std::move(bytes);
  hashed_ = std::move(hashed);
  busy_ = true;
  return absl::OkStatus();
}

void Snapshotter::PrepareBuffers(uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  prepare_bytes_ = bytes;
}

void Snapshotter::Loop() {
  YieldToTraining();
  // The next snapshot takes a buffer for its own shard and one per replica it receives over TCP.
  const int next_snapshot_buffers = 1 + replication_.received_over_tcp;
  while (true) {
    SnapshotShard shard;
    SnapshotBytes bytes;
    std::shared_ptr<ShardHasher> hasher;
    uint64_t prepare = 0;
    {
      absl::MutexLock lock(&mu_);
      auto work = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stopping_ || busy_ || prepare_bytes_ > 0;
      };
      mu_.Await(absl::Condition(&work));
      if (stopping_) return;
      if (!busy_) {  // a snapshot in flight goes first
        std::swap(prepare, prepare_bytes_);
      } else {
        shard = std::move(shard_);
        bytes.swap(bytes_);
        hasher.swap(hashed_);
      }
    }
    if (prepare > 0) {
      store_->Prepare(prepare, next_snapshot_buffers);
      continue;
    }
    std::vector<ShardExtra> extras = std::move(shard.record.extras);  // placed by the trainer
    if (hasher == nullptr) hasher = NewHasher();
    hasher->Append(bytes->data() + hasher->bytes(), bytes->size() - hasher->bytes());
    shard.record = hasher->Finish(ShardFileName(shard.rank, shard.plan.world_size), shard.rank);
    shard.record.extras = std::move(extras);
    const std::vector<std::string> dropped = store_->Add(shard, bytes);
    if (callbacks_.on_held) callbacks_.on_held(shard, dropped);
    PeerCallOptions options;
    options.timeout = TransferTimeout(bytes->size(), push_timeout_floor_);
    options.cancel = &cancel_;
    options.same_host_pages = replication_.same_host_buffers;
    absl::Status refused;
    options.pages_refused = &refused;
    for (const std::string& buddy : replication_.buddies) {
      if (cancel_) break;
      refused = absl::OkStatus();
      if (absl::Status pushed = PushSnapshotShard(buddy, shard, *bytes, options);
          !pushed.ok() && callbacks_.on_push_failed) {
        callbacks_.on_push_failed(shard, buddy, pushed);
      }
      if (!refused.ok() && callbacks_.on_pages_refused && refused_by_.insert(buddy).second) {
        callbacks_.on_pages_refused(shard, buddy, refused);
      }
    }
    const uint64_t size = bytes->size();
    bytes.reset();  // the store's reference alone lets it reuse the buffer once dropped
    absl::MutexLock lock(&mu_);
    busy_ = false;
    if (prepare_bytes_ == 0) prepare_bytes_ = size;  // the next one's, in case none was dropped
  }
}

}  // namespace shard
