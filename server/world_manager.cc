#include "server/world_manager.h"

#include <algorithm>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/logging.h"
#include "common/names.h"
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
    case WorkerState::kStandby: return "standby";
    case WorkerState::kLeaving: return "leaving";
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

std::string Seconds(absl::Duration d) {
  return absl::FormatDuration(absl::Trunc(d, absl::Milliseconds(100)));
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
    if (absl::Status valid = ValidateName("capability", capability); !valid.ok()) return valid;
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<WorldManager>> WorldManager::Create(WorldOptions options,
                                                                   StateStore* store,
                                                                   absl::Time now) {
  if (absl::Status valid = ValidateName("job name", options.job); !valid.ok()) return valid;
  if (options.expected_world_size < 1) {
    return absl::InvalidArgumentError(absl::StrCat("expected world size must be at least 1, got ",
                                                   options.expected_world_size));
  }
  if (options.min_world_size < 0 || options.min_world_size > options.expected_world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("min world size ", options.min_world_size, " must be between 1 and the world ",
                     "size ", options.expected_world_size));
  }
  if (options.lease <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("heartbeat lease must be positive");
  }
  if (options.reform_grace < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("the re-form grace period cannot be negative");
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
  const int64_t saved_generation = manager->state_.generation();
  if (manager->options_.recover && manager->RecoverLocked(now)) {
    manager->recovered_ = true;
    manager->kept_generation_ = manager->state_.generation() == saved_generation;
  } else {
    // A new world: whatever existed before is gone, and its generation numbers stay used.
    const Membership before = manager->m_;
    manager->m_.target = manager->options_.expected_world_size;
    manager->m_.rank_holders.assign(manager->m_.target, "");
    std::vector<v1::MembershipEvent> events;
    events.push_back(manager->MakeEvent(
        v1::MEMBERSHIP_EVENT_KIND_COORDINATOR_STARTED, "", -1,
        absl::StrCat("expecting ", manager->m_.target, " workers (at least ",
                     manager->min_world_size_, " to re-form), lease ",
                     absl::FormatDuration(manager->options_.lease)),
        now));
    if (absl::Status saved = manager->PersistLocked(manager->state_.generation() + 1,
                                                    std::move(events), before);
        !saved.ok()) {
      return saved;
    }
  }
  return manager;
}

absl::StatusOr<bool> WorldManager::HasLiveWorld(StateStore* store) {
  v1::CoordinatorState state;
  absl::StatusOr<bool> loaded = store->Load(kMembershipRecord, &state);
  if (!loaded.ok()) return loaded.status();
  return *loaded && !state.stop_requested() && !state.members().empty();
}

WorldManager::WorldManager(WorldOptions options, StateStore* store, v1::CoordinatorState state)
    : options_(std::move(options)),
      min_world_size_(options_.min_world_size > 0 ? options_.min_world_size
                                                  : options_.expected_world_size),
      store_(store),
      state_(std::move(state)) {}

bool WorldManager::RecoverLocked(absl::Time now) {
  if (state_.stop_requested() || state_.members().empty()) return false;
  m_.target = state_.target_world_size() > 0 ? state_.target_world_size()
                                             : options_.expected_world_size;
  m_.formed = state_.formed();
  m_.rank_holders.assign(m_.formed ? state_.ranks() : m_.target, "");
  m_.connected_generation = state_.connected_generation();
  for (const v1::MemberRecord& record : state_.members()) {
    Worker& worker = m_.workers[record.id()];
    worker.id = record.id();
    worker.incarnation = record.incarnation();
    worker.host = record.host();
    worker.device = record.device();
    worker.capabilities.assign(record.capabilities().begin(), record.capabilities().end());
    worker.joined_generation = record.joined_generation();
    worker.draining = record.draining();
    worker.detail = record.leave_reason();
    // Every worker gets two leases to reach the new process: it may be backing off.
    worker.last_heartbeat = now + options_.lease;
    worker.standby_since = now;
    const int rank = record.rank();
    if (record.role() == v1::MEMBER_ROLE_ACTIVE && rank >= 0 &&
        rank < static_cast<int>(m_.rank_holders.size()) && m_.rank_holders[rank].empty()) {
      worker.role = Role::kActive;
      worker.rank = rank;
      worker.last_rank = rank;
      m_.rank_holders[rank] = worker.id;
    } else {
      worker.role = record.role() == v1::MEMBER_ROLE_LEAVING ? Role::kLeaving : Role::kStandby;
    }
  }
  const int held = HeldRanks();
  const bool complete = held == static_cast<int>(m_.rank_holders.size());
  // An intact world that had connected keeps its generation: its data path never depended on
  // the coordinator, so training goes on. Anything else reconnects at a new generation.
  const bool keep = complete && m_.connected_generation == state_.generation();
  if (!complete && m_.formed) m_.free_rank_since = now;
  const int64_t generation = state_.generation() + (keep ? 0 : 1);
  std::vector<v1::MembershipEvent> events;
  events.push_back(MakeEvent(
      v1::MEMBERSHIP_EVENT_KIND_COORDINATOR_RECOVERED, "", -1,
      absl::StrCat("took back ", held, " of ", m_.rank_holders.size(), " ranks and ",
                   CountRole(Role::kStandby), " standbys; ",
                   keep ? "generation kept: training continues"
                        : "new generation: the workers reconnect"),
      now));
  PersistOrRetryLocked(generation, std::move(events));
  spdlog::info("recovered job '{}' from the state directory: {} of {} ranks held, {} standbys, "
               "generation {} ({})",
               options_.job, held, m_.rank_holders.size(), CountRole(Role::kStandby),
               state_.generation(), keep ? "kept" : "new");
  return true;
}

void WorldManager::set_generation_listener(std::function<void(int64_t)> listener) {
  absl::MutexLock lock(&mu_);
  generation_listener_ = std::move(listener);
}

int WorldManager::CountRole(Role role) const {
  return static_cast<int>(std::count_if(m_.workers.begin(), m_.workers.end(),
                                        [role](const auto& entry) { return entry.second.role == role; }));
}

int WorldManager::HeldRanks() const {
  return static_cast<int>(std::count_if(m_.rank_holders.begin(), m_.rank_holders.end(),
                                        [](const std::string& id) { return !id.empty(); }));
}

World WorldManager::WorldLocked() const {
  World world;
  world.generation = state_.generation();
  world.ranks = static_cast<int>(m_.rank_holders.size());
  world.world_size = HeldRanks();
  world.expected_world_size = m_.target;
  world.min_world_size = min_world_size_;
  world.standby = CountRole(Role::kStandby);
  if (m_.stop_requested) {
    const int live = world.world_size + world.standby + CountRole(Role::kLeaving);
    world.state = live == 0 ? JobState::kStopped : JobState::kStopping;
  } else {
    world.state = world.ranks > 0 && world.world_size == world.ranks ? JobState::kRunning
                                                                     : JobState::kForming;
  }
  return world;
}

std::string WorldManager::TransitionLocked(absl::Time now) const {
  if (m_.stop_requested) return "";
  const int ranks = static_cast<int>(m_.rank_holders.size());
  const int held = HeldRanks();
  if (held < ranks) {
    if (!m_.formed) {
      return absl::StrCat("forming: waiting for ", ranks - held, " more of ", ranks, " workers");
    }
    std::vector<int> free;
    for (int rank = 0; rank < ranks; ++rank) {
      if (m_.rank_holders[rank].empty()) free.push_back(rank);
    }
    const std::string lost = absl::StrCat(free.size() == 1 ? "rank " : "ranks ",
                                          absl::StrJoin(free, ","), " lost ",
                                          free.size() == 1 ? "its worker" : "their workers");
    if (held >= min_world_size_ && m_.free_rank_since.has_value()) {
      const absl::Duration left =
          std::max(absl::ZeroDuration(), *m_.free_rank_since + options_.reform_grace - now);
      return absl::StrCat(lost, ": waiting ", Seconds(left),
                          " more for a replacement, then re-forming with the ", held,
                          " survivors");
    }
    return absl::StrCat(lost, ": waiting for ", min_world_size_ - held,
                        " more workers (the job needs at least ", min_world_size_, ")");
  }
  const int standby = CountRole(Role::kStandby);
  int draining = 0;
  for (const std::string& id : m_.rank_holders) draining += m_.workers.at(id).draining ? 1 : 0;
  if (ranks != m_.target || draining > 0 || (standby > 0 && ranks < m_.target)) {
    return absl::StrCat("re-forming from ", ranks, " to ", m_.target, " workers",
                        draining > 0 ? absl::StrCat(" (", draining, " draining)") : "",
                        " at the next checkpoint boundary",
                        ranks < m_.target && standby == 0 ? "; waiting for workers to join" : "");
  }
  return "";
}

absl::StatusOr<MemberRef> WorldManager::Member(const std::string& worker_id,
                                               uint64_t incarnation) {
  absl::MutexLock lock(&mu_);
  absl::StatusOr<Worker*> worker = FindMember(worker_id, incarnation);
  if (!worker.ok()) return worker.status();
  const World world = WorldLocked();
  if ((*worker)->role != Role::kActive) {
    return absl::FailedPreconditionError(absl::StrCat(
        "worker '", worker_id, "' holds no rank at generation ", world.generation, " (",
        (*worker)->role == Role::kStandby ? "a standby" : "leaving", ")"));
  }
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

void WorldManager::MarkFormedIfComplete(absl::Time now, std::vector<v1::MembershipEvent>* events) {
  const int ranks = static_cast<int>(m_.rank_holders.size());
  if (HeldRanks() != ranks) return;
  m_.formed = true;
  m_.free_rank_since.reset();
  events->push_back(MakeEvent(v1::MEMBERSHIP_EVENT_KIND_WORLD_FORMED, "", -1,
                              absl::StrCat(ranks, " workers"), now));
}

v1::CoordinatorState WorldManager::RecordLocked(int64_t next_generation,
                                                std::vector<v1::MembershipEvent> events) const {
  v1::CoordinatorState next = state_;
  next.set_generation(next_generation);
  int64_t sequence = next.last_event_sequence();
  for (v1::MembershipEvent& event : events) {
    event.set_generation(next_generation);
    event.set_sequence(++sequence);
    *next.add_events() = std::move(event);
  }
  next.set_last_event_sequence(sequence);
  const int excess = next.events_size() - static_cast<int>(options_.max_events);
  if (excess > 0) next.mutable_events()->DeleteSubrange(0, excess);
  next.clear_members();
  std::vector<const Worker*> live;
  for (const auto& [id, worker] : m_.workers) {
    if (worker.role != Role::kDeparted) live.push_back(&worker);
  }
  std::sort(live.begin(), live.end(), [](const Worker* a, const Worker* b) { return a->id < b->id; });
  for (const Worker* worker : live) {
    v1::MemberRecord* record = next.add_members();
    record->set_id(worker->id);
    record->set_incarnation(worker->incarnation);
    record->set_rank(worker->rank);
    record->set_host(worker->host);
    record->set_device(worker->device);
    for (const std::string& capability : worker->capabilities) record->add_capabilities(capability);
    record->set_joined_generation(worker->joined_generation);
    record->set_role(worker->role == Role::kActive    ? v1::MEMBER_ROLE_ACTIVE
                     : worker->role == Role::kStandby ? v1::MEMBER_ROLE_STANDBY
                                                      : v1::MEMBER_ROLE_LEAVING);
    record->set_draining(worker->draining);
    if (worker->role == Role::kLeaving) record->set_leave_reason(worker->detail);
  }
  next.set_ranks(static_cast<int>(m_.rank_holders.size()));
  next.set_target_world_size(m_.target);
  next.set_formed(m_.formed);
  next.set_connected_generation(m_.connected_generation);
  next.set_stop_requested(m_.stop_requested);
  next.set_stop_reason(m_.stop_reason);
  return next;
}

void WorldManager::CommitRecordLocked(v1::CoordinatorState record) {
  const int64_t previous = state_.generation();
  state_ = std::move(record);
  if (state_.generation() != previous && generation_listener_) {
    generation_listener_(state_.generation());
  }
}

absl::Status WorldManager::PersistLocked(int64_t next_generation,
                                         std::vector<v1::MembershipEvent> events,
                                         const Membership& before) {
  v1::CoordinatorState next = RecordLocked(next_generation, std::move(events));
  if (absl::Status saved = store_->Save(kMembershipRecord, next); !saved.ok()) {
    m_ = before;
    return absl::UnavailableError(absl::StrCat(
        "the coordinator cannot record the membership change in its state directory (",
        saved.message(), "); nothing was changed, retry once the disk is writable"));
  }
  persist_pending_ = false;
  CommitRecordLocked(std::move(next));
  return absl::OkStatus();
}

void WorldManager::PersistOrRetryLocked(int64_t next_generation,
                                        std::vector<v1::MembershipEvent> events) {
  v1::CoordinatorState next = RecordLocked(next_generation, std::move(events));
  if (absl::Status saved = store_->Save(kMembershipRecord, next); !saved.ok()) {
    // The change happens regardless (a dead worker is dead); only its record waits.
    spdlog::error("the coordinator cannot record the membership change in its state directory "
                  "({}); will retry",
                  saved.message());
    persist_pending_ = true;
  } else {
    persist_pending_ = false;
  }
  CommitRecordLocked(std::move(next));
}

std::string WorldManager::LiveHolders() const {
  std::vector<std::string> ids;
  for (const std::string& id : m_.rank_holders) {
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
  const int ranks = static_cast<int>(m_.rank_holders.size());
  if (params.requested_rank.has_value()) {
    const int rank = *params.requested_rank;
    if (rank < 0 || rank >= ranks) {
      return absl::InvalidArgumentError(absl::StrCat("requested rank ", rank,
                                                     " is outside the world: ranks are 0..",
                                                     ranks - 1));
    }
    const std::string& holder = m_.rank_holders[rank];
    if (!holder.empty() && holder != params.worker_id) {
      const Worker& other = m_.workers.at(holder);
      return absl::AlreadyExistsError(absl::StrCat(
          "rank ", rank, " is held by live worker '", holder, "' (host ", other.host,
          "); pick a free rank or leave the rank unset"));
    }
    if (existing != nullptr && existing->role == Role::kActive && existing->rank != rank) {
      return absl::FailedPreconditionError(
          absl::StrCat("worker '", params.worker_id, "' already holds rank ", existing->rank,
                       "; it cannot also take rank ", rank));
    }
    return rank;
  }
  if (existing != nullptr && existing->role == Role::kActive) return existing->rank;
  if (existing != nullptr && existing->last_rank >= 0 && existing->last_rank < ranks &&
      m_.rank_holders[existing->last_rank].empty()) {
    return existing->last_rank;
  }
  for (int rank = 0; rank < ranks; ++rank) {
    if (m_.rank_holders[rank].empty()) return rank;
  }
  return -1;
}

absl::Status WorldManager::CheckBackendLocked(const JoinParams& params) const {
  if (params.capabilities.empty()) return absl::OkStatus();
  for (const auto& [id, other] : m_.workers) {
    if (id == params.worker_id || other.role == Role::kDeparted || other.role == Role::kLeaving ||
        other.capabilities.empty()) {
      continue;
    }
    const bool shared = std::any_of(
        params.capabilities.begin(), params.capabilities.end(), [&](const std::string& c) {
          return std::find(other.capabilities.begin(), other.capabilities.end(), c) !=
                 other.capabilities.end();
        });
    if (!shared) {
      // NCCL and Gloo ranks cannot form one world: connecting would time out on every attempt.
      return absl::FailedPreconditionError(absl::StrCat(
          "worker '", params.worker_id, "' (device ", params.device, ") runs the ",
          absl::StrJoin(params.capabilities, "/"), " data path, but worker '", id, "' (device ",
          other.device, ") in this job runs ", absl::StrJoin(other.capabilities, "/"),
          "; start every worker of a job with the same --backend (auto means nccl on cuda:N, "
          "gloo on cpu)"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<JoinOutcome> WorldManager::JoinLocked(const JoinParams& params, absl::Time now) {
  if (absl::Status valid = ValidateName("worker id", params.worker_id); !valid.ok()) return valid;
  if (absl::Status valid = ValidateJoinDescription(params); !valid.ok()) return valid;
  if (m_.stop_requested) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job '", options_.job, "' is stopping (", m_.stop_reason, "); it accepts no workers"));
  }
  if (absl::Status compatible = CheckBackendLocked(params); !compatible.ok()) return compatible;
  auto it = m_.workers.find(params.worker_id);
  Worker* existing = it == m_.workers.end() ? nullptr : &it->second;
  const bool live = existing != nullptr && existing->role != Role::kDeparted &&
                    existing->role != Role::kLeaving;
  if (live && existing->incarnation == params.incarnation) {
    // A retried join: answer as before.
    if (params.requested_rank.has_value() && *params.requested_rank != existing->rank) {
      return absl::FailedPreconditionError(
          absl::StrCat("worker '", params.worker_id, "' already holds rank ", existing->rank,
                       "; it cannot also take rank ", *params.requested_rank));
    }
    existing->last_heartbeat = now;
    return JoinOutcome{existing->rank, WorldLocked()};
  }
  absl::StatusOr<int> rank = ChooseRank(params, live ? existing : nullptr);
  if (!rank.ok()) return rank.status();
  const bool restart = live && existing->role == Role::kActive;
  const int ranks = static_cast<int>(m_.rank_holders.size());
  // Below the job's largest size, a worker that finds no free rank waits as a standby.
  if (*rank < 0 && !(live && existing->role == Role::kStandby) &&
      !(m_.formed && ranks + CountRole(Role::kStandby) < options_.expected_world_size)) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the world is full: all ", ranks, " ranks are held by live workers (", LiveHolders(),
        ")", CountRole(Role::kStandby) > 0 ? " and standbys wait for the rest" : "",
        " up to the job's world size ", options_.expected_world_size,
        "; wait for one to leave or die"));
  }

  const Membership before = m_;
  Worker& worker = m_.workers[params.worker_id];
  worker.id = params.worker_id;
  worker.incarnation = params.incarnation;
  worker.host = params.host;
  worker.device = params.device;
  worker.capabilities = params.capabilities;
  worker.last_heartbeat = now;
  worker.self_check = SelfCheckRecord{};
  worker.draining = false;
  worker.detail.clear();
  std::vector<v1::MembershipEvent> events;
  int64_t next_generation = state_.generation();
  const std::string where = absl::StrCat("host ", params.host, ", device ", params.device);
  if (*rank >= 0) {
    next_generation += 1;
    worker.role = Role::kActive;
    worker.rank = *rank;
    worker.last_rank = *rank;
    worker.joined_generation = next_generation;
    m_.rank_holders[*rank] = params.worker_id;
    events.push_back(MakeEvent(
        restart ? v1::MEMBERSHIP_EVENT_KIND_RESTARTED : v1::MEMBERSHIP_EVENT_KIND_JOINED,
        params.worker_id, *rank, where, now));
    MarkFormedIfComplete(now, &events);
  } else {
    // The world is whole but smaller than the job's largest: wait to be folded in.
    if (!(live && existing->role == Role::kStandby)) worker.standby_since = now;
    worker.role = Role::kStandby;
    worker.rank = -1;
    worker.joined_generation = next_generation;
    events.push_back(MakeEvent(v1::MEMBERSHIP_EVENT_KIND_STANDBY, params.worker_id, -1,
                               absl::StrCat(where, "; folded in at the next checkpoint boundary"),
                               now));
  }
  if (absl::Status saved = PersistLocked(next_generation, std::move(events), before);
      !saved.ok()) {
    return saved;
  }
  const World world = WorldLocked();
  if (*rank >= 0) {
    spdlog::info("worker {} {} rank {} ({}); generation {}, {}/{} ranks held", params.worker_id,
                 restart ? "restarted with" : "joined as", *rank, where, next_generation,
                 world.world_size, world.ranks);
  } else {
    spdlog::info("worker {} joined as a standby ({}); the world has {} ranks, target {}",
                 params.worker_id, where, world.ranks, m_.target);
  }
  return JoinOutcome{*rank, world};
}

absl::StatusOr<WorldManager::Worker*> WorldManager::FindMember(const std::string& worker_id,
                                                               uint64_t incarnation) {
  auto it = m_.workers.find(worker_id);
  if (it == m_.workers.end()) {
    return absl::NotFoundError(
        absl::StrCat("worker '", worker_id, "' is not a member of job '", options_.job,
                     "'; join first"));
  }
  Worker& worker = it->second;
  if (worker.role == Role::kDeparted) {
    return absl::NotFoundError(
        absl::StrCat("worker '", worker_id, "' is no longer a member (",
                     WorkerStateName(worker.departed_state), ": ", worker.detail,
                     "); join again"));
  }
  if (worker.incarnation != incarnation) {
    return absl::FailedPreconditionError(absl::StrCat(
        "worker '", worker_id, "' has been taken over by a newer process (incarnation ",
        worker.incarnation, ", this one is ", incarnation, "); this process must exit"));
  }
  return &worker;
}

absl::StatusOr<HeartbeatOutcome> WorldManager::OutcomeLocked(const std::string& worker_id,
                                                             const World& world) const {
  auto it = m_.workers.find(worker_id);
  if (it == m_.workers.end() || it->second.role == Role::kDeparted) {
    const std::string why = it == m_.workers.end()
                                ? std::string("unknown")
                                : absl::StrCat(WorkerStateName(it->second.departed_state), ": ",
                                               it->second.detail);
    return absl::NotFoundError(absl::StrCat("worker '", worker_id, "' is no longer a member (",
                                            why, "); join again"));
  }
  const Worker& worker = it->second;
  HeartbeatOutcome outcome;
  outcome.world = world;
  outcome.rank = worker.rank;
  if (worker.role == Role::kLeaving) {
    outcome.stop = true;
    outcome.stop_reason = worker.detail;
  } else if (m_.stop_requested) {
    outcome.stop = true;
    outcome.stop_reason = m_.stop_reason;
  }
  return outcome;
}

absl::StatusOr<HeartbeatOutcome> WorldManager::HeartbeatLocked(const std::string& worker_id,
                                                               uint64_t incarnation,
                                                               absl::Time now) {
  absl::StatusOr<Worker*> worker = FindMember(worker_id, incarnation);
  if (!worker.ok()) return worker.status();
  (*worker)->last_heartbeat = now;
  return OutcomeLocked(worker_id, WorldLocked());
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
        !WatchFires(outcome->world, params.known_generation, params.known_state,
                    &m_.workers.at(params.worker_id))) {
      watches_.push_back(Watch{params.worker_id, params.known_generation, params.known_state,
                               now + wait, std::move(done)});
      return;
    }
  }
  done(std::move(outcome));
}

bool WorldManager::WatchFires(const World& world, int64_t known_generation, JobState known_state,
                              const Worker* worker) const {
  if (worker == nullptr || worker->role == Role::kDeparted || worker->role == Role::kLeaving ||
      m_.stop_requested) {
    return true;
  }
  // While the world is forming, joins bump the generation without concerning anyone: waking
  // every waiting worker on each join would cost O(W^2) replies to form a world of W.
  return world.state != known_state ||
         (world.state == JobState::kRunning && world.generation != known_generation);
}

std::vector<WorldManager::Answer> WorldManager::TakeChangedWatchesLocked() {
  std::vector<Answer> answers;
  // Once for all watches: recomputing it per watch made every join O(W^2) while a world forms.
  const World world = WorldLocked();
  for (size_t i = 0; i < watches_.size();) {
    Watch& watch = watches_[i];
    auto it = m_.workers.find(watch.worker_id);
    const Worker* worker = it == m_.workers.end() ? nullptr : &it->second;
    if (!WatchFires(world, watch.known_generation, watch.known_state, worker)) {
      ++i;
      continue;
    }
    answers.push_back(
        Answer{std::move(watch.done), OutcomeLocked(watch.worker_id, world), {}, {}});
    watches_[i] = std::move(watches_.back());
    watches_.pop_back();
  }
  for (size_t i = 0; i < event_watches_.size();) {
    if (event_watches_[i].after >= state_.last_event_sequence()) {
      ++i;
      continue;
    }
    Answer answer;
    answer.events_done = std::move(event_watches_[i].done);
    for (const v1::MembershipEvent& event : state_.events()) {
      if (event.sequence() > event_watches_[i].after) answer.events.push_back(event);
    }
    answers.push_back(std::move(answer));
    event_watches_[i] = std::move(event_watches_.back());
    event_watches_.pop_back();
  }
  return answers;
}

void WorldManager::Deliver(std::vector<Answer> answers) {
  for (Answer& answer : answers) {
    if (answer.done) answer.done(std::move(answer.outcome));
    if (answer.events_done) answer.events_done(std::move(answer.events));
  }
}

void WorldManager::ExpireWatches(absl::Time now) {
  std::vector<Answer> answers;
  {
    absl::MutexLock lock(&mu_);
    std::optional<World> world;  // computed if a watch expires
    for (size_t i = 0; i < watches_.size();) {
      if (watches_[i].deadline > now) {
        ++i;
        continue;
      }
      if (!world.has_value()) world = WorldLocked();
      answers.push_back(Answer{std::move(watches_[i].done),
                               OutcomeLocked(watches_[i].worker_id, *world), {}, {}});
      watches_[i] = std::move(watches_.back());
      watches_.pop_back();
    }
    for (size_t i = 0; i < event_watches_.size();) {
      if (event_watches_[i].deadline > now) {
        ++i;
        continue;
      }
      Answer answer;
      answer.events_done = std::move(event_watches_[i].done);
      answers.push_back(std::move(answer));
      event_watches_[i] = std::move(event_watches_.back());
      event_watches_.pop_back();
    }
  }
  Deliver(std::move(answers));
}

void WorldManager::WakeWatches() {
  std::vector<Answer> answers;
  {
    absl::MutexLock lock(&mu_);
    const World world = WorldLocked();
    for (Watch& watch : watches_) {
      answers.push_back(
          Answer{std::move(watch.done), OutcomeLocked(watch.worker_id, world), {}, {}});
    }
    watches_.clear();
  }
  Deliver(std::move(answers));
}

void WorldManager::CloseWatches(const absl::Status& reason) {
  std::vector<Watch> closed;
  std::vector<EventWatch> closed_events;
  {
    absl::MutexLock lock(&mu_);
    closed.swap(watches_);
    closed_events.swap(event_watches_);
  }
  for (Watch& watch : closed) watch.done(reason);
  for (EventWatch& watch : closed_events) watch.done({});
}

std::vector<v1::MembershipEvent> WorldManager::Events(int64_t after) const {
  absl::ReaderMutexLock lock(&mu_);
  std::vector<v1::MembershipEvent> events;
  for (const v1::MembershipEvent& event : state_.events()) {
    if (event.sequence() > after) events.push_back(event);
  }
  return events;
}

void WorldManager::WatchEvents(int64_t after, absl::Time deadline, EventsCallback done) {
  std::vector<v1::MembershipEvent> events;
  {
    absl::MutexLock lock(&mu_);
    if (after >= state_.last_event_sequence()) {
      event_watches_.push_back(EventWatch{after, deadline, std::move(done)});
      return;
    }
    for (const v1::MembershipEvent& event : state_.events()) {
      if (event.sequence() > after) events.push_back(event);
    }
  }
  done(std::move(events));
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
  if (!passed) {
    spdlog::error("worker {} (rank {}) failed its self-check at generation {}: {}", worker_id,
                  (*worker)->rank, generation, detail);
    return absl::OkStatus();
  }
  spdlog::info("worker {} (rank {}) passed its self-check at generation {}: {}", worker_id,
               (*worker)->rank, generation, detail);
  // Once every rank has connected, a restarted coordinator can keep this generation.
  const World world = WorldLocked();
  if (world.state != JobState::kRunning || m_.connected_generation == generation) {
    return absl::OkStatus();
  }
  for (const std::string& id : m_.rank_holders) {
    const SelfCheckRecord& check = m_.workers.at(id).self_check;
    if (check.state != SelfCheckState::kPassed || check.generation != generation) {
      return absl::OkStatus();
    }
  }
  m_.connected_generation = generation;
  PersistOrRetryLocked(generation, {});
  return absl::OkStatus();
}

void WorldManager::Depart(Worker& worker, WorkerState state, std::string detail, absl::Time now) {
  if (worker.role == Role::kActive) m_.rank_holders[worker.rank] = "";
  worker.role = Role::kDeparted;
  worker.rank = -1;
  worker.draining = false;
  worker.departed_state = state;
  worker.departed_at = now;
  worker.detail = detail.empty() ? std::string(WorkerStateName(state)) : std::move(detail);
}

std::vector<WorldManager::Worker*> WorldManager::StandbysLocked() {
  std::vector<Worker*> standbys;
  for (auto& [id, worker] : m_.workers) {
    if (worker.role == Role::kStandby) standbys.push_back(&worker);
  }
  std::sort(standbys.begin(), standbys.end(), [](const Worker* a, const Worker* b) {
    return a->standby_since != b->standby_since ? a->standby_since < b->standby_since
                                                : a->id < b->id;
  });
  return standbys;
}

int WorldManager::PromoteStandbysLocked(absl::Time now, std::vector<v1::MembershipEvent>* events) {
  std::vector<Worker*> standbys = StandbysLocked();
  size_t next = 0;
  int placed = 0;
  for (int rank = 0; rank < static_cast<int>(m_.rank_holders.size()) && next < standbys.size();
       ++rank) {
    if (!m_.rank_holders[rank].empty()) continue;
    Worker& worker = *standbys[next++];
    worker.role = Role::kActive;
    worker.rank = rank;
    worker.last_rank = rank;
    worker.self_check = SelfCheckRecord{};
    m_.rank_holders[rank] = worker.id;
    events->push_back(MakeEvent(v1::MEMBERSHIP_EVENT_KIND_JOINED, worker.id, rank,
                                "a standby took the free rank", now));
    spdlog::info("standby {} takes free rank {}", worker.id, rank);
    ++placed;
  }
  return placed;
}

void WorldManager::RenumberLocked(const std::vector<Worker*>& keep, int size) {
  m_.rank_holders.assign(size, "");
  std::vector<Worker*> moving;
  for (Worker* worker : keep) {
    if (worker->rank >= 0 && worker->rank < size && m_.rank_holders[worker->rank].empty()) {
      m_.rank_holders[worker->rank] = worker->id;
    } else {
      moving.push_back(worker);
    }
  }
  int rank = 0;
  for (Worker* worker : moving) {
    while (!m_.rank_holders[rank].empty()) ++rank;
    worker->rank = rank;
    m_.rank_holders[rank] = worker->id;
  }
  for (Worker* worker : keep) {
    worker->role = Role::kActive;
    worker->last_rank = worker->rank;
  }
}

absl::Status WorldManager::LeaveLocked(const std::string& worker_id, uint64_t incarnation,
                                       const std::string& reason, absl::Time now) {
  auto it = m_.workers.find(worker_id);
  if (it != m_.workers.end() && it->second.role == Role::kDeparted &&
      it->second.incarnation == incarnation) {
    return absl::OkStatus();  // a retried leave
  }
  absl::StatusOr<Worker*> found = FindMember(worker_id, incarnation);
  if (!found.ok()) return found.status();
  Worker& worker = **found;
  const Membership before = m_;
  const bool held_rank = worker.role == Role::kActive;
  const int rank = worker.rank;
  std::vector<v1::MembershipEvent> events;
  events.push_back(MakeEvent(v1::MEMBERSHIP_EVENT_KIND_LEFT, worker_id, rank, reason, now));
  Depart(worker, WorkerState::kLeft, reason, now);
  int64_t next_generation = state_.generation();
  if (held_rank && !m_.stop_requested) {
    next_generation += 1;
    if (m_.formed && !m_.free_rank_since.has_value()) m_.free_rank_since = now;
    if (PromoteStandbysLocked(now, &events) > 0) MarkFormedIfComplete(now, &events);
  }
  if (m_.stop_requested && WorldLocked().state == JobState::kStopped) {
    events.push_back(MakeEvent(v1::MEMBERSHIP_EVENT_KIND_STOPPED, "", -1, m_.stop_reason, now));
  }
  if (absl::Status saved = PersistLocked(next_generation, std::move(events), before);
      !saved.ok()) {
    return saved;
  }
  spdlog::info("worker {} ({}) left: {}; generation {}", worker_id,
               held_rank ? absl::StrCat("rank ", rank) : std::string("no rank"), reason,
               next_generation);
  PruneDepartedLocked();
  return absl::OkStatus();
}

std::vector<std::string> WorldManager::ExpireLeasesLocked(absl::Time now) {
  std::vector<std::string> dead;
  std::vector<v1::MembershipEvent> events;
  bool bump = false;
  for (auto& [id, worker] : m_.workers) {
    if (worker.role == Role::kDeparted) continue;
    const absl::Duration silent = now - worker.last_heartbeat;
    if (silent <= options_.lease) continue;
    const std::string detail =
        absl::StrCat("no heartbeat for ", absl::FormatDuration(absl::Trunc(silent, absl::Milliseconds(1))),
                     " (lease ", absl::FormatDuration(options_.lease), ")");
    events.push_back(MakeEvent(v1::MEMBERSHIP_EVENT_KIND_DEAD, worker.id, worker.rank, detail, now));
    spdlog::warn("worker {} ({}) declared dead: {}", worker.id,
                 worker.role == Role::kActive ? absl::StrCat("rank ", worker.rank)
                                              : std::string(worker.role == Role::kStandby
                                                                ? "standby"
                                                                : "leaving"),
                 detail);
    if (worker.role == Role::kActive && !m_.stop_requested) {
      bump = true;
      if (m_.formed && !m_.free_rank_since.has_value()) m_.free_rank_since = now;
    }
    Depart(worker, WorkerState::kDead, detail, now);
    dead.push_back(worker.id);
  }
  const int ranks = static_cast<int>(m_.rank_holders.size());
  if (!m_.stop_requested && m_.formed && HeldRanks() < ranks) {
    if (PromoteStandbysLocked(now, &events) > 0) {
      bump = true;
      MarkFormedIfComplete(now, &events);
    }
  }
  // Past the grace period, re-form with the survivors (as many as an allowed size takes).
  if (!m_.stop_requested && m_.formed && HeldRanks() < ranks && m_.free_rank_since.has_value() &&
      now >= *m_.free_rank_since + options_.reform_grace) {
    std::vector<Worker*> survivors;
    for (const std::string& id : m_.rank_holders) {
      if (!id.empty()) survivors.push_back(&m_.workers.at(id));
    }
    int size = static_cast<int>(survivors.size());
    while (size >= min_world_size_ && !Allowed(size)) --size;
    if (size >= min_world_size_ && size >= 1) {
      std::sort(survivors.begin(), survivors.end(),
                [](const Worker* a, const Worker* b) { return a->rank < b->rank; });
      for (size_t i = size; i < survivors.size(); ++i) {
        survivors[i]->role = Role::kStandby;
        survivors[i]->rank = -1;
        survivors[i]->standby_since = now;
      }
      survivors.resize(size);
      const absl::Duration waited = now - *m_.free_rank_since;
      RenumberLocked(survivors, size);
      m_.free_rank_since.reset();
      events.push_back(MakeEvent(
          v1::MEMBERSHIP_EVENT_KIND_RESIZED, "", -1,
          absl::StrCat("re-formed from ", ranks, " to ", size, " workers: no replacement within ",
                       Seconds(waited)),
          now));
      spdlog::warn("no replacement within {}: re-forming with {} of the {} ranks", Seconds(waited),
                   size, ranks);
      bump = true;
      MarkFormedIfComplete(now, &events);
    }
  }
  if (!events.empty()) {
    if (m_.stop_requested && WorldLocked().state == JobState::kStopped) {
      events.push_back(MakeEvent(v1::MEMBERSHIP_EVENT_KIND_STOPPED, "", -1, m_.stop_reason, now));
    }
    PersistOrRetryLocked(state_.generation() + (bump ? 1 : 0), std::move(events));
    PruneDepartedLocked();
  } else if (persist_pending_) {
    PersistOrRetryLocked(state_.generation(), {});
  }
  return dead;
}

World WorldManager::RequestStopLocked(const std::string& reason, absl::Time now) {
  if (!m_.stop_requested) {
    m_.stop_requested = true;
    m_.stop_reason = reason.empty() ? "stop requested" : reason;
    std::vector<v1::MembershipEvent> events;
    events.push_back(
        MakeEvent(v1::MEMBERSHIP_EVENT_KIND_STOP_REQUESTED, "", -1, m_.stop_reason, now));
    if (WorldLocked().state == JobState::kStopped) {
      events.push_back(MakeEvent(v1::MEMBERSHIP_EVENT_KIND_STOPPED, "", -1, m_.stop_reason, now));
    }
    PersistOrRetryLocked(state_.generation(), std::move(events));
    spdlog::info("stop requested ({}); {} live workers will be told to leave", m_.stop_reason,
                 HeldRanks() + CountRole(Role::kStandby) + CountRole(Role::kLeaving));
  }
  return WorldLocked();
}

absl::StatusOr<JoinOutcome> WorldManager::Join(const JoinParams& params, absl::Time now) {
  return Mutate([&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return JoinLocked(params, now); });
}

absl::Status WorldManager::Leave(const std::string& worker_id, uint64_t incarnation,
                                 const std::string& reason, absl::Time now) {
  return Mutate([&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return LeaveLocked(worker_id, incarnation, reason, now);
  });
}

std::vector<std::string> WorldManager::ExpireLeases(absl::Time now) {
  return Mutate([&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return ExpireLeasesLocked(now); });
}

World WorldManager::RequestStop(const std::string& reason, absl::Time now) {
  return Mutate(
      [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return RequestStopLocked(reason, now); });
}

absl::Status WorldManager::ReportTrainingDoneLocked(const std::string& worker_id,
                                                    uint64_t incarnation,
                                                    const std::string& summary, absl::Time now) {
  absl::StatusOr<Worker*> worker = FindMember(worker_id, incarnation);
  if (!worker.ok()) return worker.status();
  (*worker)->last_heartbeat = now;
  (*worker)->done_generation = state_.generation();
  spdlog::info("worker {} (rank {}) finished training: {}", worker_id, (*worker)->rank, summary);
  for (const std::string& id : m_.rank_holders) {
    if (id.empty() || m_.workers.at(id).done_generation != state_.generation()) {
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
  return Mutate([&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return ReportTrainingDoneLocked(worker_id, incarnation, summary, now);
  });
}

absl::Status WorldManager::SetTarget(int world_size, absl::Time now) {
  return Mutate([&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) -> absl::Status {
    if (m_.stop_requested) {
      return absl::FailedPreconditionError(
          absl::StrCat("job '", options_.job, "' is stopping (", m_.stop_reason, ")"));
    }
    if (world_size < min_world_size_ || world_size > options_.expected_world_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "world size ", world_size, " is outside the job's range ", min_world_size_, "..",
          options_.expected_world_size, " (min_world_size..world_size of the job spec)"));
    }
    if (options_.check_size) {
      if (absl::Status allowed = options_.check_size(world_size); !allowed.ok()) return allowed;
    }
    if (world_size == m_.target) return absl::OkStatus();
    const Membership before = m_;
    const int from = m_.target;
    m_.target = world_size;
    std::vector<v1::MembershipEvent> events;
    events.push_back(MakeEvent(v1::MEMBERSHIP_EVENT_KIND_RESIZE_REQUESTED, "", -1,
                               absl::StrCat("target world size ", from, " -> ", world_size), now));
    if (absl::Status saved = PersistLocked(state_.generation(), std::move(events), before);
        !saved.ok()) {
      return saved;
    }
    spdlog::info("resize requested: target world size {} -> {}", from, world_size);
    return absl::OkStatus();
  });
}

absl::Status WorldManager::Drain(const std::string& worker_id, absl::Time now) {
  return Mutate([&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) -> absl::Status {
    if (m_.stop_requested) {
      return absl::FailedPreconditionError(
          absl::StrCat("job '", options_.job, "' is stopping (", m_.stop_reason, ")"));
    }
    auto it = m_.workers.find(worker_id);
    if (it == m_.workers.end() || it->second.role != Role::kActive) {
      return absl::NotFoundError(absl::StrCat("worker '", worker_id,
                                              "' holds no rank in the world; 'shardctl workers' "
                                              "lists the ones that do"));
    }
    Worker& worker = it->second;
    if (worker.draining) return absl::OkStatus();
    int draining = 1;
    for (const std::string& id : m_.rank_holders) draining += m_.workers.at(id).draining ? 1 : 0;
    const int left = static_cast<int>(m_.rank_holders.size()) - draining;
    if (left + CountRole(Role::kStandby) < min_world_size_) {
      return absl::FailedPreconditionError(absl::StrCat(
          "draining '", worker_id, "' would leave ", left, " workers and no standby to replace "
          "it; the job needs at least ", min_world_size_, " (start a replacement worker first)"));
    }
    const Membership before = m_;
    worker.draining = true;
    std::vector<v1::MembershipEvent> events;
    events.push_back(MakeEvent(v1::MEMBERSHIP_EVENT_KIND_RESIZE_REQUESTED, worker_id, worker.rank,
                               "drain requested", now));
    if (absl::Status saved = PersistLocked(state_.generation(), std::move(events), before);
        !saved.ok()) {
      return saved;
    }
    spdlog::info("drain requested for worker {} (rank {})", worker_id, worker.rank);
    return absl::OkStatus();
  });
}

std::optional<Reshape> WorldManager::PendingReshape() const {
  absl::ReaderMutexLock lock(&mu_);
  const World world = WorldLocked();
  if (m_.stop_requested || world.state != JobState::kRunning) return std::nullopt;
  std::vector<const Worker*> actives;
  for (const std::string& id : m_.rank_holders) actives.push_back(&m_.workers.at(id));
  Reshape reshape;
  reshape.generation = world.generation;
  reshape.from_size = world.ranks;
  std::vector<const Worker*> remaining;
  int drained = 0;
  for (const Worker* worker : actives) {
    if (worker->draining) {
      reshape.leavers.push_back(worker->id);
      ++drained;
    } else {
      remaining.push_back(worker);
    }
  }
  // Shrinking to the target takes the highest ranks out.
  int resized_out = 0;
  while (static_cast<int>(remaining.size()) > m_.target) {
    reshape.leavers.push_back(remaining.back()->id);
    remaining.pop_back();
    ++resized_out;
  }
  std::vector<const Worker*> standbys;
  for (const auto& [id, worker] : m_.workers) {
    if (worker.role == Role::kStandby) standbys.push_back(&worker);
  }
  std::sort(standbys.begin(), standbys.end(), [](const Worker* a, const Worker* b) {
    return a->standby_since != b->standby_since ? a->standby_since < b->standby_since
                                                : a->id < b->id;
  });
  int promote = std::min<int>(m_.target - static_cast<int>(remaining.size()),
                              static_cast<int>(standbys.size()));
  while (promote > 0 && !Allowed(static_cast<int>(remaining.size()) + promote)) --promote;
  // A size no allowed world has: healthy workers wait as standbys rather than leave.
  while (promote == 0 && !remaining.empty() && !Allowed(static_cast<int>(remaining.size()))) {
    reshape.demoted.push_back(remaining.back()->id);
    remaining.pop_back();
  }
  for (int i = 0; i < promote; ++i) reshape.promoted.push_back(standbys[i]->id);
  reshape.to_size = static_cast<int>(remaining.size()) + promote;
  if (reshape.leavers.empty() && reshape.promoted.empty()) return std::nullopt;
  if (reshape.to_size < min_world_size_ || reshape.to_size < 1) return std::nullopt;
  std::vector<std::string> why;
  if (drained > 0) why.push_back(absl::StrCat(drained, " drained"));
  if (resized_out > 0) why.push_back(absl::StrCat("resize to ", m_.target));
  if (promote > 0) why.push_back(absl::StrCat(promote, promote == 1 ? " standby" : " standbys",
                                              " folded in"));
  reshape.reason = absl::StrJoin(why, ", ");
  return reshape;
}

absl::StatusOr<World> WorldManager::ApplyReshapeLocked(const Reshape& reshape, absl::Time now) {
  const World world = WorldLocked();
  if (m_.stop_requested || world.state != JobState::kRunning ||
      world.generation != reshape.generation) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the world changed (now ", JobStateName(world.state), " at generation ",
        world.generation, ") since the re-formation was planned at generation ",
        reshape.generation));
  }
  const Membership before = m_;
  std::vector<Worker*> keep;
  auto is_in = [](const std::vector<std::string>& ids, const std::string& id) {
    return std::find(ids.begin(), ids.end(), id) != ids.end();
  };
  std::vector<v1::MembershipEvent> events;
  for (const std::string& id : m_.rank_holders) {
    Worker& worker = m_.workers.at(id);
    if (is_in(reshape.leavers, id)) {
      worker.detail = worker.draining ? "drained by an operator"
                                      : absl::StrCat("resized out: the world shrinks to ",
                                                     reshape.to_size, " workers");
      events.push_back(MakeEvent(v1::MEMBERSHIP_EVENT_KIND_LEFT, id, worker.rank,
                                 absl::StrCat("told to leave: ", worker.detail), now));
      worker.role = Role::kLeaving;
      worker.rank = -1;
    } else if (is_in(reshape.demoted, id)) {
      worker.role = Role::kStandby;
      worker.rank = -1;
      worker.standby_since = now;
    } else {
      keep.push_back(&worker);
    }
  }
  for (const std::string& id : reshape.promoted) {
    auto it = m_.workers.find(id);
    if (it == m_.workers.end() || it->second.role != Role::kStandby) {
      m_ = before;
      return absl::FailedPreconditionError(
          absl::StrCat("standby '", id, "' is gone since the re-formation was planned"));
    }
    it->second.rank = -1;
    it->second.self_check = SelfCheckRecord{};
    keep.push_back(&it->second);
  }
  RenumberLocked(keep, reshape.to_size);
  events.push_back(MakeEvent(v1::MEMBERSHIP_EVENT_KIND_RESIZED, "", -1,
                             absl::StrCat("re-formed from ", reshape.from_size, " to ",
                                          reshape.to_size, " workers: ", reshape.reason),
                             now));
  if (absl::Status saved = PersistLocked(state_.generation() + 1, std::move(events), before);
      !saved.ok()) {
    return saved;
  }
  spdlog::info("world re-formed from {} to {} workers at generation {} ({})", reshape.from_size,
               reshape.to_size, state_.generation(), reshape.reason);
  return WorldLocked();
}

absl::StatusOr<World> WorldManager::ApplyReshape(const Reshape& reshape, absl::Time now) {
  return Mutate([&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return ApplyReshapeLocked(reshape, now); });
}

void WorldManager::PruneDepartedLocked() {
  std::vector<std::pair<absl::Time, std::string>> departed;
  for (const auto& [id, worker] : m_.workers) {
    if (worker.role == Role::kDeparted) departed.emplace_back(worker.departed_at, id);
  }
  if (departed.size() <= options_.max_departed_records) return;
  std::sort(departed.begin(), departed.end());
  const size_t excess = departed.size() - options_.max_departed_records;
  for (size_t i = 0; i < excess; ++i) m_.workers.erase(departed[i].second);
}

StatusSnapshot WorldManager::Status(absl::Time now) const {
  absl::ReaderMutexLock lock(&mu_);
  StatusSnapshot snapshot;
  snapshot.job = options_.job;
  snapshot.world = WorldLocked();
  snapshot.world.transition = TransitionLocked(now);
  snapshot.lease = options_.lease;
  std::vector<const Worker*> workers;
  for (const auto& [id, worker] : m_.workers) workers.push_back(&worker);
  auto order = [](const Worker* w) {
    switch (w->role) {
      case Role::kActive: return 0;
      case Role::kStandby: return 1;
      case Role::kLeaving: return 2;
      case Role::kDeparted: return 3;
    }
    return 3;
  };
  std::sort(workers.begin(), workers.end(), [&](const Worker* a, const Worker* b) {
    if (order(a) != order(b)) return order(a) < order(b);
    if (a->role == Role::kActive) return a->rank < b->rank;
    if (a->role == Role::kDeparted && a->departed_at != b->departed_at) {
      return a->departed_at > b->departed_at;
    }
    return a->id < b->id;
  });
  for (const Worker* worker : workers) {
    WorkerSnapshot w;
    w.id = worker->id;
    w.rank = worker->rank;
    w.host = worker->host;
    w.device = worker->device;
    w.capabilities = worker->capabilities;
    w.since_heartbeat = std::max(absl::ZeroDuration(), now - worker->last_heartbeat);
    // A member's check from an earlier generation says nothing about this world.
    w.self_check = worker->role == Role::kDeparted ||
                           worker->self_check.generation == state_.generation()
                       ? worker->self_check
                       : SelfCheckRecord{SelfCheckState::kPending, state_.generation(), ""};
    w.joined_generation = worker->joined_generation;
    switch (worker->role) {
      case Role::kDeparted: w.state = worker->departed_state; break;
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

}  // namespace shard
