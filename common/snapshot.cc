#include "common/snapshot.h"

#include <algorithm>
#include <limits>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/names.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"

namespace shard {
namespace {

// The ring the buddies are taken from: ranks grouped by host (hosts in the order of their
// lowest rank), the groups interleaved: with hosts A = {0, 1} and B = {2, 3}, 0 2 1 3.
std::vector<int> BuddyRing(const std::vector<std::string>& hosts) {
  std::vector<std::vector<int>> groups;
  std::map<std::string, size_t> group_of;
  for (int rank = 0; rank < static_cast<int>(hosts.size()); ++rank) {
    auto [it, added] = group_of.emplace(hosts[rank], groups.size());
    if (added) groups.emplace_back();
    groups[it->second].push_back(rank);
  }
  std::vector<int> ring;
  for (size_t i = 0; ring.size() < hosts.size(); ++i) {
    for (const std::vector<int>& group : groups) {
      if (i < group.size()) ring.push_back(group[i]);
    }
  }
  return ring;
}

std::vector<int> RingNeighbours(const std::vector<std::string>& hosts, int rank, int replicas,
                                int direction) {
  const int world = static_cast<int>(hosts.size());
  const std::vector<int> ring = BuddyRing(hosts);
  const int position =
      static_cast<int>(std::find(ring.begin(), ring.end(), rank) - ring.begin());
  std::vector<int> neighbours;
  for (int k = 1; k <= std::min(replicas, world - 1); ++k) {
    neighbours.push_back(ring[((position + direction * k) % world + world) % world]);
  }
  return neighbours;
}

template <typename T>
T Integer(const nlohmann::json& object, const char* key) {
  const nlohmann::json& value = object.at(key);
  if (!value.is_number_integer()) {
    throw nlohmann::json::type_error::create(302, absl::StrCat(key, " is not an integer"),
                                             &value);
  }
  if (value.is_number_unsigned()) {
    const uint64_t v = value.get<uint64_t>();
    if (v > static_cast<uint64_t>(std::numeric_limits<T>::max())) {
      throw nlohmann::json::type_error::create(302, absl::StrCat(key, " is out of range"),
                                               &value);
    }
    return static_cast<T>(v);
  }
  const int64_t v = value.get<int64_t>();
  if (v < 0 || static_cast<uint64_t>(v) > static_cast<uint64_t>(std::numeric_limits<T>::max())) {
    throw nlohmann::json::type_error::create(302, absl::StrCat(key, " is out of range"), &value);
  }
  return static_cast<T>(v);
}

}  // namespace

std::string SnapshotId(int64_t step, int64_t generation) {
  return CheckpointIdForStep(step, absl::StrCat("g", generation));
}

bool NewerSnapshot(int64_t generation_a, int64_t step_a, int64_t generation_b, int64_t step_b) {
  return generation_a != generation_b ? generation_a > generation_b : step_a > step_b;
}

std::vector<int> SnapshotBuddies(const std::vector<std::string>& hosts, int rank, int replicas) {
  return RingNeighbours(hosts, rank, replicas, +1);
}

std::vector<int> SnapshotSources(const std::vector<std::string>& hosts, int rank, int replicas) {
  return RingNeighbours(hosts, rank, replicas, -1);
}

absl::StatusOr<CheckpointManifest> SnapshotManifest(const std::string& job, int zero_stage,
                                                    const Manifest& model,
                                                    const OptimizerConfig& optimizer,
                                                    const std::vector<SnapshotShard>& shards) {
  if (shards.empty()) return absl::InvalidArgumentError("a snapshot without shards");
  const SnapshotShard& first = shards.front();
  if (static_cast<int>(shards.size()) != first.plan.world_size) {
    return absl::FailedPreconditionError(
        absl::StrCat("snapshot ", first.id, " has ", shards.size(), " shards for a world of ",
                     first.plan.world_size));
  }
  std::vector<ShardRecord> records;
  for (int rank = 0; rank < static_cast<int>(shards.size()); ++rank) {
    const SnapshotShard& shard = shards[rank];
    if (shard.rank != rank || shard.id != first.id || shard.step != first.step ||
        shard.generation != first.generation || shard.plan_hash != first.plan_hash ||
        shard.counters != first.counters || shard.state != first.state) {
      return absl::FailedPreconditionError(absl::StrCat(
          "snapshot ", first.id, ": the shard given for rank ", rank, " is rank ", shard.rank,
          "'s of ", shard.id, " (step ", shard.step, ", plan ", shard.plan_hash,
          ", optimizer step ", shard.counters.optimizer_step, "), not of the same snapshot as rank ",
          first.rank, "'s (step ", first.step, ", plan ", first.plan_hash, ", optimizer step ",
          first.counters.optimizer_step, ")"));
    }
    records.push_back(shard.record);
    records.back().rank = rank;
  }
  SHARD_ASSIGN_OR_RETURN(const Plan plan, MakePlan(model, first.plan));
  if (plan.hash != first.plan_hash) {
    return absl::FailedPreconditionError(
        absl::StrCat("snapshot ", first.id, " was laid out by plan ", first.plan_hash,
                     " but its plan options make plan ", plan.hash, " of this model"));
  }
  SHARD_ASSIGN_OR_RETURN(const OptimizerConfig saved, SavedOptimizer(optimizer, first.state));
  SHARD_ASSIGN_OR_RETURN(
      CheckpointManifest manifest,
      MakeCheckpointManifest(job, first.id, first.step, zero_stage, model, plan, saved,
                             OptimizerStateNames(saved), std::move(records)));
  manifest.counters = first.counters;
  return manifest;
}

std::string SnapshotShardToJson(const SnapshotShard& shard) {
  nlohmann::ordered_json json = {
      {"id", shard.id},
      {"generation", shard.generation},
      {"step", shard.step},
      {"rank", shard.rank},
      {"plan",
       {{"world_size", shard.plan.world_size},
        {"mode", std::string(ShardModeName(shard.plan.mode))},
        {"bucket_cap_bytes", shard.plan.bucket_cap_bytes},
        {"first_bucket_cap_bytes", shard.plan.first_bucket_cap_bytes},
        {"min_buckets", shard.plan.min_buckets},
        {"alignment_bytes", shard.plan.alignment_bytes},
        {"gradient_order", shard.plan.gradient_order},
        {"hash", shard.plan_hash}}},
      {"counters",
       {{"optimizer_step", shard.counters.optimizer_step},
        {"loss_scale", shard.counters.loss_scale},
        {"loss_scale_growth_tracker", shard.counters.loss_scale_growth_tracker}}},
      {"record",
       {{"file", shard.record.file},
        {"bytes", shard.record.bytes},
        {"xxh3", shard.record.xxh3},
        {"block_xxh3", shard.record.block_xxh3}}},
      {"request", shard.request},
      {"state", {{"torch_class", shard.state.torch_class}, {"names", shard.state.names}}}};
  for (const ShardExtra& e : shard.record.extras) {
    json["record"]["extras"].push_back(
        {{"param", e.param}, {"offset", e.offset}, {"bytes", e.bytes}});
  }
  return json.dump();
}

absl::StatusOr<SnapshotShard> SnapshotShardFromJson(absl::string_view text) {
  const nlohmann::json json = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (json.is_discarded() || !json.is_object()) {
    return absl::InvalidArgumentError("a snapshot shard's description is not a JSON object");
  }
  SnapshotShard shard;
  try {
    shard.id = json.at("id").get<std::string>();
    shard.generation = Integer<int64_t>(json, "generation");
    shard.step = Integer<int64_t>(json, "step");
    shard.rank = Integer<int>(json, "rank");
    const nlohmann::json& plan = json.at("plan");
    shard.plan.world_size = Integer<int>(plan, "world_size");
    absl::StatusOr<ShardMode> mode = ParseShardMode(plan.at("mode").get<std::string>());
    if (!mode.ok()) return mode.status();
    shard.plan.mode = *mode;
    shard.plan.bucket_cap_bytes = Integer<int64_t>(plan, "bucket_cap_bytes");
    shard.plan.first_bucket_cap_bytes = Integer<int64_t>(plan, "first_bucket_cap_bytes");
    shard.plan.min_buckets = plan.contains("min_buckets") ? Integer<int>(plan, "min_buckets") : 1;
    shard.plan.alignment_bytes = Integer<int64_t>(plan, "alignment_bytes");
    const nlohmann::json& order = plan.at("gradient_order");
    if (!order.is_array()) throw nlohmann::json::type_error::create(302, "gradient_order", &order);
    for (size_t i = 0; i < order.size(); ++i) {
      if (!order[i].is_number_integer() ||
          order[i].get<int64_t>() < std::numeric_limits<int>::min() ||
          order[i].get<int64_t>() > std::numeric_limits<int>::max()) {
        return absl::InvalidArgumentError("plan.gradient_order holds a non-index");
      }
      shard.plan.gradient_order.push_back(order[i].get<int>());
    }
    shard.plan_hash = plan.at("hash").get<std::string>();
    const nlohmann::json& counters = json.at("counters");
    shard.counters.optimizer_step = Integer<int64_t>(counters, "optimizer_step");
    shard.counters.loss_scale = counters.at("loss_scale").get<float>();
    shard.counters.loss_scale_growth_tracker =
        Integer<int64_t>(counters, "loss_scale_growth_tracker");
    const nlohmann::json& record = json.at("record");
    shard.record.file = record.at("file").get<std::string>();
    shard.record.rank = shard.rank;
    shard.record.bytes = Integer<uint64_t>(record, "bytes");
    shard.record.xxh3 = record.at("xxh3").get<std::string>();
    shard.record.block_xxh3 = record.at("block_xxh3").get<std::vector<std::string>>();
    if (record.contains("extras")) {
      const nlohmann::json& extras = record.at("extras");
      if (!extras.is_array()) throw nlohmann::json::type_error::create(302, "extras", &extras);
      for (const nlohmann::json& e : extras) {
        const nlohmann::json& param = e.at("param");
        if (!param.is_number_integer() || param.get<int64_t>() < std::numeric_limits<int>::min() ||
            param.get<int64_t>() > std::numeric_limits<int>::max()) {
          return absl::InvalidArgumentError("an extra's param is not a parameter index or -1");
        }
        shard.record.extras.push_back(ShardExtra{param.get<int>(), Integer<uint64_t>(e, "offset"),
                                                 Integer<uint64_t>(e, "bytes")});
      }
    }
    shard.request = Integer<int64_t>(json, "request");
    const nlohmann::json& state = json.at("state");
    shard.state.torch_class = state.at("torch_class").get<std::string>();
    shard.state.names = state.at("names").get<std::vector<std::string>>();
  } catch (const nlohmann::json::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("a snapshot shard's description is missing or mistypes a field: ", e.what()));
  }
  SHARD_RETURN_IF_ERROR(ValidateSnapshotShard(shard));
  return shard;
}

absl::Status ValidateSnapshotShard(const SnapshotShard& shard) {
  // The JSON parser refuses these as it reads them; a report's protobuf carries signed fields.
  const std::pair<const char*, int64_t> counts[] = {
      {"generation", shard.generation},
      {"step", shard.step},
      {"rank", shard.rank},
      {"request", shard.request},
      {"plan.bucket_cap_bytes", shard.plan.bucket_cap_bytes},
      {"plan.first_bucket_cap_bytes", shard.plan.first_bucket_cap_bytes},
      {"plan.min_buckets", shard.plan.min_buckets},
      {"plan.alignment_bytes", shard.plan.alignment_bytes},
      {"counters.optimizer_step", shard.counters.optimizer_step},
      {"counters.loss_scale_growth_tracker", shard.counters.loss_scale_growth_tracker}};
  for (const auto& [name, value] : counts) {
    if (value < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("a snapshot shard's ", name, " is negative (", value, ")"));
    }
  }
  for (int param : shard.plan.gradient_order) {
    if (param < 0) return absl::InvalidArgumentError("plan.gradient_order holds a non-index");
  }
  uint64_t end = 0;  // extras lie back to back, inside the shard
  for (const ShardExtra& extra : shard.record.extras) {
    if (extra.param < -1) {  // -1: the job's
      return absl::InvalidArgumentError("an extra's param is not a parameter index or -1");
    }
    if (extra.offset < end || extra.offset > shard.record.bytes ||
        extra.bytes > shard.record.bytes - extra.offset) {
      return absl::InvalidArgumentError("the shard's extras lie outside it or overlap");
    }
    end = extra.offset + extra.bytes;
  }
  SHARD_RETURN_IF_ERROR(ValidateCheckpointId(shard.id));
  if (shard.plan.world_size < 1 || shard.rank >= shard.plan.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("snapshot shard of rank ", shard.rank,
                                                   " in a world of ", shard.plan.world_size));
  }
  if (shard.id != SnapshotId(shard.step, shard.generation)) {
    return absl::InvalidArgumentError(absl::StrCat("snapshot id ", shard.id, " is not that of step ",
                                                   shard.step, " of generation ",
                                                   shard.generation));
  }
  if (shard.record.block_xxh3.size() !=
      shard.record.bytes / kCheckpointBlockBytes +
          (shard.record.bytes % kCheckpointBlockBytes != 0 ? 1 : 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "snapshot shard lists ", shard.record.block_xxh3.size(), " block checksums for ",
        shard.record.bytes, " bytes"));
  }
  SHARD_RETURN_IF_ERROR(ValidateName("snapshot shard name", shard.record.file));
  return ValidateTrainingCounters(shard.counters, shard.step);
}

}  // namespace shard
