// Where the engine's plan comes from: the coordinator in a worker (worker/plan_session.h), or
// local planning when a program runs the data path without a coordinator.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "common/manifest.h"
#include "common/plan.h"
#include "common/status_macros.h"

namespace shard {

struct AppliedPlan {
  std::shared_ptr<const Plan> plan;
  int64_t version = 0;
  bool rebuilt = false;  // built from an observed gradient order (no rebuild needed)
};

class PlanProvider {
 public:
  virtual ~PlanProvider() = default;
  // The plan to start with, for this manifest.
  virtual absl::StatusOr<AppliedPlan> Initial(const Manifest& manifest) = 0;
  // After the first iteration: the order gradients became ready under `version`. Every rank
  // must get the same rebuilt plan back.
  virtual absl::StatusOr<AppliedPlan> Rebuild(int64_t version, const std::vector<int>& order) = 0;
};

// Plans with common/plan.h in this process. Ranks using their own LocalPlanProvider agree as
// long as their models make gradients ready in the same order. Options with a gradient order
// (e.g. a checkpoint's) give a plan that is already rebuilt.
class LocalPlanProvider : public PlanProvider {
 public:
  explicit LocalPlanProvider(PlanOptions options) : options_(std::move(options)) {}

  absl::StatusOr<AppliedPlan> Initial(const Manifest& manifest) override {
    manifest_ = manifest;
    SHARD_ASSIGN_OR_RETURN(Plan plan, MakePlan(manifest_, options_));
    return AppliedPlan{std::make_shared<const Plan>(std::move(plan)), 1,
                       !options_.gradient_order.empty()};
  }

  absl::StatusOr<AppliedPlan> Rebuild(int64_t version, const std::vector<int>& order) override {
    PlanOptions options = options_;
    options.gradient_order = order;
    SHARD_ASSIGN_OR_RETURN(Plan plan, MakePlan(manifest_, options));
    return AppliedPlan{std::make_shared<const Plan>(std::move(plan)), version + 1, true};
  }

 private:
  PlanOptions options_;
  Manifest manifest_;
};

}  // namespace shard
