// The world: membership (server/membership.h has the rules), generations, leases, reshapes,
// the event log and the workers' long-polled heartbeats. It applies the rules under its lock,
// numbers the generations, records every change in the membership journal (MembershipLog) and
// answers the heartbeats the change concerns. No gRPC; callers pass the time, so tests and the
// simulation drive the clock.
//
// Durability: a change is in the journal when the call returns, and durable once the state
// store says so (StateStore::WhenDurable on last_sequence()). Whoever acknowledges a change to
// a worker or an operator waits for that (CoordinatorCore does), so a restarted coordinator
// never forgets what anyone was told, and never reuses a generation.
//
// Thread-safe. Callbacks run outside the manager's lock.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/progress_lease.h"
#include "server/event_log.h"
#include "server/membership.h"
#include "server/membership_log.h"
#include "server/store/state_store.h"
#include "server/types.h"
#include "server/wait_list.h"

namespace shard {

struct WorldOptions {
  std::string job = "default";
  int expected_world_size = 1;  // the initial target world size, and the largest one
  int min_world_size = 0;       // the fewest workers to re-form with; 0 = expected_world_size
  int max_standbys = 0;         // live workers waiting without a rank; 0 = expected_world_size
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
  // The job fails once more than this many workers have exited with an error over its life
  // (a worker whose training fails the same way wherever it restarts would otherwise be
  // replaced forever); negative: never.
  int max_worker_failures = 3;
  size_t max_departed_records = 64;  // departed workers still shown in status
  size_t max_events = 1000;          // membership history kept in the state store
};

class WorldManager {
 public:
  // Loads the saved state (if any) and records the start. The saved job must match
  // `options.job`; generations continue from the saved one. With `options.recover`, a saved
  // world whose job had not stopped is taken back: its live workers stay members (each with a
  // fresh lease) and, if every rank was held and had connected its data path, the generation
  // is kept so that training goes on undisturbed; a job whose training had finished, or that
  // had failed, comes back ended.
  static absl::StatusOr<std::unique_ptr<WorldManager>> Create(WorldOptions options,
                                                              StateStore* store, absl::Time now);
  // Whether Create took back a saved world, and whether it kept its generation (an intact,
  // connected world that goes on training).
  bool recovered() const { return recovered_; }
  bool kept_generation() const { return kept_generation_; }
  // What `store` holds: no world, a world whose job had not stopped (its coordinator crashed,
  // so it is taken back), or a job whose training finished or that failed (a coordinator started
  // again on it has nothing to run: it ends at once, as it ended, instead of training the job
  // over). An operator's stop leaves nothing to take back: the next start is a new run.
  enum class SavedWorld { kNone, kLive, kEnded };
  static absl::StatusOr<SavedWorld> FindSavedWorld(StateStore* store);

  // Called under the manager's lock whenever the generation changes; must not call back.
  void set_generation_listener(std::function<void(int64_t)> listener);
  // Called under the manager's lock when the world first runs at a generation (it is about to
  // tell its workers so), with who is live now; the events it returns are recorded with the
  // change, at its time. Must not call back.
  using RunningListener =
      std::function<std::vector<v1::MembershipEvent>(int64_t generation, const IsLiveMember&)>;
  void set_running_listener(RunningListener listener);
  // Whether a worker told to leave must stay (it holds state the new world still reads): it is
  // then not told to stop, and its heartbeat waits as a standby's does. Called under the
  // manager's lock; must not call back. WakeWatches once it may change.
  void set_leaver_hold(std::function<bool(const std::string& worker_id)> hold);

  absl::StatusOr<JoinOutcome> Join(const JoinParams& params, absl::Time now);
  // Renews the lease and answers at once.
  absl::StatusOr<HeartbeatOutcome> Heartbeat(const std::string& worker_id, uint64_t incarnation,
                                             absl::Time now);
  // Renews the lease, notes whether the worker's training is paused; calls `done` exactly
  // once, outside the lock: at once if the world differs from what the worker knows
  // (generation, state or a stop), else when it changes or when the wait runs out
  // (ExpireWatches).
  void WatchHeartbeat(const HeartbeatParams& params, absl::Time now, HeartbeatCallback done);
  // Answers the heartbeats and event watches whose wait has run out.
  void ExpireWatches(absl::Time now, size_t fired_at_most = kAllFired);
  // Answers every heartbeat now (something outside the membership changed, e.g. a save request).
  void WakeWatches(size_t fired_at_most = kAllFired);
  // Held heartbeats that a change or their deadline fired are answered in order with the world as
  // it is when they are answered, not when they fired: a backlog (10,000 workers told of a death)
  // that outlives the next change (the re-formation after the grace) carries the newer world, so
  // those workers are answered once. Answers up to `at_most` of them and returns how many still
  // wait. A change answers all it fired; the housekeeping pass answers kAnswersPerPass (and runs
  // again at once while some wait), so that its timers (leases, the grace) stay on time.
  size_t AnswerFired(size_t at_most);
  static constexpr size_t kAllFired = std::numeric_limits<size_t>::max();
  static constexpr size_t kAnswersPerPass = 1000;
  // Answers every heartbeat and event watch with `reason`, and from now on every new one at once
  // (at shutdown: a client that asks again must not hold the server open).
  void CloseWatches(const absl::Status& reason);
  // A check of the current generation; a failed one (a rank could not use the data path) ends
  // the generation of a running world, so that every rank reconnects at the next.
  // `unreachable`: the peers it could not reach (server/reachability.h): a failed connect
  // re-forms the world with members that reach one another.
  absl::Status ReportSelfCheck(const std::string& worker_id, uint64_t incarnation,
                               int64_t generation, bool passed, const std::string& detail,
                               absl::Time now, const std::vector<PeerFault>& unreachable = {});
  // A worker leaves; one that leaves failed counts towards max_worker_failures, beyond which
  // the job fails.
  absl::Status Leave(const LeaveParams& params, absl::Time now);
  // The member finished training; once every member of the generation has, the job is
  // stopped with `summary` as the reason.
  absl::Status ReportTrainingDone(const std::string& worker_id, uint64_t incarnation,
                                  const std::string& summary, absl::Time now);

  // Declares every member whose lease has expired dead (returns their ids), fills free ranks
  // with standbys and, past the grace period, re-forms with the survivors.
  std::vector<std::string> ExpireLeases(absl::Time now, size_t fired_at_most = kAllFired);

  // Ends the generation with the same members (e.g. to restart training from a checkpoint):
  // every worker re-connects its data path.
  World Reform(const std::string& reason, absl::Time now);

  // The operator's resize: the target world size from now on (min_world_size..the largest,
  // and allowed). PendingReshape then proposes the change.
  absl::Status SetTarget(int world_size, absl::Time now);
  // The operator takes `worker_id` (holding a rank) out of the world.
  absl::Status Drain(const std::string& worker_id, absl::Time now);
  // What the running world must change to meet the target and the drains, if anything.
  std::optional<Reshape> PendingReshape() const;
  // Carries out `reshape` (FailedPrecondition if the world changed since it was computed).
  absl::StatusOr<World> ApplyReshape(const Reshape& reshape, absl::Time now);
  // Whether every rank of the running world at `generation` says its training paused there.
  bool AllPausedAt(int64_t generation) const;
  // The ranks of the running world at `generation` were asked to pause for a reshape: the job
  // is RESHAPING until the generation ends. False (nothing changes) if the world is not running
  // at that generation.
  bool BeginReshaping(int64_t generation);

  // Events after sequence number `after`, oldest first.
  std::vector<v1::MembershipEvent> Events(int64_t after) const;
  // Calls `done` outside the lock with the events after `after`: at once if there are some,
  // else when one is recorded or at `deadline` (empty; see ExpireWatches).
  void WatchEvents(int64_t after, absl::Time deadline, EventsCallback done);

  // An operator's stop: asks every member to leave; the job is FINISHED once none is live.
  World RequestStop(const std::string& reason, absl::Time now);

  // What the ranks of the current world last said of their training (common/progress_lease.h).
  std::vector<RankProgress> Progress() const;
  // The rank holder made no progress while its peers waited (see shard::Evict in membership.h).
  absl::Status Evict(const std::string& worker_id, uint64_t incarnation, const std::string& detail,
                     absl::Time now);

  // Whether `worker_id` with `incarnation` is a live member (holding a rank, standing by or
  // leaving).
  bool IsLive(const std::string& worker_id, uint64_t incarnation) const;
  // The same for every live member at once, as it is now (for callers that ask under a lock of
  // their own, which must never wait for this manager's).
  IsLiveMember LiveNow() const;
  // Records an event of the job's history (e.g. where a generation restores from).
  void RecordEvent(v1::MembershipEventKind kind, const std::string& worker_id, int rank,
                   std::string detail, absl::Time now);

  // The member `worker_id` of the running world; NotFound/FailedPrecondition as Heartbeat, and
  // Aborted (its generation is over) for a standby, a leaver, or while the world is not
  // running.
  absl::StatusOr<MemberRef> RunningMember(const std::string& worker_id, uint64_t incarnation);

  World world() const;
  StatusSnapshot Status(absl::Time now) const;
  // The whole record as the journal holds it (for tests that compare memory with disk).
  v1::CoordinatorState Record() const;
  const WorldOptions& options() const { return options_; }
  const MembershipRules& rules() const { return rules_; }

 private:
  struct Watch {
    std::string worker_id;
    int64_t known_generation;
    JobState known_state;
    HeartbeatCallback done;
  };
  // Answers computed under the lock, delivered after it is released (heartbeats answered at once;
  // the watches a change or an expiry fires are queued in fired_ instead).
  struct Answers {
    std::vector<std::pair<HeartbeatCallback, absl::StatusOr<HeartbeatOutcome>>> heartbeats;
    std::vector<EventLog::Answer> events;
  };

  WorldManager(WorldOptions options, StateStore* store, Membership membership,
               int64_t generation);

  // Runs `rule` (which fills a Change) under the lock, then commits the change (generation,
  // events, journal) and answers the watches it concerns.
  template <typename Rule>
  auto Mutate(Rule rule, size_t fired_at_most = kAllFired)
      -> decltype(rule(std::declval<Change*>()));
  // Ends the generation if the change asks to, numbers its events, journals what it touched.
  // Returns the members it recorded.
  // Marks the world as having run at this generation, and as formed, if it runs now (see
  // Membership::ran and Membership::formed).
  void NoteRunningLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::set<std::string> CommitLocked(Change change) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The heartbeats a change of the world from `before` concerns, and event watches with news.
  Answers TakeChangedWatchesLocked(const World& before, const std::set<std::string>& touched)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Delivers `answers`, then up to `fired_at_most` fired watches (see AnswerFired).
  void Deliver(Answers answers, size_t fired_at_most = kAllFired);
  // Queues fired watches, to be answered with the world as it is when they are answered.
  void FireLocked(std::vector<Watch> fired) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<HeartbeatOutcome> OutcomeLocked(const std::string& worker_id,
                                                 const World& world) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  bool WatchFires(const World& world, const Watch& watch) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  bool LiveLocked(const std::string& worker_id, uint64_t incarnation) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // A leaver that must stay for now (set_leaver_hold).
  bool HeldLocked(const shard::Member& member) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Once every rank of the running world reported the end of training, the job stops.
  void StopIfTrainingFinished(const std::string& summary, absl::Time now, Change* change)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  World WorldLocked() const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // A live member making a call of its generation (a self-check, planning, reports): Aborted
  // rather than NotFound once it departed, since that generation is over for it.
  absl::StatusOr<shard::Member*> GenerationMemberLocked(const std::string& worker_id,
                                                        uint64_t incarnation)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<HeartbeatOutcome> HeartbeatLocked(const std::string& worker_id,
                                                   uint64_t incarnation, absl::Time now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const WorldOptions options_;
  const MembershipRules rules_;
  StateStore* const store_;
  bool recovered_ = false;
  bool kept_generation_ = false;
  mutable absl::Mutex mu_;
  Membership membership_ ABSL_GUARDED_BY(mu_);
  int64_t generation_ ABSL_GUARDED_BY(mu_);
  EventLog events_ ABSL_GUARDED_BY(mu_);
  MembershipLog log_ ABSL_GUARDED_BY(mu_);
  std::function<void(int64_t)> generation_listener_ ABSL_GUARDED_BY(mu_);
  RunningListener running_listener_ ABSL_GUARDED_BY(mu_);
  std::function<bool(const std::string&)> leaver_hold_ ABSL_GUARDED_BY(mu_);
  WaitList<Watch> watches_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, WaitList<Watch>::Id> watch_of_ ABSL_GUARDED_BY(mu_);  // by worker
  std::deque<Watch> fired_ ABSL_GUARDED_BY(mu_);  // fired, not answered yet, oldest first
};

}  // namespace shard
