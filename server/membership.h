// The world's membership as a value, and the rules that change it, as functions over it: who
// holds which rank, standbys, leavers, departures, and when a change ends the generation.
// No locks, no clock, no storage: WorldManager calls these under its lock with the time, and
// persists what they touched (MembershipLog); the simulation test drives the same code.
//
// Rules (docs/control-plane.md has the state machine they implement):
// - The world of a generation has ranks 0..R-1. Until it first forms, R is the target size. A
//   new worker takes the rank it asks for, else the rank it held before if free, else the
//   lowest free rank. A retried join (same id and incarnation) is idempotent; a restarted worker
//   (same id, new incarnation) keeps its rank.
// - A worker that finds every rank held waits as a standby (at most `max_standbys`; beyond them
//   the join is refused as transient: the worker retries). A standby takes the rank of a worker
//   that dies at once, and is folded in at a checkpoint boundary when the world is smaller than
//   its target (reshape.h).
// - The generation names one world: it ends (the number is bumped) when a world that has been
//   RUNNING at it changes hands (a join into a freed rank, a restart, a leave, a death, a
//   re-formation), so workers that may have connected at it reconnect. Joins while a world
//   forms do not bump it: a world of any size forms at one generation.
// - RUNNING: every rank is held by a live worker; FORMING otherwise; STOPPING/STOPPED after a
//   stop.
// - A worker silent for longer than the lease is dead. A freed rank goes to a standby at once;
//   else the job waits `reform_grace` for a replacement, then re-forms with the survivors
//   (reshape.h) if at least `min_world_size` remain at an allowed size.
// - A rank that cannot reach a peer says so; once a connect fails, the world re-forms with
//   members that reach one another and the others wait as isolated standbys, which take no rank
//   until a probe to every member passes (reachability.h).
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/types.h"

namespace shard {

struct MembershipRules {
  std::string job = "default";
  int max_world_size = 1;  // the job's world size: the largest world and the first target
  int min_world_size = 1;  // the fewest workers to re-form with
  int max_standbys = 1;    // live workers waiting without a rank
  absl::Duration lease = absl::Seconds(10);
  absl::Duration reform_grace = absl::Seconds(30);
  // Whether the job can run on this many workers (e.g. its global batch must divide over
  // them); the error says why not. Unset: any size.
  std::function<absl::Status(int)> check_size;
  size_t max_departed = 64;  // departed workers still shown in status
  int max_worker_failures = 3;  // the job fails beyond this many; negative: never

  bool Allowed(int world_size) const {
    return world_size >= 1 && (!check_size || check_size(world_size).ok());
  }
};

enum class Role { kActive, kStandby, kLeaving, kDeparted };

struct Member {
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
  int64_t done_generation = 0;    // the generation in which it finished training (recorded)
  int64_t paused_generation = 0;  // the generation in which its training paused (0: none)
  // What its training said it was doing, and when (not recorded: heartbeats carry it again).
  TrainingActivity activity;
  absl::Time activity_at;
  bool evicted = false;  // departed because it made no progress: this process may not return
  // Isolated: peers could not connect to it, so it takes no rank until a connectivity probe to
  // every member passes; says which links failed ("": not isolated). Kept across a rejoin.
  std::string unreachable;
  std::string probe_address;  // host:port that peers' connect probes reach (its snapshot server)
};

// A link a rank reported broken: `from` could not reach `to`.
struct BrokenLink {
  std::string from;
  std::string to;
  LinkFailure how = LinkFailure::kConnect;
  int64_t generation = 0;  // of the world in which it failed
  std::string detail;
};

// What one rule did: the events to record and whether the generation ends.
struct Change {
  std::vector<v1::MembershipEvent> events;
  bool bump = false;
};

// The members and their indexes, kept consistent by the mutators below.
class Membership {
 public:
  // A world of `ranks` free ranks aiming at `target` workers.
  Membership(int ranks, int target);

  const Member* Find(const std::string& id) const;
  // A live (not departed) member with this incarnation, or the error a stale caller gets:
  // NotFound (departed or unknown: join again), FailedPrecondition (taken over: exit).
  absl::StatusOr<Member*> FindLive(const std::string& id, uint64_t incarnation,
                                   const std::string& job);
  const std::map<std::string, Member>& members() const { return members_; }
  // For changes that need no record (leases, self-checks); the mutators below, Upsert and
  // Touch mark what the journal must record.
  Member* Mutable(const std::string& id);
  // `id`'s record changed (e.g. draining, done_generation).
  void Touch(const std::string& id);

  int ranks() const { return static_cast<int>(holders_.size()); }
  const std::string& holder(int rank) const { return holders_[rank]; }
  const std::vector<std::string>& holders() const { return holders_; }
  int held() const { return held_; }
  int count(Role role) const { return role_counts_[static_cast<int>(role)]; }
  int live() const { return count(Role::kActive) + count(Role::kStandby) + count(Role::kLeaving); }
  std::optional<int> LowestFreeRank() const;
  std::vector<int> FreeRanks() const;
  // Standbys in the order they arrived.
  std::vector<const Member*> Standbys() const;
  // Those of them that may take a rank: all but the isolated (Member::unreachable).
  std::vector<const Member*> ReadyStandbys() const;
  int draining() const;
  // Names of up to 8 holders, for messages.
  std::string HolderNames() const;
  // A live member (other than `except`) none of whose backends `capabilities` shares.
  const Member* IncompatibleWith(const std::vector<std::string>& capabilities,
                                 const std::string& except) const;

  // Creates `id` (departed, no rank) if unknown.
  Member& Upsert(const std::string& id);
  void Activate(Member& member, int rank);
  void MakeStandby(Member& member, absl::Time since);
  void MakeLeaving(Member& member, std::string detail);
  void Depart(Member& member, WorkerState state, std::string detail, absl::Time now);
  // The world becomes `size` ranks held by `keep` (active or standby members): a member keeps
  // its rank if it is below `size` and free, the others take the free ranks in order.
  void Renumber(const std::vector<std::string>& keep, int size);
  // Forgets the oldest departed members beyond `max_departed`.
  void PruneDeparted(size_t max_departed);

  // The job's phase (common/job_state.h). Only Advance moves it, with the event that happened:
  // the primitives above advance it when the last free rank is filled (kRanksHeld), a held
  // rank is freed (kRankFreed), or the last live worker of a stopping job departs.
  JobState phase() const { return phase_; }
  StopKind stop_kind() const { return stop_kind_; }
  bool stop_requested() const { return stop_kind_ != StopKind::kNone; }
  void Advance(JobEvent event);

  // The ids whose persistent record changed since the last call (live or departed now).
  std::set<std::string> TakeDirty();
  bool has_dirty() const { return !dirty_.empty(); }

  // Job-level fields, persisted with the members.
  int target = 0;
  bool formed = false;  // the world has formed at least once
  std::optional<absl::Time> free_rank_since;  // a rank of the formed world lost its worker
  int64_t connected_generation = 0;  // every rank passed its self-check at this generation
  std::string stop_reason;  // for people; stop_kind() says why the job stops
  int worker_failures = 0;  // workers that left with an error, over the job's life
  // The world of the current generation has been RUNNING: workers may have connected at it,
  // so a change of hands must end the generation.
  bool ran = false;
  // The links members reported broken since the world last connected in full, by (from, to)
  // (reachability.h; not recorded: a restarted coordinator learns them again).
  std::map<std::pair<std::string, std::string>, BrokenLink> broken_links;

 private:
  void SetRole(Member& member, Role role);
  void Release(Member& member);  // frees its rank, if it holds one
  void CountCapabilities(const Member& member, int delta);

  std::map<std::string, Member> members_;
  std::vector<std::string> holders_;  // member id per rank, "" = free
  int held_ = 0;
  std::set<int> free_ranks_;
  int role_counts_[4] = {0, 0, 0, 0};
  std::set<std::pair<absl::Time, std::string>> standby_order_;
  std::deque<std::pair<absl::Time, std::string>> departed_order_;
  std::map<std::vector<std::string>, int> live_capabilities_;  // sorted set -> live members
  std::set<std::string> dirty_;
  JobState phase_ = JobState::kForming;
  StopKind stop_kind_ = StopKind::kNone;
};

// --- Rules ----------------------------------------------------------------------------------------

// The world as workers see it at `generation`.
World WorldOf(const Membership& membership, int64_t generation, const MembershipRules& rules);
// What the world waits for, for people ("" when settled).
std::string Transition(const Membership& membership, const MembershipRules& rules,
                       absl::Time now);

absl::StatusOr<int> Join(Membership& membership, const MembershipRules& rules,
                         const JoinParams& params, int64_t generation, absl::Time now,
                         Change* change);
// A worker leaves (`params.failed`: its process exits with an error, which counts towards
// rules.max_worker_failures: beyond them, the job fails).
absl::Status Leave(Membership& membership, const MembershipRules& rules,
                   const LeaveParams& params, absl::Time now, Change* change);
// Declares the silent dead, gives their ranks to standbys and, past the grace period,
// re-forms with the survivors. Returns the dead.
std::vector<std::string> ExpireLeases(Membership& membership, const MembershipRules& rules,
                                      absl::Time now, Change* change);
// An operator's resize of a world that has not formed in this run: the forming world has `size`
// ranks at once (as a coordinator restarted on its state would make it), holders beyond them
// wait as standbys, waiting standbys take free ranks, and the world forms once every rank is
// held. (A world that has formed is reshaped at a step boundary instead: reshape.h.)
void ResizeFormingWorld(Membership& membership, int size, absl::Time now, Change* change);
// Stops the job: `why` is kStopRequested (an operator, a signal), kTrainingFinished or
// kJobFailed; the first stop's kind and reason stay.
void Stop(Membership& membership, JobEvent why, const std::string& reason, absl::Time now,
          Change* change);
// What a departed member's process is told: NotFound (join again), or for one evicted,
// FailedPrecondition (it must exit).
absl::Status DepartedStatus(const Member& member);
// The rank holder `worker_id` made no step progress while its peers waited on it (common/
// progress_lease.h): it departs as a dead worker would, and this process of it may not come back
// (it is hung; a restarted one may). `detail` says why.
absl::Status Evict(Membership& membership, const MembershipRules& rules,
                   const std::string& worker_id, uint64_t incarnation, const std::string& detail,
                   absl::Time now, Change* change);

v1::MembershipEvent MakeEvent(v1::MembershipEventKind kind, const std::string& worker_id,
                              int rank, std::string detail, absl::Time now);

}  // namespace shard
