#include "common/param_groups.h"

#include <fnmatch.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace shard {
namespace {

constexpr double kPi = 3.14159265358979323846;  // math.pi

std::string Patterns(const ParamGroup& group) {
  return absl::StrCat("[\"", absl::StrJoin(group.match, "\", \""), "\"]");
}

}  // namespace

bool MatchesParamPattern(absl::string_view pattern, absl::string_view name) {
  // fnmatch(3) needs NUL-terminated strings.
  return fnmatch(std::string(pattern).c_str(), std::string(name).c_str(), 0) == 0;
}

int FindParamGroup(const std::vector<ParamGroup>& groups, absl::string_view name) {
  for (size_t g = 0; g < groups.size(); ++g) {
    for (const std::string& pattern : groups[g].match) {
      if (MatchesParamPattern(pattern, name)) return static_cast<int>(g);
    }
  }
  return -1;
}

absl::StatusOr<std::vector<int>> AssignParamGroups(const OptimizerConfig& optimizer,
                                                   const Manifest& manifest) {
  const std::vector<ParamGroup>& groups = optimizer.param_groups;
  std::vector<int> assigned(manifest.params.size(), -1);
  std::vector<int64_t> taken(groups.size(), 0);
  for (size_t p = 0; p < manifest.params.size(); ++p) {
    assigned[p] = FindParamGroup(groups, manifest.params[p].name);
    if (assigned[p] >= 0 && manifest.params[p].requires_grad) ++taken[assigned[p]];
  }
  for (size_t g = 0; g < groups.size(); ++g) {
    if (taken[g] > 0) continue;
    // Say which it is: a pattern that matches nothing (a typo), or a group shadowed by earlier
    // ones (first match wins), or one that matches only frozen parameters.
    bool matches_any = false;
    bool matches_trainable = false;
    for (const ParamSpec& param : manifest.params) {
      for (const std::string& pattern : groups[g].match) {
        if (!MatchesParamPattern(pattern, param.name)) continue;
        matches_any = true;
        matches_trainable |= param.requires_grad;
      }
    }
    std::string why;
    if (matches_trainable) {
      why = "matches only parameters that earlier groups already took (the first matching "
            "group wins)";
    } else if (matches_any) {
      why = "matches only parameters without gradients, which the optimizer does not update";
    } else {
      std::vector<std::string> names;
      for (size_t p = 0; p < manifest.params.size() && p < 4; ++p) {
        names.push_back(manifest.params[p].name);
      }
      why = absl::StrCat("matches no parameter of the model (", manifest.params.size(),
                         " parameters, e.g. ", absl::StrJoin(names, ", "), ")");
    }
    return absl::InvalidArgumentError(absl::StrCat("optimizer.param_groups[", g, "] (match ",
                                                   Patterns(groups[g]), ") ", why));
  }
  return assigned;
}

double LearningRateFactor(const OptimizerConfig& optimizer, int64_t step) {
  const LrSchedule& schedule = optimizer.schedule;
  const int64_t warmup = schedule.warmup_steps;
  if (warmup > 0 && step <= warmup) {
    return static_cast<double>(step) / static_cast<double>(warmup);
  }
  if (schedule.decay == LrDecay::kConstant) return 1.0;
  const int64_t total = optimizer.total_steps;
  const double progress =
      total > warmup
          ? std::min(1.0, static_cast<double>(step - warmup) / static_cast<double>(total - warmup))
          : 1.0;
  const double floor = schedule.min_lr / optimizer.lr;
  if (schedule.decay == LrDecay::kCosine) {
    return floor + (1.0 - floor) * (0.5 * (1.0 + std::cos(kPi * progress)));
  }
  return floor + (1.0 - floor) * (1.0 - progress);
}

double LearningRateAt(const OptimizerConfig& optimizer, int64_t step) {
  return optimizer.lr * LearningRateFactor(optimizer, step);
}

StepHyperParameters GroupHyperParameters(const OptimizerConfig& optimizer, int group,
                                         int64_t step) {
  const double factor = LearningRateFactor(optimizer, step);
  if (group < 0 || group >= static_cast<int>(optimizer.param_groups.size())) {
    return {optimizer.lr * factor, optimizer.weight_decay};
  }
  const ParamGroup& g = optimizer.param_groups[group];
  return {(optimizer.lr * g.lr_scale) * factor, g.weight_decay.value_or(optimizer.weight_decay)};
}

}  // namespace shard
