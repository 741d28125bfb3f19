#include "common/bus_bandwidth.h"

#include "absl/strings/str_cat.h"

namespace shard {

absl::string_view CollectiveName(Collective collective) {
  switch (collective) {
    case Collective::kAllReduce: return "all_reduce";
    case Collective::kReduceScatter: return "reduce_scatter";
    case Collective::kAllGather: return "all_gather";
    case Collective::kBroadcast: return "broadcast";
  }
  return "unknown";
}

absl::StatusOr<Collective> ParseCollective(absl::string_view name) {
  for (Collective c : {Collective::kAllReduce, Collective::kReduceScatter, Collective::kAllGather,
                       Collective::kBroadcast}) {
    if (name == CollectiveName(c)) return c;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown collective '", name,
      "'; expected one of all_reduce, reduce_scatter, all_gather, broadcast"));
}

double BusBandwidthFactor(Collective collective, int ranks) {
  const double n = ranks;
  switch (collective) {
    case Collective::kAllReduce: return 2.0 * (n - 1) / n;
    case Collective::kReduceScatter:
    case Collective::kAllGather: return (n - 1) / n;
    case Collective::kBroadcast: return 1.0;
  }
  return 0.0;
}

double AlgorithmBandwidthGBps(double bytes, double seconds) {
  return seconds > 0 ? bytes / seconds / 1e9 : 0.0;
}

double BusBandwidthGBps(Collective collective, int ranks, double bytes, double seconds) {
  return AlgorithmBandwidthGBps(bytes, seconds) * BusBandwidthFactor(collective, ranks);
}

}  // namespace shard
