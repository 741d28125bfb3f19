#include "common/progress_lease.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace shard {
namespace {

std::string Show(absl::Duration d) {
  return d < absl::Seconds(1) ? absl::StrFormat("%.0f ms", absl::ToDoubleMilliseconds(d))
                              : absl::StrFormat("%.1f s", absl::ToDoubleSeconds(d));
}

}  // namespace

double Quantile(std::vector<double> values, double q) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const size_t index = static_cast<size_t>(
      std::clamp(std::ceil(q * static_cast<double>(values.size())) - 1, 0.0,
                 static_cast<double>(values.size() - 1)));
  return values[index];
}

absl::Duration DerivedTimeout(absl::Duration typical_step, double factor, absl::Duration floor,
                              absl::Duration ceiling) {
  return std::clamp(factor * typical_step, floor, std::max(floor, ceiling));
}

std::optional<Stall> FindStall(const std::vector<RankProgress>& ranks, int world_size,
                               int64_t generation, absl::Duration lease,
                               absl::Duration median_step, absl::Time now) {
  if (static_cast<int>(ranks.size()) != world_size || ranks.empty()) return std::nullopt;
  Stall stall;
  stall.stalled = absl::InfiniteDuration();
  std::vector<const RankProgress*> waiting;
  std::vector<const RankProgress*> idle;
  for (const RankProgress& rank : ranks) {
    if (rank.activity.generation != generation) return std::nullopt;  // not all training yet
    // As it was when it said so, carried on to now.
    const absl::Duration since = now - rank.reported;
    stall.stalled = std::min(stall.stalled, rank.activity.since_step + since);
    stall.step = std::max(stall.step, rank.activity.step + 1);
    (rank.activity.waiting > absl::ZeroDuration() ? waiting : idle).push_back(&rank);
  }
  if (stall.stalled <= lease) return std::nullopt;
  const std::string median = absl::StrCat("median step ", Show(median_step));
  if (waiting.empty() || idle.empty()) {
    stall.description = absl::StrCat(
        "training at generation ", generation, " has not finished step ", stall.step, " for ",
        Show(stall.stalled), "; ", median, "; ",
        waiting.empty() ? "no rank waits in a collective" : "every rank waits in a collective",
        ", so none can be named as holding it up");
    return stall;
  }
  std::vector<std::string> named;
  for (const RankProgress* rank : idle) {
    stall.stuck.push_back(*rank);
    named.push_back(absl::StrCat("rank ", rank->rank, " (worker ", rank->worker_id,
                                 ") has not finished step ", rank->activity.step + 1, " for ",
                                 Show(rank->activity.since_step + (now - rank->reported))));
  }
  stall.description = absl::StrCat(absl::StrJoin(named, ", "), "; ", median, "; ",
                                   waiting.size(), " of ", ranks.size(),
                                   " ranks wait for it in a collective");
  return stall;
}

}  // namespace shard
