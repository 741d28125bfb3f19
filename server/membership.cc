#include "server/membership.h"

#include <algorithm>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/logging.h"
#include "common/names.h"
#include "common/status_macros.h"
#include "server/reshape.h"
#include "spdlog/spdlog.h"

namespace shard {
namespace {

std::string Seconds(absl::Duration d) {
  return absl::FormatDuration(absl::Trunc(d, absl::Milliseconds(100)));
}

std::vector<std::string> Sorted(std::vector<std::string> values) {
  std::sort(values.begin(), values.end());
  values.erase(std::unique(values.begin(), values.end()), values.end());
  return values;
}

// What a worker says about itself ends up in logs, status and other workers' connections:
// bounded, and a host that is a host name or an address.
absl::Status ValidateJoinDescription(const JoinParams& params) {
  const auto host_char = [](char c) {
    return absl::ascii_isalnum(c) || c == '.' || c == '-' || c == ':' || c == '[' || c == ']';
  };
  if (params.host.empty() || params.host.size() > 253 ||
      !std::all_of(params.host.begin(), params.host.end(), host_char)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "worker '", params.worker_id,
        "' gave no valid host for its data path (a host name or address of at most 253 "
        "characters of [A-Za-z0-9.:-] or brackets)"));
  }
  if (params.device.size() > 64 || params.capabilities.size() > 16) {
    return absl::InvalidArgumentError(absl::StrCat(
        "worker '", params.worker_id, "' describes itself with a device of more than 64 "
        "characters or more than 16 capabilities"));
  }
  for (const std::string& capability : params.capabilities) {
    SHARD_RETURN_IF_ERROR(ValidateName("capability", capability));
  }
  return absl::OkStatus();
}

// Gives free ranks to standbys, oldest first; returns how many it placed.
int PromoteStandbys(Membership& membership, absl::Time now, Change* change) {
  int placed = 0;
  for (const Member* standby : membership.ReadyStandbys()) {
    const std::optional<int> rank = membership.LowestFreeRank();
    if (!rank.has_value()) break;
    Member& member = *membership.Mutable(standby->id);
    membership.Activate(member, *rank);
    member.self_check = SelfCheckRecord{};
    change->events.push_back(MakeEvent(v1::MEMBERSHIP_EVENT_KIND_JOINED, member.id, *rank,
                                       "a standby took the free rank", now));
    spdlog::info("standby {} takes free rank {}", member.id, *rank);
    ++placed;
  }
  return placed;
}

void MarkFormedIfComplete(Membership& membership, absl::Time now, Change* change) {
  if (membership.held() != membership.ranks()) return;
  membership.formed = true;
  membership.free_rank_since.reset();
  change->events.push_back(MakeEvent(v1::MEMBERSHIP_EVENT_KIND_WORLD_FORMED, "", -1,
                                     absl::StrCat(membership.ranks(), " workers"), now));
}

// A rank of a world that has formed lost its worker: the grace period starts.
void NoteFreedRank(Membership& membership, absl::Time now) {
  if (membership.formed && !membership.free_rank_since.has_value()) {
    membership.free_rank_since = now;
  }
}

void NoteStoppedIfEmpty(Membership& membership, absl::Time now, Change* change) {
  if (Ended(membership.phase())) {
    change->events.push_back(
        MakeEvent(v1::MEMBERSHIP_EVENT_KIND_STOPPED, "", -1, membership.stop_reason, now));
  }
}

}  // namespace

// --- Membership ---------------------------------------------------------------------------------

Membership::Membership(int ranks, int target_size) : target(target_size) {
  holders_.assign(ranks, "");
  for (int rank = 0; rank < ranks; ++rank) free_ranks_.insert(rank);
}

const Member* Membership::Find(const std::string& id) const {
  auto it = members_.find(id);
  return it == members_.end() ? nullptr : &it->second;
}

Member* Membership::Mutable(const std::string& id) {
  auto it = members_.find(id);
  return it == members_.end() ? nullptr : &it->second;
}

void Membership::Touch(const std::string& id) { dirty_.insert(id); }

absl::StatusOr<Member*> Membership::FindLive(const std::string& id, uint64_t incarnation,
                                             const std::string& job) {
  auto it = members_.find(id);
  if (it == members_.end()) {
    return absl::NotFoundError(
        absl::StrCat("worker '", id, "' is not a member of job '", job, "'; join first"));
  }
  Member& member = it->second;
  if (member.role == Role::kDeparted) {
    // Only the evicted process must exit; a restarted one joins again.
    if (member.evicted && member.incarnation != incarnation) {
      return absl::NotFoundError(
          absl::StrCat("worker '", id, "' is no longer a member; join again"));
    }
    return DepartedStatus(member);
  }
  if (member.incarnation != incarnation) {
    return absl::FailedPreconditionError(absl::StrCat(
        "worker '", id, "' has been taken over by a newer process (incarnation ",
        member.incarnation, ", this one is ", incarnation, "); this process must exit"));
  }
  return &member;
}

std::optional<int> Membership::LowestFreeRank() const {
  if (free_ranks_.empty()) return std::nullopt;
  return *free_ranks_.begin();
}

std::vector<int> Membership::FreeRanks() const { return {free_ranks_.begin(), free_ranks_.end()}; }

std::vector<const Member*> Membership::Standbys() const {
  std::vector<const Member*> standbys;
  for (const auto& [since, id] : standby_order_) standbys.push_back(&members_.at(id));
  return standbys;
}

std::vector<const Member*> Membership::ReadyStandbys() const {
  std::vector<const Member*> ready;
  for (const Member* standby : Standbys()) {
    if (standby->unreachable.empty()) ready.push_back(standby);
  }
  return ready;
}

int Membership::draining() const {
  int draining = 0;
  for (const std::string& id : holders_) {
    if (!id.empty() && members_.at(id).draining) ++draining;
  }
  return draining;
}

std::string Membership::HolderNames() const {
  std::vector<std::string> ids;
  size_t more = 0;
  for (const std::string& id : holders_) {
    if (id.empty()) continue;
    if (ids.size() < 8) {
      ids.push_back(id);
    } else {
      ++more;
    }
  }
  if (more > 0) ids.push_back(absl::StrCat("and ", more, " more"));
  return absl::StrJoin(ids, ", ");
}

const Member* Membership::IncompatibleWith(const std::vector<std::string>& capabilities,
                                           const std::string& except) const {
  if (capabilities.empty()) return nullptr;
  for (const auto& [set, count] : live_capabilities_) {
    if (count == 0 || set.empty()) continue;
    const bool shared = std::any_of(capabilities.begin(), capabilities.end(), [&](const auto& c) {
      return std::binary_search(set.begin(), set.end(), c);
    });
    if (shared) continue;
    // Only the ids of this set's members tell the operator who disagrees: find one.
    for (const auto& [id, member] : members_) {
      if (id != except && member.role != Role::kDeparted && member.role != Role::kLeaving &&
          Sorted(member.capabilities) == set) {
        return &member;
      }
    }
  }
  return nullptr;
}

Member& Membership::Upsert(const std::string& id) {
  dirty_.insert(id);
  auto [it, inserted] = members_.try_emplace(id);
  if (inserted) {
    it->second.id = id;
    it->second.role = Role::kDeparted;
    ++role_counts_[static_cast<int>(Role::kDeparted)];
  }
  return it->second;
}

void Membership::CountCapabilities(const Member& member, int delta) {
  if (member.role == Role::kDeparted || member.role == Role::kLeaving) return;
  const std::vector<std::string> set = Sorted(member.capabilities);
  live_capabilities_[set] += delta;
  if (live_capabilities_[set] == 0) live_capabilities_.erase(set);
}

void Membership::SetRole(Member& member, Role role) {
  if (member.role == role) return;
  dirty_.insert(member.id);
  CountCapabilities(member, -1);
  if (member.role == Role::kStandby) standby_order_.erase({member.standby_since, member.id});
  if (member.role == Role::kDeparted) {
    auto it = std::find_if(departed_order_.begin(), departed_order_.end(),
                           [&](const auto& entry) { return entry.second == member.id; });
    if (it != departed_order_.end()) departed_order_.erase(it);
  }
  --role_counts_[static_cast<int>(member.role)];
  member.role = role;
  ++role_counts_[static_cast<int>(role)];
  CountCapabilities(member, +1);
}

void Membership::Advance(JobEvent event) {
  if (stop_kind_ == StopKind::kNone && !Ended(phase_)) stop_kind_ = StopKindOf(event);
  phase_ = NextJobState(phase_, event, stop_kind_);
}

void Membership::Release(Member& member) {
  if (member.role != Role::kActive || member.rank < 0) return;
  if (member.rank < ranks() && holders_[member.rank] == member.id) {
    holders_[member.rank] = "";
    free_ranks_.insert(member.rank);
    --held_;
    Advance(JobEvent::kRankFreed);
  }
  member.rank = -1;
}

void Membership::Activate(Member& member, int rank) {
  if (member.role == Role::kActive && member.rank == rank) return;
  dirty_.insert(member.id);
  Release(member);
  SetRole(member, Role::kActive);
  member.rank = rank;
  member.last_rank = rank;
  holders_[rank] = member.id;
  free_ranks_.erase(rank);
  ++held_;
  if (held_ == ranks()) Advance(JobEvent::kRanksHeld);
}

void Membership::MakeStandby(Member& member, absl::Time since) {
  dirty_.insert(member.id);
  Release(member);
  if (member.role == Role::kStandby) return;
  SetRole(member, Role::kStandby);
  member.standby_since = since;
  standby_order_.insert({since, member.id});
}

void Membership::MakeLeaving(Member& member, std::string detail) {
  dirty_.insert(member.id);
  Release(member);
  SetRole(member, Role::kLeaving);
  member.detail = std::move(detail);
}

void Membership::Depart(Member& member, WorkerState state, std::string detail, absl::Time now) {
  dirty_.insert(member.id);
  Release(member);
  // Capabilities are counted by role; a departed member's no longer count.
  SetRole(member, Role::kDeparted);
  member.draining = false;
  member.departed_state = state;
  member.departed_at = now;
  member.detail = detail.empty() ? std::string(WorkerStateName(state)) : std::move(detail);
  departed_order_.emplace_back(now, member.id);
  if (live() == 0) Advance(JobEvent::kLastWorkerGone);
}

void Membership::Renumber(const std::vector<std::string>& keep, int size) {
  // A keeper keeps its rank if it is below `size` and not taken; the others fill the free ranks
  // in order. Only members whose rank changes are recorded: re-forming 10,000 survivors after
  // one death writes one member, not all of them.
  std::vector<std::string> next(size);
  std::vector<Member*> moving;
  for (const std::string& id : keep) {
    Member& member = members_.at(id);
    if (member.role == Role::kActive && member.rank >= 0 && member.rank < size &&
        next[member.rank].empty()) {
      next[member.rank] = id;
    } else {
      moving.push_back(&member);
    }
  }
  int rank = 0;
  for (Member* member : moving) {
    while (!next[rank].empty()) ++rank;
    next[rank] = member->id;
    SetRole(*member, Role::kActive);
    member->rank = rank;
    member->last_rank = rank;
    dirty_.insert(member->id);
  }
  holders_ = std::move(next);
  free_ranks_.clear();
  held_ = 0;
  for (int r = 0; r < size; ++r) {
    if (holders_[r].empty()) {
      free_ranks_.insert(r);
    } else {
      ++held_;
    }
  }
  Advance(held_ == size ? JobEvent::kRanksHeld : JobEvent::kRankFreed);
}

void Membership::PruneDeparted(size_t max_departed) {
  while (departed_order_.size() > max_departed) {
    const std::string id = departed_order_.front().second;
    departed_order_.pop_front();
    auto it = members_.find(id);
    if (it == members_.end() || it->second.role != Role::kDeparted) continue;
    --role_counts_[static_cast<int>(Role::kDeparted)];
    members_.erase(it);
    dirty_.insert(id);
  }
}

std::set<std::string> Membership::TakeDirty() {
  std::set<std::string> dirty;
  dirty.swap(dirty_);
  return dirty;
}

// --- Rules --------------------------------------------------------------------------------------

v1::MembershipEvent MakeEvent(v1::MembershipEventKind kind, const std::string& worker_id,
                              int rank, std::string detail, absl::Time now) {
  v1::MembershipEvent event;
  event.set_unix_ms(absl::ToUnixMillis(now));
  event.set_kind(kind);
  event.set_worker_id(worker_id);
  event.set_rank(rank);
  event.set_detail(std::move(detail));
  return event;
}

World WorldOf(const Membership& membership, int64_t generation, const MembershipRules& rules) {
  World world;
  world.generation = generation;
  world.ranks = membership.ranks();
  world.world_size = membership.held();
  world.expected_world_size = membership.target;
  world.min_world_size = rules.min_world_size;
  world.standby = membership.count(Role::kStandby);
  world.state = membership.phase();
  return world;
}

std::string Transition(const Membership& membership, const MembershipRules& rules,
                       absl::Time now) {
  if (membership.stop_requested()) return "";
  const int ranks = membership.ranks();
  const int held = membership.held();
  if (held < ranks) {
    if (!membership.formed) {
      return absl::StrCat("forming: waiting for ", ranks - held, " more of ", ranks, " workers");
    }
    const std::vector<int> free = membership.FreeRanks();
    const std::string lost = absl::StrCat(free.size() == 1 ? "rank " : "ranks ",
                                          absl::StrJoin(free, ","), " lost ",
                                          free.size() == 1 ? "its worker" : "their workers");
    if (held >= rules.min_world_size && membership.free_rank_since.has_value()) {
      const absl::Duration left =
          std::max(absl::ZeroDuration(), *membership.free_rank_since + rules.reform_grace - now);
      return absl::StrCat(lost, ": waiting ", Seconds(left),
                          " more for a replacement, then re-forming with the ", held,
                          " survivors");
    }
    return absl::StrCat(lost, ": waiting for ", rules.min_world_size - held,
                        " more workers (the job needs at least ", rules.min_world_size, ")");
  }
  const int standby = membership.count(Role::kStandby);
  const int draining = membership.draining();
  if (ranks != membership.target || draining > 0 || (standby > 0 && ranks < membership.target)) {
    return absl::StrCat(
        "re-forming from ", ranks, " to ", membership.target, " workers",
        draining > 0 ? absl::StrCat(" (", draining, " draining)") : "",
        " at the next checkpoint boundary",
        ranks < membership.target && standby == 0 ? "; waiting for workers to join" : "");
  }
  return "";
}

absl::StatusOr<int> Join(Membership& membership, const MembershipRules& rules,
                         const JoinParams& params, int64_t generation, absl::Time now,
                         Change* change) {
  SHARD_RETURN_IF_ERROR(ValidateName("worker id", params.worker_id));
  SHARD_RETURN_IF_ERROR(ValidateJoinDescription(params));
  if (membership.stop_requested()) {
    return absl::FailedPreconditionError(absl::StrCat("job '", rules.job, "' is stopping (",
                                                      membership.stop_reason,
                                                      "); it accepts no workers"));
  }
  if (const Member* other = membership.IncompatibleWith(params.capabilities, params.worker_id)) {
    // NCCL and Gloo ranks cannot form one world: connecting would time out on every attempt.
    return absl::FailedPreconditionError(absl::StrCat(
        "worker '", params.worker_id, "' (device ", params.device, ") runs the ",
        absl::StrJoin(params.capabilities, "/"), " data path, but worker '", other->id,
        "' (device ", other->device, ") in this job runs ",
        absl::StrJoin(other->capabilities, "/"),
        "; start every worker of a job with the same --backend (auto means nccl on cuda:N, gloo "
        "on cpu)"));
  }
  const Member* existing = membership.Find(params.worker_id);
  if (existing != nullptr && existing->role == Role::kDeparted && existing->evicted &&
      existing->incarnation == params.incarnation) {
    return absl::FailedPreconditionError(absl::StrCat(
        "worker '", params.worker_id, "' was evicted (", existing->detail,
        "); this process must exit, and a restarted one may join again"));
  }
  const bool live = existing != nullptr && existing->role != Role::kDeparted &&
                    existing->role != Role::kLeaving;
  if (live && existing->incarnation == params.incarnation) {
    // A retried join: answer as before.
    if (params.requested_rank.has_value() && *params.requested_rank != existing->rank) {
      return absl::FailedPreconditionError(
          absl::StrCat("worker '", params.worker_id, "' already holds rank ", existing->rank,
                       "; it cannot also take rank ", *params.requested_rank));
    }
    membership.Mutable(params.worker_id)->last_heartbeat = now;
    return existing->rank;
  }

  // The rank it gets: the one it asks for, its own (a restart), its last, or the lowest free.
  const int ranks = membership.ranks();
  int rank = -1;
  if (params.requested_rank.has_value()) {
    rank = *params.requested_rank;
    if (rank < 0 || rank >= ranks) {
      return absl::InvalidArgumentError(absl::StrCat(
          "requested rank ", rank, " is outside the world: ranks are 0..", ranks - 1));
    }
    const std::string& holder = membership.holder(rank);
    if (!holder.empty() && holder != params.worker_id) {
      // Transient: the holder may be about to be declared dead; the worker retries.
      return absl::AlreadyExistsError(absl::StrCat(
          "rank ", rank, " is held by live worker '", holder, "' (host ",
          membership.Find(holder)->host, "); waiting for it to leave or be declared dead "
          "(or pick another rank, or leave the rank unset)"));
    }
    if (live && existing->role == Role::kActive && existing->rank != rank) {
      return absl::FailedPreconditionError(
          absl::StrCat("worker '", params.worker_id, "' already holds rank ", existing->rank,
                       "; it cannot also take rank ", rank));
    }
  } else if (live && existing->role == Role::kActive) {
    rank = existing->rank;
  } else if (existing != nullptr && !existing->unreachable.empty()) {
    rank = -1;  // isolated: it waits as a standby until its probe passes (reachability.h)
  } else if (existing != nullptr && existing->last_rank >= 0 && existing->last_rank < ranks &&
             membership.holder(existing->last_rank).empty()) {
    rank = existing->last_rank;
  } else {
    rank = membership.LowestFreeRank().value_or(-1);
  }
  const bool was_standby = live && existing->role == Role::kStandby;
  if (rank < 0 && !was_standby &&
      membership.count(Role::kStandby) >= rules.max_standbys) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the world is full: all ", ranks, " ranks are held by live workers (",
        membership.HolderNames(), ") and ", membership.count(Role::kStandby),
        " standbys wait, the most the coordinator keeps (--max-standbys); retrying until a "
        "worker leaves or dies"));
  }

  const bool restart = live && existing->role == Role::kActive;
  Member& member = membership.Upsert(params.worker_id);
  member.incarnation = params.incarnation;
  member.host = params.host;
  member.device = params.device;
  member.capabilities = params.capabilities;
  member.last_heartbeat = now;
  member.self_check = SelfCheckRecord{};
  member.draining = false;
  member.detail.clear();
  member.done_generation = 0;
  member.paused_generation = 0;
  member.probe_address = params.snapshot_address;
  const std::string where = absl::StrCat("host ", params.host, ", device ", params.device);
  if (rank >= 0) {
    // A new process behind a rank: peers that connected at this generation must reconnect.
    change->bump = membership.ran;
    membership.Activate(member, rank);
    member.joined_generation = generation + (change->bump ? 1 : 0);
    change->events.push_back(MakeEvent(
        restart ? v1::MEMBERSHIP_EVENT_KIND_RESTARTED : v1::MEMBERSHIP_EVENT_KIND_JOINED,
        params.worker_id, rank, where, now));
    MarkFormedIfComplete(membership, now, change);
  } else {
    membership.MakeStandby(member, was_standby ? member.standby_since : now);
    member.joined_generation = generation;
    change->events.push_back(MakeEvent(
        v1::MEMBERSHIP_EVENT_KIND_STANDBY, params.worker_id, -1,
        absl::StrCat(where, "; takes the rank of a worker that dies, or is folded in at a "
                            "checkpoint boundary while the world is below its target"),
        now));
  }
  return rank;
}

absl::Status Leave(Membership& membership, const MembershipRules& rules,
                   const LeaveParams& params, absl::Time now, Change* change) {
  const std::string& worker_id = params.worker_id;
  if (const Member* gone = membership.Find(worker_id);
      gone != nullptr && gone->role == Role::kDeparted && gone->incarnation == params.incarnation) {
    return absl::OkStatus();  // a retried leave
  }
  SHARD_ASSIGN_OR_RETURN(Member * found,
                         membership.FindLive(worker_id, params.incarnation, rules.job));
  Member& member = *found;
  const bool held_rank = member.role == Role::kActive;
  const std::string reason =
      params.failed ? absl::StrCat("failed: ", params.reason) : params.reason;
  change->events.push_back(
      MakeEvent(v1::MEMBERSHIP_EVENT_KIND_LEFT, worker_id, member.rank, reason, now));
  membership.Depart(member, WorkerState::kLeft, reason, now);
  // A failure while the job stops anyway counts for nothing.
  const bool counted = params.failed && !membership.stop_requested();
  if (counted) ++membership.worker_failures;
  const bool fails_job = counted && rules.max_worker_failures >= 0 &&
                         membership.worker_failures > rules.max_worker_failures;
  if (held_rank && !membership.stop_requested() && !fails_job) {
    change->bump = membership.ran;
    NoteFreedRank(membership, now);
    if (PromoteStandbys(membership, now, change) > 0) MarkFormedIfComplete(membership, now, change);
  }
  NoteStoppedIfEmpty(membership, now, change);
  if (fails_job) {
    // The same error would come back wherever the job restarts its workers: stop for good.
    Stop(membership, JobEvent::kJobFailed,
         absl::StrCat(membership.worker_failures, " workers exited with an error (more than ",
                      "--max-worker-failures ", rules.max_worker_failures, "); the last, ",
                      worker_id, ": ", params.reason),
         now, change);
  }
  membership.PruneDeparted(rules.max_departed);
  return absl::OkStatus();
}

absl::Status DepartedStatus(const Member& member) {
  if (member.evicted) {
    return absl::FailedPreconditionError(absl::StrCat(
        "worker '", member.id, "' was evicted (", member.detail,
        "); this process must exit, and a restarted one may join again"));
  }
  return absl::NotFoundError(absl::StrCat("worker '", member.id, "' is no longer a member (",
                                          WorkerStateName(member.departed_state), ": ",
                                          member.detail, "); join again"));
}

absl::Status Evict(Membership& membership, const MembershipRules& rules,
                   const std::string& worker_id, uint64_t incarnation, const std::string& detail,
                   absl::Time now, Change* change) {
  SHARD_ASSIGN_OR_RETURN(Member * member, membership.FindLive(worker_id, incarnation, rules.job));
  if (member->role != Role::kActive) {
    return absl::FailedPreconditionError(
        absl::StrCat("worker '", worker_id, "' holds no rank: nothing waits on it"));
  }
  change->events.push_back(MakeEvent(v1::MEMBERSHIP_EVENT_KIND_STUCK, worker_id, member->rank,
                                     absl::StrCat(detail, "; evicted"), now));
  spdlog::warn("worker {} (rank {}) evicted: {}", worker_id, member->rank, detail);
  if (!membership.stop_requested()) {
    change->bump = change->bump || membership.ran;
    NoteFreedRank(membership, now);
  }
  membership.Depart(*member, WorkerState::kDead, absl::StrCat("stuck: ", detail), now);
  member->evicted = true;
  NoteStoppedIfEmpty(membership, now, change);
  membership.PruneDeparted(rules.max_departed);
  return absl::OkStatus();
}

std::vector<std::string> ExpireLeases(Membership& membership, const MembershipRules& rules,
                                      absl::Time now, Change* change) {
  std::vector<std::string> dead;
  for (const auto& [id, member] : membership.members()) {
    if (member.role != Role::kDeparted && now - member.last_heartbeat > rules.lease) {
      dead.push_back(id);
    }
  }
  for (const std::string& id : dead) {
    Member& member = *membership.Mutable(id);
    const absl::Duration silent = now - member.last_heartbeat;
    const std::string detail =
        absl::StrCat("no heartbeat for ", absl::FormatDuration(absl::Trunc(silent, absl::Milliseconds(1))),
                     " (lease ", absl::FormatDuration(rules.lease), ")");
    change->events.push_back(
        MakeEvent(v1::MEMBERSHIP_EVENT_KIND_DEAD, id, member.rank, detail, now));
    spdlog::warn("worker {} ({}) declared dead: {}", id,
                 member.role == Role::kActive    ? absl::StrCat("rank ", member.rank)
                 : member.role == Role::kStandby ? std::string("standby")
                                                 : std::string("leaving"),
                 detail);
    if (member.role == Role::kActive && !membership.stop_requested()) {
      change->bump = change->bump || membership.ran;
      NoteFreedRank(membership, now);
    }
    membership.Depart(member, WorkerState::kDead, detail, now);
  }
  // A free rank goes to a waiting standby, whether the world lost its holder or never had one (a
  // world forming after a restart or a resize may hold standbys that no join would place).
  if (!membership.stop_requested() && membership.held() < membership.ranks()) {
    if (PromoteStandbys(membership, now, change) > 0) MarkFormedIfComplete(membership, now, change);
  }
  // Past the grace period, re-form with the survivors (as many as an allowed size takes).
  if (!membership.stop_requested() && membership.formed &&
      membership.held() < membership.ranks() && membership.free_rank_since.has_value() &&
      now >= *membership.free_rank_since + rules.reform_grace) {
    ReformWithSurvivors(membership, rules, now, change);
  }
  if (!dead.empty()) {
    NoteStoppedIfEmpty(membership, now, change);
    membership.PruneDeparted(rules.max_departed);
  }
  return dead;
}

void ResizeFormingWorld(Membership& membership, int size, absl::Time now, Change* change) {
  const int from = membership.ranks();
  std::vector<std::string> keep;  // the holders, in rank order, as many as the new size takes
  for (const std::string& id : membership.holders()) {
    if (id.empty()) continue;
    if (static_cast<int>(keep.size()) < size) {
      keep.push_back(id);
    } else {
      membership.MakeStandby(*membership.Mutable(id), now);
    }
  }
  membership.Renumber(keep, size);
  change->events.push_back(
      MakeEvent(v1::MEMBERSHIP_EVENT_KIND_RESIZED, "", -1,
                absl::StrCat("the forming world goes from ", from, " to ", size, " ranks"), now));
  PromoteStandbys(membership, now, change);
  MarkFormedIfComplete(membership, now, change);
}

void Stop(Membership& membership, JobEvent why, const std::string& reason, absl::Time now,
          Change* change) {
  if (membership.stop_requested()) return;
  membership.Advance(why);
  if (membership.live() == 0) membership.Advance(JobEvent::kLastWorkerGone);
  membership.stop_reason = reason.empty() ? "stop requested" : reason;
  change->events.push_back(MakeEvent(v1::MEMBERSHIP_EVENT_KIND_STOP_REQUESTED, "", -1,
                                     membership.stop_reason, now));
  NoteStoppedIfEmpty(membership, now, change);
  spdlog::log(why == JobEvent::kJobFailed ? spdlog::level::err : spdlog::level::info,
              "the job stops ({}); {} live workers will be told to leave", membership.stop_reason,
              membership.live());
}

}  // namespace shard
