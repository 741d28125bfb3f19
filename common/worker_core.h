// The worker's side of the control protocol as a deterministic state machine with no threads,
// sockets or clocks of its own, as server/coordinator_core.h is the coordinator's: join (or
// wait as a standby), keep the lease, follow the world's generations, decide what the end of a
// generation means (report it, ask whether it is still ours, or exit), and when to stop and
// leave. It takes events (a reply, a generation's end, the time) and returns what to do next.
// worker/agent.cc runs it over gRPC, threads and the data path; the deterministic simulation
// (tests/sim/) drives the same class over a simulated network and clock. docs/control-plane.md
// "The worker" lists its states and transitions.
//
// Not thread-safe: the shell serialises the events (the agent holds its mutex).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/backoff.h"
#include "common/control_types.h"

namespace shard {

struct WorkerCoreOptions {
  std::string worker_id;
  uint64_t incarnation = 0;
  std::string coordinator;  // its address, for messages
  // How long to keep trying while the coordinator cannot be reached (at a join and later).
  absl::Duration coordinator_timeout = absl::Seconds(60);
};

// A generation this worker trains in as a rank.
struct GenerationAssignment {
  int64_t generation = 0;
  int rank = -1;
  int world_size = 0;

  bool operator==(const GenerationAssignment&) const = default;
};

// What the shell sends next on the chain of calls the event belongs to (the join and
// heartbeat chain, or the question whether a failed generation is still this worker's).
enum class WorkerNext {
  kWait,          // nothing on this chain: wait for the next event
  kJoin,          // send a join after `wait`
  kHeartbeat,     // send NextHeartbeat() after `wait`
  kAskStillMine,  // send StillMineRequest() after `wait`
  kEnd,           // the process ends: stop the data path, send LeaveRequest() if any, exit
};

// What the shell does after an event.
struct WorkerStep {
  WorkerNext next = WorkerNext::kWait;
  absl::Duration wait;
  // Abort the data path (the communicator, a rendezvous) of every generation below this one,
  // with `abort_reason`: the world moved on, the process stops, or the coordinator's lease ran
  // out. 0: abort nothing.
  int64_t abort_below = 0;
  std::string abort_reason;
  // Tell the coordinator that this generation's data path failed (then OnFailureReported).
  std::optional<SelfCheckReport> report_failure;
  // An isolated standby: connect to these members and send the result with a later heartbeat.
  std::vector<PeerProbe> probe;

  bool operator==(const WorkerStep&) const = default;
};

// Everything below this generation: a stop aborts every data path.
inline constexpr int64_t kAbortAll = INT64_MAX;

class WorkerCore {
 public:
  explicit WorkerCore(WorkerCoreOptions options);

  // --- Joining: Start, then OnJoinReply for each answer (again after a heartbeat's NotFound).
  WorkerStep Start(absl::Time now);
  WorkerStep OnJoinReply(const absl::StatusOr<JoinReply>& reply, absl::Time sent_at,
                         absl::Time now);

  // --- The lease: a long-polling heartbeat chain.
  // `activity` is what the training does; `probed` the answer to an earlier step's `probe`.
  HeartbeatParams NextHeartbeat(TrainingActivity activity, std::vector<PeerProbe> probed) const;
  WorkerStep OnHeartbeatReply(const absl::StatusOr<HeartbeatReply>& reply, absl::Time sent_at,
                              absl::Time now);
  // When the coordinator will have counted this worker dead if it does not answer before
  // (InfiniteFuture while that is moot); OnLeaseCheck at or after it stops the training.
  absl::Time LeaseExpiry() const;
  WorkerStep OnLeaseCheck(absl::Time now);

  // --- Snapshot holdings: after the coordinator was away (it may have restarted and lost what
  // it knew), everything this worker holds is told again before the next heartbeat.
  bool TakeReportAllHeld();
  void OnHeldReportFailed() { report_all_held_ = true; }

  // --- Generations.
  // The generation this rank should train now, if any: running, a rank, and newer than the
  // last one taken. Taking it marks it attempted.
  bool HasGenerationToTrain() const;
  std::optional<GenerationAssignment> TakeGeneration();
  // Training paused at a re-formation's boundary: heartbeats say so until the next generation.
  void OnPaused(int64_t generation) { paused_generation_ = generation; }
  // The data path of `generation` ended with `status` (OK: trained or paused). Aborted or
  // transient: reported as failed, with the peers it could not reach (`unreachable`), and the
  // worker waits for the next generation. Any other error ends the process unless the
  // generation is no longer this worker's (asked with kAskStillMine).
  WorkerStep OnGenerationEnded(int64_t generation, const absl::Status& status,
                               std::vector<PeerFault> unreachable);
  HeartbeatParams StillMineRequest() const;  // a heartbeat that does not wait
  WorkerStep OnStillMineReply(const absl::StatusOr<HeartbeatReply>& reply, absl::Time sent_at,
                              absl::Time now);
  // A failure report was sent (or could not be: then it goes again after the next answer).
  void OnFailureReported(const SelfCheckReport& report, const absl::Status& sent);

  // --- Ending.
  WorkerStep RequestStop(const std::string& reason);  // a signal, or the coordinator's order
  WorkerStep Fail(absl::Status status);                // an error nothing here recovers from
  bool ended() const { return stop_ || !fatal_.ok(); }
  absl::Status exit_status() const { return fatal_; }
  // The leave to send as the process ends; none where the coordinator no longer counts this
  // worker a member (taken over, evicted, never joined).
  std::optional<LeaveParams> LeaveRequest() const;

  // --- What the coordinator last said.
  const World& world() const { return world_; }
  int rank() const { return rank_; }
  bool member() const { return member_; }
  const StepOrders& orders() const { return orders_; }
  const TrainingStartPoint& start() const { return start_; }
  int64_t paused_generation() const { return paused_generation_; }
  absl::Duration heartbeat_interval() const { return heartbeat_interval_; }
  absl::Duration lease() const { return lease_; }
  // When the newest call the coordinator answered was sent.
  absl::Time last_contact() const { return last_contact_; }
  const std::string& stop_reason() const { return stop_reason_; }
  // Taken over by a newer process or evicted as stuck: the training thread may hang where
  // nothing can abort it, so the shell exits the process after a grace even if it does not
  // return.
  bool taken_out() const { return taken_out_; }

 private:
  // Applies a world seen in a reply (not one older than known: a reply overtaken by a newer
  // one): aborts the data path of an ended generation.
  void UpdateWorld(const World& world, int rank, WorkerStep* step);
  // A heartbeat's answer, on either chain: contact, the world, the orders, a stop.
  void Answered(const HeartbeatReply& reply, absl::Time sent_at, WorkerStep* step);
  // A heartbeat refused: taken over or evicted (FailedPrecondition), or another error; ends.
  WorkerStep Refused(const absl::Status& status);
  void NoteContact(absl::Time sent_at);
  // Ends the process (with `fatal` as its error, unless it has one already).
  WorkerStep End(WorkerStep step = {}, absl::Status fatal = absl::OkStatus());
  WorkerStep Rejoin(absl::Time now);

  const WorkerCoreOptions options_;
  // Joining: the refused-for-now and the unreachable retries, and when to give up on the latter.
  Backoff join_refused_{absl::Milliseconds(100), absl::Seconds(5)};
  Backoff join_unreachable_{absl::Milliseconds(100), absl::Seconds(2)};
  absl::Time join_deadline_;
  // Heartbeats while the coordinator is unreachable: 50ms doubling, capped at the heartbeat
  // interval (a restarted coordinator must hear from this worker within the lease).
  Backoff heartbeat_unreachable_{absl::Milliseconds(50), absl::Seconds(1)};
  Backoff still_mine_unreachable_{absl::Milliseconds(50), absl::Seconds(1)};
  bool member_ = false;   // joined, and not since declared dead, taken over or evicted
  bool joined_once_ = false;
  bool taken_out_ = false;
  World world_;
  int rank_ = -1;
  absl::Duration heartbeat_interval_ = absl::Seconds(1);
  absl::Duration lease_ = absl::Seconds(4);
  StepOrders orders_;
  TrainingStartPoint start_;
  // When the newest call the coordinator answered was sent; whether it has been silent for a
  // lease since (training stopped).
  absl::Time last_contact_ = absl::InfinitePast();
  bool cut_off_ = false;
  bool report_all_held_ = false;
  int64_t attempted_generation_ = 0;
  int64_t paused_generation_ = 0;
  // The generation whose data path failed, and its report: told again when the coordinator
  // answers after a silence (it may have restarted and kept that generation) or when sending
  // it failed.
  std::optional<SelfCheckReport> failure_;
  bool failure_untold_ = false;
  // A generation that ended with an error of its own: ends the process if still this worker's.
  int64_t asking_generation_ = 0;
  absl::Status asking_error_;
  bool stop_ = false;
  std::string stop_reason_;
  absl::Status fatal_;
};

// The coordinator refuses a join because the job is stopping (server/membership.cc): there is
// nothing to join, and the worker exits cleanly.
bool IsJobStoppingRefusal(const absl::Status& status);

}  // namespace shard
