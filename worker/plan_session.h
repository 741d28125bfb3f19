// A worker's side of planning: registers the model's manifest, recomputes the plan from the
// coordinator's spec with the same pure function, checks that it arrives at the same hash,
// and acknowledges it; after the first iteration, reports the gradient-ready order and applies
// the rebuilt plan the same way.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/manifest.h"
#include "common/plan.h"
#include "worker/coordinator_client.h"

namespace shard {

struct AppliedPlan {
  std::shared_ptr<const Plan> plan;
  int64_t version = 0;
  v1::OverlapStatus status = v1::OVERLAP_STATUS_UNSPECIFIED;
};

class PlanSession {
 public:
  PlanSession(CoordinatorClient* client, std::string worker_id, uint64_t incarnation,
              Manifest manifest);

  // Registers the manifest; returns the current plan, applied and acknowledged (the newest one
  // if a rebuild publishes a new version meanwhile).
  absl::StatusOr<AppliedPlan> Register();
  // Reports the order in which gradients became ready under plan `version` and returns the
  // rebuilt plan (rank 0's order), applied and acknowledged. Waits up to `wait` for rank 0.
  absl::StatusOr<AppliedPlan> Rebuild(int64_t version, const std::vector<int>& order,
                                      absl::Duration wait);

 private:
  absl::StatusOr<AppliedPlan> Apply(const v1::PlanResponse& response);

  CoordinatorClient* client_;
  std::string worker_id_;
  uint64_t incarnation_;
  Manifest manifest_;
};

}  // namespace shard
