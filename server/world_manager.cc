#include "server/world_manager.h"

#include <algorithm>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/names.h"
#include "common/status_macros.h"
#include "server/reachability.h"
#include "server/reshape.h"
#include "spdlog/spdlog.h"

namespace shard {

namespace {

// Whether a job stopped this way is over for good (a restart has nothing to run): it trained to
// the end, or it failed. An operator's stop is not: the next start is a new run.
bool EndedFor(StopKind stop) { return stop == StopKind::kTrained || stop == StopKind::kFailed; }

// The job-level fields a change may touch without touching a member or recording an event.
auto Header(const Membership& m) {
  return std::make_tuple(m.ranks(), m.target, m.formed, m.connected_generation, m.phase(),
                         m.stop_kind(), m.stop_reason, m.worker_failures);
}

MembershipRules RulesFor(const WorldOptions& options) {
  MembershipRules rules;
  rules.job = options.job;
  rules.max_world_size = options.expected_world_size;
  rules.min_world_size =
      options.min_world_size > 0 ? options.min_world_size : options.expected_world_size;
  rules.max_standbys =
      options.max_standbys > 0 ? options.max_standbys : options.expected_world_size;
  rules.lease = options.lease;
  rules.reform_grace = options.reform_grace;
  rules.check_size = options.check_size;
  rules.max_departed = options.max_departed_records;
  rules.max_worker_failures = options.max_worker_failures;
  return rules;
}

absl::Status ValidateOptions(const WorldOptions& options) {
  SHARD_RETURN_IF_ERROR(ValidateName("job name", options.job));
  if (options.expected_world_size < 1) {
    return absl::InvalidArgumentError(absl::StrCat("expected world size must be at least 1, got ",
                                                   options.expected_world_size));
  }
  if (options.min_world_size < 0 || options.min_world_size > options.expected_world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("min world size ", options.min_world_size, " must be between 1 and the world ",
                     "size ", options.expected_world_size));
  }
  if (options.max_standbys < 0) {
    return absl::InvalidArgumentError("the number of standbys cannot be negative");
  }
  if (options.lease <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("heartbeat lease must be positive");
  }
  if (options.reform_grace < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("the re-form grace period cannot be negative");
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<WorldManager>> WorldManager::Create(WorldOptions options,
                                                                   StateStore* store,
                                                                   absl::Time now) {
  SHARD_RETURN_IF_ERROR(ValidateOptions(options));
  SHARD_ASSIGN_OR_RETURN(std::optional<v1::CoordinatorState> saved,
                         MembershipLog::Load(store, options.max_events));
  if (saved.has_value() && saved->job() != options.job) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the state directory belongs to job '", saved->job(), "' but this coordinator runs job '",
        options.job, "'; pass the matching job name or another state directory"));
  }
  const int64_t saved_generation = saved.has_value() ? saved->generation() : 0;
  const bool take_back =
      options.recover && saved.has_value() && !saved->stop_requested() && !saved->members().empty();
  const int target = options.expected_world_size;
  std::unique_ptr<WorldManager> manager;
  Change change;
  if (take_back) {
    // Every worker gets two leases to reach the new process: it may be backing off.
    Membership membership = RestoreMembership(*saved, target, now + options.lease, now);
    const bool complete = membership.held() == membership.ranks();
    // An intact world that had connected keeps its generation: its data path never depended on
    // the coordinator, so training goes on. Anything else reconnects at a new generation.
    const bool keep = complete && membership.connected_generation == saved_generation;
    membership.ran = keep;
    const std::string summary = absl::StrCat(
        "took back ", membership.held(), " of ", membership.ranks(), " ranks and ",
        membership.count(Role::kStandby), " standbys; ",
        keep ? "generation kept: training continues" : "new generation: the workers reconnect");
    change.events.push_back(
        MakeEvent(v1::MEMBERSHIP_EVENT_KIND_COORDINATOR_RECOVERED, "", -1, summary, now));
    manager.reset(new WorldManager(std::move(options), store, std::move(membership),
                                   saved_generation + (keep ? 0 : 1)));
    manager->recovered_ = true;
    manager->kept_generation_ = keep;
    spdlog::info("recovered job '{}' from the state directory at generation {}: {}",
                 manager->options_.job, manager->generation_, summary);
  } else if (options.recover && saved.has_value() && EndedFor(SavedStopKind(*saved))) {
    // Nothing to run: the world comes back as it ended and the coordinator exits.
    const bool failed = SavedStopKind(*saved) == StopKind::kFailed;
    const std::string how = failed ? "failed" : "finished";
    change.events.push_back(MakeEvent(v1::MEMBERSHIP_EVENT_KIND_COORDINATOR_RECOVERED, "", -1,
                                      absl::StrCat("the job had ", how, " (",
                                                   saved->stop_reason(), "): nothing to run"),
                                      now));
    manager.reset(new WorldManager(std::move(options), store, Membership(target, target),
                                   saved_generation));
    manager->recovered_ = true;
    shard::Stop(manager->membership_,
                failed ? JobEvent::kJobFailed : JobEvent::kTrainingFinished,
                saved->stop_reason(), now, &change);
    spdlog::info("job '{}' had {} ({}); nothing to run: start with --restore to train "
                 "again from a checkpoint, or on another --state-dir for a new run",
                 manager->options_.job, how, saved->stop_reason());
  } else {
    // A new world: whatever existed before is gone, and its generation numbers stay used.
    change.events.push_back(MakeEvent(
        v1::MEMBERSHIP_EVENT_KIND_COORDINATOR_STARTED, "", -1,
        absl::StrCat("expecting ", target, " workers (at least ", RulesFor(options).min_world_size,
                     " to re-form), lease ", absl::FormatDuration(options.lease)),
        now));
    manager.reset(new WorldManager(std::move(options), store, Membership(target, target),
                                   saved_generation + 1));
  }
  absl::MutexLock lock(&manager->mu_);
  if (saved.has_value()) manager->events_.Restore(*saved);
  if (manager->kept_generation_) {
    // Every rank had finished training when the coordinator went down.
    manager->StopIfTrainingFinished("every rank had reported the end", now, &change);
  }
  // A world taken back whole at a new generation runs at once: its workers reconnect to it.
  manager->NoteRunningLocked();
  manager->membership_.TakeDirty();
  manager->events_.Append(std::move(change.events), manager->generation_);
  // The record starts afresh as one snapshot (also converting a record of an earlier format).
  manager->log_.Compact(manager->membership_, manager->generation_, manager->events_);
  return manager;
}

absl::StatusOr<WorldManager::SavedWorld> WorldManager::FindSavedWorld(StateStore* store) {
  SHARD_ASSIGN_OR_RETURN(std::optional<v1::CoordinatorState> saved,
                         MembershipLog::Load(store, /*max_events=*/0));
  if (!saved.has_value()) return SavedWorld::kNone;
  if (EndedFor(SavedStopKind(*saved))) return SavedWorld::kEnded;
  return !saved->stop_requested() && !saved->members().empty() ? SavedWorld::kLive
                                                                : SavedWorld::kNone;
}

WorldManager::WorldManager(WorldOptions options, StateStore* store, Membership membership,
                           int64_t generation)
    : options_(std::move(options)),
      rules_(RulesFor(options_)),
      store_(store),
      membership_(std::move(membership)),
      generation_(generation),
      events_(options_.max_events),
      log_(store, options_.job) {}

void WorldManager::set_generation_listener(std::function<void(int64_t)> listener) {
  absl::MutexLock lock(&mu_);
  generation_listener_ = std::move(listener);
}

void WorldManager::set_running_listener(RunningListener listener) {
  absl::MutexLock lock(&mu_);
  running_listener_ = std::move(listener);
}

void WorldManager::set_leaver_hold(std::function<bool(const std::string&)> hold) {
  absl::MutexLock lock(&mu_);
  leaver_hold_ = std::move(hold);
}

bool WorldManager::LiveLocked(const std::string& worker_id, uint64_t incarnation) const {
  const shard::Member* member = membership_.Find(worker_id);
  return member != nullptr && member->role != Role::kDeparted &&
         member->incarnation == incarnation;
}

bool WorldManager::IsLive(const std::string& worker_id, uint64_t incarnation) const {
  absl::ReaderMutexLock lock(&mu_);
  return LiveLocked(worker_id, incarnation);
}

std::vector<RankProgress> WorldManager::Progress() const {
  absl::ReaderMutexLock lock(&mu_);
  std::vector<RankProgress> ranks;
  for (int rank = 0; rank < membership_.ranks(); ++rank) {
    const shard::Member* member = membership_.Find(membership_.holder(rank));
    if (member == nullptr) continue;
    ranks.push_back(RankProgress{member->id, member->incarnation, rank, member->activity,
                                 member->activity_at});
  }
  return ranks;
}

absl::Status WorldManager::Evict(const std::string& worker_id, uint64_t incarnation,
                                 const std::string& detail, absl::Time now) {
  return Mutate([&](Change* change) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return shard::Evict(membership_, rules_, worker_id, incarnation, detail, now, change);
  });
}

IsLiveMember WorldManager::LiveNow() const {
  auto live = std::make_shared<std::map<std::string, uint64_t>>();
  {
    absl::ReaderMutexLock lock(&mu_);
    for (const auto& [id, member] : membership_.members()) {
      if (member.role != Role::kDeparted) (*live)[id] = member.incarnation;
    }
  }
  return [live](const std::string& id, uint64_t incarnation) {
    auto it = live->find(id);
    return it != live->end() && it->second == incarnation;
  };
}

bool WorldManager::HeldLocked(const shard::Member& member) const {
  return member.role == Role::kLeaving && !membership_.stop_requested() && leaver_hold_ &&
         leaver_hold_(member.id);
}

void WorldManager::RecordEvent(v1::MembershipEventKind kind, const std::string& worker_id,
                               int rank, std::string detail, absl::Time now) {
  Mutate([&](Change* change) {
    change->events.push_back(MakeEvent(kind, worker_id, rank, std::move(detail), now));
    return 0;
  });
}

World WorldManager::WorldLocked() const { return WorldOf(membership_, generation_, rules_); }

World WorldManager::world() const {
  absl::ReaderMutexLock lock(&mu_);
  return WorldLocked();
}

template <typename Rule>
auto WorldManager::Mutate(Rule rule, size_t fired_at_most)
    -> decltype(rule(std::declval<Change*>())) {
  Answers answers;
  decltype(rule(std::declval<Change*>())) result;
  {
    absl::MutexLock lock(&mu_);
    const World before = WorldLocked();
    const auto header = Header(membership_);
    Change change;
    result = rule(&change);
    // Nothing to record unless an event, a job-level field or a member's record changed (a
    // lease pass that finds every worker alive writes nothing).
    std::set<std::string> touched;
    if (change.bump || !change.events.empty() || header != Header(membership_) ||
        membership_.has_dirty()) {
      touched = CommitLocked(std::move(change));
    }
    answers = TakeChangedWatchesLocked(before, touched);
  }
  Deliver(std::move(answers), fired_at_most);
  return result;
}

void WorldManager::NoteRunningLocked() {
  if (!Trains(WorldLocked().state)) return;
  // Once a world runs, workers may connect at its generation: a change of hands ends it.
  membership_.ran = true;
  // However it became whole (joins, a resize while forming, a restart), a world that runs has
  // formed: a rank it loses goes to a standby, or the survivors re-form after the grace.
  membership_.formed = true;
}

std::set<std::string> WorldManager::CommitLocked(Change change) {
  if (change.bump) {
    ++generation_;
    membership_.Advance(JobEvent::kGenerationEnded);
    membership_.ran = false;
    // First, so that a world running at once at the new generation resolves its start there.
    if (generation_listener_) generation_listener_(generation_);
  }
  const bool starts_running = !membership_.ran && Trains(WorldLocked().state);
  NoteRunningLocked();
  if (starts_running && running_listener_) {
    // The listener reads the membership under this lock, as it stands.
    const IsLiveMember live = [this](const std::string& id, uint64_t incarnation)
                                  ABSL_NO_THREAD_SAFETY_ANALYSIS { return LiveLocked(id, incarnation); };
    const int64_t unix_ms = !change.events.empty()   ? change.events.front().unix_ms()
                            : events_.events().empty() ? 0
                                                       : events_.events().back().unix_ms();
    for (v1::MembershipEvent& event : running_listener_(generation_, live)) {
      event.set_unix_ms(unix_ms);
      change.events.push_back(std::move(event));
    }
  }
  const std::vector<v1::MembershipEvent> events =
      events_.Append(std::move(change.events), generation_);
  std::set<std::string> touched = membership_.TakeDirty();
  log_.Record(membership_, generation_, touched, events, events_);
  return touched;
}

absl::StatusOr<shard::Member*> WorldManager::GenerationMemberLocked(const std::string& worker_id,
                                                                   uint64_t incarnation) {
  absl::StatusOr<shard::Member*> member =
      membership_.FindLive(worker_id, incarnation, options_.job);
  if (absl::IsNotFound(member.status())) {
    // Declared dead (or left) meanwhile: its generation is over, and its heartbeat rejoins.
    return absl::AbortedError(member.status().message());
  }
  return member;
}

absl::StatusOr<HeartbeatOutcome> WorldManager::HeartbeatLocked(const std::string& worker_id,
                                                               uint64_t incarnation,
                                                               absl::Time now) {
  SHARD_ASSIGN_OR_RETURN(shard::Member * member,
                         membership_.FindLive(worker_id, incarnation, options_.job));
  member->last_heartbeat = now;
  return OutcomeLocked(worker_id, WorldLocked());
}

absl::StatusOr<HeartbeatOutcome> WorldManager::Heartbeat(const std::string& worker_id,
                                                         uint64_t incarnation, absl::Time now) {
  absl::MutexLock lock(&mu_);
  return HeartbeatLocked(worker_id, incarnation, now);
}

void WorldManager::WatchHeartbeat(const HeartbeatParams& params, absl::Time now,
                                  HeartbeatCallback done) {
  if (!params.probed.empty()) {
    Mutate([&](Change* change) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      if (!LiveLocked(params.worker_id, params.incarnation)) return false;
      NoteProbe(membership_, params.worker_id, generation_, params.probed, now, change);
      return true;
    });
  }
  absl::StatusOr<HeartbeatOutcome> outcome;
  Answers answers;
  {
    absl::MutexLock lock(&mu_);
    outcome = HeartbeatLocked(params.worker_id, params.incarnation, now);
    if (outcome.ok()) {
      // Not recorded: a restarted coordinator hears it again with the next heartbeat.
      shard::Member* member = membership_.Mutable(params.worker_id);
      member->paused_generation = params.paused_generation;
      member->activity = params.activity;
      member->activity_at = now;
    }
    const absl::Duration wait = std::min(params.wait, options_.lease / 4);
    Watch watch{params.worker_id, params.known_generation, params.known_state, std::move(done)};
    if (!watches_.closed().ok()) {
      // Closed: nothing would answer a held heartbeat, and the server could not drain.
      answers.heartbeats.emplace_back(std::move(watch.done), watches_.closed());
    } else if (outcome.ok() && wait > absl::ZeroDuration() && !WatchFires(outcome->world, watch)) {
      // One held heartbeat per worker: an older one (a retry after a lost reply) is answered.
      if (auto it = watch_of_.find(params.worker_id); it != watch_of_.end()) {
        if (std::optional<Watch> older = watches_.Take(it->second)) {
          answers.heartbeats.emplace_back(std::move(older->done), outcome);
        }
      }
      watch_of_[params.worker_id] = watches_.Add(now + wait, std::move(watch));
    } else {
      answers.heartbeats.emplace_back(std::move(watch.done), std::move(outcome));
    }
  }
  Deliver(std::move(answers));
}

absl::StatusOr<JoinOutcome> WorldManager::Join(const JoinParams& params, absl::Time now) {
  return Mutate([&](Change* change) ABSL_EXCLUSIVE_LOCKS_REQUIRED(
                    mu_) -> absl::StatusOr<JoinOutcome> {
    SHARD_ASSIGN_OR_RETURN(int rank,
                           shard::Join(membership_, rules_, params, generation_, now, change));
    World world = WorldLocked();
    if (change->bump) ++world.generation;  // CommitLocked ends the generation next
    if (!change->events.empty()) {
      if (rank >= 0) {
        spdlog::info(
            "worker {} joined as rank {} (host {}, device {}); generation {}, {}/{} "
            "ranks held",
            params.worker_id, rank, params.host, params.device, world.generation, world.world_size,
            world.ranks);
      } else {
        spdlog::info("worker {} joined as a standby (host {}, device {}); the world has {} "
                     "ranks, target {}",
                     params.worker_id, params.host, params.device, world.ranks, world.expected_world_size);
      }
    }
    return JoinOutcome{rank, world};
  });
}

absl::Status WorldManager::ReportSelfCheck(const std::string& worker_id, uint64_t incarnation,
                                           int64_t generation, bool passed,
                                           const std::string& detail, absl::Time now,
                                           const std::vector<PeerFault>& unreachable) {
  return Mutate([&](Change* change) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) -> absl::Status {
    SHARD_ASSIGN_OR_RETURN(shard::Member * member, GenerationMemberLocked(worker_id, incarnation));
    if (generation != generation_) {
      return absl::AbortedError(absl::StrCat("self-check was run at generation ", generation,
                                             " but the world is at generation ", generation_,
                                             "; check again"));
    }
    member->last_heartbeat = now;
    member->self_check = SelfCheckRecord{passed ? SelfCheckState::kPassed : SelfCheckState::kFailed,
                                         generation, detail};
    if (!passed) {
      spdlog::error("worker {} (rank {}) failed its self-check at generation {}: {}", worker_id,
                    member->rank, generation, detail);
      // Its peers cannot use this generation's data path either: every rank reconnects at the
      // next one (after a death, only once the lease says who is gone).
      if (member->role == Role::kActive && Trains(WorldLocked().state) &&
          !membership_.stop_requested()) {
        RecordUnreachable(membership_, worker_id, generation, unreachable, now, change);
        if (IsolateUnreachable(membership_, rules_, now, change)) return absl::OkStatus();
        change->bump = true;
        change->events.push_back(MakeEvent(
            v1::MEMBERSHIP_EVENT_KIND_REFORMED, worker_id, member->rank,
            absl::StrCat("the data path of generation ", generation, " failed: ", detail), now));
      }
      return absl::OkStatus();
    }
    spdlog::info("worker {} (rank {}) passed its self-check at generation {}: {}", worker_id,
                 member->rank, generation, detail);
    // Once every rank has connected, a restarted coordinator can keep this generation.
    if (!Trains(WorldLocked().state) ||
        membership_.connected_generation == generation) {
      return absl::OkStatus();
    }
    for (const std::string& id : membership_.holders()) {
      const SelfCheckRecord& check = membership_.Find(id)->self_check;
      if (check.state != SelfCheckState::kPassed || check.generation != generation) {
        return absl::OkStatus();
      }
    }
    membership_.connected_generation = generation;
    ForgetBrokenLinks(membership_);
    return absl::OkStatus();
  });
}

absl::Status WorldManager::Leave(const LeaveParams& params, absl::Time now) {
  return Mutate([&](Change* change) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const shard::Member* member = membership_.Find(params.worker_id);
    const int rank = member == nullptr ? -1 : member->rank;
    absl::Status left = shard::Leave(membership_, rules_, params, now, change);
    if (left.ok() && !change->events.empty()) {
      spdlog::info("worker {} ({}) left{}: {}", params.worker_id,
                   rank >= 0 ? absl::StrCat("rank ", rank) : std::string("no rank"),
                   params.failed ? " with an error" : "", params.reason);
    }
    return left;
  });
}

absl::Status WorldManager::ReportTrainingDone(const std::string& worker_id, uint64_t incarnation,
                                              const std::string& summary, absl::Time now) {
  return Mutate([&](Change* change) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) -> absl::Status {
    SHARD_ASSIGN_OR_RETURN(shard::Member * member,
                           membership_.FindLive(worker_id, incarnation, options_.job));
    member->last_heartbeat = now;
    if (member->done_generation != generation_) {
      // Acknowledged once durable: a restarted coordinator must still know it.
      member->done_generation = generation_;
      membership_.Touch(worker_id);
    }
    spdlog::info("worker {} (rank {}) finished training: {}", worker_id, member->rank, summary);
    StopIfTrainingFinished(summary, now, change);
    return absl::OkStatus();
  });
}

void WorldManager::StopIfTrainingFinished(const std::string& summary, absl::Time now,
                                          Change* change) {
  if (!Trains(WorldLocked().state)) return;
  for (const std::string& id : membership_.holders()) {
    if (membership_.Find(id)->done_generation != generation_) return;
  }
  shard::Stop(membership_, JobEvent::kTrainingFinished,
              absl::StrCat("training finished (", summary, ")"), now, change);
}

std::vector<std::string> WorldManager::ExpireLeases(absl::Time now, size_t fired_at_most) {
  auto expire = [&](Change* change) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return shard::ExpireLeases(membership_, rules_, now, change);
  };
  return Mutate(expire, fired_at_most);
}

World WorldManager::Reform(const std::string& reason, absl::Time now) {
  Mutate([&](Change* change) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    change->bump = true;
    change->events.push_back(MakeEvent(v1::MEMBERSHIP_EVENT_KIND_REFORMED, "", -1, reason, now));
    spdlog::info("world re-formed at generation {}: {}", generation_ + 1, reason);
    return 0;
  });
  return world();
}

absl::Status WorldManager::SetTarget(int world_size, absl::Time now) {
  return Mutate([&](Change* change) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) -> absl::Status {
    if (membership_.stop_requested()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "job '", options_.job, "' is stopping (", membership_.stop_reason, ")"));
    }
    if (world_size < rules_.min_world_size || world_size > rules_.max_world_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "world size ", world_size, " is outside the job's range ", rules_.min_world_size, "..",
          rules_.max_world_size, " (min_world_size..world_size of the job spec)"));
    }
    if (rules_.check_size) {
      SHARD_RETURN_IF_ERROR(rules_.check_size(world_size));
    }
    if (world_size == membership_.target) return absl::OkStatus();
    const int from = membership_.target;
    membership_.target = world_size;
    change->events.push_back(MakeEvent(v1::MEMBERSHIP_EVENT_KIND_RESIZE_REQUESTED, "", -1,
                                       absl::StrCat("target world size ", from, " -> ", world_size),
                                       now));
    spdlog::info("resize requested: target world size {} -> {}", from, world_size);
    // A world that has not formed has nothing to save or pause: it takes the new size now, and
    // does not wait for joins the operator no longer asks for (simulation seed 1285).
    if (!membership_.formed) ResizeFormingWorld(membership_, world_size, now, change);
    return absl::OkStatus();
  });
}

absl::Status WorldManager::Drain(const std::string& worker_id, absl::Time now) {
  return Mutate([&](Change* change) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) -> absl::Status {
    if (membership_.stop_requested()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "job '", options_.job, "' is stopping (", membership_.stop_reason, ")"));
    }
    const shard::Member* found = membership_.Find(worker_id);
    if (found == nullptr || found->role != Role::kActive) {
      return absl::NotFoundError(absl::StrCat("worker '", worker_id,
                                              "' holds no rank in the world; 'shardctl workers' "
                                              "lists the ones that do"));
    }
    if (found->draining) return absl::OkStatus();
    const int left = membership_.ranks() - membership_.draining() - 1;
    if (left + membership_.count(Role::kStandby) < rules_.min_world_size) {
      return absl::FailedPreconditionError(absl::StrCat(
          "draining '", worker_id, "' would leave ", left, " workers and no standby to replace "
          "it; the job needs at least ", rules_.min_world_size,
          " (start a replacement worker first)"));
    }
    shard::Member& member = *membership_.Mutable(worker_id);
    member.draining = true;
    membership_.Touch(worker_id);
    change->events.push_back(MakeEvent(v1::MEMBERSHIP_EVENT_KIND_RESIZE_REQUESTED, worker_id,
                                       member.rank, "drain requested", now));
    spdlog::info("drain requested for worker {} (rank {})", worker_id, member.rank);
    return absl::OkStatus();
  });
}

std::optional<Reshape> WorldManager::PendingReshape() const {
  absl::ReaderMutexLock lock(&mu_);
  return shard::PendingReshape(membership_, rules_, generation_, WorldLocked().state);
}

absl::StatusOr<World> WorldManager::ApplyReshape(const Reshape& reshape, absl::Time now) {
  absl::Status applied = Mutate([&](Change* change) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return shard::ApplyReshape(membership_, reshape, generation_, WorldLocked().state, now,
                               change);
  });
  if (!applied.ok()) return applied;
  return world();
}

bool WorldManager::AllPausedAt(int64_t generation) const {
  absl::ReaderMutexLock lock(&mu_);
  if (generation != generation_ || !Trains(WorldLocked().state)) return false;
  for (const std::string& id : membership_.holders()) {
    if (membership_.Find(id)->paused_generation != generation) return false;
  }
  return true;
}

std::vector<v1::MembershipEvent> WorldManager::Events(int64_t after) const {
  absl::ReaderMutexLock lock(&mu_);
  return events_.After(after);
}

World WorldManager::RequestStop(const std::string& reason, absl::Time now) {
  Mutate([&](Change* change) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    shard::Stop(membership_, JobEvent::kStopRequested, reason, now, change);
    return 0;
  });
  return world();
}

bool WorldManager::BeginReshaping(int64_t generation) {
  return Mutate([&](Change*) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (generation != generation_ || WorldLocked().state != JobState::kRunning) return false;
    membership_.Advance(JobEvent::kPauseRequested);
    return true;
  });
}

absl::StatusOr<MemberRef> WorldManager::RunningMember(const std::string& worker_id,
                                                      uint64_t incarnation) {
  absl::MutexLock lock(&mu_);
  SHARD_ASSIGN_OR_RETURN(shard::Member * member, GenerationMemberLocked(worker_id, incarnation));
  const World world = WorldLocked();
  // Both mean the caller's generation is over (it learns the next one from its heartbeat).
  if (member->role != Role::kActive) {
    return absl::AbortedError(
        absl::StrCat("worker '", worker_id, "' holds no rank at generation ", world.generation,
                     " (", member->role == Role::kStandby ? "a standby" : "leaving", ")"));
  }
  if (!Trains(world.state)) {
    return absl::AbortedError(absl::StrCat(
        "the world is ", JobStateName(world.state), " at generation ", world.generation,
        "; it trains once it runs again"));
  }
  return MemberRef{worker_id, member->rank, world.generation, world.world_size};
}

StatusSnapshot WorldManager::Status(absl::Time now) const {
  absl::ReaderMutexLock lock(&mu_);
  StatusSnapshot snapshot;
  snapshot.job = options_.job;
  snapshot.world = WorldLocked();
  snapshot.world.transition = Transition(membership_, rules_, now);
  snapshot.lease = options_.lease;
  std::vector<const shard::Member*> members;
  for (const auto& [id, member] : membership_.members()) members.push_back(&member);
  auto order = [](const shard::Member* m) { return static_cast<int>(m->role); };
  std::stable_sort(members.begin(), members.end(),
                   [&](const shard::Member* a, const shard::Member* b) {
                     if (order(a) != order(b)) return order(a) < order(b);
                     if (a->role == Role::kActive) return a->rank < b->rank;
                     if (a->role == Role::kDeparted) return a->departed_at > b->departed_at;
                     return false;  // by id, as the map holds them
                   });
  for (const shard::Member* member : members) {
    WorkerSnapshot w;
    w.id = member->id;
    w.rank = member->rank;
    w.host = member->host;
    w.device = member->device;
    w.capabilities = member->capabilities;
    w.since_heartbeat = std::max(absl::ZeroDuration(), now - member->last_heartbeat);
    // A member's check from an earlier generation says nothing about this world.
    w.self_check = member->role == Role::kDeparted || member->self_check.generation == generation_
                       ? member->self_check
                       : SelfCheckRecord{SelfCheckState::kPending, generation_, ""};
    w.joined_generation = member->joined_generation;
    w.unreachable = member->unreachable;
    switch (member->role) {
      case Role::kDeparted: w.state = member->departed_state; break;
      case Role::kStandby: w.state = WorkerState::kStandby; break;
      case Role::kLeaving: w.state = WorkerState::kLeaving; break;
      case Role::kActive:
        w.state = w.self_check.state == SelfCheckState::kPassed ? WorkerState::kReady
                  : w.self_check.state == SelfCheckState::kFailed ? WorkerState::kFailed
                                                                  : WorkerState::kJoining;
        break;
    }
    snapshot.workers.push_back(std::move(w));
  }
  return snapshot;
}

v1::CoordinatorState WorldManager::Record() const {
  absl::ReaderMutexLock lock(&mu_);
  return log_.Snapshot(membership_, generation_, events_);
}

}  // namespace shard
