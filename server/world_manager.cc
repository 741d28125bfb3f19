#include "server/world_manager.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/names.h"
#include "common/logging.h"
#include "spdlog/spdlog.h"

namespace shard {

absl::string_view JobStateName(JobState state) {
  switch (state) {
    case JobState::kForming: return "forming";
    case JobState::kRunning: return "running";
    case JobState::kStopping: return "stopping";
    case JobState::kStopped: return "stopped";
  }
  return "unknown";
}

absl::string_view WorkerStateName(WorkerState state) {
  switch (state) {
    case WorkerState::kJoining: return "joining";
    case WorkerState::kReady: return "ready";
    case WorkerState::kFailed: return "failed";
    case WorkerState::kLeft: return "left";
    case WorkerState::kDead: return "dead";
  }
  return "unknown";
}

absl::string_view SelfCheckStateName(SelfCheckState state) {
  switch (state) {
    case SelfCheckState::kPending: return "pending";
    case SelfCheckState::kPassed: return "passed";
    case SelfCheckState::kFailed: return "failed";
  }
  return "unknown";
}

namespace {
constexpr char kMembershipRecord[] = "membership";
}  // namespace

absl::StatusOr<std::unique_ptr<WorldManager>> WorldManager::Create(WorldOptions options,
                                                                   StateStore* store,
                                                                   absl::Time now) {
  if (absl::Status valid = ValidateName("job name", options.job); !valid.ok()) return valid;
  if (options.expected_world_size < 1) {
    return absl::InvalidArgumentError(absl::StrCat("expected world size must be at least 1, got ",
                                                   options.expected_world_size));
  }
  if (options.lease <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("heartbeat lease must be positive");
  }
  v1::CoordinatorState state;
  absl::StatusOr<bool> loaded = store->Load(kMembershipRecord, &state);
  if (!loaded.ok()) return loaded.status();
  if (*loaded) {
    if (state.format_version() != 1) {
      return absl::FailedPreconditionError(
          absl::StrCat("the state directory's membership record has format version ",
                       state.format_version(), "; this shard-coordinator reads version 1"));
    }
    if (state.job() != options.job) {
      return absl::FailedPreconditionError(
          absl::StrCat("the state directory belongs to job '", state.job(),
                       "' but this coordinator runs job '", options.job,
                       "'; pass the matching job name or another state directory"));
    }
  } else {
    state.set_format_version(1);
    state.set_job(options.job);
  }
  auto manager =
      std::unique_ptr<WorldManager>(new WorldManager(std::move(options), store, std::move(state)));
  absl::MutexLock lock(&manager->mu_);
  // A restart starts a new generation: whatever world existed before is gone.
  const int64_t generation = manager->state_.generation() + 1;
  std::vector<v1::MembershipEvent> events;
  events.push_back(manager->MakeEvent(v1::MEMBERSHIP_EVENT_KIND_COORDINATOR_STARTED, "", -1,
                                      absl::StrCat("expecting ", manager->options_.expected_world_size,
                                                   " workers, lease ",
                                                   absl::FormatDuration(manager->options_.lease)),
                                      now));
  if (absl::Status saved = manager->PersistLocked(generation, std::move(events)); !saved.ok()) {
    return saved;
  }
  return manager;
}

WorldManager::WorldManager(WorldOptions options, StateStore* store, v1::CoordinatorState state)
    : options_(std::move(options)), store_(store), state_(std::move(state)) {
  rank_holders_.resize(options_.expected_world_size);
}

void WorldManager::set_generation_listener(std::function<void(int64_t)> listener) {
  absl::MutexLock lock(&mu_);
  generation_listener_ = std::move(listener);
}

int WorldManager::LiveCount() const {
  return static_cast<int>(
      std::count_if(rank_holders_.begin(), rank_holders_.end(),
                    [](const std::string& id) { return !id.empty(); }));
}

World WorldManager::WorldLocked() const {
  World world;
  world.generation = state_.generation();
  world.world_size = LiveCount();
  world.expected_world_size = options_.expected_world_size;
  if (stop_requested_) {
    world.state = world.world_size == 0 ? JobState::kStopped : JobState::kStopping;
  } else {
    world.state =
        world.world_size == options_.expected_world_size ? JobState::kRunning : JobState::kForming;
  }
  return world;
}

absl::StatusOr<MemberRef> WorldManager::Member(const std::string& worker_id,
                                               uint64_t incarnation) {
  absl::MutexLock lock(&mu_);
  absl::StatusOr<Worker*> worker = FindMember(worker_id, incarnation);
  if (!worker.ok()) return worker.status();
  const World world = WorldLocked();
  if (world.state != JobState::kRunning) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the world is ", JobStateName(world.state), " at generation ", world.generation,
        "; planning needs a running world"));
  }
  return MemberRef{worker_id, (*worker)->rank, world.generation, world.world_size};
}

World WorldManager::world() const {
  absl::ReaderMutexLock lock(&mu_);
  return WorldLocked();
}

v1::MembershipEvent WorldManager::MakeEvent(v1::MembershipEventKind kind,
                                            const std::string& worker_id, int rank,
                                            std::string detail, absl::Time now) const {
  v1::MembershipEvent event;
  event.set_unix_ms(absl::ToUnixMillis(now));
  event.set_kind(kind);
  event.set_worker_id(worker_id);
  event.set_rank(rank);
  event.set_detail(std::move(detail));
  return event;
}

void WorldManager::MaybeFormedEvent(int members, absl::Time now,
                                    std::vector<v1::MembershipEvent>* events) const {
  if (members == options_.expected_world_size) {
    events->push_back(MakeEvent(v1::MEMBERSHIP_EVENT_KIND_WORLD_FORMED, "", -1,
                                absl::StrCat(members, " workers"), now));
  }
}

absl::Status WorldManager::PersistLocked(int64_t next_generation,
                                         std::vector<v1::MembershipEvent> events) {
  v1::CoordinatorState next = state_;
  next.set_generation(next_generation);
  for (v1::MembershipEvent& event : events) {
    event.set_generation(next_generation);
    *next.add_events() = std::move(event);
  }
  const int excess = next.events_size() - static_cast<int>(options_.max_events);
  if (excess > 0) next.mutable_events()->DeleteSubrange(0, excess);
  if (absl::Status saved = store_->Save(kMembershipRecord, next); !saved.ok()) {
    return absl::UnavailableError(absl::StrCat(
        "the coordinator cannot record the membership change in its state directory (",
        saved.message(), "); nothing was changed, retry once the disk is writable"));
  }
  const int64_t previous = state_.generation();
  state_ = std::move(next);
  persist_pending_ = false;
  if (next_generation != previous) SetGenerationLocked(next_generation);
  return absl::OkStatus();
}

void WorldManager::PersistOrRetryLocked(int64_t next_generation,
                                        std::vector<v1::MembershipEvent> events) {
  const int64_t previous = state_.generation();
  absl::Status saved = PersistLocked(next_generation, events);
  if (saved.ok()) return;
  spdlog::error("{}; will retry", saved.message());
  // The change happens regardless (a dead worker is dead); only its record waits.
  state_.set_generation(next_generation);
  for (v1::MembershipEvent& event : events) {
    event.set_generation(next_generation);
    *state_.add_events() = std::move(event);
  }
  persist_pending_ = true;
  if (next_generation != previous) SetGenerationLocked(next_generation);
}

void WorldManager::SetGenerationLocked(int64_t generation) {
  if (generation_listener_) generation_listener_(generation);
}

std::string WorldManager::LiveHolders() const {
  std::vector<std::string> ids;
  for (const std::string& id : rank_holders_) {
    if (!id.empty()) ids.push_back(id);
  }
  if (ids.size() > 8) {
    const size_t more = ids.size() - 8;
    ids.resize(8);
    ids.push_back(absl::StrCat("and ", more, " more"));
  }
  return absl::StrJoin(ids, ", ");
}

absl::StatusOr<int> WorldManager::ChooseRank(const JoinParams& params,
                                             const Worker* existing) const {
  const int world_size = options_.expected_world_size;
  if (params.requested_rank.has_value()) {
    const int rank = *params.requested_rank;
    if (rank < 0 || rank >= world_size) {
      return absl::InvalidArgumentError(absl::StrCat("requested rank ", rank,
                                                     " is outside the world: ranks are 0..",
                                                     world_size - 1));
    }
    const std::string& holder = rank_holders_[rank];
    if (!holder.empty() && holder != params.worker_id) {
      const Worker& other = workers_.at(holder);
      return absl::AlreadyExistsError(absl::StrCat(
          "rank ", rank, " is held by live worker '", holder, "' (host ", other.host,
          "); pick a free rank or leave the rank unset"));
    }
    if (existing != nullptr && existing->rank >= 0 && existing->rank != rank) {
      return absl::FailedPreconditionError(
          absl::StrCat("worker '", params.worker_id, "' already holds rank ", existing->rank,
                       "; it cannot also take rank ", rank));
    }
    return rank;
  }
  if (existing != nullptr && existing->rank >= 0) return existing->rank;
  if (existing != nullptr && existing->last_rank >= 0 &&
      rank_holders_[existing->last_rank].empty()) {
    return existing->last_rank;
  }
  for (int rank = 0; rank < world_size; ++rank) {
    if (rank_holders_[rank].empty()) return rank;
  }
  return absl::ResourceExhaustedError(absl::StrCat(
      "the world is full: all ", world_size, " ranks are held by live workers (", LiveHolders(),
      "); wait for one to leave or die, or run the job with a larger world size"));
}

absl::StatusOr<JoinOutcome> WorldManager::JoinLocked(const JoinParams& params, absl::Time now) {
  if (absl::Status valid = ValidateName("worker id", params.worker_id); !valid.ok()) return valid;
  if (params.host.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("worker '", params.worker_id, "' gave no host for its data path"));
  }
  if (stop_requested_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job '", options_.job, "' is stopping (", stop_reason_, "); it accepts no workers"));
  }
  auto it = workers_.find(params.worker_id);
  Worker* existing = it == workers_.end() ? nullptr : &it->second;
  const bool member = existing != nullptr && existing->rank >= 0;
  if (member && existing->incarnation == params.incarnation) {
    // A retried join: answer as before.
    if (params.requested_rank.has_value() && *params.requested_rank != existing->rank) {
      return absl::FailedPreconditionError(
          absl::StrCat("worker '", params.worker_id, "' already holds rank ", existing->rank,
                       "; it cannot also take rank ", *params.requested_rank));
    }
    existing->last_heartbeat = now;
    return JoinOutcome{existing->rank, WorldLocked()};
  }
  absl::StatusOr<int> rank = ChooseRank(params, existing);
  if (!rank.ok()) return rank.status();

  const int64_t next_generation = state_.generation() + 1;
  const int members_after = LiveCount() + (member ? 0 : 1);
  std::vector<v1::MembershipEvent> events;
  events.push_back(MakeEvent(
      member ? v1::MEMBERSHIP_EVENT_KIND_RESTARTED : v1::MEMBERSHIP_EVENT_KIND_JOINED,
      params.worker_id, *rank, absl::StrCat("host ", params.host, ", device ", params.device),
      now));
  MaybeFormedEvent(members_after, now, &events);
  if (absl::Status saved = PersistLocked(next_generation, std::move(events)); !saved.ok()) {
    return saved;
  }

  Worker& worker = workers_[params.worker_id];
  worker.id = params.worker_id;
  worker.incarnation = params.incarnation;
  worker.rank = *rank;
  worker.last_rank = *rank;
  worker.host = params.host;
  worker.device = params.device;
  worker.capabilities = params.capabilities;
  worker.last_heartbeat = now;
  worker.self_check = SelfCheckRecord{};
  worker.joined_generation = next_generation;
  worker.departed_detail.clear();
  rank_holders_[*rank] = params.worker_id;
  spdlog::info("worker {} {} rank {} (host {}, device {}); generation {}, {}/{} live",
               params.worker_id, member ? "restarted with" : "joined as", *rank, params.host,
               params.device, next_generation, members_after, options_.expected_world_size);
  return JoinOutcome{*rank, WorldLocked()};
}

absl::StatusOr<WorldManager::Worker*> WorldManager::FindMember(const std::string& worker_id,
                                                               uint64_t incarnation) {
  auto it = workers_.find(worker_id);
  if (it == workers_.end()) {
    return absl::NotFoundError(
        absl::StrCat("worker '", worker_id, "' is not a member of job '", options_.job,
                     "'; join first"));
  }
  Worker& worker = it->second;
  if (worker.rank < 0) {
    return absl::NotFoundError(
        absl::StrCat("worker '", worker_id, "' is no longer a member (",
                     WorkerStateName(worker.departed_state), ": ", worker.departed_detail,
                     "); join again"));
  }
  if (worker.incarnation != incarnation) {
    return absl::FailedPreconditionError(absl::StrCat(
        "worker '", worker_id, "' has been taken over by a newer process (incarnation ",
        worker.incarnation, ", this one is ", incarnation, "); this process must exit"));
  }
  return &worker;
}

absl::StatusOr<HeartbeatOutcome> WorldManager::OutcomeLocked(const std::string& worker_id) const {
  auto it = workers_.find(worker_id);
  if (it == workers_.end() || it->second.rank < 0) {
    const std::string why = it == workers_.end()
                                ? std::string("unknown")
                                : absl::StrCat(WorkerStateName(it->second.departed_state), ": ",
                                               it->second.departed_detail);
    return absl::NotFoundError(absl::StrCat("worker '", worker_id, "' is no longer a member (",
                                            why, "); join again"));
  }
  HeartbeatOutcome outcome;
  outcome.world = WorldLocked();
  outcome.rank = it->second.rank;
  outcome.stop = stop_requested_;
  outcome.stop_reason = stop_reason_;
  return outcome;
}

absl::StatusOr<HeartbeatOutcome> WorldManager::HeartbeatLocked(const std::string& worker_id,
                                                               uint64_t incarnation,
                                                               absl::Time now) {
  absl::StatusOr<Worker*> worker = FindMember(worker_id, incarnation);
  if (!worker.ok()) return worker.status();
  (*worker)->last_heartbeat = now;
  return OutcomeLocked(worker_id);
}

absl::StatusOr<HeartbeatOutcome> WorldManager::Heartbeat(const std::string& worker_id,
                                                         uint64_t incarnation, absl::Time now) {
  absl::MutexLock lock(&mu_);
  return HeartbeatLocked(worker_id, incarnation, now);
}

void WorldManager::WatchHeartbeat(const HeartbeatParams& params, absl::Time now,
                                  HeartbeatCallback done) {
  absl::StatusOr<HeartbeatOutcome> outcome;
  {
    absl::MutexLock lock(&mu_);
    outcome = HeartbeatLocked(params.worker_id, params.incarnation, now);
    const absl::Duration wait = std::min(params.wait, options_.lease / 4);
    if (outcome.ok() && wait > absl::ZeroDuration() &&
        !WatchFires(params.known_generation, params.known_state, /*member=*/true)) {
      watches_.push_back(Watch{params.worker_id, params.known_generation, params.known_state,
                               now + wait, std::move(done)});
      return;
    }
  }
  done(std::move(outcome));
}

bool WorldManager::WatchFires(int64_t known_generation, JobState known_state,
                              bool member) const {
  const World world = WorldLocked();
  // While the world is forming, joins bump the generation without concerning anyone: waking
  // every waiting worker on each join would cost O(W^2) replies to form a world of W.
  return !member || stop_requested_ || world.state != known_state ||
         (world.state == JobState::kRunning && world.generation != known_generation);
}

std::vector<WorldManager::Answer> WorldManager::TakeChangedWatchesLocked() {
  std::vector<Answer> answers;
  for (size_t i = 0; i < watches_.size();) {
    Watch& watch = watches_[i];
    auto it = workers_.find(watch.worker_id);
    const bool member = it != workers_.end() && it->second.rank >= 0;
    if (!WatchFires(watch.known_generation, watch.known_state, member)) {
      ++i;
      continue;
    }
    answers.push_back(Answer{std::move(watch.done), OutcomeLocked(watch.worker_id)});
    watches_[i] = std::move(watches_.back());
    watches_.pop_back();
  }
  return answers;
}

void WorldManager::Deliver(std::vector<Answer> answers) {
  for (Answer& answer : answers) answer.done(std::move(answer.outcome));
}

void WorldManager::ExpireWatches(absl::Time now) {
  std::vector<Answer> answers;
  {
    absl::MutexLock lock(&mu_);
    for (size_t i = 0; i < watches_.size();) {
      if (watches_[i].deadline > now) {
        ++i;
        continue;
      }
      answers.push_back(Answer{std::move(watches_[i].done), OutcomeLocked(watches_[i].worker_id)});
      watches_[i] = std::move(watches_.back());
      watches_.pop_back();
    }
  }
  Deliver(std::move(answers));
}

void WorldManager::WakeWatches() {
  std::vector<Answer> answers;
  {
    absl::MutexLock lock(&mu_);
    for (Watch& watch : watches_) {
      answers.push_back(Answer{std::move(watch.done), OutcomeLocked(watch.worker_id)});
    }
    watches_.clear();
  }
  Deliver(std::move(answers));
}

void WorldManager::CloseWatches(const absl::Status& reason) {
  std::vector<Watch> closed;
  {
    absl::MutexLock lock(&mu_);
    closed.swap(watches_);
  }
  for (Watch& watch : closed) watch.done(reason);
}

absl::Status WorldManager::ReportSelfCheck(const std::string& worker_id, uint64_t incarnation,
                                           int64_t generation, bool passed,
                                           const std::string& detail, absl::Time now) {
  absl::MutexLock lock(&mu_);
  absl::StatusOr<Worker*> worker = FindMember(worker_id, incarnation);
  if (!worker.ok()) return worker.status();
  if (generation != state_.generation()) {
    return absl::AbortedError(absl::StrCat("self-check was run at generation ", generation,
                                           " but the world is at generation ",
                                           state_.generation(), "; check again"));
  }
  (*worker)->last_heartbeat = now;
  (*worker)->self_check =
      SelfCheckRecord{passed ? SelfCheckState::kPassed : SelfCheckState::kFailed, generation,
                      detail};
  if (passed) {
    spdlog::info("worker {} (rank {}) passed its self-check at generation {}: {}", worker_id,
                 (*worker)->rank, generation, detail);
  } else {
    spdlog::error("worker {} (rank {}) failed its self-check at generation {}: {}", worker_id,
                  (*worker)->rank, generation, detail);
  }
  return absl::OkStatus();
}

absl::Status WorldManager::LeaveLocked(const std::string& worker_id, uint64_t incarnation,
                                 const std::string& reason, absl::Time now) {
  auto it = workers_.find(worker_id);
  if (it != workers_.end() && it->second.rank < 0 && it->second.incarnation == incarnation) {
    return absl::OkStatus();  // a retried leave
  }
  absl::StatusOr<Worker*> found = FindMember(worker_id, incarnation);
  if (!found.ok()) return found.status();
  Worker& worker = **found;
  const int64_t next_generation = state_.generation() + (stop_requested_ ? 0 : 1);
  std::vector<v1::MembershipEvent> events;
  events.push_back(
      MakeEvent(v1::MEMBERSHIP_EVENT_KIND_LEFT, worker_id, worker.rank, reason, now));
  if (stop_requested_ && LiveCount() == 1) {
    events.push_back(MakeEvent(v1::MEMBERSHIP_EVENT_KIND_STOPPED, "", -1, stop_reason_, now));
  }
  if (absl::Status saved = PersistLocked(next_generation, std::move(events)); !saved.ok()) {
    return saved;
  }
  spdlog::info("worker {} (rank {}) left: {}; generation {}", worker_id, worker.rank, reason,
               next_generation);
  rank_holders_[worker.rank] = "";
  worker.rank = -1;
  worker.departed_state = WorkerState::kLeft;
  worker.departed_at = now;
  worker.departed_detail = reason.empty() ? "left" : reason;
  PruneDepartedLocked();
  return absl::OkStatus();
}

std::vector<std::string> WorldManager::ExpireLeasesLocked(absl::Time now) {
  std::vector<std::string> dead;
  std::vector<v1::MembershipEvent> events;
  for (int rank = 0; rank < static_cast<int>(rank_holders_.size()); ++rank) {
    if (rank_holders_[rank].empty()) continue;
    Worker& worker = workers_.at(rank_holders_[rank]);
    const absl::Duration silent = now - worker.last_heartbeat;
    if (silent <= options_.lease) continue;
    const std::string detail =
        absl::StrCat("no heartbeat for ", absl::FormatDuration(absl::Trunc(silent, absl::Milliseconds(1))),
                     " (lease ", absl::FormatDuration(options_.lease), ")");
    events.push_back(MakeEvent(v1::MEMBERSHIP_EVENT_KIND_DEAD, worker.id, rank, detail, now));
    spdlog::warn("worker {} (rank {}) declared dead: {}", worker.id, rank, detail);
    rank_holders_[rank] = "";
    worker.rank = -1;
    worker.departed_state = WorkerState::kDead;
    worker.departed_at = now;
    worker.departed_detail = detail;
    dead.push_back(worker.id);
  }
  if (!dead.empty()) {
    if (stop_requested_ && LiveCount() == 0) {
      events.push_back(MakeEvent(v1::MEMBERSHIP_EVENT_KIND_STOPPED, "", -1, stop_reason_, now));
    }
    const int64_t next_generation = state_.generation() + (stop_requested_ ? 0 : 1);
    PersistOrRetryLocked(next_generation, std::move(events));
    PruneDepartedLocked();
  } else if (persist_pending_) {
    PersistOrRetryLocked(state_.generation(), {});
  }
  return dead;
}

World WorldManager::RequestStopLocked(const std::string& reason, absl::Time now) {
  if (!stop_requested_) {
    stop_requested_ = true;
    stop_reason_ = reason.empty() ? "stop requested" : reason;
    std::vector<v1::MembershipEvent> events;
    events.push_back(
        MakeEvent(v1::MEMBERSHIP_EVENT_KIND_STOP_REQUESTED, "", -1, stop_reason_, now));
    if (LiveCount() == 0) {
      events.push_back(MakeEvent(v1::MEMBERSHIP_EVENT_KIND_STOPPED, "", -1, stop_reason_, now));
    }
    PersistOrRetryLocked(state_.generation(), std::move(events));
    spdlog::info("stop requested ({}); {} live workers will be told to leave", stop_reason_,
                 LiveCount());
  }
  return WorldLocked();
}

absl::StatusOr<JoinOutcome> WorldManager::Join(const JoinParams& params, absl::Time now) {
  return Mutate([&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return JoinLocked(params, now); });
}

absl::Status WorldManager::Leave(const std::string& worker_id, uint64_t incarnation,
                                 const std::string& reason, absl::Time now) {
  return Mutate([&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return LeaveLocked(worker_id, incarnation, reason, now); });
}

std::vector<std::string> WorldManager::ExpireLeases(absl::Time now) {
  return Mutate([&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return ExpireLeasesLocked(now); });
}

World WorldManager::RequestStop(const std::string& reason, absl::Time now) {
  return Mutate([&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return RequestStopLocked(reason, now); });
}

absl::Status WorldManager::ReportTrainingDoneLocked(const std::string& worker_id,
                                                    uint64_t incarnation,
                                                    const std::string& summary, absl::Time now) {
  absl::StatusOr<Worker*> worker = FindMember(worker_id, incarnation);
  if (!worker.ok()) return worker.status();
  (*worker)->last_heartbeat = now;
  (*worker)->done_generation = state_.generation();
  spdlog::info("worker {} (rank {}) finished training: {}", worker_id, (*worker)->rank, summary);
  for (const std::string& id : rank_holders_) {
    if (id.empty() || workers_.at(id).done_generation != state_.generation()) {
      return absl::OkStatus();
    }
  }
  if (WorldLocked().state == JobState::kRunning) {
    RequestStopLocked(absl::StrCat("training finished (", summary, ")"), now);
  }
  return absl::OkStatus();
}

World WorldManager::ReformLocked(const std::string& reason, absl::Time now) {
  std::vector<v1::MembershipEvent> events;
  events.push_back(MakeEvent(v1::MEMBERSHIP_EVENT_KIND_REFORMED, "", -1, reason, now));
  PersistOrRetryLocked(state_.generation() + 1, std::move(events));
  spdlog::info("world re-formed at generation {}: {}", state_.generation(), reason);
  return WorldLocked();
}

World WorldManager::Reform(const std::string& reason, absl::Time now) {
  return Mutate([&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return ReformLocked(reason, now); });
}

absl::Status WorldManager::ReportTrainingDone(const std::string& worker_id, uint64_t incarnation,
                                              const std::string& summary, absl::Time now) {
  return Mutate([&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return ReportTrainingDoneLocked(worker_id, incarnation, summary, now); });
}

void WorldManager::PruneDepartedLocked() {
  std::vector<std::pair<absl::Time, std::string>> departed;
  for (const auto& [id, worker] : workers_) {
    if (worker.rank < 0) departed.emplace_back(worker.departed_at, id);
  }
  if (departed.size() <= options_.max_departed_records) return;
  std::sort(departed.begin(), departed.end());
  const size_t excess = departed.size() - options_.max_departed_records;
  for (size_t i = 0; i < excess; ++i) workers_.erase(departed[i].second);
}

StatusSnapshot WorldManager::Status(absl::Time now) const {
  absl::ReaderMutexLock lock(&mu_);
  StatusSnapshot snapshot;
  snapshot.job = options_.job;
  snapshot.world = WorldLocked();
  snapshot.lease = options_.lease;
  std::vector<const Worker*> members;
  std::vector<const Worker*> departed;
  for (const auto& [id, worker] : workers_) {
    (worker.rank >= 0 ? members : departed).push_back(&worker);
  }
  std::sort(members.begin(), members.end(),
            [](const Worker* a, const Worker* b) { return a->rank < b->rank; });
  std::sort(departed.begin(), departed.end(), [](const Worker* a, const Worker* b) {
    return a->departed_at != b->departed_at ? a->departed_at > b->departed_at : a->id < b->id;
  });
  for (const auto* group : {&members, &departed}) {
    for (const Worker* worker : *group) {
      WorkerSnapshot w;
      w.id = worker->id;
      w.rank = worker->rank;
      w.host = worker->host;
      w.device = worker->device;
      w.capabilities = worker->capabilities;
      w.since_heartbeat = now - worker->last_heartbeat;
      // A member's check from an earlier generation says nothing about this world.
      w.self_check = worker->rank < 0 || worker->self_check.generation == state_.generation()
                         ? worker->self_check
                         : SelfCheckRecord{SelfCheckState::kPending, state_.generation(), ""};
      w.joined_generation = worker->joined_generation;
      if (worker->rank < 0) {
        w.state = worker->departed_state;
      } else {
        w.state = w.self_check.state == SelfCheckState::kPassed ? WorkerState::kReady
                  : worker->self_check.state == SelfCheckState::kFailed ? WorkerState::kFailed
                                                                        : WorkerState::kJoining;
      }
      snapshot.workers.push_back(std::move(w));
    }
  }
  return snapshot;
}

}  // namespace shard
