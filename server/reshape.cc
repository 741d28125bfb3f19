#include "server/reshape.h"

#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/logging.h"
#include "spdlog/spdlog.h"

namespace shard {
namespace {

bool Contains(const std::vector<std::string>& ids, const std::string& id) {
  return std::find(ids.begin(), ids.end(), id) != ids.end();
}

}  // namespace

std::optional<Reshape> PendingReshape(const Membership& membership, const MembershipRules& rules,
                                      int64_t generation, JobState state) {
  if (!Trains(state)) return std::nullopt;
  Reshape reshape;
  reshape.generation = generation;
  reshape.from_size = membership.ranks();
  std::vector<const Member*> remaining;
  int drained = 0;
  for (const std::string& id : membership.holders()) {
    const Member* member = membership.Find(id);
    if (member->draining) {
      reshape.leavers.push_back(id);
      ++drained;
    } else {
      remaining.push_back(member);
    }
  }
  // Shrinking to the target takes the highest ranks out.
  int resized_out = 0;
  while (static_cast<int>(remaining.size()) > membership.target) {
    reshape.leavers.push_back(remaining.back()->id);
    remaining.pop_back();
    ++resized_out;
  }
  const std::vector<const Member*> standbys = membership.ReadyStandbys();
  int promote = std::min<int>(membership.target - static_cast<int>(remaining.size()),
                              static_cast<int>(standbys.size()));
  while (promote > 0 && !rules.Allowed(static_cast<int>(remaining.size()) + promote)) --promote;
  // A size no allowed world has: healthy workers wait as standbys rather than leave.
  while (promote == 0 && !remaining.empty() &&
         !rules.Allowed(static_cast<int>(remaining.size()))) {
    reshape.demoted.push_back(remaining.back()->id);
    remaining.pop_back();
  }
  for (int i = 0; i < promote; ++i) reshape.promoted.push_back(standbys[i]->id);
  reshape.to_size = static_cast<int>(remaining.size()) + promote;
  if (reshape.leavers.empty() && reshape.promoted.empty()) return std::nullopt;
  if (reshape.to_size < rules.min_world_size || reshape.to_size < 1) return std::nullopt;
  std::vector<std::string> why;
  if (drained > 0) why.push_back(absl::StrCat(drained, " drained"));
  if (resized_out > 0) why.push_back(absl::StrCat("resize to ", membership.target));
  if (promote > 0) {
    why.push_back(absl::StrCat(promote, promote == 1 ? " standby" : " standbys", " folded in"));
  }
  reshape.reason = absl::StrJoin(why, ", ");
  return reshape;
}

absl::Status ApplyReshape(Membership& membership, const Reshape& reshape, int64_t generation,
                          JobState state, absl::Time now, Change* change) {
  if (!Trains(state) || generation != reshape.generation) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the world changed (now ", JobStateName(state), " at generation ", generation,
        ") since the re-formation was planned at generation ", reshape.generation));
  }
  for (const std::string& id : reshape.promoted) {
    const Member* standby = membership.Find(id);
    if (standby == nullptr || standby->role != Role::kStandby) {
      return absl::FailedPreconditionError(
          absl::StrCat("standby '", id, "' is gone since the re-formation was planned"));
    }
  }
  std::vector<std::string> keep;
  const std::vector<std::string> holders = membership.holders();
  for (const std::string& id : holders) {
    Member& member = *membership.Mutable(id);
    if (Contains(reshape.leavers, id)) {
      const std::string why = member.draining
                                  ? std::string("drained by an operator")
                                  : absl::StrCat("resized out: the world shrinks to ",
                                                 reshape.to_size, " workers");
      change->events.push_back(MakeEvent(v1::MEMBERSHIP_EVENT_KIND_LEFT, id, member.rank,
                                         absl::StrCat("told to leave: ", why), now));
      membership.MakeLeaving(member, why);
    } else if (Contains(reshape.demoted, id)) {
      membership.MakeStandby(member, now);
    } else {
      keep.push_back(id);
    }
  }
  for (const std::string& id : reshape.promoted) {
    membership.Mutable(id)->self_check = SelfCheckRecord{};
    keep.push_back(id);
  }
  membership.Renumber(keep, reshape.to_size);
  change->events.push_back(MakeEvent(v1::MEMBERSHIP_EVENT_KIND_RESIZED, "", -1,
                                     absl::StrCat("re-formed from ", reshape.from_size, " to ",
                                                  reshape.to_size, " workers: ", reshape.reason),
                                     now));
  change->bump = true;
  spdlog::info("world re-formed from {} to {} workers ({})", reshape.from_size, reshape.to_size,
               reshape.reason);
  return absl::OkStatus();
}

void ReformWithSurvivors(Membership& membership, const MembershipRules& rules, absl::Time now,
                         Change* change) {
  std::vector<std::string> survivors;  // in rank order
  for (const std::string& id : membership.holders()) {
    if (!id.empty()) survivors.push_back(id);
  }
  const int ranks = membership.ranks();
  int size = static_cast<int>(survivors.size());
  while (size >= rules.min_world_size && !rules.Allowed(size)) --size;
  if (size < rules.min_world_size || size < 1) return;
  for (size_t i = size; i < survivors.size(); ++i) {
    membership.MakeStandby(*membership.Mutable(survivors[i]), now);
  }
  survivors.resize(size);
  const absl::Duration waited = now - *membership.free_rank_since;
  membership.Renumber(survivors, size);
  membership.free_rank_since.reset();
  membership.formed = true;
  change->events.push_back(MakeEvent(
      v1::MEMBERSHIP_EVENT_KIND_RESIZED, "", -1,
      absl::StrCat("re-formed from ", ranks, " to ", size, " workers: no replacement within ",
                   absl::FormatDuration(absl::Trunc(waited, absl::Milliseconds(100)))),
      now));
  change->events.push_back(MakeEvent(v1::MEMBERSHIP_EVENT_KIND_WORLD_FORMED, "", -1,
                                     absl::StrCat(size, " workers"), now));
  // Survivors were renumbered: if this world had run, its generation ends.
  change->bump = change->bump || membership.ran;
  spdlog::warn("no replacement within {}: re-forming with {} of the {} ranks",
               absl::FormatDuration(absl::Trunc(waited, absl::Milliseconds(100))), size, ranks);
}

}  // namespace shard
