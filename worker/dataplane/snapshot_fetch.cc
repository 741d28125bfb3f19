#include "worker/dataplane/snapshot_fetch.h"

#include <cstring>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace shard {

void SnapshotReadStats::AddRefusal(std::string what) {
  absl::MutexLock lock(&mu_);
  refusals_.push_back(std::move(what));
}

std::vector<std::string> SnapshotReadStats::refusals() const {
  absl::MutexLock lock(&mu_);
  return refusals_;
}

namespace {

// Where a shard's bytes come from: this worker's own store (kLocal), or holders_[shard][i].
constexpr int kLocal = -1;
constexpr int kNone = -2;

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
        stats_(stats),
        sources_(holders_.size()) {}

  absl::Status Read(int shard, uint64_t offset, uint64_t bytes, char* out) override {
    if (local_ != nullptr && !Refused(shard, kLocal)) {
      if (std::optional<SnapshotStore::Held> held = local_->Find(id_, shard);
          held.has_value() && offset + bytes <= held->bytes.size()) {
        std::memcpy(out, held->bytes.data() + offset, bytes);
        Count(bytes, false);
        Served(shard, kLocal);
        return absl::OkStatus();
      }
    }
    std::vector<std::string> tried;
    PeerCallOptions options;
    options.timeout = TransferTimeout(bytes, timeout_floor_);
    options.cancel = cancel_;
    for (size_t i = 0; i < holders_[shard].size(); ++i) {
      const SnapshotHolderAddress& holder = holders_[shard][i];
      if (Refused(shard, static_cast<int>(i))) {
        tried.push_back(absl::StrCat(holder.worker_id, ": its copy failed its checksums"));
        continue;
      }
      absl::Status fetched =
          FetchSnapshotRange(holder.address, id_, shard, offset, bytes, out, options);
      if (fetched.ok()) {
        Count(bytes, true);
        Served(shard, static_cast<int>(i));
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

  bool Refuse(int shard, const absl::Status& why) override {
    int source;
    {
      absl::MutexLock lock(&mu_);
      source = sources_[shard].last;
      if (source == kNone) return false;
      sources_[shard].refused.insert(source);
      sources_[shard].last = kNone;
    }
    const bool other = HasUnrefused(shard);
    // The reader's error names the shard and the bytes; here the bytes are enough.
    absl::string_view detail = why.message();
    if (const size_t at = detail.find("bytes ["); at != absl::string_view::npos) {
      detail = detail.substr(at);
    }
    const std::string what = absl::StrCat(
        "rank ", shard, "'s shard of memory snapshot ", id_, " as ", SourceName(shard, source),
        " held it failed its checksums (", detail, "): refused, ",
        other ? "read from the next holder" : "no other holder has it");
    if (stats_ != nullptr) stats_->AddRefusal(what);
    return other;
  }

  std::string Describe(int shard) const override {
    std::vector<std::string> names;
    for (const SnapshotHolderAddress& holder : holders_[shard]) names.push_back(holder.worker_id);
    int last;
    {
      absl::MutexLock lock(&mu_);
      last = sources_[shard].last;
    }
    return absl::StrCat("rank ", shard, "'s shard of memory snapshot ", id_,
                        last == kNone ? "" : absl::StrCat(" as ", SourceName(shard, last),
                                                          " held it"),
                        " (held by ", names.empty() ? "nobody" : absl::StrJoin(names, ", "),
                        ")");
  }

 private:
  struct Sources {
    int last = kNone;       // the source that served the last read
    std::set<int> refused;  // sources whose bytes failed their checksums
  };

  bool Refused(int shard, int source) const {
    absl::MutexLock lock(&mu_);
    return sources_[shard].refused.contains(source);
  }
  void Served(int shard, int source) {
    absl::MutexLock lock(&mu_);
    sources_[shard].last = source;
  }
  // Whether some source of `shard` was not refused yet (a holder that may be dead counts).
  bool HasUnrefused(int shard) const {
    if (local_ != nullptr && !Refused(shard, kLocal) && local_->Find(id_, shard).has_value()) {
      return true;
    }
    for (size_t i = 0; i < holders_[shard].size(); ++i) {
      if (!Refused(shard, static_cast<int>(i))) return true;
    }
    return false;
  }
  std::string SourceName(int shard, int source) const {
    if (source == kLocal) return "this worker";
    const SnapshotHolderAddress& holder = holders_[shard][source];
    return absl::StrCat(holder.worker_id, " at ", holder.address);
  }

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
  mutable absl::Mutex mu_;
  std::vector<Sources> sources_ ABSL_GUARDED_BY(mu_);  // by shard
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
