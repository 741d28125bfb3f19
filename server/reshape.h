// Reshapes of the world as functions over its membership: what an operator's resize or drain,
// or standbys waiting below the target, ask of a running world (PendingReshape), carrying it out
// at a checkpoint boundary (ApplyReshape), and the survivors' re-formation after a death whose
// rank found no replacement (ReformWithSurvivors). No locks, no clock, no storage.
#pragma once

#include <optional>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "server/membership.h"

namespace shard {

// What the running world of `generation` must change to meet the target and the drains, if
// anything: drained workers and the highest ranks beyond the target leave, standbys (oldest
// first) fill up to the target at an allowed size, and survivors no allowed size holds become
// standbys.
std::optional<Reshape> PendingReshape(const Membership& membership, const MembershipRules& rules,
                                      int64_t generation, JobState state);

// Carries out `reshape` on the world of `generation` (FailedPrecondition if it was computed for
// another one, or a standby it folds in is gone): leavers are told to leave, standbys get
// ranks, ranks are renumbered 0..n-1, and the generation ends.
absl::Status ApplyReshape(Membership& membership, const Reshape& reshape, int64_t generation,
                          JobState state, absl::Time now, Change* change);

// The grace period after a death ran out without a replacement: the survivors (as many as an
// allowed size of at least min_world_size takes, the rest as standbys) become the world, ranks
// renumbered in their old order. Nothing happens below min_world_size.
void ReformWithSurvivors(Membership& membership, const MembershipRules& rules, absl::Time now,
                         Change* change);

}  // namespace shard
