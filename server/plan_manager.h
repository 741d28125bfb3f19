// The job's plan: the manifest every worker must agree on, the plan of the current generation
// (computed with common/plan.h, versioned), the bucket rebuild from the first iteration's
// gradient order (rank 0's order wins, as in DDP) and the overlap status machine
// UNINITIALIZED -> DDP_HAS_REBUILT_BUCKETS -> INITIALIZED, plus aggregated step statistics.
// With a StateStore, the manifest, the rebuilt order, the current plan and its acknowledgements
// are kept (record "plan") so that a restarted coordinator serves the same plan.
// No gRPC. Thread-safe; callbacks run outside the manager's lock.
#pragma once

#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/manifest.h"
#include "common/plan.h"
#include "common/progress_meter.h"
#include "server/store/state_store.h"
#include "server/types.h"
#include "server/wait_list.h"

namespace shard {

struct PlanConfig {
  ShardMode mode = ShardMode::kRange;
  int64_t bucket_cap_bytes = int64_t{25} << 20;
  int64_t first_bucket_cap_bytes = int64_t{1} << 20;
  int min_buckets = 1;  // PlanOptions::min_buckets
  int64_t alignment_bytes = 64;
};

struct OrderDisagreement {
  int rank = 0;
  int position = 0;
  std::string expected;  // rank 0's parameter at that position
  std::string reported;
};

struct PlanStats {
  OverlapStatus status = OverlapStatus::kUninitialized;
  int64_t plan_version = 0;
  std::string plan_hash;
  std::vector<int> pending_acks;
  std::vector<OrderDisagreement> disagreements;
  int64_t steps_reported = 0;
  double mean_step_ms = 0;
  double mean_backward_ms = 0;
  double mean_communication_ms = 0;
  double mean_hidden_ms = 0;
  double overlap_fraction = 0;
  std::vector<int64_t> bucket_bytes;
  struct Rank {
    int rank = 0;
    std::string worker_id;
    int64_t acked_version = 0;
    std::optional<StepReport> last;
  };
  std::vector<Rank> ranks;
};

class PlanManager {
 public:
  using PlanCallback = std::function<void(absl::StatusOr<PlanView>)>;

  explicit PlanManager(PlanConfig config, StateStore* store = nullptr, size_t stats_window = 50);

  // Takes back the saved plan state (a restarted coordinator, at `generation`): the manifest and
  // rebuilt order always, the plan and its acknowledgements if they are of that generation.
  absl::Status Recover(int64_t generation);

  // A new world generation: its plan is made at the first registration, with the rebuilt
  // order if there is one. Pending rebuild waits are answered Aborted.
  void OnGeneration(int64_t generation);

  // The gradient order of a checkpoint the job restores from, when no rebuild happened yet in
  // this coordinator: plans are made with it, so no rebuild (and no state move) is needed.
  void SeedRebuiltOrder(std::vector<int> order);

  absl::StatusOr<PlanView> RegisterManifest(const MemberRef& member, const Manifest& manifest);
  absl::StatusOr<PlanView> AckPlan(const MemberRef& member, int64_t version,
                                   const std::string& hash);
  // Calls `done` once the rebuilt plan exists (at once if it does), or DeadlineExceeded after
  // `wait`, or Aborted if the generation ends first.
  void ReportGradientOrder(const MemberRef& member, int64_t plan_version, std::vector<int> order,
                           absl::Duration wait, absl::Time now, PlanCallback done);
  void ExpireWaits(absl::Time now);
  // Answers every held wait with `reason`, and from now on every new one at once (at shutdown).
  void CloseWaits(const absl::Status& reason);

  // A rank finished a step of its generation at `now` (statistics and progress).
  absl::Status ReportStepStats(const MemberRef& member, StepReport report, absl::Time now);
  // The job's progress as the step reports tell it (it spans generations).
  ProgressMeter progress() const;
  // The step times (ms) of the steps the ranks reported last (the statistics window).
  std::vector<double> RecentStepMs() const;

  std::optional<PlanView> Current() const;
  PlanStats Stats() const;
  // Ranks waiting for rank 0's gradient order.
  size_t pending_waiters() const;

 private:
  struct Answer {
    PlanCallback done;
    absl::StatusOr<PlanView> result;
  };

  absl::Status CheckGeneration(const MemberRef& member) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Makes the current generation's plan if there is none yet.
  absl::Status EnsurePlanLocked(int world_size) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status CheckOrderLocked(const MemberRef& member, int64_t plan_version,
                                const std::vector<int>& order) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  void RecordDisagreementLocked(int rank, const std::vector<int>& order)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  OverlapStatus StatusLocked() const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  PlanView ViewLocked() const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  std::vector<Answer> TakeWaitersLocked(const absl::Status& status)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Saves the plan state (no-op without a store); a failure is logged: the plan is recomputed
  // from the workers' manifests after a restart anyway.
  void PersistLocked() const ABSL_SHARED_LOCKS_REQUIRED(mu_);

  const PlanConfig config_;
  StateStore* const store_;
  const size_t stats_window_;
  mutable absl::Mutex mu_;
  std::shared_ptr<const Manifest> manifest_ ABSL_GUARDED_BY(mu_);
  std::string manifest_owner_ ABSL_GUARDED_BY(mu_);
  std::optional<std::vector<int>> rebuilt_order_ ABSL_GUARDED_BY(mu_);
  int64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  std::shared_ptr<const Plan> plan_ ABSL_GUARDED_BY(mu_);  // of generation_, if made
  int64_t version_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<int, int64_t> acked_ ABSL_GUARDED_BY(mu_);      // rank -> plan version applied
  std::map<int, std::string> rank_workers_ ABSL_GUARDED_BY(mu_);
  std::map<int, std::vector<int>> reported_orders_ ABSL_GUARDED_BY(mu_);
  std::vector<OrderDisagreement> disagreements_ ABSL_GUARDED_BY(mu_);
  WaitList<PlanCallback> waiters_ ABSL_GUARDED_BY(mu_);  // ranks waiting for rank 0's order
  std::map<int, std::deque<StepReport>> stats_ ABSL_GUARDED_BY(mu_);
  ProgressMeter progress_ ABSL_GUARDED_BY(mu_);
};

}  // namespace shard
