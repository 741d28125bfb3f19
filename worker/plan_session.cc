#include "worker/plan_session.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "proto/plan_convert.h"

namespace shard {

PlanSession::PlanSession(CoordinatorClient* client, std::string worker_id, uint64_t incarnation,
                         absl::Duration rebuild_wait)
    : client_(client),
      worker_id_(std::move(worker_id)),
      incarnation_(incarnation),
      rebuild_wait_(rebuild_wait) {}

absl::StatusOr<AppliedPlan> PlanSession::Apply(const v1::PlanResponse& response) {
  const v1::PlanSpec& spec = response.plan();
  SHARD_ASSIGN_OR_RETURN(PlanOptions options, PlanOptionsFromSpec(spec));
  absl::StatusOr<Plan> plan = MakePlan(manifest_, options);
  if (!plan.ok()) {
    return absl::Status(plan.status().code(), absl::StrCat("cannot compute plan v", spec.version(),
                                                           ": ", plan.status().message()));
  }
  v1::AckPlanRequest ack;
  ack.set_worker_id(worker_id_);
  ack.set_incarnation(incarnation_);
  ack.set_version(spec.version());
  ack.set_hash(plan->hash);
  // A hash that differs is refused by the coordinator with the details.
  SHARD_ASSIGN_OR_RETURN(v1::PlanResponse acked, client_->AckPlan(ack));
  return AppliedPlan{std::make_shared<const Plan>(std::move(*plan)), spec.version(),
                     acked.status() != v1::OVERLAP_STATUS_UNINITIALIZED};
}

absl::StatusOr<AppliedPlan> PlanSession::Initial(const Manifest& manifest) {
  manifest_ = manifest;
  v1::RegisterManifestRequest request;
  request.set_worker_id(worker_id_);
  request.set_incarnation(incarnation_);
  *request.mutable_manifest() = ToProto(manifest_);
  // A rebuild may publish a newer version between our registration and our acknowledgement
  // (a fast rank 0): the stale acknowledgement is refused, and registering again returns the
  // new version. Registering in an ended generation is refused and ends the loop.
  constexpr int kAttempts = 3;
  absl::StatusOr<AppliedPlan> applied;
  for (int attempt = 0; attempt < kAttempts; ++attempt) {
    SHARD_ASSIGN_OR_RETURN(v1::PlanResponse response, client_->RegisterManifest(request));
    applied = Apply(response);
    if (!absl::IsAborted(applied.status())) return applied;
  }
  return applied;
}

absl::StatusOr<AppliedPlan> PlanSession::Rebuild(int64_t version,
                                                 const std::vector<int>& order) {
  v1::ReportGradientOrderRequest request;
  request.set_worker_id(worker_id_);
  request.set_incarnation(incarnation_);
  request.set_plan_version(version);
  for (int p : order) request.add_order(p);
  request.set_wait_ms(absl::ToInt64Milliseconds(rebuild_wait_));
  SHARD_ASSIGN_OR_RETURN(v1::PlanResponse response, client_->ReportGradientOrder(request));
  return Apply(response);
}

}  // namespace shard
