// The worker's side of the control protocol (common/worker_core.h) driven event by event on a
// hand-advanced clock: joining, the heartbeat chain and its lease, the world's generations, what
// the end of a generation means, and how the process ends.
#include "common/worker_core.h"

#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shard {

// Readable failures for whole-step comparisons.
void PrintTo(const WorkerStep& step, std::ostream* os) {
  *os << "{next " << static_cast<int>(step.next) << ", wait " << step.wait << ", abort_below "
      << step.abort_below << " '" << step.abort_reason << "', report_failure "
      << (step.report_failure ? absl::StrCat("gen ", step.report_failure->generation) : "none")
      << ", probe " << step.probe.size() << "}";
}

namespace {

using ::testing::HasSubstr;

const absl::Time kT0 = absl::FromUnixSeconds(1000);
const absl::Duration kLease = absl::Seconds(2);
const absl::Duration kInterval = absl::Milliseconds(500);
const absl::Duration kCoordinatorTimeout = absl::Seconds(60);

WorkerCoreOptions Options() {
  WorkerCoreOptions options;
  options.worker_id = "w1";
  options.incarnation = 7;
  options.coordinator = "coord:7000";
  options.coordinator_timeout = kCoordinatorTimeout;
  return options;
}

// A world of two ranks at `generation`.
World MakeWorld(int64_t generation, JobState state = JobState::kRunning) {
  World world;
  world.state = state;
  world.generation = generation;
  world.world_size = world.expected_world_size = world.ranks = 2;
  return world;
}

JoinReply Joined(const World& world, int rank) {
  JoinReply reply;
  reply.outcome.rank = rank;
  reply.outcome.world = world;
  reply.lease = kLease;
  reply.heartbeat_interval = kInterval;
  reply.start.checkpoint_id = "ckpt-9";
  reply.start.step = 90;
  return reply;
}

HeartbeatReply Beat(const World& world, int rank) {
  HeartbeatReply reply;
  reply.outcome.world = world;
  reply.outcome.rank = rank;
  reply.orders.generation = world.generation;
  reply.orders.save_request = 4;
  reply.start.checkpoint_id = "ckpt-12";
  reply.start.step = 120;
  reply.start.in_memory = true;
  return reply;
}

// What this worker (w1, incarnation 7) sends.
HeartbeatParams Heartbeat(int64_t known_generation, absl::Duration wait) {
  HeartbeatParams params;
  params.worker_id = "w1";
  params.incarnation = 7;
  params.known_generation = known_generation;
  params.known_state = JobState::kRunning;
  params.wait = wait;
  return params;
}

LeaveParams Leave(std::string reason, bool failed) {
  LeaveParams params;
  params.worker_id = "w1";
  params.incarnation = 7;
  params.reason = std::move(reason);
  params.failed = failed;
  return params;
}

PeerFault Fault(int peer_rank) {
  PeerFault fault;
  fault.peer_rank = peer_rank;
  fault.how = LinkFailure::kReceive;
  fault.detail = "eof";
  return fault;
}

// Only the next call on the chain: no abort, no report, no probe.
WorkerStep Then(WorkerNext next, absl::Duration wait = absl::ZeroDuration()) {
  WorkerStep step;
  step.next = next;
  step.wait = wait;
  return step;
}

class WorkerCoreTest : public ::testing::Test {
 protected:
  // Starts and joins at kT0 as `rank` of `world`.
  void JoinAt(const World& world, int rank) {
    ASSERT_EQ(core_.Start(kT0), Then(WorkerNext::kJoin));
    ASSERT_EQ(core_.OnJoinReply(Joined(world, rank), kT0, kT0).next, WorkerNext::kHeartbeat);
  }
  // A heartbeat sent at `sent_at` answered 10ms later.
  WorkerStep BeatAt(const World& world, int rank, absl::Time sent_at) {
    return core_.OnHeartbeatReply(Beat(world, rank), sent_at, sent_at + absl::Milliseconds(10));
  }
  // Joins rank 0 of a running generation 3 and takes it.
  void TrainGeneration3() {
    JoinAt(MakeWorld(3), 0);
    ASSERT_TRUE(core_.TakeGeneration().has_value());
  }

  WorkerCore core_{Options()};
};

TEST_F(WorkerCoreTest, AnAcceptedJoinTakesTheWorldAndHeartbeatsAtOnce) {
  EXPECT_EQ(core_.Start(kT0), Then(WorkerNext::kJoin));
  EXPECT_FALSE(core_.member());
  const WorkerStep step = core_.OnJoinReply(Joined(MakeWorld(3), 1), kT0, kT0);
  EXPECT_EQ(step, Then(WorkerNext::kHeartbeat));  // the first world aborts nothing
  EXPECT_TRUE(core_.member());
  EXPECT_EQ(core_.world(), MakeWorld(3));
  EXPECT_EQ(core_.rank(), 1);
  EXPECT_EQ(core_.lease(), kLease);
  EXPECT_EQ(core_.heartbeat_interval(), kInterval);
  EXPECT_EQ(core_.start(), Joined(MakeWorld(3), 1).start);

  EXPECT_EQ(BeatAt(MakeWorld(3), 1, kT0 + absl::Seconds(1)), Then(WorkerNext::kHeartbeat));
  EXPECT_EQ(core_.orders(), Beat(MakeWorld(3), 1).orders);
  EXPECT_EQ(core_.start(), Beat(MakeWorld(3), 1).start);

  core_.OnPaused(3);
  HeartbeatParams expected = Heartbeat(3, kInterval);
  expected.paused_generation = 3;
  expected.activity.generation = 3;
  expected.activity.step = 95;
  expected.probed.resize(1);
  expected.probed[0].worker_id = "w2";
  expected.probed[0].reachable = true;
  EXPECT_EQ(core_.NextHeartbeat(expected.activity, expected.probed), expected);
}

TEST_F(WorkerCoreTest, ARefusedJoinAsksAgainWithGrowingWaitsAndNeverGivesUp) {
  core_.Start(kT0);
  const absl::Status full = absl::ResourceExhaustedError("the world is full");
  const absl::Status held = absl::AlreadyExistsError("rank 0 is still held");
  const int64_t expected_ms[] = {100, 200, 400, 800, 1600, 3200, 5000, 5000};
  absl::Time now = kT0;
  for (int i = 0; i < 8; ++i) {
    EXPECT_EQ(core_.OnJoinReply(i % 2 ? held : full, now, now),
              Then(WorkerNext::kJoin, absl::Milliseconds(expected_ms[i])));
    now += absl::Milliseconds(expected_ms[i]);
  }
  // An hour on, far past the coordinator timeout, it still asks.
  now = kT0 + absl::Hours(1);
  EXPECT_EQ(core_.OnJoinReply(full, now, now), Then(WorkerNext::kJoin, absl::Seconds(5)));
  EXPECT_FALSE(core_.ended());
}

TEST_F(WorkerCoreTest, AnUnreachableCoordinatorIsAskedAgainUntilTheTimeoutThenTheWorkerExits) {
  core_.Start(kT0);
  const absl::Status down = absl::UnavailableError("connection refused");
  const int64_t expected_ms[] = {100, 200, 400, 800, 1600, 2000, 2000};
  for (int i = 0; i < 7; ++i) {
    const absl::Time now = kT0 + absl::Seconds(i);
    EXPECT_EQ(core_.OnJoinReply(i == 3 ? absl::DeadlineExceededError("slow") : down, now, now),
              Then(WorkerNext::kJoin, absl::Milliseconds(expected_ms[i])));
  }
  // The next try lands exactly on the deadline (Start + 60s): still allowed; a moment later not.
  const absl::Time last = kT0 + absl::Seconds(58);
  EXPECT_EQ(core_.OnJoinReply(down, last, last), Then(WorkerNext::kJoin, absl::Seconds(2)));
  const absl::Time late = last + absl::Milliseconds(1);
  const WorkerStep step = core_.OnJoinReply(down, late, late);
  EXPECT_EQ(step.next, WorkerNext::kEnd);
  EXPECT_EQ(step.abort_below, kAbortAll);
  EXPECT_EQ(core_.exit_status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(core_.exit_status().message(), HasSubstr("coord:7000"));
  EXPECT_THAT(core_.exit_status().message(), HasSubstr("connection refused"));
  EXPECT_FALSE(core_.LeaveRequest().has_value());  // never joined: nothing to leave
}

TEST_F(WorkerCoreTest, AJobThatIsStoppingEndsTheWorkerCleanlyAndOtherJoinErrorsWithThemselves) {
  const absl::Status stopping =
      absl::FailedPreconditionError("job 'j' is stopping (done); it accepts no workers");
  EXPECT_TRUE(IsJobStoppingRefusal(stopping));
  core_.Start(kT0);
  EXPECT_EQ(core_.OnJoinReply(stopping, kT0, kT0).next, WorkerNext::kEnd);
  EXPECT_TRUE(core_.ended());
  EXPECT_TRUE(core_.exit_status().ok());
  EXPECT_EQ(core_.stop_reason(), stopping.message());
  EXPECT_FALSE(core_.LeaveRequest().has_value());

  for (const absl::Status& error :
       {absl::PermissionDeniedError("bad token"), absl::FailedPreconditionError("wrong job"),
        absl::InternalError("boom")}) {
    WorkerCore core(Options());
    core.Start(kT0);
    EXPECT_EQ(core.OnJoinReply(error, kT0, kT0).next, WorkerNext::kEnd);
    EXPECT_EQ(core.exit_status(), error);
  }
}

TEST_F(WorkerCoreTest, ANewerGenerationAbortsTheDataPathOfTheOldOne) {
  JoinAt(MakeWorld(0, JobState::kForming), 0);
  EXPECT_EQ(BeatAt(MakeWorld(1), 0, kT0), Then(WorkerNext::kHeartbeat));  // nothing ran at 0
  EXPECT_EQ(BeatAt(MakeWorld(1), 0, kT0), Then(WorkerNext::kHeartbeat));
  const WorkerStep step = BeatAt(MakeWorld(3), 0, kT0 + absl::Seconds(1));
  EXPECT_EQ(step.next, WorkerNext::kHeartbeat);
  EXPECT_EQ(step.abort_below, 3);
  EXPECT_THAT(step.abort_reason, HasSubstr("generation 1 ended"));
  EXPECT_THAT(step.abort_reason, HasSubstr("generation 3"));
}

TEST_F(WorkerCoreTest, AStopInAHeartbeatEndsTheWorkerWhichLeavesWithTheReason) {
  JoinAt(MakeWorld(3), 0);
  HeartbeatReply reply = Beat(MakeWorld(3), 0);
  reply.outcome.stop = true;
  reply.outcome.stop_reason = "trained to the end";
  const WorkerStep step = core_.OnHeartbeatReply(reply, kT0, kT0);
  EXPECT_EQ(step.next, WorkerNext::kEnd);
  EXPECT_EQ(step.abort_below, kAbortAll);
  EXPECT_TRUE(core_.exit_status().ok());
  EXPECT_EQ(core_.LeaveRequest(), Leave("trained to the end", /*failed=*/false));
}

TEST_F(WorkerCoreTest, AWorkerDeclaredDeadRejoinsAndTrainsNothingUntilItIsBack) {
  JoinAt(MakeWorld(3), 0);
  const absl::Time now = kT0 + absl::Seconds(5);
  EXPECT_EQ(core_.OnHeartbeatReply(absl::NotFoundError("unknown worker"), now, now),
            Then(WorkerNext::kJoin));
  EXPECT_FALSE(core_.member());
  EXPECT_FALSE(core_.HasGenerationToTrain());
  EXPECT_FALSE(core_.TakeGeneration().has_value());
  EXPECT_FALSE(core_.LeaveRequest().has_value());
  EXPECT_EQ(core_.OnJoinReply(Joined(MakeWorld(4), 1), now, now).abort_below, 4);
  EXPECT_TRUE(core_.member());
  EXPECT_EQ(core_.TakeGeneration(), (GenerationAssignment{4, 1, 2}));
}

TEST_F(WorkerCoreTest, AnUnreachableCoordinatorIsHeartbeatenAgainUntilItIsLost) {
  JoinAt(MakeWorld(3), 0);
  // The last answered call was sent at +1s and answered at +1.5s: silence counts from +1s.
  const absl::Time contact = kT0 + absl::Seconds(1);
  core_.OnHeartbeatReply(Beat(MakeWorld(3), 0), contact, contact + absl::Milliseconds(500));
  EXPECT_FALSE(core_.TakeReportAllHeld());
  const absl::Status down = absl::UnavailableError("connection reset");
  const int64_t expected_ms[] = {50, 100, 200, 400, 500, 500};  // capped at the interval
  for (int i = 0; i < 6; ++i) {
    const absl::Time now = contact + absl::Seconds(10 * i);
    EXPECT_EQ(core_.OnHeartbeatReply(down, now, now),
              Then(WorkerNext::kHeartbeat, absl::Milliseconds(expected_ms[i])));
  }
  EXPECT_TRUE(core_.TakeReportAllHeld());
  EXPECT_FALSE(core_.TakeReportAllHeld());
  const absl::Time edge = contact + kCoordinatorTimeout;
  EXPECT_EQ(core_.OnHeartbeatReply(down, edge, edge).next, WorkerNext::kHeartbeat);
  const absl::Time lost = edge + absl::Milliseconds(1);
  EXPECT_EQ(core_.OnHeartbeatReply(down, lost, lost).next, WorkerNext::kEnd);
  EXPECT_EQ(core_.exit_status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(core_.exit_status().message(), HasSubstr("lost the coordinator at coord:7000"));
}

TEST_F(WorkerCoreTest, ATakenOverWorkerExitsWithoutLeaving) {
  JoinAt(MakeWorld(3), 0);
  const absl::Status taken = absl::FailedPreconditionError("taken over by incarnation 8");
  const WorkerStep step = core_.OnHeartbeatReply(taken, kT0, kT0);
  EXPECT_EQ(step.next, WorkerNext::kEnd);
  EXPECT_EQ(step.abort_below, kAbortAll);
  EXPECT_TRUE(core_.taken_out());
  EXPECT_FALSE(core_.member());
  EXPECT_FALSE(core_.LeaveRequest().has_value());
  EXPECT_EQ(core_.exit_status(), taken);
}

TEST_F(WorkerCoreTest, TheLeaseRunsFromTheLastAnsweredCallAndCutsTrainingOffOnce) {
  EXPECT_EQ(core_.LeaseExpiry(), absl::InfiniteFuture());  // never joined
  core_.Start(kT0);
  core_.OnJoinReply(Joined(MakeWorld(3), 0), kT0, kT0 + absl::Milliseconds(100));
  EXPECT_EQ(core_.LeaseExpiry(), kT0 + kLease);
  const absl::Time sent = kT0 + absl::Milliseconds(300);
  core_.OnHeartbeatReply(Beat(MakeWorld(3), 0), sent, sent + absl::Milliseconds(500));
  EXPECT_EQ(core_.LeaseExpiry(), sent + kLease);
  // An answer to an older call does not move it back.
  core_.OnHeartbeatReply(Beat(MakeWorld(3), 0), kT0, sent + absl::Seconds(1));
  EXPECT_EQ(core_.LeaseExpiry(), sent + kLease);

  EXPECT_EQ(core_.OnLeaseCheck(sent + kLease - absl::Nanoseconds(1)), WorkerStep{});
  const WorkerStep cut = core_.OnLeaseCheck(sent + kLease);
  EXPECT_EQ(cut.next, WorkerNext::kWait);
  EXPECT_EQ(cut.abort_below, kAbortAll);
  EXPECT_THAT(cut.abort_reason, HasSubstr("coord:7000"));
  EXPECT_EQ(core_.LeaseExpiry(), absl::InfiniteFuture());
  EXPECT_EQ(core_.OnLeaseCheck(sent + kLease + absl::Seconds(5)), WorkerStep{});

  const absl::Time back = sent + absl::Seconds(10);
  EXPECT_EQ(BeatAt(MakeWorld(3), 0, back), Then(WorkerNext::kHeartbeat));  // nothing failed
  EXPECT_EQ(core_.LeaseExpiry(), back + kLease);
}

TEST_F(WorkerCoreTest, AfterACutOffTheFailedGenerationIsReportedAgainWhileItIsCurrent) {
  TrainGeneration3();
  const WorkerStep failed =
      core_.OnGenerationEnded(3, absl::AbortedError("peer 1 closed"), {Fault(1)});
  ASSERT_TRUE(failed.report_failure.has_value());
  core_.OnFailureReported(*failed.report_failure, absl::OkStatus());
  EXPECT_FALSE(BeatAt(MakeWorld(3), 0, kT0 + absl::Seconds(1)).report_failure.has_value());

  core_.OnLeaseCheck(core_.LeaseExpiry());
  const WorkerStep back = BeatAt(MakeWorld(3), 0, kT0 + absl::Seconds(10));
  EXPECT_EQ(back.next, WorkerNext::kHeartbeat);
  EXPECT_EQ(back.report_failure, failed.report_failure);
  EXPECT_FALSE(BeatAt(MakeWorld(3), 0, kT0 + absl::Seconds(11)).report_failure.has_value());

  // Cut off again, and the world has moved on meanwhile: that failure is old news.
  core_.OnLeaseCheck(core_.LeaseExpiry());
  const WorkerStep moved = BeatAt(MakeWorld(4), 0, kT0 + absl::Seconds(20));
  EXPECT_FALSE(moved.report_failure.has_value());
  EXPECT_EQ(moved.abort_below, 4);
}

TEST_F(WorkerCoreTest, OnlyARankOfATrainingWorldHasAGenerationToTrainAndOnlyOnce) {
  JoinAt(MakeWorld(2, JobState::kForming), 0);
  EXPECT_FALSE(core_.HasGenerationToTrain());
  BeatAt(MakeWorld(3), -1, kT0);  // a standby
  EXPECT_FALSE(core_.HasGenerationToTrain());
  EXPECT_FALSE(core_.TakeGeneration().has_value());
  BeatAt(MakeWorld(3), 1, kT0);
  EXPECT_TRUE(core_.HasGenerationToTrain());
  EXPECT_EQ(core_.TakeGeneration(), (GenerationAssignment{3, 1, 2}));
  EXPECT_FALSE(core_.HasGenerationToTrain());
  EXPECT_FALSE(core_.TakeGeneration().has_value());

  core_.OnPaused(3);
  EXPECT_EQ(core_.NextHeartbeat({}, {}).paused_generation, 3);
  BeatAt(MakeWorld(4, JobState::kReshaping), 0, kT0);
  EXPECT_EQ(core_.NextHeartbeat({}, {}).paused_generation, 3);  // until the next is taken
  EXPECT_EQ(core_.TakeGeneration(), (GenerationAssignment{4, 0, 2}));
  EXPECT_EQ(core_.paused_generation(), 0);
  EXPECT_EQ(core_.NextHeartbeat({}, {}).paused_generation, 0);
}

TEST_F(WorkerCoreTest, ADataPathFailureOfTheCurrentGenerationIsReportedAndOfAnOlderOneIsNot) {
  TrainGeneration3();
  EXPECT_EQ(core_.OnGenerationEnded(3, absl::OkStatus(), {}), WorkerStep{});
  const std::vector<PeerFault> peers = {Fault(1)};
  for (const absl::Status& status :
       {absl::AbortedError("peer 1 closed"), absl::UnavailableError("connect refused"),
        absl::DeadlineExceededError("collective timed out")}) {
    const WorkerStep step = core_.OnGenerationEnded(3, status, peers);
    EXPECT_EQ(step.next, WorkerNext::kWait);
    EXPECT_EQ(step.abort_below, 0);
    ASSERT_TRUE(step.report_failure.has_value());
    EXPECT_EQ(step.report_failure->worker_id, "w1");
    EXPECT_EQ(step.report_failure->incarnation, 7u);
    EXPECT_EQ(step.report_failure->generation, 3);
    EXPECT_FALSE(step.report_failure->passed);
    EXPECT_EQ(step.report_failure->detail, status.message());
    EXPECT_EQ(step.report_failure->unreachable, peers);
  }
  EXPECT_EQ(core_.OnGenerationEnded(2, absl::AbortedError("old"), peers), WorkerStep{});
  EXPECT_FALSE(core_.ended());
}

TEST_F(WorkerCoreTest, AFailureReportThatWasNotSentGoesAgainWithTheNextAnswerAtItsGeneration) {
  TrainGeneration3();
  const SelfCheckReport report =
      *core_.OnGenerationEnded(3, absl::AbortedError("peer 1 closed"), {}).report_failure;
  core_.OnFailureReported(report, absl::UnavailableError("no route"));
  EXPECT_EQ(BeatAt(MakeWorld(3), 0, kT0 + absl::Seconds(1)).report_failure, report);
  EXPECT_FALSE(BeatAt(MakeWorld(3), 0, kT0 + absl::Seconds(2)).report_failure.has_value());

  core_.OnFailureReported(report, absl::UnavailableError("no route"));
  EXPECT_FALSE(BeatAt(MakeWorld(4), 0, kT0 + absl::Seconds(3)).report_failure.has_value());
  // A send failing after the world moved on changes nothing.
  core_.OnFailureReported(report, absl::UnavailableError("no route"));
  EXPECT_FALSE(BeatAt(MakeWorld(4), 0, kT0 + absl::Seconds(4)).report_failure.has_value());
}

TEST_F(WorkerCoreTest, AnErrorOfItsOwnEndsTheWorkerWhileTheGenerationIsStillItsOwn) {
  TrainGeneration3();
  const absl::Status error = absl::NotFoundError("cannot restore checkpoint ckpt-9");
  EXPECT_EQ(core_.OnGenerationEnded(3, error, {}), Then(WorkerNext::kAskStillMine));
  EXPECT_EQ(core_.StillMineRequest(), Heartbeat(3, absl::ZeroDuration()));
  const absl::Time now = kT0 + absl::Seconds(1);
  const WorkerStep step = core_.OnStillMineReply(Beat(MakeWorld(3), 0), now, now);
  EXPECT_EQ(step.next, WorkerNext::kEnd);
  EXPECT_EQ(step.abort_below, kAbortAll);
  EXPECT_EQ(core_.exit_status(), error);
  EXPECT_EQ(core_.LeaveRequest(), Leave("cannot restore checkpoint ckpt-9", /*failed=*/true));
}

TEST_F(WorkerCoreTest, AnErrorOfItsOwnInAGenerationThatIsOverEndsOnlyThatGeneration) {
  TrainGeneration3();
  const absl::Status error = absl::InternalError("shape mismatch");
  core_.OnGenerationEnded(3, error, {});
  // The coordinator does not answer: ask again, 50ms doubling up to the heartbeat interval.
  const int64_t expected_ms[] = {50, 100, 200, 400, 500, 500};
  for (int64_t ms : expected_ms) {
    EXPECT_EQ(core_.OnStillMineReply(absl::UnavailableError("down"), kT0, kT0),
              Then(WorkerNext::kAskStillMine, absl::Milliseconds(ms)));
  }
  const absl::Time now = kT0 + absl::Seconds(1);
  const WorkerStep moved = core_.OnStillMineReply(Beat(MakeWorld(4), 0), now, now);
  EXPECT_EQ(moved.next, WorkerNext::kWait);
  EXPECT_EQ(moved.abort_below, 4);
  EXPECT_FALSE(core_.ended());
  // Declared dead: the heartbeat chain rejoins; this chain just stops.
  core_.TakeGeneration();
  core_.OnGenerationEnded(4, error, {});
  EXPECT_EQ(core_.OnStillMineReply(absl::NotFoundError("unknown worker"), now, now),
            WorkerStep{});
  EXPECT_FALSE(core_.ended());
  // An error of a generation the world already left asks nothing.
  EXPECT_EQ(core_.OnGenerationEnded(3, error, {}), WorkerStep{});
}

TEST_F(WorkerCoreTest, StopAndFailEndTheWorkerAndTheLeaveSaysWhy) {
  JoinAt(MakeWorld(3), 0);
  const WorkerStep step = core_.RequestStop("SIGTERM");
  EXPECT_EQ(step.next, WorkerNext::kEnd);
  EXPECT_EQ(step.abort_below, kAbortAll);
  EXPECT_THAT(step.abort_reason, HasSubstr("SIGTERM"));
  core_.RequestStop("the coordinator's stop");
  EXPECT_EQ(core_.stop_reason(), "SIGTERM");
  EXPECT_TRUE(core_.exit_status().ok());
  EXPECT_EQ(core_.LeaveRequest(), Leave("SIGTERM", /*failed=*/false));
  // Every later reply ends too.
  EXPECT_EQ(BeatAt(MakeWorld(3), 0, kT0).next, WorkerNext::kEnd);

  WorkerCore failing(Options());
  failing.Start(kT0);
  failing.OnJoinReply(Joined(MakeWorld(3), 0), kT0, kT0);
  EXPECT_EQ(failing.Fail(absl::DataLossError("disk gone")).next, WorkerNext::kEnd);
  EXPECT_EQ(failing.exit_status(), absl::DataLossError("disk gone"));
  EXPECT_EQ(failing.LeaveRequest(), Leave("disk gone", /*failed=*/true));
}

TEST_F(WorkerCoreTest, AStaleStillMineReplyDoesNotTakeTheWorldBackAndEndTheWorker) {
  TrainGeneration3();
  core_.OnGenerationEnded(3, absl::InternalError("shape mismatch"), {});
  BeatAt(MakeWorld(4), 0, kT0 + absl::Seconds(1));  // the long poll, answered first
  const absl::Time now = kT0 + absl::Seconds(2);
  EXPECT_EQ(core_.OnStillMineReply(Beat(MakeWorld(3), 0), kT0 + absl::Seconds(1), now).next,
            WorkerNext::kWait);
  EXPECT_FALSE(core_.ended());
  EXPECT_EQ(core_.world().generation, 4);
}

TEST_F(WorkerCoreTest, ARefusedJoinIsAnAnswerSoTheUnreachableTimeoutCountsFromIt) {
  core_.Start(kT0);
  const absl::Time now = kT0 + absl::Seconds(90);
  core_.OnJoinReply(absl::ResourceExhaustedError("the world is full"), now, now);
  const absl::Time blip = now + absl::Seconds(1);
  EXPECT_EQ(core_.OnJoinReply(absl::UnavailableError("restarting"), blip, blip),
            Then(WorkerNext::kJoin, absl::Milliseconds(100)));
}

TEST_F(WorkerCoreTest, AStillMineAnswerThatStopsOrRefusesEndsTheWorkerAsAHeartbeatWould) {
  TrainGeneration3();
  core_.OnGenerationEnded(3, absl::InternalError("shape mismatch"), {});
  HeartbeatReply stop = Beat(MakeWorld(3), 0);
  stop.outcome.stop = true;
  stop.outcome.stop_reason = "operator stop";
  const absl::Time now = kT0 + absl::Seconds(1);
  EXPECT_EQ(core_.OnStillMineReply(stop, now, now).next, WorkerNext::kEnd);
  EXPECT_TRUE(core_.exit_status().ok());
  EXPECT_EQ(core_.LeaveRequest(), Leave("operator stop", /*failed=*/false));

  WorkerCore taken(Options());
  taken.Start(kT0);
  taken.OnJoinReply(Joined(MakeWorld(3), 0), kT0, kT0);
  taken.TakeGeneration();
  taken.OnGenerationEnded(3, absl::InternalError("shape mismatch"), {});
  EXPECT_EQ(taken.OnStillMineReply(absl::FailedPreconditionError("taken over"), now, now).next,
            WorkerNext::kEnd);
  EXPECT_TRUE(taken.taken_out());
  EXPECT_EQ(taken.LeaveRequest(), std::nullopt);
}

}  // namespace
}  // namespace shard
