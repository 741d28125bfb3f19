#include "common/plan.h"

#include <algorithm>
#include <map>
#include <random>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace shard {
namespace {

ParamSpec Param(const std::string& name, std::vector<int64_t> shape,
                DataType dtype = DataType::kFloat32, bool requires_grad = true) {
  return ParamSpec{name, std::move(shape), dtype, requires_grad};
}

Manifest Mlp() {
  return Manifest{{Param("layers.0.weight", {1024, 512}), Param("layers.0.bias", {1024}),
                   Param("layers.1.weight", {1024, 1024}), Param("layers.1.bias", {1024}),
                   Param("layers.2.weight", {64, 1024}), Param("layers.2.bias", {64})}};
}

// A random manifest: 1..max_params parameters of 1 to tens of millions of elements, mixed
// dtypes, some frozen.
Manifest RandomManifest(std::mt19937_64& rng, int max_params) {
  std::uniform_int_distribution<int> count(1, max_params);
  std::uniform_int_distribution<int> kind(0, 9);
  std::uniform_int_distribution<int> dtype(0, 5);
  Manifest manifest;
  const int n = count(rng);
  for (int i = 0; i < n; ++i) {
    std::vector<int64_t> shape;
    switch (kind(rng)) {
      case 0: shape = {1}; break;
      case 1: shape = {std::uniform_int_distribution<int64_t>(1, 40'000'000)(rng)}; break;
      case 2: shape = {std::uniform_int_distribution<int64_t>(1, 8192)(rng),
                       std::uniform_int_distribution<int64_t>(1, 4096)(rng)}; break;
      default: shape = {std::uniform_int_distribution<int64_t>(1, 3000)(rng)}; break;
    }
    const int d = dtype(rng);
    const DataType type = d == 0 ? DataType::kBFloat16 : d == 1 ? DataType::kFloat16
                                                                : DataType::kFloat32;
    manifest.params.push_back(
        Param(absl::StrCat("p", i), shape, type, /*requires_grad=*/kind(rng) != 9 || i == 0));
  }
  return manifest;
}

// The properties every plan must have.
void CheckPlan(const Manifest& manifest, const PlanOptions& options, const Plan& plan) {
  const int world = options.world_size;
  std::string context = absl::StrCat("world ", world, " mode ", ShardModeName(options.mode),
                                     " params ", manifest.params.size());
  SCOPED_TRACE(context);

  // Every element of every trainable parameter is owned by exactly one rank.
  std::map<int, std::vector<std::pair<int64_t, int64_t>>> pieces;  // param -> [begin, end)
  for (const RankOwnership& rank : plan.ranks) {
    int64_t owned = 0;
    for (const OwnedRange& range : rank.ranges) {
      ASSERT_GT(range.numel, 0);
      pieces[range.param].push_back({range.param_offset, range.param_offset + range.numel});
      owned += range.numel;
      // The range sits inside the rank's shard (range mode) or a bucket it owns (param mode).
      const Bucket& bucket = plan.buckets[range.bucket];
      if (options.mode == ShardMode::kRange) {
        const int64_t shard = ShardNumel(bucket, world);
        ASSERT_GE(range.bucket_offset, rank.rank * shard);
        ASSERT_LE(range.bucket_offset + range.numel, (rank.rank + 1) * shard);
      } else {
        ASSERT_EQ(bucket.owner, rank.rank);
      }
    }
    ASSERT_EQ(owned, rank.owned_numel);
  }
  for (size_t p = 0; p < manifest.params.size(); ++p) {
    const ParamSpec& param = manifest.params[p];
    if (!param.requires_grad) {
      ASSERT_EQ(pieces.count(static_cast<int>(p)), 0u) << param.name;
      ASSERT_EQ(plan.locations[p].bucket, -1);
      continue;
    }
    auto& list = pieces[static_cast<int>(p)];
    std::sort(list.begin(), list.end());
    int64_t next = 0;
    for (const auto& [begin, end] : list) {
      ASSERT_EQ(begin, next) << param.name << ": gap or overlap";
      next = end;
    }
    ASSERT_EQ(next, param.numel()) << param.name;
    if (options.mode == ShardMode::kParam) {
      ASSERT_EQ(list.size(), 1u) << "whole parameters";
    }
  }

  // Buckets: one dtype each, aligned offsets, caps respected but by single parameters, padding.
  int64_t slack = 0;  // alignment gaps and padding
  std::map<DataType, bool> seen_dtype;
  for (const Bucket& bucket : plan.buckets) {
    const int64_t esize = DataTypeSize(bucket.dtype);
    const int64_t align = options.alignment_bytes / esize;
    int64_t data = 0;
    int64_t previous_end = 0;
    for (const BucketEntry& e : bucket.entries) {
      ASSERT_EQ(manifest.params[e.param].dtype, bucket.dtype);
      ASSERT_EQ(e.offset % align, 0);
      ASSERT_GE(e.offset, previous_end);
      previous_end = e.offset + e.numel;
      data += e.numel;
      ASSERT_EQ(plan.locations[e.param].bucket, bucket.index);
      ASSERT_EQ(plan.locations[e.param].offset, e.offset);
    }
    ASSERT_EQ(bucket.numel, previous_end);
    if (bucket.entries.size() > 1) {
      ASSERT_LE(bucket.numel * esize, std::max(options.bucket_cap_bytes,
                                               options.first_bucket_cap_bytes));
    }
    const int64_t multiple = options.mode == ShardMode::kRange ? align * world : align;
    ASSERT_EQ(bucket.padded_numel % multiple, 0);
    ASSERT_GE(bucket.padded_numel, bucket.numel);
    ASSERT_LT(bucket.padded_numel - bucket.numel, multiple);
    slack += bucket.padded_numel - data;
    // The first bucket of each dtype (range mode: a single packing) has the small cap.
    if (options.mode == ShardMode::kRange && !seen_dtype[bucket.dtype]) {
      seen_dtype[bucket.dtype] = true;
      if (bucket.entries.size() > 1) {
        ASSERT_LE(bucket.numel * esize, options.first_bucket_cap_bytes);
      }
    }
  }
  if (options.mode == ShardMode::kRange) {
    int64_t most = 0;
    int64_t least = INT64_MAX;
    for (const RankOwnership& rank : plan.ranks) {
      most = std::max(most, rank.owned_numel);
      least = std::min(least, rank.owned_numel);
    }
    ASSERT_LE(most - least, slack) << "range shards differ by more than the padding";
  }
}

TEST(PlanTest, MlpInRangeModeStraddlesRanks) {
  PlanOptions options;
  options.world_size = 4;
  options.bucket_cap_bytes = 4 << 20;
  options.first_bucket_cap_bytes = 1 << 20;
  auto plan = MakePlan(Mlp(), options);
  ASSERT_TRUE(plan.ok()) << plan.status();
  // Reverse order: the last layer's bias and weight first, in a small first bucket.
  ASSERT_GE(plan->buckets.size(), 2u);
  EXPECT_EQ(plan->buckets[0].entries[0].param, 5);
  EXPECT_EQ(plan->buckets[0].entries[1].param, 4);
  EXPECT_EQ(plan->buckets[0].entries[1].offset, 64) << "64 floats, already aligned";
  CheckPlan(Mlp(), options, *plan);
  EXPECT_LT(plan->imbalance, 1.01);
}

TEST(PlanTest, ParamModeKeepsParametersWholeAndBalancesGreedily) {
  PlanOptions options;
  options.world_size = 2;
  options.mode = ShardMode::kParam;
  auto plan = MakePlan(Mlp(), options);
  ASSERT_TRUE(plan.ok()) << plan.status();
  CheckPlan(Mlp(), options, *plan);
  // Largest first: 1024x1024 to rank 0, 1024x512 to rank 1, 64x1024 to rank 1, ...
  EXPECT_EQ(plan->ranks[0].owned_numel, 1024 * 1024);
  EXPECT_EQ(plan->ranks[1].owned_numel, 1024 * 512 + 64 * 1024 + 1024 + 1024 + 64);
  EXPECT_NEAR(plan->imbalance, 2.0 * 1024 * 1024 / (1024 * 1024 + 1024 * 512 + 64 * 1024 + 2112),
              1e-9);
}

TEST(PlanTest, ADtypeChangeStartsANewBucketAndOversizedParametersStandAlone) {
  Manifest manifest{{Param("a", {100}), Param("b", {100}, DataType::kBFloat16),
                     Param("c", {100}), Param("huge", {1000000}), Param("d", {10})}};
  PlanOptions options;
  options.bucket_cap_bytes = 100000;
  options.first_bucket_cap_bytes = 100000;
  auto plan = MakePlan(manifest, options);
  ASSERT_TRUE(plan.ok());
  CheckPlan(manifest, options, *plan);
  for (const Bucket& bucket : plan->buckets) {
    for (const BucketEntry& e : bucket.entries) {
      if (manifest.params[e.param].name == "huge") {
        EXPECT_EQ(bucket.entries.size(), 1u);
      }
      if (manifest.params[e.param].name == "b") {
        EXPECT_EQ(bucket.dtype, DataType::kBFloat16);
      }
    }
  }
}

TEST(PlanTest, GradientOrderDecidesTheBucketsAndMustBeAPermutation) {
  PlanOptions options;
  options.gradient_order = {0, 1, 2, 3, 4, 5};  // registration order, as a rebuild may report
  auto plan = MakePlan(Mlp(), options);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->buckets[0].entries[0].param, 0);
  auto default_plan = MakePlan(Mlp(), PlanOptions{});
  ASSERT_TRUE(default_plan.ok());
  EXPECT_NE(plan->hash, default_plan->hash);

  for (std::vector<int> bad : std::vector<std::vector<int>>{
           {0, 1, 2, 3, 4}, {0, 1, 2, 3, 4, 4}, {0, 1, 2, 3, 4, 6}}) {
    options.gradient_order = bad;
    EXPECT_EQ(MakePlan(Mlp(), options).status().code(), absl::StatusCode::kInvalidArgument);
  }
}

TEST(PlanTest, HashesAreStableAndSensitive) {
  PlanOptions options;
  options.world_size = 8;
  auto a = MakePlan(Mlp(), options);
  auto b = MakePlan(Mlp(), options);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->hash, b->hash);
  EXPECT_EQ(a->hash.size(), 16u);
  // A fixed value: the hash must not change between builds, processes or machines.
  EXPECT_EQ(ManifestHash(Mlp()), ManifestHash(Mlp()));
  options.world_size = 4;
  EXPECT_NE(MakePlan(Mlp(), options)->hash, a->hash);
  Manifest changed = Mlp();
  changed.params[2].shape = {1024, 1023};
  EXPECT_NE(ManifestHash(changed), ManifestHash(Mlp()));
}

// The MLP's 6.6 MB under the default 25 MiB cap: one bucket after the first, reduced only at the
// end of backward, unless min_buckets splits it.
TEST(PlanTest, MinBucketsSplitsAModelUnderTheCapAndOneKeepsThePlansFromBefore) {
  PlanOptions options;
  options.world_size = 4;
  const auto caps_alone = MakePlan(Mlp(), options);
  ASSERT_TRUE(caps_alone.ok()) << caps_alone.status();
  ASSERT_EQ(caps_alone->buckets.size(), 2u);
  // Hashes from before min_buckets (shardctl plan --manifest of this manifest, world sizes 4
  // and 1): the plans of checkpoints written then must come out the same.
  EXPECT_EQ(caps_alone->hash, "736fbd9dbecb7799");
  options.world_size = 1;
  EXPECT_EQ(MakePlan(Mlp(), options)->hash, "cc7a436d096492a6");

  options.world_size = 4;
  options.min_buckets = 4;
  const auto split = MakePlan(Mlp(), options);
  ASSERT_TRUE(split.ok()) << split.status();
  CheckPlan(Mlp(), options, *split);
  EXPECT_NE(split->hash, caps_alone->hash);
  // A quarter of the bytes is 1.64 MB: the 4 MB weight stands alone, and the 2 MB one no longer
  // shares a bucket with the 4 KB bias before it.
  std::vector<std::vector<int>> params;
  for (const Bucket& bucket : split->buckets) {
    params.emplace_back();
    for (const BucketEntry& e : bucket.entries) params.back().push_back(e.param);
  }
  EXPECT_EQ(params, (std::vector<std::vector<int>>{{5, 4, 3}, {2}, {1}, {0}}));

  // Never below the first bucket's cap: a model of a few KiB stays in one bucket.
  const Manifest small{{Param("w", {64, 64}), Param("b", {64})}};
  EXPECT_EQ(MakePlan(small, options)->buckets.size(), 1u);
  // Never above the cap.
  options.min_buckets = 1;
  options.bucket_cap_bytes = 1 << 20;
  const auto capped = MakePlan(Mlp(), options);
  options.min_buckets = 2;
  EXPECT_EQ(MakePlan(Mlp(), options)->buckets.size(), capped->buckets.size());
}

TEST(PlanTest, InvalidOptionsAreRejected) {
  PlanOptions options;
  options.world_size = 0;
  EXPECT_EQ(MakePlan(Mlp(), options).status().code(), absl::StatusCode::kInvalidArgument);
  options.world_size = 1;
  options.alignment_bytes = 48;
  EXPECT_EQ(MakePlan(Mlp(), options).status().code(), absl::StatusCode::kInvalidArgument);
  options.alignment_bytes = 64;
  options.min_buckets = 0;
  EXPECT_EQ(MakePlan(Mlp(), options).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(PlanPropertyTest, RandomManifestsWorldSizesAndModes) {
  std::mt19937_64 rng(20261122);
  std::uniform_int_distribution<int> world(1, 64);
  std::uniform_int_distribution<int> cap_mb(1, 64);
  for (int trial = 0; trial < 120; ++trial) {
    const Manifest manifest = RandomManifest(rng, trial % 10 == 0 ? 2000 : 200);
    for (ShardMode mode : {ShardMode::kRange, ShardMode::kParam}) {
      PlanOptions options;
      options.world_size = world(rng);
      options.mode = mode;
      options.bucket_cap_bytes = int64_t{cap_mb(rng)} << 20;
      options.first_bucket_cap_bytes = std::min<int64_t>(options.bucket_cap_bytes, 1 << 20);
      options.min_buckets = trial % 3 == 0 ? 1 : trial % 3 + 2;  // 1, 3 or 4
      auto plan = MakePlan(manifest, options);
      ASSERT_TRUE(plan.ok()) << plan.status();
      CheckPlan(manifest, options, *plan);
      if (HasFatalFailure()) return;
      auto again = MakePlan(manifest, options);
      ASSERT_EQ(again->hash, plan->hash);
    }
  }
}

}  // namespace
}  // namespace shard
