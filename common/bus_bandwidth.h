// Collective bandwidth as nccl-tests reports it (GB = 1e9 bytes).
//   algbw = bytes / time, where bytes is the per-rank buffer the collective is about:
//           the full buffer for all-reduce and broadcast, the gathered (output) buffer for
//           all-gather, the scattered (input) buffer for reduce-scatter.
//   busbw = algbw * factor, the factor making the figure comparable to link bandwidth:
//           all-reduce 2(n-1)/n; reduce-scatter and all-gather (n-1)/n; broadcast 1.
#pragma once


#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace shard {

enum class Collective { kAllReduce, kReduceScatter, kAllGather, kBroadcast };

absl::string_view CollectiveName(Collective collective);
absl::StatusOr<Collective> ParseCollective(absl::string_view name);

// The nccl-tests bus-bandwidth factor for `ranks` participants (ranks >= 1).
double BusBandwidthFactor(Collective collective, int ranks);

// Algorithm bandwidth in GB/s for `bytes` moved in `seconds`.
double AlgorithmBandwidthGBps(double bytes, double seconds);

// Bus bandwidth in GB/s.
double BusBandwidthGBps(Collective collective, int ranks, double bytes, double seconds);

}  // namespace shard
