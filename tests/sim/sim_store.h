// The state store and checkpoint storage of the simulated coordinator: in memory, with the
// failures a real disk and a real crash produce. Appends become durable only when the
// simulation flushes (its fsync), a crash loses what was not flushed, and every commit and
// removal of a checkpoint is recorded so the invariants can tell a retention from a loss.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "server/checkpoint_storage.h"
#include "server/store/state_store.h"

namespace shard::sim {

class SimStateStore : public StateStore {
 public:
  absl::StatusOr<bool> Load(absl::string_view key, google::protobuf::Message* message) override;
  absl::Status Save(absl::string_view key, const google::protobuf::Message& message) override;
  absl::StatusOr<std::optional<Journal>> LoadJournal(absl::string_view key) override;
  uint64_t Append(absl::string_view key, std::string delta) override;
  uint64_t Compact(absl::string_view key, std::string snapshot) override;
  void WhenDurable(uint64_t sequence, std::function<void()> done) override;
  uint64_t last_sequence() const override { return sequence_; }

  // The fsync: everything appended becomes durable and the waiting acknowledgements run.
  void Flush();
  bool has_pending() const { return !pending_.empty() || !waiting_.empty(); }
  // The coordinator died: unflushed appends are lost and nobody is acknowledged.
  void Crash();

 private:
  struct Write {
    std::string key;
    bool snapshot;
    std::string payload;
  };

  std::map<std::string, std::string> records_;
  std::map<std::string, Journal> journals_;  // durable
  std::vector<Write> pending_;
  std::multimap<uint64_t, std::function<void()>> waiting_;
  uint64_t sequence_ = 0;
  uint64_t durable_ = 0;
};

class SimCheckpointStorage : public CheckpointStorage {
 public:
  struct Removal {
    std::string dir;
    std::string why;
  };

  bool IsCommitted(const std::string& dir) override { return manifests_.count(dir) > 0; }
  std::vector<std::string> ListDirectories(const std::string& job_dir) override;
  absl::Status Commit(const std::string& dir, const CheckpointManifest& manifest) override;
  absl::StatusOr<CheckpointManifest> ReadManifest(const std::string& dir) override;
  void Remove(const std::string& dir, absl::string_view why) override;

  // Shards written by ranks into a directory not yet committed (removed with it).
  void AddShard(const std::string& dir) { partial_[dir] += 1; }
  const std::map<std::string, std::string>& manifests() const { return manifests_; }
  const std::vector<Removal>& removals() const { return removals_; }
  // A commit over a committed checkpoint (which must never happen), if any.
  const std::optional<std::string>& overwritten() const { return overwritten_; }

 private:
  std::map<std::string, std::string> manifests_;  // dir -> manifest JSON
  std::map<std::string, int> partial_;
  std::vector<Removal> removals_;
  std::optional<std::string> overwritten_;
};

}  // namespace shard::sim
