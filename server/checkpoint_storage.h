// Where checkpoints live, as the coordinator sees them: a checkpoint directory is committed
// once its manifest is written (the workers write the shards). An interface so that the
// deterministic simulation of the control plane keeps its checkpoints in memory.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/checkpoint.h"

namespace shard {

class CheckpointStorage {
 public:
  virtual ~CheckpointStorage() = default;
  // Whether `dir` holds a committed checkpoint (its manifest).
  virtual bool IsCommitted(const std::string& dir) = 0;
  // The names of the directories in `job_dir` (none if it does not exist).
  virtual std::vector<std::string> ListDirectories(const std::string& job_dir) = 0;
  // The commit point: writes the manifest of `dir` atomically.
  virtual absl::Status Commit(const std::string& dir, const CheckpointManifest& manifest) = 0;
  virtual absl::StatusOr<CheckpointManifest> ReadManifest(const std::string& dir) = 0;
  // Removes `dir` and everything in it; failures are logged with `why`.
  virtual void Remove(const std::string& dir, absl::string_view why) = 0;
};

// Checkpoints on a filesystem (common/checkpoint.h).
class FilesystemCheckpointStorage : public CheckpointStorage {
 public:
  bool IsCommitted(const std::string& dir) override;
  std::vector<std::string> ListDirectories(const std::string& job_dir) override;
  absl::Status Commit(const std::string& dir, const CheckpointManifest& manifest) override;
  absl::StatusOr<CheckpointManifest> ReadManifest(const std::string& dir) override;
  void Remove(const std::string& dir, absl::string_view why) override;
};

}  // namespace shard
