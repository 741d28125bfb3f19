#include "common/plan.h"

#include <algorithm>
#include <map>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace shard {
namespace {

int64_t AlignUp(int64_t value, int64_t alignment) {
  return (value + alignment - 1) / alignment * alignment;
}

int64_t AlignmentElements(const PlanOptions& options, DataType dtype) {
  return options.alignment_bytes / static_cast<int64_t>(DataTypeSize(dtype));
}

absl::Status ValidateOptions(const PlanOptions& options) {
  if (options.world_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("world size must be at least 1, got ", options.world_size));
  }
  if (options.bucket_cap_bytes < 1 || options.first_bucket_cap_bytes < 1) {
    return absl::InvalidArgumentError("bucket caps must be positive");
  }
  if (options.min_buckets < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("min buckets must be at least 1, got ", options.min_buckets));
  }
  const int64_t a = options.alignment_bytes;
  if (a < 4 || (a & (a - 1)) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("alignment must be a power of two of at least 4 bytes, got ", a));
  }
  return absl::OkStatus();
}

// The trainable parameters in gradient order: the given permutation, checked, or the reverse
// registration order.
absl::StatusOr<std::vector<int>> ResolveOrder(const Manifest& manifest,
                                              const std::vector<int>& requested) {
  std::vector<int> trainable;
  for (int i = static_cast<int>(manifest.params.size()) - 1; i >= 0; --i) {
    if (manifest.params[i].requires_grad) trainable.push_back(i);
  }
  if (requested.empty()) return trainable;
  std::vector<bool> seen(manifest.params.size(), false);
  for (int index : requested) {
    if (index < 0 || index >= static_cast<int>(manifest.params.size())) {
      return absl::InvalidArgumentError(absl::StrCat("gradient order names parameter ", index,
                                                     ", but the manifest has ",
                                                     manifest.params.size()));
    }
    const ParamSpec& param = manifest.params[index];
    if (!param.requires_grad) {
      return absl::InvalidArgumentError(absl::StrCat(
          "gradient order names '", param.name, "', which does not require a gradient"));
    }
    if (seen[index]) {
      return absl::InvalidArgumentError(
          absl::StrCat("gradient order names '", param.name, "' twice"));
    }
    seen[index] = true;
  }
  for (int index : trainable) {
    if (!seen[index]) {
      return absl::InvalidArgumentError(absl::StrCat(
          "gradient order is missing '", manifest.params[index].name, "'"));
    }
  }
  return requested;
}

// Packs `params` (in gradient order) into buckets: one open bucket per dtype, closed before a
// parameter that would overflow it and as soon as it reaches its cap.
std::vector<Bucket> PackBuckets(const Manifest& manifest, const std::vector<int>& params,
                                const PlanOptions& options, int owner) {
  struct Open {
    Bucket bucket;
    int closed = 0;  // buckets of this dtype closed so far: the first uses the smaller cap
  };
  std::map<DataType, Open> open;
  std::vector<Bucket> done;
  // The later buckets' cap of each dtype: the job's, or a min_buckets-th of the dtype's bytes
  // where that is less (and more than the first bucket's cap).
  std::map<DataType, int64_t> later_cap;
  for (int p : params) {
    const ParamSpec& param = manifest.params[p];
    later_cap[param.dtype] += param.numel() * static_cast<int64_t>(DataTypeSize(param.dtype));
  }
  for (auto& [dtype, cap] : later_cap) {
    const int64_t share = (cap + options.min_buckets - 1) / options.min_buckets;
    cap = options.min_buckets == 1  // exactly the plans from before min_buckets
              ? options.bucket_cap_bytes
              : std::min(options.bucket_cap_bytes,
                         std::max(options.first_bucket_cap_bytes, share));
  }
  auto limit = [&](const Open& o) {
    return o.closed == 0 ? options.first_bucket_cap_bytes : later_cap.at(o.bucket.dtype);
  };
  auto close = [&](Open& o) {
    done.push_back(std::move(o.bucket));
    o.bucket = Bucket{};
    ++o.closed;
  };
  for (int p : params) {
    const ParamSpec& param = manifest.params[p];
    const int64_t esize = static_cast<int64_t>(DataTypeSize(param.dtype));
    Open& o = open[param.dtype];
    int64_t offset = AlignUp(o.bucket.numel, AlignmentElements(options, param.dtype));
    if (!o.bucket.entries.empty() && (offset + param.numel()) * esize > limit(o)) {
      close(o);
      offset = 0;
    }
    o.bucket.dtype = param.dtype;
    o.bucket.owner = owner;
    o.bucket.entries.push_back(BucketEntry{p, offset, param.numel()});
    o.bucket.numel = offset + param.numel();
    if (o.bucket.numel * esize >= limit(o)) close(o);
  }
  for (auto& [dtype, o] : open) {
    if (!o.bucket.entries.empty()) close(o);
  }
  return done;
}

// Greedy partition of whole parameters, largest first, to the least-loaded rank.
std::vector<int> PartitionParams(const Manifest& manifest, const std::vector<int>& params,
                                 int world_size) {
  std::vector<int> by_size = params;
  std::stable_sort(by_size.begin(), by_size.end(), [&](int a, int b) {
    return manifest.params[a].numel() > manifest.params[b].numel();
  });
  std::vector<int64_t> load(world_size, 0);
  std::vector<int> owner(manifest.params.size(), -1);
  for (int p : by_size) {
    const int rank = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
    owner[p] = rank;
    load[rank] += manifest.params[p].numel();
  }
  return owner;
}

std::string PlanHash(const Plan& plan) {
  std::string canonical;
  AppendString(&canonical, plan.manifest_hash);
  AppendInt(&canonical, plan.options.world_size);
  AppendString(&canonical, ShardModeName(plan.options.mode));
  AppendInt(&canonical, plan.options.bucket_cap_bytes);
  AppendInt(&canonical, plan.options.first_bucket_cap_bytes);
  // Only where it changes a plan, so that the plans of checkpoints from before it keep their
  // hashes.
  if (plan.options.min_buckets != 1) AppendInt(&canonical, plan.options.min_buckets);
  AppendInt(&canonical, plan.options.alignment_bytes);
  AppendInt(&canonical, static_cast<int64_t>(plan.options.gradient_order.size()));
  for (int p : plan.options.gradient_order) AppendInt(&canonical, p);
  AppendInt(&canonical, static_cast<int64_t>(plan.buckets.size()));
  for (const Bucket& bucket : plan.buckets) {
    AppendString(&canonical, DataTypeName(bucket.dtype));
    AppendInt(&canonical, bucket.numel);
    AppendInt(&canonical, bucket.padded_numel);
    AppendInt(&canonical, bucket.owner);
    AppendInt(&canonical, static_cast<int64_t>(bucket.entries.size()));
    for (const BucketEntry& e : bucket.entries) {
      AppendInt(&canonical, e.param);
      AppendInt(&canonical, e.offset);
      AppendInt(&canonical, e.numel);
    }
  }
  return ContentHash(canonical);
}

}  // namespace

absl::string_view ShardModeName(ShardMode mode) {
  return mode == ShardMode::kRange ? "range" : "param";
}

absl::StatusOr<ShardMode> ParseShardMode(absl::string_view name) {
  if (name == "range") return ShardMode::kRange;
  if (name == "param") return ShardMode::kParam;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown shard mode '", name, "'; expected range or param"));
}

int64_t ShardNumel(const Bucket& bucket, int world_size) {
  return bucket.padded_numel / world_size;
}

absl::StatusOr<Plan> MakePlan(const Manifest& manifest, const PlanOptions& options) {
  SHARD_RETURN_IF_ERROR(ValidateManifest(manifest));
  SHARD_RETURN_IF_ERROR(ValidateOptions(options));
  SHARD_ASSIGN_OR_RETURN(std::vector<int> order, ResolveOrder(manifest, options.gradient_order));

  Plan plan;
  plan.options = options;
  plan.options.gradient_order = order;
  plan.manifest_hash = ManifestHash(manifest);
  const int world = options.world_size;

  if (options.mode == ShardMode::kRange) {
    plan.buckets = PackBuckets(manifest, order, options, /*owner=*/-1);
  } else {
    const std::vector<int> owner = PartitionParams(manifest, order, world);
    for (int rank = 0; rank < world; ++rank) {
      std::vector<int> mine;
      for (int p : order) {
        if (owner[p] == rank) mine.push_back(p);
      }
      std::vector<Bucket> buckets = PackBuckets(manifest, mine, options, rank);
      plan.buckets.insert(plan.buckets.end(), std::make_move_iterator(buckets.begin()),
                          std::make_move_iterator(buckets.end()));
    }
  }
  // Buckets in the order they become ready: by their first parameter's gradient position.
  std::vector<int> position(manifest.params.size(), 0);
  for (size_t i = 0; i < order.size(); ++i) position[order[i]] = static_cast<int>(i);
  std::stable_sort(plan.buckets.begin(), plan.buckets.end(), [&](const Bucket& a, const Bucket& b) {
    return position[a.entries.front().param] < position[b.entries.front().param];
  });

  plan.locations.assign(manifest.params.size(), ParamLocation{});
  plan.ranks.resize(world);
  size_t entries = 0;
  for (const Bucket& bucket : plan.buckets) entries += bucket.entries.size();
  for (int r = 0; r < world; ++r) {
    plan.ranks[r].rank = r;
    // Range mode: every rank gets a piece of nearly every bucket.
    plan.ranks[r].ranges.reserve(options.mode == ShardMode::kRange
                                     ? plan.buckets.size() + entries / world + 1
                                     : entries / world + 1);
  }
  for (size_t b = 0; b < plan.buckets.size(); ++b) {
    Bucket& bucket = plan.buckets[b];
    bucket.index = static_cast<int>(b);
    const int64_t align = AlignmentElements(options, bucket.dtype);
    const int64_t esize = static_cast<int64_t>(DataTypeSize(bucket.dtype));
    bucket.padded_numel = AlignUp(bucket.numel, options.mode == ShardMode::kRange ? align * world
                                                                                   : align);
    for (const BucketEntry& e : bucket.entries) {
      plan.locations[e.param] = ParamLocation{bucket.index, e.offset};
      if (options.mode == ShardMode::kParam) {
        RankOwnership& owner = plan.ranks[bucket.owner];
        owner.ranges.push_back(OwnedRange{e.param, bucket.index, 0, e.offset, e.numel});
        owner.owned_numel += e.numel;
        owner.owned_bytes += e.numel * esize;
        continue;
      }
      // Range mode: split the entry at shard boundaries.
      const int64_t shard = ShardNumel(bucket, world);
      const int64_t end = e.offset + e.numel;
      for (int64_t r = e.offset / shard; r < world && r * shard < end; ++r) {
        const int64_t begin = std::max(e.offset, r * shard);
        const int64_t stop = std::min(end, (r + 1) * shard);
        RankOwnership& owner = plan.ranks[r];
        owner.ranges.push_back(
            OwnedRange{e.param, bucket.index, begin - e.offset, begin, stop - begin});
        owner.owned_numel += stop - begin;
        owner.owned_bytes += (stop - begin) * esize;
      }
    }
  }
  int64_t total = 0;
  int64_t largest = 0;
  for (const RankOwnership& rank : plan.ranks) {
    total += rank.owned_numel;
    largest = std::max(largest, rank.owned_numel);
  }
  plan.imbalance = total == 0 ? 1.0 : static_cast<double>(largest) * world / total;
  plan.hash = PlanHash(plan);
  return plan;
}

}  // namespace shard
