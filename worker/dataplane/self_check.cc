#include "worker/dataplane/self_check.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"

namespace shard {
namespace {

// Contributions are chosen so that every partial sum is an integer below 2^24, hence exact in
// f32 for any order of summation and any world size up to a few thousand ranks.
int64_t RankFactor(int rank) { return rank % 128 + 1; }
float GatherValue(int rank, size_t i) {
  return static_cast<float>((rank % 2048) * 4096 + static_cast<int>(i % 4096));
}

// The result of `collective` read back to the host. An aborted GPU collective lets its stream
// complete with whatever the buffer held: that is an abort (the generation ended), not a wrong
// result.
absl::Status DownloadResult(Device& device, Communicator& communicator, const float* from,
                            float* to, size_t count, absl::string_view collective) {
  SHARD_RETURN_IF_ERROR(communicator.OrderComputeAfterCollectives());
  SHARD_RETURN_IF_ERROR(device.Download(from, to, count));
  if (communicator.aborted()) {
    return absl::AbortedError(
        absl::StrCat("the communicator was aborted during the ", collective, " self-check"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<SelfCheckResult> RunSelfCheck(Communicator& communicator, size_t elements,
                                             Device& device) {
  const int world = communicator.size();
  const int rank = communicator.rank();
  const absl::Time start = absl::Now();
  const size_t per_rank = std::max<size_t>(1, elements / world);
  SHARD_RETURN_IF_ERROR(device.BindThread());
  SHARD_ASSIGN_OR_RETURN(DeviceArray on_device,
                         device.Allocate(std::max(elements, per_rank * world)));

  std::vector<float> reduced(elements);
  for (size_t i = 0; i < elements; ++i) {
    reduced[i] = static_cast<float>(RankFactor(rank) * static_cast<int64_t>(i % 64 + 1));
  }
  SHARD_RETURN_IF_ERROR(device.Upload(reduced.data(), on_device.data(), elements));
  SHARD_RETURN_IF_ERROR(communicator.AllReduce(on_device.data(), on_device.data(), elements,
                                               DataType::kFloat32, ReduceOp::kSum));
  SHARD_RETURN_IF_ERROR(DownloadResult(device, communicator, on_device.data(), reduced.data(),
                                       elements, "all-reduce"));
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

  // Rank r's block of the gathered array is its own input, as an in-place all-gather.
  std::vector<float> mine(per_rank);
  for (size_t i = 0; i < per_rank; ++i) mine[i] = GatherValue(rank, i);
  float* gather_area = on_device.data();
  SHARD_RETURN_IF_ERROR(device.Upload(mine.data(), gather_area + rank * per_rank, per_rank));
  SHARD_RETURN_IF_ERROR(communicator.AllGather(gather_area + rank * per_rank, gather_area,
                                               per_rank, DataType::kFloat32));
  std::vector<float> gathered(per_rank * world);
  SHARD_RETURN_IF_ERROR(DownloadResult(device, communicator, gather_area, gathered.data(),
                                       per_rank * world, "all-gather"));
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
  result.summary =
      absl::StrFormat("all-reduce of %d f32 and all-gather of %d f32 over %d ranks (%s) in %s",
                      elements, per_rank * world, world, communicator.backend(),
                      absl::FormatDuration(absl::Trunc(result.elapsed, absl::Microseconds(10))));
  return result;
}

}  // namespace shard
