// Parameter groups and the learning-rate schedule of a job's optimizer (OptimizerConfig's
// param_groups, schedule and total_steps in common/job_spec.h): which group each parameter
// belongs to, and the learning rate and weight decay an update of it uses. Pure functions of
// the configuration and the update's number, so every rank computes the same values and a run
// restored from a checkpoint (which keeps the optimizer's step count) continues the schedule
// exactly.
//
// The schedule. For update number s = 1, 2, ... (the optimizer's step count: a step that loss
// scaling skips is not an update), with W = warmup_steps, T = total_steps, m = min_lr / lr:
//
//   f(s) = s / W                                    s <= W  (linear warm-up, f(W) = 1)
//   f(s) = 1                                        s > W, decay constant
//   p    = min(1, (s - W) / (T - W))                s > W  (p = 1 when T <= W)
//   f(s) = m + (1 - m) * (0.5 * (1 + cos(pi * p)))  s > W, decay cosine
//   f(s) = m + (1 - m) * (1 - p)                    s > W, decay linear
//
// and a group's learning rate at update s is (lr * lr_scale) * f(s); an unmatched parameter's
// is lr * f(s). Everything is computed in double in exactly this order (integers converted to
// double before dividing), so it is bit for bit what torch.optim.lr_scheduler.LambdaLR gives
// with lr_lambda = lambda c: f(c + 1) (LambdaLR passes the number of updates already done)
// for a param group created with lr = lr * lr_scale. The decay ends at lr * m, i.e. min_lr up
// to one rounding. Without warm-up and decay f(s) = 1 and lr_scale = 1: the learning rate is
// exactly `lr`, as it was before schedules existed.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/job_spec.h"
#include "common/manifest.h"

namespace shard {

// Whether `name` matches the glob `pattern` as a whole: fnmatch(3) without flags. `*` matches
// any run of characters, '.' included; `?` one character; `[...]` one character of a set
// (`[!...]` not of it, ranges `a-z`); `\` escapes the next character. Case-sensitive.
bool MatchesParamPattern(absl::string_view pattern, absl::string_view name);

// The index of the first group with a pattern that matches `name`; -1 when none does (the
// optimizer's own settings).
int FindParamGroup(const std::vector<ParamGroup>& groups, absl::string_view name);

// The group of every parameter of `manifest`, by parameter index (-1: none). InvalidArgument
// naming the group and its patterns when a group takes no trainable parameter (none matches,
// or every match went to an earlier group): a typo in a pattern would otherwise silently train
// those parameters with the optimizer's settings.
absl::StatusOr<std::vector<int>> AssignParamGroups(const OptimizerConfig& optimizer,
                                                   const Manifest& manifest);

// f(s) of the header comment, for update number `step` (>= 1) of optimizer.total_steps.
double LearningRateFactor(const OptimizerConfig& optimizer, int64_t step);
// lr * f(s): the learning rate of a parameter in no group at update `step`.
double LearningRateAt(const OptimizerConfig& optimizer, int64_t step);

// What one update of one group's elements uses, as torch holds them in a param group (Python
// floats, i.e. double); the optimizer rounds them to fp32 where torch does.
struct StepHyperParameters {
  double lr = 0;
  double weight_decay = 0;
};

// Group `group`'s (-1: the optimizer's own) learning rate and weight decay at update `step`.
StepHyperParameters GroupHyperParameters(const OptimizerConfig& optimizer, int group,
                                         int64_t step);

}  // namespace shard
