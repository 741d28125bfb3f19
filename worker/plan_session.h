// A worker's side of planning, the engine's PlanProvider in a real job: registers the model's
// manifest with the coordinator, recomputes the plan from the coordinator's spec with the same
// pure function, and acknowledges it with the hash it got (the coordinator refuses a different
// one); after the first iteration, reports the gradient-ready order and applies the rebuilt
// plan the same way.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/manifest.h"
#include "worker/coordinator_client.h"
#include "worker/dataplane/plan_provider.h"

namespace shard {

class PlanSession : public PlanProvider {
 public:
  // `rebuild_wait`: how long a rank waits for rank 0's order after reporting its own.
  PlanSession(CoordinatorClient* client, std::string worker_id, uint64_t incarnation,
              absl::Duration rebuild_wait);

  // Registers the manifest and returns the current plan, applied and acknowledged (the newest
  // one if a rebuild publishes a new version meanwhile).
  absl::StatusOr<AppliedPlan> Initial(const Manifest& manifest) override;
  absl::StatusOr<AppliedPlan> Rebuild(int64_t version, const std::vector<int>& order) override;

 private:
  absl::StatusOr<AppliedPlan> Apply(const v1::PlanResponse& response);

  CoordinatorClient* client_;
  std::string worker_id_;
  uint64_t incarnation_;
  absl::Duration rebuild_wait_;
  Manifest manifest_;
};

}  // namespace shard
