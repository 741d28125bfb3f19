#include "proto/plan_convert.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace shard {

v1::Manifest ToProto(const Manifest& manifest) {
  v1::Manifest out;
  for (const ParamSpec& param : manifest.params) {
    v1::ParamSpec* p = out.add_params();
    p->set_name(param.name);
    for (int64_t d : param.shape) p->add_shape(d);
    p->set_dtype(std::string(DataTypeName(param.dtype)));
    p->set_requires_grad(param.requires_grad);
  }
  return out;
}

absl::StatusOr<Manifest> FromProto(const v1::Manifest& manifest) {
  Manifest out;
  for (int i = 0; i < manifest.params_size(); ++i) {
    const v1::ParamSpec& p = manifest.params(i);
    absl::StatusOr<DataType> dtype = ParseDataType(p.dtype());
    if (!dtype.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("manifest entry ", i, " ('", p.name(), "'): ", dtype.status().message()));
    }
    out.params.push_back(ParamSpec{p.name(), {p.shape().begin(), p.shape().end()}, *dtype,
                                   p.requires_grad()});
  }
  SHARD_RETURN_IF_ERROR(ValidateManifest(out));
  return out;
}

v1::ShardMode ToProto(ShardMode mode) {
  return mode == ShardMode::kRange ? v1::SHARD_MODE_RANGE : v1::SHARD_MODE_PARAM;
}

absl::StatusOr<ShardMode> FromProto(v1::ShardMode mode) {
  switch (mode) {
    case v1::SHARD_MODE_RANGE: return ShardMode::kRange;
    case v1::SHARD_MODE_PARAM: return ShardMode::kParam;
    default: return absl::InvalidArgumentError("plan spec has no shard mode");
  }
}

v1::PlanSpec ToPlanSpec(const Plan& plan, int64_t version, int64_t generation) {
  v1::PlanSpec spec;
  spec.set_version(version);
  spec.set_generation(generation);
  spec.set_world_size(plan.options.world_size);
  spec.set_mode(ToProto(plan.options.mode));
  spec.set_bucket_cap_bytes(plan.options.bucket_cap_bytes);
  spec.set_first_bucket_cap_bytes(plan.options.first_bucket_cap_bytes);
  spec.set_min_buckets(plan.options.min_buckets);
  spec.set_alignment_bytes(plan.options.alignment_bytes);
  for (int p : plan.options.gradient_order) spec.add_gradient_order(p);
  spec.set_manifest_hash(plan.manifest_hash);
  spec.set_hash(plan.hash);
  return spec;
}

absl::StatusOr<PlanOptions> PlanOptionsFromSpec(const v1::PlanSpec& spec) {
  SHARD_ASSIGN_OR_RETURN(ShardMode mode, FromProto(spec.mode()));
  PlanOptions options;
  options.world_size = spec.world_size();
  options.mode = mode;
  options.bucket_cap_bytes = spec.bucket_cap_bytes();
  options.first_bucket_cap_bytes = spec.first_bucket_cap_bytes();
  options.min_buckets = std::max(1, spec.min_buckets());
  options.alignment_bytes = spec.alignment_bytes();
  options.gradient_order.assign(spec.gradient_order().begin(), spec.gradient_order().end());
  return options;
}

v1::PlanSummary ToPlanSummary(const Plan& plan, const Manifest& manifest, int64_t version,
                              int64_t generation) {
  v1::PlanSummary summary;
  *summary.mutable_spec() = ToPlanSpec(plan, version, generation);
  for (const Bucket& bucket : plan.buckets) {
    v1::BucketSummary* b = summary.add_buckets();
    b->set_index(bucket.index);
    b->set_dtype(std::string(DataTypeName(bucket.dtype)));
    for (const BucketEntry& e : bucket.entries) b->add_params(manifest.params[e.param].name);
    b->set_numel(bucket.numel);
    b->set_padded_numel(bucket.padded_numel);
    b->set_owner(bucket.owner);
  }
  for (const RankOwnership& rank : plan.ranks) {
    v1::RankSummary* r = summary.add_ranks();
    r->set_rank(rank.rank);
    r->set_owned_numel(rank.owned_numel);
    r->set_owned_bytes(rank.owned_bytes);
    r->set_ranges(static_cast<int32_t>(rank.ranges.size()));
  }
  summary.set_imbalance(plan.imbalance);
  return summary;
}

}  // namespace shard
