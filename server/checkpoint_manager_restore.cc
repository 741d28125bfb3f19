// CheckpointManager's restore point: where the next generation's training starts (a committed
// checkpoint, a memory snapshot, or the initial weights), resolved when the generation first runs,
// and the restore reports of its ranks. The rest of the manager is in checkpoint_manager.cc.
#include <algorithm>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "server/checkpoint_manager.h"
#include "spdlog/spdlog.h"

namespace shard {

absl::StatusOr<TrainingStartPoint> CheckpointManager::SetRestorePoint(const std::string& id) {
  absl::MutexLock lock(&mu_);
  SHARD_ASSIGN_OR_RETURN(v1::CheckpointRecord record, FindLocked(id));
  start_ = TrainingStartPoint{record.id(), record.dir(), record.step()};
  memory_start_.reset();
  restore_requested_ = true;
  SHARD_RETURN_IF_ERROR(PersistLocked());
  spdlog::info("training restarts from checkpoint {} (step {})", record.id(), record.step());
  return start_;
}

TrainingStartPoint CheckpointManager::SetMemoryRestorePoint(MemoryRestorePoint point) {
  absl::MutexLock lock(&mu_);
  const SnapshotShard& first = point.shards.front();
  start_ = TrainingStartPoint{first.id, "", first.step, /*in_memory=*/true};
  memory_start_ = std::move(point);
  restore_requested_ = true;
  if (absl::Status saved = PersistLocked(); !saved.ok()) spdlog::error("{}", saved.message());
  spdlog::info("training restarts from memory snapshot {} (step {})", start_.checkpoint_id,
               start_.step);
  return start_;
}

std::optional<MemoryRestorePoint> CheckpointManager::memory_start() const {
  absl::ReaderMutexLock lock(&mu_);
  return memory_start_;
}

std::string CheckpointManager::ResolveStart(int64_t generation,
                                            std::optional<MemoryRestorePoint> memory,
                                            const std::string& memory_why_not) {
  absl::MutexLock lock(&mu_);
  if (generation != generation_ || start_fixed_generation_ == generation || !training_started_) {
    return "";
  }
  start_fixed_generation_ = generation;
  const bool has_disk = !catalog_.checkpoints().empty();
  const v1::CheckpointRecord* disk = has_disk ? &*catalog_.checkpoints().rbegin() : nullptr;
  std::string why;
  if (memory.has_value() && (disk == nullptr || memory->shards[0].step >= disk->step())) {
    const SnapshotShard& first = memory->shards[0];
    start_ = TrainingStartPoint{first.id, "", first.step, /*in_memory=*/true};
    std::set<std::string> holders;
    for (const std::vector<SnapshotHolder>& shard : memory->holders) {
      for (const SnapshotHolder& holder : shard) holders.insert(holder.worker_id);
    }
    why = absl::StrCat("generation ", generation, " restores memory snapshot ", first.id,
                       " (step ", first.step, ", ", first.plan.world_size, " shards held by ",
                       absl::StrJoin(holders, ", "), ")",
                       disk != nullptr ? absl::StrCat(", not checkpoint ", disk->id(), " (step ",
                                                      disk->step(), ") from disk")
                                       : "");
    memory_start_ = std::move(memory);
  } else {
    memory_start_.reset();
    if (disk == nullptr) {
      start_ = TrainingStartPoint{};
    } else {
      start_ = TrainingStartPoint{disk->id(), disk->dir(), disk->step()};
    }
    const std::string source = disk == nullptr
                                   ? "the initial weights"
                                   : absl::StrCat("checkpoint ", disk->id(), " (step ",
                                                  disk->step(), ") from disk");
    if (memory.has_value()) {
      why = absl::StrCat("generation ", generation, " restores ", source, ", newer than memory "
                         "snapshot ", memory->shards[0].id);
    } else if (!memory_why_not.empty()) {
      why = absl::StrCat("generation ", generation, " restores ", source,
                         ": no memory snapshot holds every range (", memory_why_not, ")");
    } else {
      why = absl::StrCat("generation ", generation, " restores ", source);
    }
  }
  if (absl::Status saved = PersistLocked(); !saved.ok()) spdlog::error("{}", saved.message());
  spdlog::info("{}", why);
  return why;
}

std::optional<CheckpointManager::RestoreSummary> CheckpointManager::NoteRestored(
    int64_t generation, int rank, int world_size, int64_t reached, const RestoreReport& report) {
  absl::MutexLock lock(&mu_);
  if (generation != generation_ || report.checkpoint_id != start_.checkpoint_id) {
    return std::nullopt;
  }
  if (restored_generation_ != generation) {
    restored_generation_ = generation;
    restored_ranks_.clear();
    restore_summary_ = RestoreSummary{};
    restore_summary_.start = start_;
    all_restored_ = false;
  }
  if (all_restored_ || !restored_ranks_.insert(rank).second) return std::nullopt;
  restore_summary_.slowest = std::max(restore_summary_.slowest, report.duration);
  restore_summary_.bytes += report.bytes;
  restore_summary_.bytes_from_peers += report.bytes_from_peers;
  restore_summary_.refused.insert(restore_summary_.refused.end(), report.refused.begin(),
                                  report.refused.end());
  if (static_cast<int>(restored_ranks_.size()) < world_size) return std::nullopt;
  all_restored_ = true;
  restore_summary_.steps_lost = std::max<int64_t>(0, reached - restore_summary_.start.step);
  ++(restore_summary_.start.in_memory ? restores_.from_memory : restores_.from_disk);
  restores_.last = restore_summary_;
  return restore_summary_;
}

CheckpointManager::Restores CheckpointManager::restores() const {
  absl::ReaderMutexLock lock(&mu_);
  return restores_;
}

bool CheckpointManager::NeededForRestore(const std::string& worker_id) const {
  absl::ReaderMutexLock lock(&mu_);
  if (!start_.in_memory || !memory_start_.has_value() ||
      (restored_generation_ == generation_ && all_restored_)) {
    return false;
  }
  for (const std::vector<SnapshotHolder>& holders : memory_start_->holders) {
    for (const SnapshotHolder& holder : holders) {
      if (holder.worker_id == worker_id) return true;
    }
  }
  return false;
}

void CheckpointManager::NoteTrainingStarted() {
  absl::MutexLock lock(&mu_);
  if (training_started_) return;
  training_started_ = true;
  if (absl::Status saved = PersistLocked(); !saved.ok()) spdlog::error("{}", saved.message());
}

bool CheckpointManager::training_started() const {
  absl::ReaderMutexLock lock(&mu_);
  return training_started_;
}

void CheckpointManager::RestartFromLatestLocked() {
  memory_start_.reset();
  if (catalog_.checkpoints().empty()) {
    start_ = TrainingStartPoint{};
    spdlog::warn("no committed checkpoint: training restarts from the initial weights");
    return;
  }
  const v1::CheckpointRecord& latest = *catalog_.checkpoints().rbegin();
  start_ = TrainingStartPoint{latest.id(), latest.dir(), latest.step()};
  spdlog::info("training restarts from the latest checkpoint {} (step {})", latest.id(),
               latest.step());
}

TrainingStartPoint CheckpointManager::start() const {
  absl::ReaderMutexLock lock(&mu_);
  return start_;
}

}  // namespace shard
