#include "server/plan_manager.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "shard/v1/state.pb.h"
#include "spdlog/spdlog.h"

namespace shard {
namespace {

constexpr size_t kMaxDisagreements = 64;
constexpr char kPlanRecord[] = "plan";
constexpr absl::Duration kMaxWait = absl::Minutes(10);

}  // namespace

PlanManager::PlanManager(PlanConfig config, StateStore* store, size_t stats_window)
    : config_(config), store_(store), stats_window_(stats_window) {}

void PlanManager::PersistLocked() const {
  if (store_ == nullptr || manifest_ == nullptr) return;
  v1::PlanRecord record;
  record.set_manifest_json(ManifestToJson(*manifest_));
  record.set_manifest_owner(manifest_owner_);
  record.set_rebuilt(rebuilt_order_.has_value());
  if (rebuilt_order_.has_value()) {
    for (int index : *rebuilt_order_) record.add_rebuilt_order(index);
  }
  record.set_version(version_);
  if (plan_ != nullptr) {
    record.set_generation(generation_);
    record.set_world_size(plan_->options.world_size);
    for (int index : plan_->options.gradient_order) record.add_plan_order(index);
    for (const auto& [rank, version] : acked_) (*record.mutable_acked())[rank] = version;
  }
  if (absl::Status saved = store_->Save(kPlanRecord, record); !saved.ok()) {
    spdlog::error("cannot keep the plan in the state directory: {}", saved.message());
  }
}

absl::Status PlanManager::Recover(int64_t generation) {
  if (store_ == nullptr) return absl::OkStatus();
  v1::PlanRecord record;
  SHARD_ASSIGN_OR_RETURN(bool loaded, store_->Load(kPlanRecord, &record));
  if (!loaded) return absl::OkStatus();
  absl::StatusOr<Manifest> manifest = ParseManifestJson(record.manifest_json());
  if (!manifest.ok()) {
    return absl::DataLossError(absl::StrCat("the state directory's plan record holds a bad "
                                            "manifest: ", manifest.status().message()));
  }
  absl::MutexLock lock(&mu_);
  generation_ = generation;
  manifest_ = std::make_shared<const Manifest>(std::move(*manifest));
  manifest_owner_ = record.manifest_owner();
  if (record.rebuilt()) {
    rebuilt_order_ = std::vector<int>(record.rebuilt_order().begin(), record.rebuilt_order().end());
  }
  version_ = record.version();
  if (record.generation() != generation || record.world_size() < 1) return absl::OkStatus();
  PlanOptions options;
  options.world_size = record.world_size();
  options.mode = config_.mode;
  options.bucket_cap_bytes = config_.bucket_cap_bytes;
  options.first_bucket_cap_bytes = config_.first_bucket_cap_bytes;
  options.min_buckets = config_.min_buckets;
  options.alignment_bytes = config_.alignment_bytes;
  options.gradient_order.assign(record.plan_order().begin(), record.plan_order().end());
  SHARD_ASSIGN_OR_RETURN(Plan plan, MakePlan(*manifest_, options));
  plan_ = std::make_shared<const Plan>(std::move(plan));
  for (const auto& [rank, version] : record.acked()) acked_[rank] = version;
  spdlog::info("plan v{} of generation {} taken back from the state directory (hash {}, overlap "
               "status {})",
               version_, generation_, plan_->hash, OverlapStatusName(StatusLocked()));
  return absl::OkStatus();
}

void PlanManager::OnGeneration(int64_t generation) {
  std::vector<Answer> answers;
  {
    absl::MutexLock lock(&mu_);
    if (generation == generation_) return;
    answers = TakeWaitersLocked(absl::AbortedError(absl::StrCat(
        "generation ", generation_, " ended while waiting for the rebuilt plan; now at ",
        generation)));
    generation_ = generation;
    plan_.reset();
    acked_.clear();
    rank_workers_.clear();
    reported_orders_.clear();
    stats_.clear();
  }
  for (Answer& answer : answers) answer.done(std::move(answer.result));
}

void PlanManager::SeedRebuiltOrder(std::vector<int> order) {
  absl::MutexLock lock(&mu_);
  if (rebuilt_order_.has_value()) return;
  rebuilt_order_ = std::move(order);
  plan_.reset();  // the next registration plans with it
}

absl::Status PlanManager::CheckGeneration(const MemberRef& member) const {
  if (member.generation != generation_) {
    return absl::AbortedError(absl::StrCat("request for generation ", member.generation,
                                           " but the world is at generation ", generation_));
  }
  return absl::OkStatus();
}

absl::Status PlanManager::EnsurePlanLocked(int world_size) {
  if (plan_ != nullptr) return absl::OkStatus();
  PlanOptions options;
  options.world_size = world_size;
  options.mode = config_.mode;
  options.bucket_cap_bytes = config_.bucket_cap_bytes;
  options.first_bucket_cap_bytes = config_.first_bucket_cap_bytes;
  options.min_buckets = config_.min_buckets;
  options.alignment_bytes = config_.alignment_bytes;
  if (rebuilt_order_.has_value()) options.gradient_order = *rebuilt_order_;
  SHARD_ASSIGN_OR_RETURN(Plan plan, MakePlan(*manifest_, options));
  plan_ = std::make_shared<const Plan>(std::move(plan));
  ++version_;
  acked_.clear();
  PersistLocked();
  spdlog::info("plan v{} for generation {}: {} buckets over {} ranks ({} mode), imbalance {:.3f}, "
               "hash {}",
               version_, generation_, plan_->buckets.size(), world_size,
               ShardModeName(config_.mode), plan_->imbalance, plan_->hash);
  return absl::OkStatus();
}

OverlapStatus PlanManager::StatusLocked() const {
  if (!rebuilt_order_.has_value()) return OverlapStatus::kUninitialized;
  if (plan_ == nullptr) return OverlapStatus::kRebuilt;
  for (int rank = 0; rank < plan_->options.world_size; ++rank) {
    auto it = acked_.find(rank);
    if (it == acked_.end() || it->second != version_) return OverlapStatus::kRebuilt;
  }
  return OverlapStatus::kInitialized;
}

PlanView PlanManager::ViewLocked() const {
  return PlanView{plan_, manifest_, version_, generation_, StatusLocked()};
}

absl::StatusOr<PlanView> PlanManager::RegisterManifest(const MemberRef& member,
                                                       const Manifest& manifest) {
  SHARD_RETURN_IF_ERROR(ValidateManifest(manifest));
  absl::MutexLock lock(&mu_);
  SHARD_RETURN_IF_ERROR(CheckGeneration(member));
  if (manifest_ != nullptr) {
    absl::Status same =
        CompareManifests(*manifest_, manifest, absl::StrCat("worker ", member.worker_id));
    if (!same.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat(same.message(), " (the job's manifest was first registered by worker ",
                       manifest_owner_, "); every worker must run the same model"));
    }
  } else {
    manifest_ = std::make_shared<const Manifest>(manifest);
    manifest_owner_ = member.worker_id;
    spdlog::info("job manifest registered by worker {}: {} parameters, hash {}", member.worker_id,
                 manifest.params.size(), ManifestHash(manifest));
  }
  SHARD_RETURN_IF_ERROR(EnsurePlanLocked(member.world_size));
  rank_workers_[member.rank] = member.worker_id;
  return ViewLocked();
}

absl::StatusOr<PlanView> PlanManager::AckPlan(const MemberRef& member, int64_t version,
                                              const std::string& hash) {
  absl::MutexLock lock(&mu_);
  SHARD_RETURN_IF_ERROR(CheckGeneration(member));
  if (plan_ == nullptr) {
    return absl::FailedPreconditionError("no plan yet in this generation; register a manifest");
  }
  if (version != version_) {
    return absl::AbortedError(absl::StrCat("plan v", version, " is not current; v", version_,
                                           " is: fetch it and apply it"));
  }
  if (hash != plan_->hash) {
    return absl::FailedPreconditionError(absl::StrCat(
        "worker ", member.worker_id, " computed plan hash ", hash, " for v", version,
        " but the coordinator's is ", plan_->hash,
        "; the worker's planning code differs from the coordinator's (mixed Shard versions?)"));
  }
  acked_[member.rank] = version;
  rank_workers_[member.rank] = member.worker_id;
  PersistLocked();
  const OverlapStatus status = StatusLocked();
  if (status == OverlapStatus::kInitialized) {
    spdlog::info("overlap status INITIALIZED: every worker applied plan v{}", version_);
  }
  return ViewLocked();
}

void PlanManager::RecordDisagreementLocked(int rank, const std::vector<int>& order) {
  const std::vector<int>& wins = *rebuilt_order_;
  if (order == wins) return;
  size_t position = 0;
  while (position < order.size() && position < wins.size() && order[position] == wins[position]) {
    ++position;
  }
  auto name = [&](const std::vector<int>& o) {
    return position < o.size() ? manifest_->params[o[position]].name : std::string("(end)");
  };
  OrderDisagreement disagreement{rank, static_cast<int>(position), name(wins), name(order)};
  spdlog::warn("rank {} saw gradients ready in a different order than rank 0 (position {}: {} "
               "instead of {}); rank 0's order is used",
               rank, position, disagreement.reported, disagreement.expected);
  if (disagreements_.size() < kMaxDisagreements) disagreements_.push_back(disagreement);
}

absl::Status PlanManager::CheckOrderLocked(const MemberRef& member, int64_t plan_version,
                                          const std::vector<int>& order) const {
  SHARD_RETURN_IF_ERROR(CheckGeneration(member));
  if (plan_ == nullptr || manifest_ == nullptr) {
    return absl::FailedPreconditionError("register a manifest before reporting an order");
  }
  // Once rebuilt, an order observed under an earlier plan of this generation still counts (it
  // is compared with rank 0's); before, it must be the current plan's.
  if (plan_version != version_ && !rebuilt_order_.has_value()) {
    return absl::AbortedError(absl::StrCat("the order was observed under plan v", plan_version,
                                           " but v", version_, " is current"));
  }
  // The order must be a permutation of the trainable parameters, as planning requires.
  PlanOptions check = plan_->options;
  check.gradient_order = order;
  return MakePlan(*manifest_, check).status();
}

void PlanManager::ReportGradientOrder(const MemberRef& member, int64_t plan_version,
                                      std::vector<int> order, absl::Duration wait, absl::Time now,
                                      PlanCallback done) {
  std::vector<Answer> answers;
  absl::StatusOr<PlanView> result;
  {
    absl::MutexLock lock(&mu_);
    if (absl::Status valid = CheckOrderLocked(member, plan_version, order); !valid.ok()) {
      result = valid;
    } else if (rebuilt_order_.has_value()) {
      RecordDisagreementLocked(member.rank, order);
      result = ViewLocked();
    } else if (!waiters_.closed().ok()) {
      result = waiters_.closed();  // nothing would answer a held wait
    } else if (member.rank != 0) {
      // Rank 0's order decides; wait for it.
      reported_orders_[member.rank] = std::move(order);
      waiters_.Add(now + std::min(wait, kMaxWait), std::move(done));
      return;
    } else {
      const int world = plan_->options.world_size;
      rebuilt_order_ = std::move(order);
      plan_.reset();
      if (const absl::Status made = EnsurePlanLocked(world); !made.ok()) {
        result = made;
      } else {
        spdlog::info("buckets rebuilt from rank 0's gradient order: plan v{}, overlap status "
                     "DDP_HAS_REBUILT_BUCKETS",
                     version_);
        for (const auto& [rank, reported] : reported_orders_) {
          RecordDisagreementLocked(rank, reported);
        }
        result = ViewLocked();
        answers = TakeWaitersLocked(absl::OkStatus());
      }
    }
  }
  for (Answer& answer : answers) answer.done(std::move(answer.result));
  done(std::move(result));
}

std::vector<PlanManager::Answer> PlanManager::TakeWaitersLocked(const absl::Status& status) {
  std::vector<Answer> answers;
  for (PlanCallback& done : waiters_.TakeAll()) {
    answers.push_back(Answer{std::move(done), status.ok() ? absl::StatusOr<PlanView>(ViewLocked())
                                                          : absl::StatusOr<PlanView>(status)});
  }
  return answers;
}

void PlanManager::ExpireWaits(absl::Time now) {
  std::vector<Answer> answers;
  {
    absl::MutexLock lock(&mu_);
    for (PlanCallback& done : waiters_.TakeExpired(now)) {
      answers.push_back(Answer{std::move(done),
                               absl::DeadlineExceededError(
                                   "rank 0 has not reported its gradient order; the rebuilt "
                                   "plan does not exist yet")});
    }
  }
  for (Answer& answer : answers) answer.done(std::move(answer.result));
}

void PlanManager::CloseWaits(const absl::Status& reason) {
  std::vector<Answer> answers;
  {
    absl::MutexLock lock(&mu_);
    answers = TakeWaitersLocked(reason);
    waiters_.Close(reason);  // nothing left to hand back: later waits are answered at once
  }
  for (Answer& answer : answers) answer.done(std::move(answer.result));
}

absl::Status PlanManager::ReportStepStats(const MemberRef& member, StepReport report,
                                          absl::Time now) {
  absl::MutexLock lock(&mu_);
  SHARD_RETURN_IF_ERROR(CheckGeneration(member));
  progress_.Note(member.generation, report.step, report.loss, now);
  std::deque<StepReport>& window = stats_[member.rank];
  window.push_back(std::move(report));
  while (window.size() > stats_window_) window.pop_front();
  rank_workers_[member.rank] = member.worker_id;
  return absl::OkStatus();
}

std::vector<double> PlanManager::RecentStepMs() const {
  absl::ReaderMutexLock lock(&mu_);
  std::vector<double> ms;
  for (const auto& [rank, reports] : stats_) {
    for (const StepReport& report : reports) ms.push_back(report.step_ms);
  }
  return ms;
}

ProgressMeter PlanManager::progress() const {
  absl::ReaderMutexLock lock(&mu_);
  return progress_;
}

std::optional<PlanView> PlanManager::Current() const {
  absl::ReaderMutexLock lock(&mu_);
  if (plan_ == nullptr) return std::nullopt;
  return ViewLocked();
}

size_t PlanManager::pending_waiters() const {
  absl::ReaderMutexLock lock(&mu_);
  return waiters_.size();
}

PlanStats PlanManager::Stats() const {
  absl::ReaderMutexLock lock(&mu_);
  PlanStats stats;
  stats.status = StatusLocked();
  stats.plan_version = version_;
  if (plan_ != nullptr) {
    stats.plan_hash = plan_->hash;
    for (int rank = 0; rank < plan_->options.world_size; ++rank) {
      auto it = acked_.find(rank);
      if (it == acked_.end() || it->second != version_) stats.pending_acks.push_back(rank);
    }
  }
  stats.disagreements = disagreements_;
  double hidden = 0;
  double communication = 0;
  for (const auto& [rank, window] : stats_) {
    for (const StepReport& report : window) {
      ++stats.steps_reported;
      stats.mean_step_ms += report.step_ms;
      stats.mean_backward_ms += report.backward_ms;
      communication += report.communication_ms;
      hidden += report.hidden_ms;
    }
  }
  if (stats.steps_reported > 0) {
    const double n = static_cast<double>(stats.steps_reported);
    stats.mean_step_ms /= n;
    stats.mean_backward_ms /= n;
    stats.mean_communication_ms = communication / n;
    stats.mean_hidden_ms = hidden / n;
    stats.overlap_fraction = communication > 0 ? hidden / communication : 0;
  }
  if (auto it = stats_.find(0); it != stats_.end() && !it->second.empty()) {
    stats.bucket_bytes = it->second.back().bucket_bytes;
  }
  for (const auto& [rank, worker_id] : rank_workers_) {
    PlanStats::Rank entry;
    entry.rank = rank;
    entry.worker_id = worker_id;
    if (auto acked = acked_.find(rank); acked != acked_.end()) entry.acked_version = acked->second;
    if (auto window = stats_.find(rank); window != stats_.end() && !window->second.empty()) {
      entry.last = window->second.back();
    }
    stats.ranks.push_back(std::move(entry));
  }
  return stats;
}

}  // namespace shard
