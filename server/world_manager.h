// World formation and membership: ranks, generations, leases, stop. The rules live here, with
// no gRPC in sight; callers pass the current time so tests drive the clock.
//
// Rules:
// - Ranks are 0..W-1. A new worker takes the rank it asks for, else the rank it held before
//   if that one is free, else the lowest free rank. A retried join (same id and incarnation)
//   is idempotent; a restarted worker (same id, new incarnation) keeps its rank.
// - The generation is bumped on every membership change: a join, a restart, a leave or a
//   death (several deaths found at once bump it once). Stop and the departures after it do
//   not bump it.
// - The world is formed (RUNNING) while W members are live; FORMING otherwise.
// - A member whose heartbeat is older than the lease is declared dead and frees its rank.
//
// Membership changes are persisted through the StateStore before a join or leave is
// acknowledged; a failed write fails that call and changes nothing.
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
enum class WorkerState { kJoining, kReady, kFailed, kLeft, kDead };
enum class SelfCheckState { kPending, kPassed, kFailed };

struct WorldOptions {
  std::string job = "default";
  int expected_world_size = 1;
  absl::Duration lease = absl::Seconds(10);
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
  int world_size = 0;  // live members
  int expected_world_size = 0;
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
  int rank = -1;
  bool stop = false;
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
  std::vector<WorkerSnapshot> workers;  // members by rank, then departed, latest first
};

class WorldManager {
 public:
  // Loads the saved state (if any) and records the start. The saved job must match
  // `options.job`; generations continue from the saved one.
  static absl::StatusOr<std::unique_ptr<WorldManager>> Create(WorldOptions options,
                                                              StateStore* store, absl::Time now);

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

  // Declares every member whose lease has expired dead; returns their ids.
  std::vector<std::string> ExpireLeases(absl::Time now);

  // Bumps the generation with the same members (e.g. to restart training from a checkpoint):
  // every worker re-connects its data path.
  World Reform(const std::string& reason, absl::Time now);

  // Asks every member to leave; the job is STOPPED once none is live.
  World RequestStop(const std::string& reason, absl::Time now);

  // The member `worker_id` of the running world; NotFound/FailedPrecondition as Heartbeat, and
  // FailedPrecondition while the world is not running.
  absl::StatusOr<MemberRef> Member(const std::string& worker_id, uint64_t incarnation);

  World world() const;
  StatusSnapshot Status(absl::Time now) const;
  const WorldOptions& options() const { return options_; }

 private:
  struct Worker {
    std::string id;
    uint64_t incarnation = 0;
    int rank = -1;       // -1 when departed
    int last_rank = -1;  // preferred on rejoin
    std::string host;
    std::string device;
    std::vector<std::string> capabilities;
    absl::Time last_heartbeat;
    absl::Time departed_at;
    WorkerState departed_state = WorkerState::kLeft;  // meaningful when rank == -1
    std::string departed_detail;
    SelfCheckRecord self_check;
    int64_t joined_generation = 0;
    int64_t done_generation = 0;  // the generation in which it finished training
  };

  struct Watch {
    std::string worker_id;
    int64_t known_generation;
    JobState known_state;
    absl::Time deadline;
    HeartbeatCallback done;
  };
  // A watch answer computed under the lock, delivered after it is released.
  struct Answer {
    HeartbeatCallback done;
    absl::StatusOr<HeartbeatOutcome> outcome;
  };

  WorldManager(WorldOptions options, StateStore* store, v1::CoordinatorState state);

  // The rules of the public calls of the same names; the public calls add the answering of
  // the heartbeat watches that the change concerns.
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
  // The reply a watching worker gets now: NotFound if it is no longer a member.
  absl::StatusOr<HeartbeatOutcome> OutcomeLocked(const std::string& worker_id) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Whether a watch taken at (known_generation, known_state) must be answered now.
  bool WatchFires(int64_t known_generation, JobState known_state, bool member) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Moves the watches whose world changed (or all, or those past `now`) into answers.
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
  int LiveCount() const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  absl::StatusOr<int> ChooseRank(const JoinParams& params, const Worker* existing) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  absl::StatusOr<Worker*> FindMember(const std::string& worker_id, uint64_t incarnation)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string LiveHolders() const ABSL_SHARED_LOCKS_REQUIRED(mu_);

  // Appends events (each stamped with the generation `next_generation`) and saves. On failure
  // nothing changes and the error says the state directory could not be written.
  absl::Status PersistLocked(int64_t next_generation, std::vector<v1::MembershipEvent> events)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // For changes that cannot be refused (deaths, stop): saves, and on failure keeps the change,
  // logs, and retries on the next ExpireLeases.
  void PersistOrRetryLocked(int64_t next_generation, std::vector<v1::MembershipEvent> events)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void SetGenerationLocked(int64_t generation) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  v1::MembershipEvent MakeEvent(v1::MembershipEventKind kind, const std::string& worker_id,
                                int rank, std::string detail, absl::Time now) const;
  // WORLD_FORMED event if `members` live workers form the world at `generation`.
  void MaybeFormedEvent(int members, absl::Time now, std::vector<v1::MembershipEvent>* events)
      const;
  void PruneDepartedLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const WorldOptions options_;
  StateStore* const store_;
  mutable absl::Mutex mu_;
  v1::CoordinatorState state_ ABSL_GUARDED_BY(mu_);  // generation and history, as persisted
  bool persist_pending_ ABSL_GUARDED_BY(mu_) = false;
  absl::flat_hash_map<std::string, Worker> workers_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> rank_holders_ ABSL_GUARDED_BY(mu_);  // worker id per rank, "" = free
  bool stop_requested_ ABSL_GUARDED_BY(mu_) = false;
  std::string stop_reason_ ABSL_GUARDED_BY(mu_);
  std::function<void(int64_t)> generation_listener_ ABSL_GUARDED_BY(mu_);
  std::vector<Watch> watches_ ABSL_GUARDED_BY(mu_);
};

absl::string_view JobStateName(JobState state);
absl::string_view WorkerStateName(WorkerState state);
absl::string_view SelfCheckStateName(SelfCheckState state);

}  // namespace shard
