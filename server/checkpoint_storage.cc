#include "server/checkpoint_storage.h"

#include <filesystem>
#include <system_error>

#include "common/logging.h"
#include "spdlog/spdlog.h"

namespace shard {

bool FilesystemCheckpointStorage::IsCommitted(const std::string& dir) {
  std::error_code error;
  return std::filesystem::exists(std::filesystem::path(dir) / "manifest.json", error);
}

std::vector<std::string> FilesystemCheckpointStorage::ListDirectories(const std::string& job_dir) {
  std::vector<std::string> names;
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(job_dir, error)) {
    if (entry.is_directory(error)) names.push_back(entry.path().filename().string());
  }
  return names;
}

absl::Status FilesystemCheckpointStorage::Commit(const std::string& dir,
                                                 const CheckpointManifest& manifest) {
  return CommitCheckpoint(dir, manifest);
}

absl::StatusOr<CheckpointManifest> FilesystemCheckpointStorage::ReadManifest(
    const std::string& dir) {
  return ReadCheckpointManifest(dir);
}

void FilesystemCheckpointStorage::Remove(const std::string& dir, absl::string_view why) {
  std::error_code error;
  std::filesystem::remove_all(dir, error);
  if (error) {
    spdlog::warn("could not remove {} ({}): {}", dir, why, error.message());
  } else {
    spdlog::info("removed {} ({})", dir, why);
  }
}

}  // namespace shard
