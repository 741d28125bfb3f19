#include "common/worker_core.h"

#include <algorithm>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace shard {
namespace {

// The coordinator answered but cannot take this worker yet (the world is full, or the rank
// asked for is still held by a predecessor whose lease has not run out).
bool IsRefusedForNow(const absl::Status& status) {
  return absl::IsResourceExhausted(status) || absl::IsAlreadyExists(status);
}

// The next call on the event's chain, and nothing else to do.
WorkerStep Then(WorkerNext next, absl::Duration wait = absl::ZeroDuration()) {
  WorkerStep step;
  step.next = next;
  step.wait = wait;
  return step;
}

}  // namespace

bool IsJobStoppingRefusal(const absl::Status& status) {
  return absl::IsFailedPrecondition(status) && absl::StrContains(status.message(), " is stopping (");
}

WorkerCore::WorkerCore(WorkerCoreOptions options) : options_(std::move(options)) {}

WorkerStep WorkerCore::Start(absl::Time now) { return Rejoin(now); }

WorkerStep WorkerCore::Rejoin(absl::Time now) {
  member_ = false;
  join_deadline_ = now + options_.coordinator_timeout;
  join_refused_.Reset();
  join_unreachable_.Reset();
  return Then(WorkerNext::kJoin);
}

WorkerStep WorkerCore::OnJoinReply(const absl::StatusOr<JoinReply>& reply, absl::Time sent_at,
                                   absl::Time now) {
  if (ended()) return End();
  if (reply.ok()) {
    WorkerStep step = Then(WorkerNext::kHeartbeat);
    member_ = true;
    joined_once_ = true;
    heartbeat_interval_ = reply->heartbeat_interval;
    lease_ = reply->lease;
    heartbeat_unreachable_.set_max(heartbeat_interval_);
    still_mine_unreachable_.set_max(heartbeat_interval_);
    heartbeat_unreachable_.Reset();
    start_ = reply->start;
    NoteContact(sent_at);
    UpdateWorld(reply->outcome.world, reply->outcome.rank, &step);
    return step;
  }
  const absl::Status& status = reply.status();
  if (IsRefusedForNow(status)) {
    // However long it takes: a restarted pod must not crash-loop while its predecessor's lease
    // runs out. An answer is contact: the timeout counts silence only.
    join_deadline_ = now + options_.coordinator_timeout;
    return Then(WorkerNext::kJoin, join_refused_.Next());
  }
  if (IsJobStoppingRefusal(status)) return RequestStop(std::string(status.message()));
  if (!IsTransient(status)) return Fail(status);
  const absl::Duration wait = join_unreachable_.Next();
  if (now + wait > join_deadline_) {
    return Fail(absl::UnavailableError(absl::StrCat(
        "cannot reach the coordinator at ", options_.coordinator, " for ",
        absl::FormatDuration(options_.coordinator_timeout), " (last error: ", status.message(),
        "); is shard-coordinator running there? Check --coordinator")));
  }
  return Then(WorkerNext::kJoin, wait);
}

HeartbeatParams WorkerCore::NextHeartbeat(TrainingActivity activity,
                                          std::vector<PeerProbe> probed) const {
  HeartbeatParams params;
  params.worker_id = options_.worker_id;
  params.incarnation = options_.incarnation;
  // Long-poll: the coordinator answers as soon as the world changes, or after the interval.
  params.known_generation = world_.generation;
  params.known_state = world_.state;
  params.wait = heartbeat_interval_;
  params.paused_generation = paused_generation_;
  params.activity = activity;
  params.probed = std::move(probed);
  return params;
}

WorkerStep WorkerCore::OnHeartbeatReply(const absl::StatusOr<HeartbeatReply>& reply,
                                        absl::Time sent_at, absl::Time now) {
  if (ended()) return End();
  if (reply.ok()) {
    WorkerStep step = Then(WorkerNext::kHeartbeat);
    heartbeat_unreachable_.Reset();
    Answered(*reply, sent_at, &step);
    return ended() ? End(std::move(step)) : step;
  }
  const absl::Status& status = reply.status();
  // Declared dead (after a long pause, say) or the coordinator restarted without it: join again.
  if (absl::IsNotFound(status)) return Rejoin(now);
  if (IsTransient(status)) {
    report_all_held_ = true;
    const absl::Duration silent = now - last_contact_;
    if (silent > options_.coordinator_timeout) {
      return Fail(absl::UnavailableError(absl::StrCat(
          "lost the coordinator at ", options_.coordinator, " for ",
          absl::FormatDuration(absl::Trunc(silent, absl::Seconds(1))), ": ", status.message())));
    }
    return Then(WorkerNext::kHeartbeat, heartbeat_unreachable_.Next());
  }
  return Refused(status);
}

WorkerStep WorkerCore::Refused(const absl::Status& status) {
  // Taken over by a newer process with this worker id, or evicted because this one made no
  // progress: exit, without leaving (the coordinator no longer counts it).
  if (absl::IsFailedPrecondition(status)) {
    member_ = false;
    taken_out_ = true;
  }
  return Fail(status);
}

void WorkerCore::Answered(const HeartbeatReply& reply, absl::Time sent_at, WorkerStep* step) {
  NoteContact(sent_at);
  if (reply.outcome.world.generation < world_.generation) return;  // overtaken by a newer one
  orders_ = reply.orders;
  start_ = reply.start;
  UpdateWorld(reply.outcome.world, reply.outcome.rank, step);
  step->probe = reply.outcome.probe;
  if (reply.outcome.stop && !stop_) {
    stop_ = true;
    stop_reason_ = reply.outcome.stop_reason;
  }
}

absl::Time WorkerCore::LeaseExpiry() const {
  if (!joined_once_ || cut_off_ || ended()) return absl::InfiniteFuture();
  return last_contact_ + lease_;
}

WorkerStep WorkerCore::OnLeaseCheck(absl::Time now) {
  if (now < LeaseExpiry()) return {};
  // By now the coordinator counts this worker dead (if it is there at all): whatever this rank
  // trains can never be committed, and a world that replaced it may be training already.
  cut_off_ = true;
  WorkerStep step;
  step.abort_below = kAbortAll;
  step.abort_reason = absl::StrCat(
      "the coordinator at ", options_.coordinator, " has not answered for its lease (",
      absl::FormatDuration(lease_),
      "): it counts this worker dead, so this rank stops training (nothing it trains now could "
      "be committed) and rejoins once the coordinator answers");
  return step;
}

bool WorkerCore::TakeReportAllHeld() { return std::exchange(report_all_held_, false); }

bool WorkerCore::HasGenerationToTrain() const {
  return !ended() && member_ && Trains(world_.state) && rank_ >= 0 &&
         world_.generation > attempted_generation_;
}

std::optional<GenerationAssignment> WorkerCore::TakeGeneration() {
  if (!HasGenerationToTrain()) return std::nullopt;
  attempted_generation_ = world_.generation;
  paused_generation_ = 0;  // a new generation: whatever paused before is over
  failure_.reset();
  return GenerationAssignment{world_.generation, rank_, world_.world_size};
}

WorkerStep WorkerCore::OnGenerationEnded(int64_t generation, const absl::Status& status,
                                         std::vector<PeerFault> unreachable) {
  // Also after this worker finished: a new generation means the job is not finished (a rank
  // died before it reported the end), and every rank trains again from the restore point.
  if (status.ok() || ended()) return {};
  // The errors of a generation that is over (its restore point since removed by retention,
  // say) end that generation, not the process.
  if (world_.generation != generation) return {};
  if (absl::IsAborted(status) || IsTransient(status)) {
    // The data path failed (a peer died or hangs, the coordinator restarted): say so, so that
    // the coordinator ends the generation if it has not, and wait for the next one for as long
    // as the coordinator answers.
    failure_ = SelfCheckReport{options_.worker_id, options_.incarnation, generation,
                               /*passed=*/false, std::string(status.message()),
                               std::move(unreachable)};
    failure_untold_ = false;
    WorkerStep step;
    step.report_failure = failure_;
    return step;
  }
  // An error of its own: the process ends with it, unless the generation is no longer this
  // worker's. The heartbeat chain may not have heard yet (right after a long SIGSTOP, say), so
  // the coordinator is asked now.
  asking_generation_ = generation;
  asking_error_ = status;
  still_mine_unreachable_.Reset();
  return Then(WorkerNext::kAskStillMine);
}

HeartbeatParams WorkerCore::StillMineRequest() const {
  HeartbeatParams params;
  params.worker_id = options_.worker_id;
  params.incarnation = options_.incarnation;
  params.known_generation = asking_generation_;
  params.known_state = world_.state;
  params.paused_generation = paused_generation_;
  return params;  // wait zero: answered at once
}

WorkerStep WorkerCore::OnStillMineReply(const absl::StatusOr<HeartbeatReply>& reply,
                                        absl::Time sent_at, absl::Time /*now*/) {
  if (ended()) return {};
  if (absl::IsNotFound(reply.status())) return {};  // declared dead: the heartbeat rejoins
  if (reply.ok()) {
    WorkerStep step;
    Answered(*reply, sent_at, &step);
    if (ended()) return End(std::move(step));  // told to stop meanwhile
    if (world_.generation != asking_generation_) return step;
    return End(std::move(step), asking_error_);
  }
  // While the coordinator does not answer, ask again, until it does or the heartbeat chain
  // gives up on it.
  if (IsTransient(reply.status())) {
    return Then(WorkerNext::kAskStillMine, still_mine_unreachable_.Next());
  }
  if (absl::IsFailedPrecondition(reply.status())) return Refused(reply.status());
  return Fail(asking_error_);
}

void WorkerCore::OnFailureReported(const SelfCheckReport& report, const absl::Status& sent) {
  if (!sent.ok() && failure_.has_value() && failure_->generation == report.generation) {
    failure_untold_ = true;
  }
}

WorkerStep WorkerCore::RequestStop(const std::string& reason) {
  if (!stop_) {
    stop_ = true;
    stop_reason_ = reason;
  }
  return End();
}

WorkerStep WorkerCore::Fail(absl::Status status) { return End({}, std::move(status)); }

WorkerStep WorkerCore::End(WorkerStep step, absl::Status fatal) {
  if (fatal_.ok()) fatal_ = std::move(fatal);
  step.next = WorkerNext::kEnd;
  step.wait = absl::ZeroDuration();
  step.abort_below = kAbortAll;
  step.abort_reason = fatal_.ok() ? absl::StrCat("worker stopping: ", stop_reason_)
                                  : absl::StrCat("worker exiting: ", fatal_.message());
  return step;
}

std::optional<LeaveParams> WorkerCore::LeaveRequest() const {
  if (!member_) return std::nullopt;
  LeaveParams params;
  params.worker_id = options_.worker_id;
  params.incarnation = options_.incarnation;
  // A process that ends with an error says so: beyond --max-worker-failures the job fails.
  params.failed = !fatal_.ok();
  params.reason = params.failed ? std::string(fatal_.message()) : stop_reason_;
  return params;
}

void WorkerCore::UpdateWorld(const World& world, int rank, WorkerStep* step) {
  if (world.generation < world_.generation) return;  // a reply overtaken by a newer one
  if (world.generation > world_.generation && world_.generation > 0) {
    step->abort_below = world.generation;
    step->abort_reason = absl::StrCat("generation ", world_.generation,
                                      " ended; the world moved to generation ", world.generation);
  }
  world_ = world;
  rank_ = rank;
  if (failure_.has_value() && failure_->generation != world_.generation) failure_.reset();
  // Back in touch after a silence while the coordinator still runs the failed generation (it
  // restarted and kept it, say), or the report could not be sent: tell it again.
  if (failure_.has_value() && failure_untold_) {
    step->report_failure = failure_;
    failure_untold_ = false;
  }
}

void WorkerCore::NoteContact(absl::Time sent_at) {
  last_contact_ = std::max(last_contact_, sent_at);
  if (!cut_off_) return;
  cut_off_ = false;
  failure_untold_ = failure_.has_value();
}

}  // namespace shard
