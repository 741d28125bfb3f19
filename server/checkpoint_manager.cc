#include "server/checkpoint_manager.h"

#include <algorithm>
#include <regex>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/fault.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "proto/control_convert.h"
#include "spdlog/spdlog.h"

namespace shard {
namespace {

constexpr char kCatalogRecord[] = "checkpoints";

// The memory restore point as the catalog keeps it; nullopt if it does not parse (an older or a
// damaged record: training then restarts from disk).
std::optional<MemoryRestorePoint> MemoryStartOf(const v1::CheckpointCatalog& catalog) {
  if (!catalog.start_in_memory()) return std::nullopt;
  MemoryRestorePoint point;
  for (const v1::SnapshotShard& shard : catalog.start_shards()) {
    absl::StatusOr<SnapshotShard> parsed = FromProto(shard);
    if (!parsed.ok()) return std::nullopt;
    point.shards.push_back(*std::move(parsed));
  }
  for (const v1::RestoreSnapshot::Shard& holders : catalog.start_holders()) {
    std::vector<SnapshotHolder>& list = point.holders.emplace_back();
    for (const v1::SnapshotHolder& holder : holders.holders()) list.push_back(FromProto(holder));
  }
  if (point.shards.empty() || point.shards.size() != point.holders.size()) return std::nullopt;
  return point;
}

// Events about failed and skipped saves: every one of the first few after a commit, then one at
// every power of two, so that a disk full for hours does not flood the history.
bool WorthAnEvent(int64_t count) { return count <= 3 || (count & (count - 1)) == 0; }
constexpr absl::Duration kSkipEventInterval = absl::Minutes(1);

// Only directories named like our checkpoints are ever removed.
bool LooksLikeCheckpoint(const std::string& name) {
  static const std::regex pattern("step-[0-9]{8}(-[A-Za-z0-9]+)?");
  return std::regex_match(name, pattern);
}

// The generation a coordinator's worker saved checkpoint `name` at ("step-00000040-g7": 7).
std::optional<int64_t> GenerationOf(const std::string& name) {
  static const std::regex pattern("step-[0-9]{8}-g([0-9]{1,18})");
  std::smatch match;
  if (!std::regex_match(name, match, pattern)) return std::nullopt;
  return std::stoll(match[1].str());
}

}  // namespace

absl::StatusOr<std::unique_ptr<CheckpointManager>> CheckpointManager::Create(
    CheckpointOptions options, StateStore* store, CheckpointStorage* storage, int64_t generation,
    bool generation_kept) {
  std::unique_ptr<CheckpointManager> manager(
      new CheckpointManager(std::move(options), store, storage, generation));
  absl::MutexLock lock(&manager->mu_);
  SHARD_RETURN_IF_ERROR(store->Load(kCatalogRecord, &manager->catalog_).status());
  // Keep what is committed and still there; drop the rest of the catalog.
  v1::CheckpointCatalog kept = manager->catalog_;
  kept.clear_checkpoints();
  for (const v1::CheckpointRecord& record : manager->catalog_.checkpoints()) {
    if (storage->IsCommitted(record.dir())) {
      *kept.add_checkpoints() = record;
    } else {
      spdlog::warn("checkpoint {} is in the catalog but {} has no manifest; forgetting it",
                   record.id(), record.dir());
    }
  }
  bool changed = kept.checkpoints_size() != manager->catalog_.checkpoints_size();
  manager->catalog_ = std::move(kept);
  if (manager->options_.recover) {
    manager->training_started_ = manager->catalog_.training_started();
    manager->start_ = TrainingStartPoint{manager->catalog_.start_checkpoint_id(),
                                         manager->catalog_.start_dir(),
                                         manager->catalog_.start_step(),
                                         manager->catalog_.start_in_memory()};
    manager->memory_start_ = MemoryStartOf(manager->catalog_);
    if (manager->start_.in_memory && !manager->memory_start_.has_value()) {
      spdlog::warn("the restore point {} in memory is not readable from the state directory; "
                   "training restarts from the latest checkpoint",
                   manager->start_.checkpoint_id);
      manager->RestartFromLatestLocked();
      changed = true;
    }
  } else {
    changed = changed || manager->catalog_.training_started() ||
              manager->catalog_.pause_request() != 0;
    manager->catalog_.set_pause_request(0);
  }
  if (manager->options_.recover && !generation_kept) {
    // The taken-back world reconnects at a new generation.
    manager->BeginGenerationLocked(manager->catalog_.request_generation());
    changed = true;
  }
  if (changed) {
    SHARD_RETURN_IF_ERROR(manager->PersistLocked());
  }
  // Directories of checkpoints that never committed: without a manifest. One with a manifest
  // that the catalog does not list is complete (another state directory's, or one whose commit
  // the coordinator did not live to record) and may be restored: it stays.
  const std::string job_dir = absl::StrCat(manager->options_.root, "/", manager->options_.job);
  for (const std::string& name : storage->ListDirectories(job_dir)) {
    const std::string dir = absl::StrCat(job_dir, "/", name);
    if (LooksLikeCheckpoint(name) && !storage->IsCommitted(dir)) {
      storage->Remove(dir, "a checkpoint that never committed");
    }
  }
  return manager;
}

std::string CheckpointManager::Directory(const std::string& id) const {
  return CheckpointDirectory(options_.root, options_.job, id);
}

absl::Status CheckpointManager::PersistLocked() {
  catalog_.set_training_started(training_started_);
  catalog_.set_start_checkpoint_id(start_.checkpoint_id);
  catalog_.set_start_dir(start_.dir);
  catalog_.set_start_step(start_.step);
  catalog_.set_start_in_memory(start_.in_memory);
  catalog_.clear_start_shards();
  catalog_.clear_start_holders();
  if (memory_start_.has_value()) {
    for (const SnapshotShard& shard : memory_start_->shards) {
      *catalog_.add_start_shards() = ToProto(shard);
    }
    for (const std::vector<SnapshotHolder>& holders : memory_start_->holders) {
      v1::RestoreSnapshot::Shard* list = catalog_.add_start_holders();
      for (const SnapshotHolder& holder : holders) *list->add_holders() = ToProto(holder);
    }
  }
  if (absl::Status saved = store_->Save(kCatalogRecord, catalog_); !saved.ok()) {
    return absl::UnavailableError(absl::StrCat(
        "the coordinator cannot record its checkpoint catalog in its state directory (",
        saved.message(), ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> CheckpointManager::RequestSave(int64_t generation, bool pause,
                                                       bool in_memory) {
  absl::MutexLock lock(&mu_);
  if (generation != generation_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the world moved from generation ", generation, " to ", generation_,
        " before the save was requested; ask again"));
  }
  const v1::CheckpointCatalog before = catalog_;
  catalog_.set_last_request(catalog_.last_request() + 1);
  catalog_.set_request_generation(generation);
  if (pause) {
    catalog_.set_pause_request(catalog_.last_request());
    catalog_.set_pause_in_memory(in_memory);
  }
  if (!(pause && in_memory)) catalog_.set_last_save_request(catalog_.last_request());
  if (absl::Status saved = PersistLocked(); !saved.ok()) {
    catalog_ = before;
    return saved;
  }
  spdlog::info("{} requested (request {} of generation {}{})",
               pause && in_memory ? "memory snapshot" : "checkpoint", catalog_.last_request(),
               generation, pause ? ", training pauses after it" : "");
  return catalog_.last_request();
}

bool CheckpointManager::AnsweredLocked(int64_t request) const {
  for (const v1::CheckpointRecord& record : catalog_.checkpoints()) {
    if (record.request() >= request) return true;
  }
  return !errors_.empty() && errors_.rbegin()->first >= request;
}

StepOrders CheckpointManager::Orders(int64_t generation) const {
  absl::ReaderMutexLock lock(&mu_);
  return OrdersLocked(generation);
}

int64_t CheckpointManager::pending_request() const {
  absl::ReaderMutexLock lock(&mu_);
  return OrdersLocked(generation_).save_request;
}

StepOrders CheckpointManager::OrdersLocked(int64_t generation) const {
  StepOrders orders;
  orders.generation = generation;
  if (generation != generation_ || catalog_.request_generation() != generation) return orders;
  // A pause in memory is no save request: the newest one answered on disk is.
  const int64_t pause = catalog_.pause_request();
  const bool pause_in_memory = pause > 0 && catalog_.pause_in_memory();
  const int64_t latest = pause_in_memory ? catalog_.last_save_request() : catalog_.last_request();
  if (latest > 0 && !AnsweredLocked(latest)) orders.save_request = latest;
  if (pause > 0 && !AnsweredLocked(pause)) {
    orders.pause_request = pause;
    orders.pause_in_memory = pause_in_memory;
  }
  return orders;
}

void CheckpointManager::CancelPause(int64_t request) {
  absl::MutexLock lock(&mu_);
  if (catalog_.pause_request() != request) return;
  catalog_.set_pause_request(0);
  catalog_.set_pause_in_memory(false);
  if (absl::Status saved = PersistLocked(); !saved.ok()) spdlog::error("{}", saved.message());
}

std::string CheckpointManager::LatestLocked() const {
  if (catalog_.checkpoints().empty()) return "none";
  const v1::CheckpointRecord& latest = *catalog_.checkpoints().rbegin();
  return absl::StrCat(latest.id(), " (step ", latest.step(), ")");
}

void CheckpointManager::FailLocked(const std::string& id, const std::string& error,
                                   absl::Time now) {
  auto it = pending_.find(id);
  const int64_t request = it == pending_.end() ? 0 : it->second.request;
  const int64_t step = it == pending_.end() ? 0 : it->second.step;
  errors_[request] = error;
  failed_.insert(id);
  spdlog::error("checkpoint {} failed: {}", id, error);
  // Every shard of it goes, also those still being written (their reports remove them again).
  DiscardLocked(id, "a failed checkpoint");
  if (it != pending_.end()) pending_.erase(it);
  ++health_.failures;
  ++health_.failures_total;
  health_.last_failure = absl::StrCat(id, ": ", error);
  health_.last_failure_at = now;
  if (WorthAnEvent(health_.failures)) {
    notices_.push_back(CheckpointNotice{
        v1::MEMBERSHIP_EVENT_KIND_CHECKPOINT_FAILED,
        absl::StrCat("checkpoint ", id, step > 0 ? absl::StrCat(" (step ", step, ")") : "",
                     request > 0 ? absl::StrCat(", request ", request) : "", " failed: ", error,
                     "; nothing of it is left, the latest committed checkpoint is ",
                     LatestLocked(), ", training goes on and saves are tried again (",
                     health_.failures, health_.failures == 1 ? " save" : " saves",
                     " failed since the last commit)")});
  }
}

void CheckpointManager::NoteSkippedLocked(const ShardReport& report, absl::Time now) {
  ++health_.skipped;
  ++health_.skipped_total;
  health_.last_skip = report.skipped;
  spdlog::warn("{}", report.skipped);
  // A slow disk skips saves between its commits for as long as it stays slow: at most one event
  // a minute, so that the history keeps its other events.
  if (last_skip_event_.has_value() && now - *last_skip_event_ < kSkipEventInterval) return;
  last_skip_event_ = now;
  notices_.push_back(CheckpointNotice{
      v1::MEMBERSHIP_EVENT_KIND_CHECKPOINT_SKIPPED,
      absl::StrCat(report.skipped, "; the latest committed checkpoint is ", LatestLocked(), ", ",
                   health_.skipped, health_.skipped == 1 ? " periodic save" : " periodic saves",
                   " skipped since (this is said at most once a minute)")});
}

SaveHealth CheckpointManager::health() const {
  absl::ReaderMutexLock lock(&mu_);
  return health_;
}

std::vector<CheckpointNotice> CheckpointManager::TakeNotices() {
  absl::MutexLock lock(&mu_);
  std::vector<CheckpointNotice> notices;
  notices.swap(notices_);
  return notices;
}

void CheckpointManager::DiscardLocked(const std::string& id, absl::string_view why) {
  const std::string dir = Directory(id);
  // A pending checkpoint's directory with a manifest is another run's committed checkpoint
  // (a new state directory over the same checkpoint directory meets its ids): never ours to
  // remove.
  if (storage_->IsCommitted(dir)) {
    spdlog::warn("{} holds a committed checkpoint this coordinator did not write: left as it is",
                 dir);
    return;
  }
  storage_->Remove(dir, why);
}

absl::StatusOr<bool> CheckpointManager::ReportShard(const ShardReport& report,
                                                    const PlanView& plan, absl::Time now) {
  SHARD_RETURN_IF_ERROR(ValidateCheckpointId(report.id));
  const int world = plan.plan->options.world_size;
  if (report.rank < 0 || report.rank >= world) {
    return absl::InvalidArgumentError(absl::StrCat("shard report of rank ", report.rank, " for ",
                                                   report.id, " does not fit its world of ",
                                                   world));
  }
  absl::MutexLock lock(&mu_);
  if (report.generation != generation_) {
    // Its generation ended while it was written: what it wrote can never commit (the id names
    // that generation, so no later save uses the directory).
    if (!FindLocked(report.id).ok() && !pending_.contains(report.id)) {
      DiscardLocked(report.id, "a checkpoint of an ended generation");
    }
    return absl::AbortedError(absl::StrCat(
        "rank ", report.rank, "'s shard of ", report.id, " was saved at generation ",
        report.generation, ", which has ended (now ", generation_, "); it is not committed"));
  }
  if (report.plan_hash != plan.plan->hash) {
    return absl::FailedPreconditionError(absl::StrCat(
        "rank ", report.rank, "'s shard of ", report.id, " is laid out by plan ",
        report.plan_hash, " but the current plan is ", plan.plan->hash));
  }
  if (FindLocked(report.id).ok()) return false;  // already committed (a retried report)
  if (!report.skipped.empty()) {
    NoteSkippedLocked(report, now);
    return false;
  }
  if (failed_.contains(report.id)) {
    // Another rank's shard of a checkpoint that failed, written after its directory was removed.
    DiscardLocked(report.id, "a shard of a failed checkpoint");
    return false;
  }
  Pending& pending = pending_[report.id];
  if (pending.shards.empty()) {
    pending.shards.resize(world);
    pending.step = report.step;
    pending.plan_hash = report.plan_hash;
    pending.counters = report.counters;
    pending.state = report.state;
  }
  if (report.step != pending.step) {
    return absl::InvalidArgumentError(absl::StrCat("shard report of rank ", report.rank, " for ",
                                                   report.id, " is of step ", report.step,
                                                   ", the other ranks' of ", pending.step));
  }
  pending.request = std::max(pending.request, report.request);
  pending.max_pause_ms = std::max(pending.max_pause_ms, report.pause_ms);
  pending.max_write_ms = std::max(pending.max_write_ms, report.write_ms);
  std::string report_error =
      report.error.empty()
          ? ""
          : absl::StrCat("rank ", report.rank, " could not write its shard: ", report.error);
  if (absl::Status valid = ValidateTrainingCounters(report.counters, report.step);
      report_error.empty() && !valid.ok()) {
    // Manifest readers would refuse the checkpoint: fail it now rather than commit it.
    report_error = absl::StrCat("rank ", report.rank, " reports impossible counters for ",
                                report.id, ": ", valid.message());
  }
  if (report_error.empty() && report.counters != pending.counters) {
    // The ranks' updates diverged: the checkpoint would restore inconsistent state.
    report_error = absl::StrCat(
        "rank ", report.rank, " reports optimizer step ", report.counters.optimizer_step,
        ", loss scale ", report.counters.loss_scale, " after ",
        report.counters.loss_scale_growth_tracker, " clean steps for ", report.id,
        ", other ranks ", pending.counters.optimizer_step, ", ", pending.counters.loss_scale,
        " after ", pending.counters.loss_scale_growth_tracker, "; the ranks' updates diverged");
  }
  if (report_error.empty() && report.state != pending.state) {
    report_error = absl::StrCat("rank ", report.rank, " saved optimizer state [",
                                absl::StrJoin(report.state.names, ", "), "] of '",
                                report.state.torch_class, "' for ", report.id, ", other ranks [",
                                absl::StrJoin(pending.state.names, ", "), "] of '",
                                pending.state.torch_class, "'; every rank must run the same optimizer");
  }
  absl::StatusOr<OptimizerConfig> saved_optimizer =
      SavedOptimizer(options_.optimizer, report.state);
  if (report_error.empty() && !saved_optimizer.ok()) {
    report_error = absl::StrCat("rank ", report.rank, ": ", saved_optimizer.status().message());
  }
  if (!report_error.empty()) {
    FailLocked(report.id, report_error, now);
    return false;
  }
  pending.shards[report.rank] = report.record;
  for (const std::optional<ShardRecord>& shard : pending.shards) {
    if (!shard.has_value()) return false;
  }
  // Every shard is on disk: write the manifest, the commit point.
  FaultPoint("manifest-before-write");
  std::vector<ShardRecord> shards;
  for (const std::optional<ShardRecord>& shard : pending.shards) shards.push_back(*shard);
  absl::StatusOr<CheckpointManifest> manifest = MakeCheckpointManifest(
      options_.job, report.id, pending.step, options_.zero_stage, *plan.manifest, *plan.plan,
      *saved_optimizer, OptimizerStateNames(*saved_optimizer), std::move(shards));
  if (manifest.ok()) manifest->counters = pending.counters;
  const std::string dir = Directory(report.id);
  absl::Status committed = manifest.ok() ? storage_->Commit(dir, *manifest) : manifest.status();
  if (!committed.ok()) {
    FailLocked(report.id,
               absl::StrCat("the coordinator could not commit it: ", committed.message()), now);
    return committed;
  }
  v1::CheckpointRecord* record = catalog_.add_checkpoints();
  record->set_id(report.id);
  record->set_step(pending.step);
  record->set_world_size(world);
  record->set_dir(dir);
  record->set_bytes(manifest->total_bytes());
  record->set_committed_unix_ms(absl::ToUnixMillis(now));
  record->set_request(pending.request);
  record->set_max_pause_ms(pending.max_pause_ms);
  record->set_max_write_ms(pending.max_write_ms);
  spdlog::info("checkpoint {} committed: step {}, {} ranks, {} bytes, training paused at most "
               "{:.2f} ms, slowest shard write {:.1f} ms",
               report.id, pending.step, world, manifest->total_bytes(), pending.max_pause_ms,
               pending.max_write_ms);
  if (health_.failures > 0) {
    notices_.push_back(CheckpointNotice{
        v1::MEMBERSHIP_EVENT_KIND_CHECKPOINT_RECOVERED,
        absl::StrCat("checkpoint ", report.id, " (step ", pending.step, ") committed after ",
                     health_.failures, health_.failures == 1 ? " failed save" : " failed saves",
                     " (the last: ", health_.last_failure, ")")});
  }
  pending_.erase(report.id);
  health_.failures = 0;
  health_.skipped = 0;
  ApplyRetentionLocked();
  SHARD_RETURN_IF_ERROR(PersistLocked());
  return true;
}

void CheckpointManager::ApplyRetentionLocked() {
  // The oldest go first, except the restore point: it stays (beyond the count) until training
  // restarts from another.
  int index = 0;
  while (catalog_.checkpoints_size() > options_.keep_last + (index > 0 ? 1 : 0) &&
         index < catalog_.checkpoints_size()) {
    const v1::CheckpointRecord oldest = catalog_.checkpoints(index);
    if (start_.checkpoint_id == oldest.id()) {
      ++index;
      continue;
    }
    catalog_.mutable_checkpoints()->erase(catalog_.mutable_checkpoints()->begin() + index);
    storage_->Remove(oldest.dir(), absl::StrCat("keeping the last ", options_.keep_last));
  }
}

SaveProgress CheckpointManager::Progress(int64_t request) const {
  absl::ReaderMutexLock lock(&mu_);
  SaveProgress progress;
  for (const v1::CheckpointRecord& record : catalog_.checkpoints()) {
    if (record.request() >= request) {
      progress.committed_id = record.id();
      progress.world_size = record.world_size();
      progress.shards_done = record.world_size();
      progress.bytes_done = record.bytes();
      return progress;
    }
  }
  for (const auto& [request_seq, error] : errors_) {
    if (request_seq >= request) progress.error = error;
  }
  for (const auto& [id, pending] : pending_) {
    if (pending.request < request) continue;
    progress.world_size = static_cast<int>(pending.shards.size());
    for (const std::optional<ShardRecord>& shard : pending.shards) {
      if (!shard.has_value()) continue;
      ++progress.shards_done;
      progress.bytes_done += shard->bytes;
    }
  }
  return progress;
}

std::vector<v1::CheckpointRecord> CheckpointManager::List() const {
  absl::ReaderMutexLock lock(&mu_);
  return {catalog_.checkpoints().begin(), catalog_.checkpoints().end()};
}

absl::StatusOr<v1::CheckpointRecord> CheckpointManager::FindLocked(const std::string& id) const {
  if (id == "latest") {
    if (catalog_.checkpoints().empty()) {
      return absl::NotFoundError(
          absl::StrCat("job '", options_.job, "' has no committed checkpoint yet"));
    }
    return *catalog_.checkpoints().rbegin();
  }
  SHARD_RETURN_IF_ERROR(ValidateCheckpointId(id));
  for (const v1::CheckpointRecord& record : catalog_.checkpoints()) {
    if (record.id() == id) return record;
  }
  return absl::NotFoundError(absl::StrCat("job '", options_.job, "' has no checkpoint '", id,
                                          "'; 'shardctl checkpoint list' shows the committed ones"));
}

absl::StatusOr<v1::CheckpointRecord> CheckpointManager::Find(const std::string& id) const {
  absl::ReaderMutexLock lock(&mu_);
  return FindLocked(id);
}

absl::StatusOr<CheckpointManifest> CheckpointManager::ReadManifest(
    const v1::CheckpointRecord& record) const {
  return storage_->ReadManifest(record.dir());
}

absl::Status CheckpointManager::Delete(const std::string& id) {
  absl::MutexLock lock(&mu_);
  SHARD_ASSIGN_OR_RETURN(v1::CheckpointRecord record, FindLocked(id));
  if (start_.checkpoint_id == record.id()) {
    return absl::FailedPreconditionError(
        absl::StrCat("checkpoint ", record.id(),
                     " is where the job's training restarts; restore another "
                     "first"));
  }
  auto* list = catalog_.mutable_checkpoints();
  for (auto it = list->begin(); it != list->end(); ++it) {
    if (it->id() == record.id()) {
      list->erase(it);
      break;
    }
  }
  SHARD_RETURN_IF_ERROR(PersistLocked());
  storage_->Remove(record.dir(), "deleted by an operator");
  return absl::OkStatus();
}

v1::CheckpointCatalog CheckpointManager::Catalog() const {
  absl::ReaderMutexLock lock(&mu_);
  return catalog_;
}

void CheckpointManager::OnGeneration(int64_t generation) {
  absl::MutexLock lock(&mu_);
  if (generation == generation_) return;
  const int64_t ended = generation_;
  generation_ = generation;
  for (const auto& [id, pending] : pending_) {
    DiscardLocked(id, "a checkpoint of an ended generation");
  }
  pending_.clear();
  failed_.clear();
  // And the saves of ended generations no rank reported (given up, or cut short by a death):
  // their ids name their generation, so no later save writes there.
  const std::string job_dir = absl::StrCat(options_.root, "/", options_.job);
  for (const std::string& name : storage_->ListDirectories(job_dir)) {
    const std::optional<int64_t> saved_at = GenerationOf(name);
    if (saved_at.has_value() && *saved_at < generation_ &&
        !storage_->IsCommitted(Directory(name))) {
      storage_->Remove(Directory(name), "a checkpoint of an ended generation");
    }
  }
  BeginGenerationLocked(ended);
  if (absl::Status saved = PersistLocked(); !saved.ok()) spdlog::error("{}", saved.message());
}

void CheckpointManager::BeginGenerationLocked(int64_t ended) {
  // The ended generation's requests go with it: its ranks no longer exist to save for them.
  const int64_t latest = catalog_.last_request();
  if (latest > 0 && catalog_.request_generation() != generation_ && !AnsweredLocked(latest)) {
    errors_[latest] = absl::StrCat("cancelled: generation ", ended,
                                   " ended (the world changed) before every rank had saved; "
                                   "ask again");
  }
  catalog_.set_pause_request(0);
  catalog_.set_pause_in_memory(false);
  if (restore_requested_) {
    restore_requested_ = false;  // this is the re-formation the restore asked for
    start_fixed_generation_ = generation_;
  } else if (training_started_) {
    RestartFromLatestLocked();
  }
}

}  // namespace shard
