#include "worker/dataplane/snapshot_fetch.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace shard {
namespace {

class SnapshotShardStorage : public ShardStorage {
 public:
  SnapshotShardStorage(std::string id, std::vector<std::vector<SnapshotHolderAddress>> holders,
                       const SnapshotStore* local, absl::Duration timeout_floor,
                       const std::atomic<bool>* cancel, SnapshotReadStats* stats)
      : id_(std::move(id)),
        holders_(std::move(holders)),
        local_(local),
        timeout_floor_(timeout_floor),
        cancel_(cancel),
        stats_(stats) {}

  absl::Status Read(int shard, uint64_t offset, uint64_t bytes, char* out) override {
    if (local_ != nullptr) {
      if (std::optional<SnapshotStore::Held> held = local_->Find(id_, shard);
          held.has_value() && offset + bytes <= held->bytes->size()) {
        std::memcpy(out, held->bytes->data() + offset, bytes);
        Count(bytes, false);
        return absl::OkStatus();
      }
    }
    std::vector<std::string> tried;
    PeerCallOptions options;
    options.timeout = TransferTimeout(bytes, timeout_floor_);
    options.cancel = cancel_;
    for (const SnapshotHolderAddress& holder : holders_[shard]) {
      absl::Status fetched =
          FetchSnapshotRange(holder.address, id_, shard, offset, bytes, out, options);
      if (fetched.ok()) {
        Count(bytes, true);
        return absl::OkStatus();
      }
      if (absl::IsCancelled(fetched)) return fetched;
      tried.push_back(absl::StrCat(holder.worker_id, " at ", holder.address, ": ",
                                   fetched.message()));
    }
    return absl::UnavailableError(absl::StrCat(
        "no live holder served rank ", shard, "'s shard of memory snapshot ", id_,
        tried.empty() ? " (it has none)" : absl::StrCat(" (", absl::StrJoin(tried, "; "), ")")));
  }

  std::string Describe(int shard) const override {
    std::vector<std::string> names;
    for (const SnapshotHolderAddress& holder : holders_[shard]) names.push_back(holder.worker_id);
    return absl::StrCat("rank ", shard, "'s shard of memory snapshot ", id_, " (held by ",
                        names.empty() ? "nobody" : absl::StrJoin(names, ", "), ")");
  }

 private:
  void Count(uint64_t bytes, bool from_peer) {
    if (stats_ == nullptr) return;
    stats_->bytes += bytes;
    if (from_peer) stats_->bytes_from_peers += bytes;
  }

  const std::string id_;
  const std::vector<std::vector<SnapshotHolderAddress>> holders_;
  const SnapshotStore* const local_;
  const absl::Duration timeout_floor_;
  const std::atomic<bool>* const cancel_;
  SnapshotReadStats* const stats_;
};

}  // namespace

std::unique_ptr<ShardStorage> SnapshotShards(std::string id,
                                             std::vector<std::vector<SnapshotHolderAddress>> holders,
                                             const SnapshotStore* local,
                                             absl::Duration timeout_floor,
                                             const std::atomic<bool>* cancel,
                                             SnapshotReadStats* stats) {
  return std::make_unique<SnapshotShardStorage>(std::move(id), std::move(holders), local,
                                                timeout_floor, cancel, stats);
}

}  // namespace shard
