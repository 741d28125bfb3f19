// Conversions between the planning types of common/ and their shard.v1 messages, shared by
// the coordinator, the worker and shardctl.
#pragma once

#include "absl/status/statusor.h"
#include "common/manifest.h"
#include "common/plan.h"
#include "shard/v1/coordinator.pb.h"

namespace shard {

v1::Manifest ToProto(const Manifest& manifest);
// Validates as ParseManifestJson does.
absl::StatusOr<Manifest> FromProto(const v1::Manifest& manifest);

v1::ShardMode ToProto(ShardMode mode);
absl::StatusOr<ShardMode> FromProto(v1::ShardMode mode);

// The spec a worker recomputes the plan from; `version` and `generation` are the
// coordinator's.
v1::PlanSpec ToPlanSpec(const Plan& plan, int64_t version, int64_t generation);
absl::StatusOr<PlanOptions> PlanOptionsFromSpec(const v1::PlanSpec& spec);

// Buckets with parameter names and per-rank ownership, for display.
v1::PlanSummary ToPlanSummary(const Plan& plan, const Manifest& manifest, int64_t version,
                              int64_t generation);

}  // namespace shard
