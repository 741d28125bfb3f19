// How shardctl shows the coordinator's status: tables for people, JSON for scripts.
#pragma once

#include <string>
#include <vector>

#include "nlohmann/json.hpp"
#include "shard/v1/coordinator.pb.h"

namespace shard {

// Keys: job, generation, world_size, expected_world_size, ranks, min_world_size, standby,
// transition, state, lease_ms, uptime_ms, progress (step, steps, loss, steps_per_second, eta_ms,
// last_checkpoint, last_checkpoint_step, last_checkpoint_age_ms, overlap_fraction; null where
// not known yet), workers (each: id, rank, host, device, capabilities, state,
// last_heartbeat_ms_ago, self_check, self_check_detail, joined_generation). States are
// lower-case words: "running", "ready".
nlohmann::json StatusToJson(const v1::GetStatusResponse& status);

// One header line about the job (and what it is waiting for), the training's progress, then
// the workers table.
std::string StatusTable(const v1::GetStatusResponse& status);
// "training: step 812/1000, loss 0.25, 12.5 steps/s, ETA 15s, 75% of communication hidden" and
// "last checkpoint: step-00000800-g3 (step 800), 1s ago"; empty for a world without a job.
std::string ProgressLines(const v1::GetStatusResponse& status);
// "job demo: running, generation 7, 3/3 ranks held (target 4, min 2), 1 standby: ..."
std::string WorldLine(const v1::GetStatusResponse& status);
std::string WorkersTable(const v1::GetStatusResponse& status);

// Left-aligned columns, two spaces apart; the first row is the header.
std::string RenderTable(const std::vector<std::vector<std::string>>& rows);

// "JOB_STATE_RUNNING" -> "running".
std::string EnumWord(const std::string& enum_name, const std::string& prefix);

}  // namespace shard
