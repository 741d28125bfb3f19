// Planning: how a manifest's parameters are laid out in gradient buckets and which rank owns
// which elements of the optimizer state. Pure functions: the coordinator, every worker and
// `shardctl plan` compute the same plan from the same inputs, and compare hashes.
//
// Buckets (as PyTorch DDP builds them): trainable parameters in gradient-ready order (by default
// reverse registration order, the order a sequential backward produces), packed per dtype under
// a byte cap, the first bucket of each dtype under a smaller cap so that communication starts
// early; a bucket is closed before a parameter that would overflow it, so only a single
// parameter larger than the cap makes a bucket exceed it. Every parameter starts at an offset
// aligned to `alignment_bytes`. Buckets are ordered by their first parameter's position in the
// gradient order.
//
// Ownership:
// - range (Megatron's distributed optimizer): each bucket is padded to a multiple of
//   W x alignment and split into W equal contiguous shards; rank r owns shard r, and a
//   parameter may straddle ranks.
// - param (ZeroRedundancyOptimizer): whole parameters are assigned greedily, largest first, to
//   the least-loaded rank; buckets are then formed per owner and padded to the alignment.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/dtype.h"
#include "common/manifest.h"

namespace shard {

enum class ShardMode { kRange, kParam };

absl::string_view ShardModeName(ShardMode mode);
absl::StatusOr<ShardMode> ParseShardMode(absl::string_view name);

struct PlanOptions {
  int world_size = 1;
  ShardMode mode = ShardMode::kRange;
  int64_t bucket_cap_bytes = int64_t{25} << 20;
  int64_t first_bucket_cap_bytes = int64_t{1} << 20;
  // Buckets after the first hold at most 1/min_buckets of the trainable bytes of their dtype
  // (never less than the first bucket's cap), so that a model under a few caps' worth still
  // reduces during backward instead of in one bucket at its end. 1: the caps alone decide.
  int min_buckets = 1;
  int64_t alignment_bytes = 64;  // a power of two, at least 4
  // Indices of the trainable parameters in the order their gradients become ready; empty means
  // reverse registration order.
  std::vector<int> gradient_order;

  bool operator==(const PlanOptions&) const = default;
};

// One parameter's place in a bucket; offsets and sizes are in elements.
struct BucketEntry {
  int param = 0;
  int64_t offset = 0;
  int64_t numel = 0;
};

struct Bucket {
  int index = 0;
  DataType dtype = DataType::kFloat32;
  std::vector<BucketEntry> entries;  // in gradient order
  int64_t numel = 0;                 // end of the last entry
  int64_t padded_numel = 0;          // what is allocated and communicated
  int owner = -1;                    // param mode: the owning rank; range mode: -1
};

// A contiguous run of one parameter that one rank owns.
struct OwnedRange {
  int param = 0;
  int bucket = 0;
  int64_t param_offset = 0;   // within the parameter
  int64_t bucket_offset = 0;  // within the bucket
  int64_t numel = 0;
};

struct RankOwnership {
  int rank = 0;
  std::vector<OwnedRange> ranges;  // by bucket, then offset
  int64_t owned_numel = 0;         // parameter elements, padding excluded
  int64_t owned_bytes = 0;         // the same in the parameters' dtypes
};

// Where a parameter lives; bucket -1 for parameters that do not require a gradient.
struct ParamLocation {
  int bucket = -1;
  int64_t offset = 0;
};

struct Plan {
  PlanOptions options;  // gradient_order resolved to the order used
  std::string manifest_hash;
  std::vector<Bucket> buckets;
  std::vector<RankOwnership> ranks;
  std::vector<ParamLocation> locations;  // by parameter index
  double imbalance = 1.0;                // max over mean owned elements
  std::string hash;                      // content hash of everything above
};

// Validates the manifest and options (world size, caps, alignment, and that the gradient order
// is a permutation of the trainable parameters) and computes the plan.
absl::StatusOr<Plan> MakePlan(const Manifest& manifest, const PlanOptions& options);

// Elements of one rank's shard of a bucket in range mode.
int64_t ShardNumel(const Bucket& bucket, int world_size);

}  // namespace shard
