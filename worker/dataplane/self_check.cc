#include "worker/dataplane/self_check.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace shard {
namespace {

// Contributions are chosen so that every partial sum is an integer below 2^24, hence exact in
// f32 for any order of summation and any world size up to a few thousand ranks.
int64_t RankFactor(int rank) { return rank % 128 + 1; }
float GatherValue(int rank, size_t i) {
  return static_cast<float>((rank % 2048) * 4096 + static_cast<int>(i % 4096));
}

}  // namespace

absl::StatusOr<SelfCheckResult> RunSelfCheck(Communicator& communicator, size_t elements) {
  const int world = communicator.size();
  const int rank = communicator.rank();
  const absl::Time start = absl::Now();

  std::vector<float> reduced(elements);
  for (size_t i = 0; i < elements; ++i) {
    reduced[i] = static_cast<float>(RankFactor(rank) * static_cast<int64_t>(i % 64 + 1));
  }
  if (absl::Status s = communicator.AllReduce(reduced.data(), reduced.data(), elements,
                                              DataType::kFloat32, ReduceOp::kSum);
      !s.ok()) {
    return s;
  }
  int64_t factor_sum = 0;
  for (int r = 0; r < world; ++r) factor_sum += RankFactor(r);
  for (size_t i = 0; i < elements; ++i) {
    const float expected = static_cast<float>(static_cast<int64_t>(i % 64 + 1) * factor_sum);
    if (reduced[i] != expected) {
      return absl::DataLossError(absl::StrFormat(
          "all-reduce self-check is wrong at element %d: got %g, expected %g", i, reduced[i],
          expected));
    }
  }

  const size_t per_rank = std::max<size_t>(1, elements / world);
  std::vector<float> mine(per_rank);
  for (size_t i = 0; i < per_rank; ++i) mine[i] = GatherValue(rank, i);
  std::vector<float> gathered(per_rank * world);
  if (absl::Status s = communicator.AllGather(mine.data(), gathered.data(), per_rank,
                                              DataType::kFloat32);
      !s.ok()) {
    return s;
  }
  for (int r = 0; r < world; ++r) {
    for (size_t i = 0; i < per_rank; ++i) {
      const float expected = GatherValue(r, i);
      const float got = gathered[r * per_rank + i];
      if (got != expected) {
        return absl::DataLossError(absl::StrFormat(
            "all-gather self-check is wrong in rank %d's block at element %d: got %g, expected %g",
            r, i, got, expected));
      }
    }
  }
  SelfCheckResult result;
  result.elapsed = absl::Now() - start;
  result.summary = absl::StrFormat("all-reduce of %d f32 and all-gather of %d f32 over %d ranks (%s) in %s",
                                   elements, per_rank * world, world, communicator.backend(),
                                   absl::FormatDuration(absl::Trunc(result.elapsed, absl::Microseconds(10))));
  return result;
}

}  // namespace shard
