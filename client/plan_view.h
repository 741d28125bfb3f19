// How shardctl shows plans and statistics: tables for people, JSON for scripts.
#pragma once

#include <string>

#include "nlohmann/json.hpp"
#include "shard/v1/coordinator.pb.h"

namespace shard {

// Keys: version, hash, manifest_hash, generation, world_size, mode, bucket_cap_bytes,
// first_bucket_cap_bytes, min_buckets, alignment_bytes, imbalance, buckets (each: index, dtype,
// params, numel, padded_numel, owner), ranks (each: rank, owned_numel, owned_bytes, ranges).
nlohmann::json PlanToJson(const v1::PlanSummary& plan);
std::string PlanTable(const v1::PlanSummary& plan);

// Keys: status, plan_version, plan_hash, pending_acks, disagreements, steps_reported,
// mean_step_ms, mean_backward_ms, mean_communication_ms, mean_hidden_ms, overlap_fraction,
// bucket_bytes, ranks (each: rank, worker_id, acked_plan_version, last_step).
nlohmann::json StatsToJson(const v1::GetStatsResponse& stats);
std::string StatsTable(const v1::GetStatsResponse& stats);

}  // namespace shard
