// World formation and membership: ranks, generations, leases, elasticity, stop. The rules live
// here, with no gRPC in sight; callers pass the current time so tests drive the clock.
//
// Rules:
// - The world of a generation has ranks 0..R-1. Until it first forms, R is the target world
//   size and the job waits for that many workers. A new worker takes the rank it asks for, else
//   the rank it held before if free, else the lowest free rank. A retried join (same id and
//   incarnation) is idempotent; a restarted worker (same id, new incarnation) keeps its rank.
// - Once formed, a worker that joins a full world smaller than the job's largest size becomes a
//   standby: live, without a rank, folded in at the next checkpoint boundary when the target
//   has room (see PendingReshape), or at once into the rank of a worker that dies.
// - The generation is bumped on every change of who holds which rank: a join into a free rank,
//   a restart, a leave, a death, a re-formation (several deaths found at once bump it once).
//   Standbys coming and going, stop and the departures after it do not bump it.
// - The world is RUNNING while every rank is held by a live worker, FORMING otherwise.
// - A worker whose heartbeat is older than the lease is declared dead. If it held a rank, the
//   rank is free: a standby takes it at once; else the job waits `reform_grace` for a
//   replacement, then re-forms with the survivors (ranks renumbered 0..n-1) if at least
//   `min_world_size` remain and the size is allowed (`check_size`, e.g. it divides the global
//   batch); survivors beyond an allowed size become standbys.
// - Resize (SetTarget) and Drain only record what the operator wants; PendingReshape says
//   what the world must change to get there and ApplyReshape does it (the ElasticManager calls
//   it once the workers have checkpointed). Workers taken out are told to leave.
//
// Every change is persisted through the StateStore (live members included, so a restarted
// coordinator takes the world back: Create with `recover`) before it is acknowledged; a failed
// write fails the call and changes nothing, except for changes that cannot be refused (deaths,
// stop), which are kept and written again later.
//
// Thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/store/state_store.h"
#include "shard/v1/state.pb.h"

namespace shard {

enum class JobState { kForming, kRunning, kStopping, kStopped };
enum class WorkerState { kJoining, kReady, kFailed, kLeft, kDead, kStandby, kLeaving };
enum class SelfCheckState { kPending, kPassed, kFailed };

struct WorldOptions {
  std::string job = "default";
  int expected_world_size = 1;  // the initial target world size, and the largest one
  int min_world_size = 0;       // the fewest workers to re-form with; 0 = expected_world_size
  absl::Duration lease = absl::Seconds(10);
  // After a worker holding a rank is lost: how long to wait for a replacement before re-forming
  // with the survivors.
  absl::Duration reform_grace = absl::Seconds(30);
  // Whether the job can run on this many workers (e.g. its global batch must divide over them);
  // the error says why not. Unset: any size.
  std::function<absl::Status(int)> check_size;
  // Take back the live world kept in the state directory (a restart after a crash). Without it,
  // or when the saved job had stopped, the coordinator starts a new world.
  bool recover = true;
  size_t max_departed_records = 64;  // departed workers still shown in status
  size_t max_events = 1000;          // membership history kept in the state store
};

struct JoinParams {
  std::string worker_id;
  std::string host;
  std::string device;
  std::vector<std::string> capabilities;
  uint64_t incarnation = 0;
  std::optional<int> requested_rank;
};

struct World {
  JobState state = JobState::kForming;
  int64_t generation = 0;
  int world_size = 0;           // live workers holding a rank
  int expected_world_size = 0;  // the target
  int ranks = 0;                // of this generation's world
  int min_world_size = 0;
  int standby = 0;
  std::string transition;       // what the world waits for, for people; empty when settled
};

// A member of the running world, as the other managers need to know it.
struct MemberRef {
  std::string worker_id;
  int rank = -1;
  int64_t generation = 0;
  int world_size = 0;
};

struct JoinOutcome {
  int rank = -1;
  World world;
};

struct HeartbeatOutcome {
  World world;
  int rank = -1;  // -1 for a standby
  bool stop = false;  // the job stops, or this worker was taken out: leave
  std::string stop_reason;
};

// A heartbeat that may wait for the world to change (see WatchHeartbeat).
struct HeartbeatParams {
  std::string worker_id;
  uint64_t incarnation = 0;
  int64_t known_generation = 0;
  JobState known_state = JobState::kForming;
  absl::Duration wait;  // capped at a quarter lease; zero replies at once
};
using HeartbeatCallback = std::function<void(absl::StatusOr<HeartbeatOutcome>)>;

struct SelfCheckRecord {
  SelfCheckState state = SelfCheckState::kPending;
  int64_t generation = 0;
  std::string detail;
};

struct WorkerSnapshot {
  std::string id;
  int rank = -1;  // -1 once departed
  std::string host;
  std::string device;
  std::vector<std::string> capabilities;
  WorkerState state = WorkerState::kJoining;
  absl::Duration since_heartbeat;
  SelfCheckRecord self_check;
  int64_t joined_generation = 0;
};

struct StatusSnapshot {
  std::string job;
  World world;
  absl::Duration lease;
  std::vector<WorkerSnapshot> workers;  // by rank, then standbys, leaving, departed (latest first)
};

// A change of the world's members that PendingReshape proposes and ApplyReshape carries out.
struct Reshape {
  int64_t generation = 0;             // of the world it was computed for
  std::vector<std::string> leavers;   // active workers taken out
  std::vector<std::string> promoted;  // standbys folded in
  std::vector<std::string> demoted;   // active workers that become standbys (no allowed size
                                      // holds them)
  int from_size = 0;
  int to_size = 0;
  std::string reason;  // resize, drain, standbys
};

using EventsCallback = std::function<void(std::vector<v1::MembershipEvent>)>;

class WorldManager {
 public:
  // Loads the saved state (if any) and records the start. The saved job must match
  // `options.job`; generations continue from the saved one. With `options.recover`, a saved
  // world whose job had not stopped is taken back: its live workers stay members (each with a
  // fresh lease) and, if every rank was held and had connected its data path, the generation
  // is kept so that training goes on undisturbed.
  static absl::StatusOr<std::unique_ptr<WorldManager>> Create(WorldOptions options,
                                                              StateStore* store, absl::Time now);
  // Whether Create took back a saved world, and whether it kept its generation (an intact,
  // connected world that goes on training).
  bool recovered() const { return recovered_; }
  bool kept_generation() const { return kept_generation_; }
  // Whether `store` holds a world whose job had not stopped (its coordinator crashed), and so
  // would be taken back.
  static absl::StatusOr<bool> HasLiveWorld(StateStore* store);

  // Called under the manager's lock whenever the generation changes; must not call back.
  void set_generation_listener(std::function<void(int64_t)> listener);

  absl::StatusOr<JoinOutcome> Join(const JoinParams& params, absl::Time now);
  // Renews the lease and answers at once.
  absl::StatusOr<HeartbeatOutcome> Heartbeat(const std::string& worker_id, uint64_t incarnation,
                                             absl::Time now);
  // Renews the lease; calls `done` exactly once, outside the manager's lock: at once if the
  // world differs from what the worker knows (generation, state or a stop), else when it
  // changes or when the wait runs out (see ExpireWatches).
  void WatchHeartbeat(const HeartbeatParams& params, absl::Time now, HeartbeatCallback done);
  // Answers the watches whose wait has run out.
  void ExpireWatches(absl::Time now);
  // Answers every watch now (something outside the membership changed, e.g. a save request).
  void WakeWatches();
  // Answers every watch with `reason` (at shutdown).
  void CloseWatches(const absl::Status& reason);
  absl::Status ReportSelfCheck(const std::string& worker_id, uint64_t incarnation,
                               int64_t generation, bool passed, const std::string& detail,
                               absl::Time now);
  absl::Status Leave(const std::string& worker_id, uint64_t incarnation,
                     const std::string& reason, absl::Time now);
  // The member finished training; once every member of the generation has, the job is
  // stopped with `summary` as the reason.
  absl::Status ReportTrainingDone(const std::string& worker_id, uint64_t incarnation,
                                  const std::string& summary, absl::Time now);

  // Declares every member whose lease has expired dead (returns their ids), fills free ranks
  // with standbys and, past the grace period, re-forms with the survivors.
  std::vector<std::string> ExpireLeases(absl::Time now);

  // Bumps the generation with the same members (e.g. to restart training from a checkpoint):
  // every worker re-connects its data path.
  World Reform(const std::string& reason, absl::Time now);

  // The operator's resize: the target world size from now on (min_world_size..the largest,
  // and allowed). Persisted; PendingReshape then proposes the change.
  absl::Status SetTarget(int world_size, absl::Time now);
  // The operator takes `worker_id` (holding a rank) out of the world.
  absl::Status Drain(const std::string& worker_id, absl::Time now);
  // What the running world must change to meet the target and the drains, if anything.
  std::optional<Reshape> PendingReshape() const;
  // Carries out `reshape` (FailedPrecondition if the world changed since it was computed):
  // leavers are told to leave, standbys get ranks, ranks are renumbered 0..n-1, and the
  // generation is bumped.
  absl::StatusOr<World> ApplyReshape(const Reshape& reshape, absl::Time now);

  // Events after sequence number `after`, oldest first.
  std::vector<v1::MembershipEvent> Events(int64_t after) const;
  // Calls `done` outside the lock with the events after `after`: at once if there are some,
  // else when one is recorded or at `deadline` (empty; see ExpireWatches).
  void WatchEvents(int64_t after, absl::Time deadline, EventsCallback done);

  // Asks every member to leave; the job is STOPPED once none is live.
  World RequestStop(const std::string& reason, absl::Time now);

  // The member `worker_id` of the running world; NotFound/FailedPrecondition as Heartbeat, and
  // FailedPrecondition while the world is not running.
  absl::StatusOr<MemberRef> Member(const std::string& worker_id, uint64_t incarnation);

  World world() const;
  StatusSnapshot Status(absl::Time now) const;
  const WorldOptions& options() const { return options_; }

 private:
  enum class Role { kActive, kStandby, kLeaving, kDeparted };
  struct Worker {
    std::string id;
    uint64_t incarnation = 0;
    Role role = Role::kDeparted;
    int rank = -1;       // -1 unless active
    int last_rank = -1;  // preferred on rejoin
    std::string host;
    std::string device;
    std::vector<std::string> capabilities;
    absl::Time last_heartbeat;
    absl::Time departed_at;
    WorkerState departed_state = WorkerState::kLeft;  // meaningful when departed
    std::string detail;  // why it departed, or why it must leave
    bool draining = false;
    absl::Time standby_since;
    SelfCheckRecord self_check;
    int64_t joined_generation = 0;
    int64_t done_generation = 0;  // the generation in which it finished training
  };
  // Everything a change may touch; copied before a change so a failed write can undo it.
  struct Membership {
    absl::flat_hash_map<std::string, Worker> workers;
    std::vector<std::string> rank_holders;  // worker id per rank of the world, "" = free
    int target = 0;
    bool formed = false;  // the world has formed at least once
    std::optional<absl::Time> free_rank_since;  // a rank of the formed world lost its worker
    int64_t connected_generation = 0;
    bool stop_requested = false;
    std::string stop_reason;
  };

  struct Watch {
    std::string worker_id;
    int64_t known_generation;
    JobState known_state;
    absl::Time deadline;
    HeartbeatCallback done;
  };
  struct EventWatch {
    int64_t after;
    absl::Time deadline;
    EventsCallback done;
  };
  // An answer computed under the lock, delivered after it is released.
  struct Answer {
    HeartbeatCallback done;
    absl::StatusOr<HeartbeatOutcome> outcome;
    EventsCallback events_done;
    std::vector<v1::MembershipEvent> events;
  };

  WorldManager(WorldOptions options, StateStore* store, v1::CoordinatorState state);

  // FailedPrecondition when the joiner shares no data-path backend with a live worker.
  absl::Status CheckBackendLocked(const JoinParams& params) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // The rules of the public calls of the same names; the public calls add the answering of
  // the watches that the change concerns.
  absl::StatusOr<JoinOutcome> JoinLocked(const JoinParams& params, absl::Time now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status LeaveLocked(const std::string& worker_id, uint64_t incarnation,
                           const std::string& reason, absl::Time now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::vector<std::string> ExpireLeasesLocked(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  World RequestStopLocked(const std::string& reason, absl::Time now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  World ReformLocked(const std::string& reason, absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status ReportTrainingDoneLocked(const std::string& worker_id, uint64_t incarnation,
                                        const std::string& summary, absl::Time now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<HeartbeatOutcome> HeartbeatLocked(const std::string& worker_id,
                                                   uint64_t incarnation, absl::Time now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<World> ApplyReshapeLocked(const Reshape& reshape, absl::Time now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The reply a watching worker gets now: NotFound if it is no longer a member. `world` is
  // WorldLocked(), computed once by callers answering many watches.
  absl::StatusOr<HeartbeatOutcome> OutcomeLocked(const std::string& worker_id,
                                                 const World& world) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Whether a watch taken at (known_generation, known_state) by `worker` must be answered now.
  // `world` is WorldLocked(), computed once by the caller for all the watches it checks.
  bool WatchFires(const World& world, int64_t known_generation, JobState known_state,
                  const Worker* worker) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Moves the watches whose world changed, and the event watches with news, into answers.
  std::vector<Answer> TakeChangedWatchesLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  static void Deliver(std::vector<Answer> answers);
  // Runs `change` under the lock, then answers the watches the change concerns.
  template <typename Change>
  auto Mutate(Change change) -> decltype(change()) {
    std::vector<Answer> answers;
    decltype(change()) result;
    {
      absl::MutexLock lock(&mu_);
      result = change();
      answers = TakeChangedWatchesLocked();
    }
    Deliver(std::move(answers));
    return result;
  }

  World WorldLocked() const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  std::string TransitionLocked(absl::Time now) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  int CountRole(Role role) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  int HeldRanks() const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  bool Allowed(int world_size) const {
    return world_size >= 1 && (!options_.check_size || options_.check_size(world_size).ok());
  }
  absl::StatusOr<int> ChooseRank(const JoinParams& params, const Worker* existing) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  absl::StatusOr<Worker*> FindMember(const std::string& worker_id, uint64_t incarnation)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string LiveHolders() const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Standbys, oldest first.
  std::vector<Worker*> StandbysLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Depart(Worker& worker, WorkerState state, std::string detail, absl::Time now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Gives free ranks to standbys, oldest first; returns how many it placed.
  int PromoteStandbysLocked(absl::Time now, std::vector<v1::MembershipEvent>* events)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Makes the world `size` ranks held by `keep` (active workers), renumbering: a worker keeps
  // its rank if it is below `size`, the others take the free ones in order.
  void RenumberLocked(const std::vector<Worker*>& keep, int size)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void MarkFormedIfComplete(absl::Time now, std::vector<v1::MembershipEvent>* events)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Appends events (each stamped with the generation `next_generation` and a sequence number)
  // and saves the membership. On failure the membership is put back to `before`, nothing
  // changes, and the error says the state directory could not be written.
  absl::Status PersistLocked(int64_t next_generation, std::vector<v1::MembershipEvent> events,
                             const Membership& before) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // For changes that cannot be refused (deaths, stop): saves, and on failure keeps the change,
  // logs, and writes again on the next ExpireLeases.
  void PersistOrRetryLocked(int64_t next_generation, std::vector<v1::MembershipEvent> events)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The state record with `next_generation`, `events` appended and the live members.
  v1::CoordinatorState RecordLocked(int64_t next_generation,
                                    std::vector<v1::MembershipEvent> events) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  void CommitRecordLocked(v1::CoordinatorState record) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  v1::MembershipEvent MakeEvent(v1::MembershipEventKind kind, const std::string& worker_id,
                                int rank, std::string detail, absl::Time now) const;
  void PruneDepartedLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Rebuilds the live world from the state record (a restart); false if there is none to take
  // back.
  bool RecoverLocked(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const WorldOptions options_;
  const int min_world_size_;
  bool recovered_ = false;
  bool kept_generation_ = false;
  StateStore* const store_;
  mutable absl::Mutex mu_;
  v1::CoordinatorState state_ ABSL_GUARDED_BY(mu_);  // generation and history, as persisted
  bool persist_pending_ ABSL_GUARDED_BY(mu_) = false;
  Membership m_ ABSL_GUARDED_BY(mu_);
  std::function<void(int64_t)> generation_listener_ ABSL_GUARDED_BY(mu_);
  std::vector<Watch> watches_ ABSL_GUARDED_BY(mu_);
  std::vector<EventWatch> event_watches_ ABSL_GUARDED_BY(mu_);
};

absl::string_view JobStateName(JobState state);
absl::string_view WorkerStateName(WorkerState state);
absl::string_view SelfCheckStateName(SelfCheckState state);

}  // namespace shard
