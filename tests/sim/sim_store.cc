#include "tests/sim/sim_store.h"

#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace shard::sim {

absl::StatusOr<bool> SimStateStore::Load(absl::string_view key,
                                         google::protobuf::Message* message) {
  auto it = records_.find(std::string(key));
  if (it == records_.end()) return false;
  if (!message->ParseFromString(it->second)) {
    return absl::DataLossError(absl::StrCat("record '", key, "' does not parse"));
  }
  return true;
}

absl::Status SimStateStore::Save(absl::string_view key, const google::protobuf::Message& message) {
  records_[std::string(key)] = message.SerializeAsString();
  return absl::OkStatus();
}

absl::StatusOr<std::optional<Journal>> SimStateStore::LoadJournal(absl::string_view key) {
  auto it = journals_.find(std::string(key));
  if (it == journals_.end()) return std::nullopt;
  return it->second;
}

uint64_t SimStateStore::Append(absl::string_view key, std::string delta) {
  pending_.push_back(Write{std::string(key), false, std::move(delta)});
  return ++sequence_;
}

uint64_t SimStateStore::Compact(absl::string_view key, std::string snapshot) {
  pending_.push_back(Write{std::string(key), true, std::move(snapshot)});
  return ++sequence_;
}

void SimStateStore::WhenDurable(uint64_t sequence, std::function<void()> done) {
  if (sequence <= durable_) {
    done();
    return;
  }
  waiting_.emplace(sequence, std::move(done));
}

void SimStateStore::Flush() {
  for (Write& write : pending_) {
    Journal& journal = journals_[write.key];
    if (write.snapshot) {
      journal = Journal{std::move(write.payload), {}};
    } else {
      journal.deltas.push_back(std::move(write.payload));
    }
  }
  pending_.clear();
  durable_ = sequence_;
  std::multimap<uint64_t, std::function<void()>> ready;
  ready.swap(waiting_);
  for (auto& [sequence, done] : ready) done();
}

void SimStateStore::Crash() {
  pending_.clear();
  waiting_.clear();
  // Sequence numbers are the process's own: a new one starts where the disk is.
  sequence_ = durable_;
}

std::vector<std::string> SimCheckpointStorage::ListDirectories(const std::string& job_dir) {
  std::vector<std::string> names;
  const std::string prefix = job_dir + "/";
  auto add = [&](const std::string& dir) {
    if (absl::StartsWith(dir, prefix)) names.push_back(dir.substr(prefix.size()));
  };
  for (const auto& [dir, manifest] : manifests_) add(dir);
  for (const auto& [dir, count] : partial_) {
    if (manifests_.count(dir) == 0) add(dir);
  }
  return names;
}

absl::Status SimCheckpointStorage::Commit(const std::string& dir,
                                          const CheckpointManifest& manifest) {
  if (manifests_.count(dir) > 0 && !overwritten_.has_value()) overwritten_ = dir;
  manifests_[dir] = CheckpointManifestToJson(manifest);
  partial_.erase(dir);
  return absl::OkStatus();
}

absl::StatusOr<CheckpointManifest> SimCheckpointStorage::ReadManifest(const std::string& dir) {
  auto it = manifests_.find(dir);
  if (it == manifests_.end()) {
    return absl::NotFoundError(absl::StrCat("no manifest in ", dir));
  }
  return CheckpointManifestFromJson(it->second, dir + "/manifest.json");
}

void SimCheckpointStorage::Remove(const std::string& dir, absl::string_view why) {
  if (manifests_.count(dir) > 0) removals_.push_back(Removal{dir, std::string(why)});
  manifests_.erase(dir);
  partial_.erase(dir);
}

}  // namespace shard::sim
