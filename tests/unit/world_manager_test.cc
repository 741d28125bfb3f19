#include "server/world_manager.h"

#include <map>
#include <optional>
#include <set>

#include "absl/strings/str_cat.h"
#include "google/protobuf/util/message_differencer.h"
#include "gtest/gtest.h"
#include "server/membership.h"
#include "server/membership_log.h"

namespace shard {
namespace {

class WorldManagerTest : public ::testing::Test {
 protected:
  static WorldOptions Options(int world_size, absl::Duration lease = absl::Seconds(2)) {
    WorldOptions options;
    options.job = "job1";
    options.expected_world_size = world_size;
    options.lease = lease;
    return options;
  }
  std::unique_ptr<WorldManager> Make(int world_size, absl::Duration lease = absl::Seconds(2)) {
    return Make(Options(world_size, lease));
  }
  std::unique_ptr<WorldManager> Make(const WorldOptions& options) {
    auto manager = WorldManager::Create(options, &store_, now_);
    EXPECT_TRUE(manager.ok()) << manager.status();
    (*manager)->set_generation_listener([this](int64_t g) { generations_seen_.push_back(g); });
    return std::move(*manager);
  }

  static JoinParams Params(const std::string& id, uint64_t incarnation = 1,
                           std::optional<int> rank = std::nullopt) {
    JoinParams params;
    params.worker_id = id;
    params.host = "127.0.0.1";
    params.device = "cpu";
    params.capabilities = {"gloo"};
    params.incarnation = incarnation;
    params.requested_rank = rank;
    return params;
  }

  const WorkerSnapshot* Find(const StatusSnapshot& status, const std::string& id) {
    for (const WorkerSnapshot& w : status.workers) {
      if (w.id == id) return &w;
    }
    return nullptr;
  }

  InMemoryStateStore store_;
  absl::Time now_ = absl::FromUnixSeconds(1700000000);
  std::vector<int64_t> generations_seen_;
};

TEST_F(WorldManagerTest, AssignsRanksInOrderAndFormsTheWorldAtOneGeneration) {
  auto world = Make(3);
  const int64_t g0 = world->world().generation;
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(world->world().state, JobState::kForming);
    auto joined = world->Join(Params(absl::StrCat("w", i)), now_);
    ASSERT_TRUE(joined.ok()) << joined.status();
    EXPECT_EQ(joined->rank, i);
    EXPECT_EQ(joined->world.generation, g0) << "nobody connected at it while it formed";
  }
  const World formed = world->world();
  EXPECT_EQ(formed.state, JobState::kRunning);
  EXPECT_EQ(formed.world_size, 3);
  EXPECT_EQ(formed.generation, g0);
  EXPECT_TRUE(generations_seen_.empty());
}

TEST_F(WorldManagerTest, RetriedJoinIsIdempotentAndRestartKeepsRankButBumpsGeneration) {
  auto world = Make(2);
  ASSERT_TRUE(world->Join(Params("a", 7), now_).ok());
  ASSERT_TRUE(world->Join(Params("b", 8), now_).ok());
  const int64_t formed = world->world().generation;

  auto retried = world->Join(Params("b", 8), now_);
  ASSERT_TRUE(retried.ok());
  EXPECT_EQ(retried->rank, 1);
  EXPECT_EQ(world->world().generation, formed) << "a retry is not a membership change";

  auto restarted = world->Join(Params("b", 9), now_);
  ASSERT_TRUE(restarted.ok());
  EXPECT_EQ(restarted->rank, 1);
  EXPECT_EQ(world->world().generation, formed + 1) << "peers must re-rendezvous";
  EXPECT_EQ(world->world().state, JobState::kRunning);
  // The old process is told it was taken over.
  auto old = world->Heartbeat("b", 8, now_);
  EXPECT_EQ(old.status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(WorldManagerTest, RequestedRankMustBeFreeAndInRange) {
  auto world = Make(3);
  ASSERT_TRUE(world->Join(Params("a", 1, 2), now_).ok());
  auto taken = world->Join(Params("b", 1, 2), now_);
  EXPECT_EQ(taken.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_NE(taken.status().message().find("held by live worker 'a'"), absl::string_view::npos)
      << taken.status();
  auto outside = world->Join(Params("b", 1, 3), now_);
  EXPECT_EQ(outside.status().code(), absl::StatusCode::kInvalidArgument);
  auto free_rank = world->Join(Params("b"), now_);
  ASSERT_TRUE(free_rank.ok());
  EXPECT_EQ(free_rank->rank, 0);
}

TEST_F(WorldManagerTest, AFullWorldKeepsStandbysUpToTheLimitThenSaysRetryNamingTheHolders) {
  WorldOptions options = Options(2);
  options.max_standbys = 1;
  auto world = Make(options);
  ASSERT_TRUE(world->Join(Params("a"), now_).ok());
  ASSERT_TRUE(world->Join(Params("b"), now_).ok());
  const int64_t generation = world->world().generation;
  auto standby = world->Join(Params("c"), now_);
  ASSERT_TRUE(standby.ok()) << standby.status();
  EXPECT_EQ(standby->rank, -1);
  EXPECT_EQ(world->world().standby, 1);
  auto extra = world->Join(Params("d"), now_);
  EXPECT_EQ(extra.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(extra.status().message().find("world is full"), absl::string_view::npos);
  EXPECT_NE(extra.status().message().find("a, b"), absl::string_view::npos) << extra.status();
  EXPECT_NE(extra.status().message().find("retrying"), absl::string_view::npos) << extra.status();
  EXPECT_EQ(world->world().generation, generation);
  // The standby's retried join is idempotent; a new process behind it stays a standby.
  EXPECT_EQ(world->Join(Params("c"), now_)->rank, -1);
  EXPECT_EQ(world->Join(Params("c", 2), now_)->rank, -1);
  EXPECT_EQ(world->world().standby, 1);
}

TEST_F(WorldManagerTest, ARequestedRankHeldByALiveWorkerIsRefusedForNow) {
  auto world = Make(2);
  ASSERT_TRUE(world->Join(Params("a", 1, 0), now_).ok());
  auto held = world->Join(Params("b", 1, 0), now_);
  EXPECT_EQ(held.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_NE(held.status().message().find("waiting for it to leave or be declared dead"),
            absl::string_view::npos)
      << held.status();
}

TEST_F(WorldManagerTest, InvalidJoinsAreRejected) {
  auto world = Make(2);
  EXPECT_EQ(world->Join(Params("../etc"), now_).status().code(),
            absl::StatusCode::kInvalidArgument);
  JoinParams no_host = Params("a");
  no_host.host = "";
  EXPECT_EQ(world->Join(no_host, now_).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(WorldManagerTest, AWorkerOfAnotherBackendIsRefusedNamingBoth) {
  auto world = Make(3);
  ASSERT_TRUE(world->Join(Params("a"), now_).ok());
  JoinParams nccl = Params("b");
  nccl.device = "cuda:0";
  nccl.capabilities = {"nccl"};
  const int64_t generation = world->world().generation;
  auto refused = world->Join(nccl, now_);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  for (const char* part : {"'b'", "cuda:0", "nccl", "'a'", "gloo", "--backend"}) {
    EXPECT_NE(refused.status().message().find(part), absl::string_view::npos)
        << part << " in " << refused.status();
  }
  EXPECT_EQ(world->world().generation, generation);
  // A GPU worker staging Gloo talks to CPU workers.
  JoinParams staged = Params("c");
  staged.device = "cuda:0";
  EXPECT_TRUE(world->Join(staged, now_).ok());
}

TEST_F(WorldManagerTest, ExpiredLeaseDeclaresDeadBumpsGenerationAndFreesTheRank) {
  auto world = Make(3, absl::Seconds(2));
  for (const char* id : {"a", "b", "c"}) ASSERT_TRUE(world->Join(Params(id), now_).ok());
  const int64_t formed = world->world().generation;

  // a and c keep heartbeating; b goes silent.
  for (int i = 1; i <= 4; ++i) {
    const absl::Time t = now_ + absl::Milliseconds(500 * i);
    ASSERT_TRUE(world->Heartbeat("a", 1, t).ok());
    ASSERT_TRUE(world->Heartbeat("c", 1, t).ok());
    EXPECT_TRUE(world->ExpireLeases(t).empty()) << "lease not yet expired at " << i;
  }
  const absl::Time late = now_ + absl::Milliseconds(2001);
  EXPECT_EQ(world->ExpireLeases(late), std::vector<std::string>{"b"});
  const World after = world->world();
  EXPECT_EQ(after.generation, formed + 1);
  EXPECT_EQ(after.state, JobState::kForming);
  EXPECT_EQ(after.world_size, 2);

  const StatusSnapshot status = world->Status(late);
  const WorkerSnapshot* b = Find(status, "b");
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->state, WorkerState::kDead);
  EXPECT_EQ(b->rank, -1);
  EXPECT_EQ(status.workers.back().id, "b") << "departed workers come after members";

  // The dead worker learns it must join again; it gets its old rank back while it is free.
  EXPECT_EQ(world->Heartbeat("b", 1, late).status().code(), absl::StatusCode::kNotFound);
  auto back = world->Join(Params("b", 1), late);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->rank, 1);
  EXPECT_EQ(world->world().state, JobState::kRunning);
  EXPECT_EQ(world->world().generation, formed + 1)
      << "the world re-forms at the generation the death began: nobody connected at it yet";
}

TEST_F(WorldManagerTest, SimultaneousDeathsBumpTheGenerationOnce) {
  auto world = Make(3, absl::Seconds(1));
  for (const char* id : {"a", "b", "c"}) ASSERT_TRUE(world->Join(Params(id), now_).ok());
  const int64_t formed = world->world().generation;
  ASSERT_TRUE(world->Heartbeat("a", 1, now_ + absl::Milliseconds(900)).ok());
  EXPECT_EQ(world->ExpireLeases(now_ + absl::Milliseconds(1500)).size(), 2u);
  EXPECT_EQ(world->world().generation, formed + 1);
}

TEST_F(WorldManagerTest, LeaveFreesTheRankAndStopEndsTheJobWhenTheLastOneLeaves) {
  auto world = Make(2);
  ASSERT_TRUE(world->Join(Params("a"), now_).ok());
  ASSERT_TRUE(world->Join(Params("b"), now_).ok());
  const int64_t formed = world->world().generation;
  ASSERT_TRUE(world->Leave({"a", 1, "maintenance"}, now_).ok());
  EXPECT_EQ(world->world().generation, formed + 1);
  EXPECT_TRUE(world->Leave({"a", 1, "maintenance"}, now_).ok()) << "a retried leave is fine";

  World stopping = world->RequestStop("operator", now_);
  EXPECT_EQ(stopping.state, JobState::kStopping);
  auto heartbeat = world->Heartbeat("b", 1, now_);
  ASSERT_TRUE(heartbeat.ok());
  EXPECT_TRUE(heartbeat->stop);
  EXPECT_EQ(heartbeat->stop_reason, "operator");
  EXPECT_EQ(world->Join(Params("c"), now_).status().code(),
            absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(world->Leave({"b", 1, "stopped"}, now_).ok());
  EXPECT_EQ(world->world().state, JobState::kFinished);
  EXPECT_EQ(world->world().generation, formed + 1) << "departures after a stop do not bump";
}

TEST_F(WorldManagerTest, SelfCheckDecidesReadinessOnlyForTheCurrentGeneration) {
  auto world = Make(2);
  ASSERT_TRUE(world->Join(Params("a"), now_).ok());
  ASSERT_TRUE(world->Join(Params("b"), now_).ok());
  const int64_t g = world->world().generation;
  EXPECT_EQ(world->ReportSelfCheck("a", 1, g - 1, true, "old", now_).code(),
            absl::StatusCode::kAborted);
  ASSERT_TRUE(world->ReportSelfCheck("a", 1, g, true, "ok", now_).ok());
  StatusSnapshot status = world->Status(now_);
  EXPECT_EQ(Find(status, "a")->state, WorkerState::kReady);
  EXPECT_EQ(Find(status, "b")->state, WorkerState::kJoining);

  ASSERT_TRUE(world->Join(Params("b", 2), now_).ok());  // b restarts: new generation
  status = world->Status(now_);
  EXPECT_EQ(Find(status, "a")->state, WorkerState::kJoining);
  EXPECT_EQ(Find(status, "a")->self_check.state, SelfCheckState::kPending);
}

TEST_F(WorldManagerTest, AFailedSelfCheckEndsTheGenerationSoThatEveryRankReconnects) {
  auto world = Make(2);
  ASSERT_TRUE(world->Join(Params("a"), now_).ok());
  ASSERT_TRUE(world->Join(Params("b"), now_).ok());
  const int64_t g = world->world().generation;
  ASSERT_TRUE(world->ReportSelfCheck("a", 1, g, true, "ok", now_).ok());
  ASSERT_TRUE(world->ReportSelfCheck("b", 1, g, false, "peer 0 reset the connection", now_).ok());
  EXPECT_EQ(world->world().generation, g + 1);
  EXPECT_EQ(world->world().state, JobState::kRunning) << "the same members reconnect";
  const v1::MembershipEvent last = world->Events(0).back();
  EXPECT_EQ(last.kind(), v1::MEMBERSHIP_EVENT_KIND_REFORMED);
  EXPECT_NE(last.detail().find("peer 0 reset the connection"), std::string::npos)
      << last.detail();
  // The other rank's report of the same failure comes too late to end another generation.
  EXPECT_EQ(world->ReportSelfCheck("a", 1, g, false, "reset", now_).code(),
            absl::StatusCode::kAborted);
  EXPECT_EQ(world->world().generation, g + 1);
  // A worker declared dead meanwhile hears that its generation is over, not that it is
  // unknown (its heartbeat rejoins).
  world->ExpireLeases(now_ + absl::Seconds(3));
  EXPECT_EQ(world->ReportSelfCheck("a", 1, g + 1, true, "ok", now_).code(),
            absl::StatusCode::kAborted);
  EXPECT_EQ(world->RunningMember("a", 1).status().code(), absl::StatusCode::kAborted);
}

TEST_F(WorldManagerTest, ANewWorldContinuesTheGenerationsOfTheStateDirectory) {
  int64_t before = 0;
  {
    auto world = Make(2);
    ASSERT_TRUE(world->Join(Params("a"), now_).ok());
    before = world->world().generation;
  }
  WorldOptions fresh = Options(2);
  fresh.recover = false;
  auto again = Make(fresh);
  EXPECT_FALSE(again->recovered());
  EXPECT_GT(again->world().generation, before);
  EXPECT_EQ(again->world().world_size, 0) << "workers must join the new coordinator";
  EXPECT_EQ(again->Heartbeat("a", 1, now_).status().code(), absl::StatusCode::kNotFound);

  WorldOptions other;
  other.job = "another-job";
  other.expected_world_size = 2;
  auto wrong = WorldManager::Create(other, &store_, now_);
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(wrong.status().message().find("job1"), absl::string_view::npos);
}

// A coordinator killed after its job's training finished (while the workers leave) and started
// again has nothing to run: the world comes back stopped, instead of a new run waiting for
// workers that have exited (the simulation's seeds 18514, 19020 and 19751).
TEST_F(WorldManagerTest, AFinishedJobComesBackStoppedAfterARestart) {
  int64_t generation = 0;
  {
    auto world = Make(2);
    for (const char* id : {"a", "b"}) ASSERT_TRUE(world->Join(Params(id), now_).ok());
    generation = world->world().generation;
    for (const char* id : {"a", "b"}) {
      ASSERT_TRUE(world->ReportTrainingDone(id, 1, "10 steps", now_).ok());
    }
    ASSERT_EQ(world->world().state, JobState::kStopping);
  }  // killed before the workers left
  ASSERT_EQ(*WorldManager::FindSavedWorld(&store_), WorldManager::SavedWorld::kEnded);
  auto again = Make(2);
  EXPECT_TRUE(again->recovered());
  EXPECT_EQ(again->world().state, JobState::kFinished);
  EXPECT_EQ(again->world().generation, generation);
  EXPECT_EQ(again->Heartbeat("a", 1, now_).status().code(), absl::StatusCode::kNotFound);

  // Started as a new run instead, it expects workers again.
  WorldOptions fresh = Options(2);
  fresh.recover = false;
  auto rerun = Make(fresh);
  EXPECT_EQ(rerun->world().state, JobState::kForming);
}

TEST_F(WorldManagerTest, AMembershipRecordOfAnUnknownFormatIsRefused) {
  v1::CoordinatorState future;
  future.set_format_version(9);
  future.set_job("job1");
  ASSERT_TRUE(store_.Save("membership", future).ok());
  WorldOptions options;
  options.job = "job1";
  EXPECT_EQ(WorldManager::Create(options, &store_, now_).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

// RESHAPING is a phase of its own: entered when the running generation is asked to pause, left
// when that generation ends (the reshape applied, or a re-formation), and never derived.
TEST_F(WorldManagerTest, AJobReshapesFromAPauseRequestUntilItsGenerationEnds) {
  auto world = Make(2);
  for (const char* id : {"a", "b"}) ASSERT_TRUE(world->Join(Params(id), now_).ok());
  const int64_t g = world->world().generation;
  EXPECT_FALSE(world->BeginReshaping(g + 1)) << "a generation that does not run";
  ASSERT_TRUE(world->BeginReshaping(g));
  EXPECT_EQ(world->world().state, JobState::kReshaping);
  EXPECT_FALSE(world->BeginReshaping(g)) << "once is enough";
  auto beat = world->Heartbeat("a", 1, now_);
  ASSERT_TRUE(beat.ok());
  EXPECT_EQ(beat->world.state, JobState::kReshaping);
  EXPECT_FALSE(beat->stop);
  const World reformed = world->Reform("the reshape applied", now_);
  EXPECT_EQ(reformed.generation, g + 1);
  EXPECT_EQ(reformed.state, JobState::kRunning);

  // A death while reshaping: the world forms again, and the pause went with its generation.
  ASSERT_TRUE(world->BeginReshaping(g + 1));
  ASSERT_TRUE(world->Leave({"b", 1, "gone"}, now_).ok());
  EXPECT_EQ(world->world().state, JobState::kForming);
}

// A worker whose training fails the same way wherever it restarts would be replaced forever:
// beyond --max-worker-failures (counted over the job's life, across coordinator restarts) the
// job stops and, once every worker has gone, has FAILED.
TEST_F(WorldManagerTest, WorkersThatExitWithAnErrorFailTheJobBeyondTheLimit) {
  WorldOptions options = Options(2);
  options.max_worker_failures = 1;
  {
    auto world = Make(options);
    for (const char* id : {"a", "b"}) ASSERT_TRUE(world->Join(Params(id), now_).ok());
    ASSERT_TRUE(world->Leave({"a", 1, "training failed: out of memory", /*failed=*/true}, now_)
                    .ok());
    EXPECT_EQ(world->world().state, JobState::kForming) << "one failure is within the limit";
    ASSERT_TRUE(world->Join(Params("a", 2), now_).ok());
    ASSERT_EQ(world->world().state, JobState::kRunning);
  }  // the coordinator restarts: the count is in its state
  auto world = Make(options);
  ASSERT_TRUE(world->recovered());
  ASSERT_TRUE(world->Join(Params("a", 2), now_).ok());
  ASSERT_TRUE(world->Join(Params("b", 1), now_).ok());
  ASSERT_TRUE(world->Leave({"a", 2, "training failed: out of memory", /*failed=*/true}, now_)
                  .ok());
  EXPECT_EQ(world->world().state, JobState::kStopping);
  auto beat = world->Heartbeat("b", 1, now_);
  ASSERT_TRUE(beat.ok());
  EXPECT_TRUE(beat->stop);
  EXPECT_NE(beat->stop_reason.find("2 workers exited with an error"), std::string::npos)
      << beat->stop_reason;
  // A worker leaving failed while the job already stops is not counted again.
  ASSERT_TRUE(world->Leave({"b", 1, "told to leave"}, now_).ok());
  EXPECT_EQ(world->world().state, JobState::kFailed);
  std::optional<v1::CoordinatorState> saved = *MembershipLog::Load(&store_, 10);
  ASSERT_TRUE(saved.has_value());
  EXPECT_EQ(saved->stop_kind(), v1::STOP_KIND_FAILED);
  EXPECT_EQ(saved->phase(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(saved->worker_failures(), 2);
  // Started again as it was, a failed job has nothing to run: it comes back failed.
  world.reset();
  ASSERT_EQ(*WorldManager::FindSavedWorld(&store_), WorldManager::SavedWorld::kEnded);
  auto again = Make(options);
  EXPECT_TRUE(again->recovered());
  EXPECT_EQ(again->world().state, JobState::kFailed);
}

TEST_F(WorldManagerTest, ALeaveWithoutAnErrorNeverFailsTheJob) {
  WorldOptions options = Options(1);
  options.max_worker_failures = 0;
  auto world = Make(options);
  for (uint64_t incarnation = 1; incarnation <= 3; ++incarnation) {
    ASSERT_TRUE(world->Join(Params("a", incarnation), now_).ok());
    ASSERT_TRUE(world->Leave({"a", incarnation, "rescheduled"}, now_).ok());
  }
  EXPECT_EQ(world->world().state, JobState::kForming);
}

// Records of earlier releases kept only how the stop read.
TEST_F(WorldManagerTest, TheStopKindOfARecordOfAnEarlierReleaseComesFromItsReason) {
  v1::CoordinatorState record;
  EXPECT_EQ(SavedStopKind(record), StopKind::kNone);
  record.set_stop_requested(true);
  record.set_stop_reason("training finished (100 steps)");
  EXPECT_EQ(SavedStopKind(record), StopKind::kTrained);
  record.set_stop_reason("coordinator received Terminated");
  EXPECT_EQ(SavedStopKind(record), StopKind::kOperator);
  record.set_stop_kind(v1::STOP_KIND_FAILED);
  EXPECT_EQ(SavedStopKind(record), StopKind::kFailed) << "the recorded kind wins";
}

TEST_F(WorldManagerTest, TheJournalHoldsWhatMemoryHoldsAndSurvivesSnapshots) {
  WorldOptions options = Options(40, absl::Seconds(2));
  options.max_events = 50;
  auto world = Make(options);
  // Enough changes for several snapshots (the journal is compacted once the deltas outgrow
  // 64 KiB or the snapshot), and departures, standbys and a stop among them.
  for (int round = 0; round < 30; ++round) {
    for (int i = 0; i < 40; ++i) {
      ASSERT_TRUE(world->Join(Params(absl::StrCat("w", i), round + 1), now_).ok());
    }
    ASSERT_TRUE(world->Join(Params(absl::StrCat("spare", round)), now_).ok());
    ASSERT_TRUE(world->Leave({absl::StrCat("w", round), uint64_t(round + 1), "moving"}, now_).ok());
  }
  auto saved = MembershipLog::Load(&store_, options.max_events);
  ASSERT_TRUE(saved.ok()) << saved.status();
  ASSERT_TRUE(saved->has_value());
  const v1::CoordinatorState memory = world->Record();
  std::string differences;
  google::protobuf::util::MessageDifferencer differencer;
  differencer.ReportDifferencesToString(&differences);
  EXPECT_TRUE(differencer.Compare(**saved, memory)) << differences;
  EXPECT_EQ(memory.events_size(), 50);
  EXPECT_EQ(memory.events().rbegin()->sequence(), memory.last_event_sequence());

  // A coordinator started on it takes the same world back.
  const World before = world->world();
  world.reset();
  auto again = Make(options);
  EXPECT_TRUE(again->recovered());
  EXPECT_EQ(again->world().generation, before.generation + 1) << "a world that had not connected";
  EXPECT_EQ(again->world().world_size, 40);
  EXPECT_EQ(again->world().standby, before.standby);
  EXPECT_GT(before.standby, 0);
}

TEST_F(WorldManagerTest, AnEarlierFormatsRecordIsTakenBackAndRewrittenAsAJournal) {
  v1::CoordinatorState legacy;
  legacy.set_format_version(1);
  legacy.set_job("job1");
  legacy.set_generation(7);
  legacy.set_ranks(1);
  legacy.set_formed(true);
  legacy.set_last_event_sequence(3);
  v1::MemberRecord* member = legacy.add_members();
  member->set_id("a");
  member->set_incarnation(1);
  member->set_rank(0);
  member->set_host("127.0.0.1");
  member->set_role(v1::MEMBER_ROLE_ACTIVE);
  ASSERT_TRUE(store_.Save("membership", legacy).ok());
  auto world = Make(1);
  EXPECT_TRUE(world->recovered());
  EXPECT_EQ(world->world().generation, 8);
  EXPECT_EQ(world->world().state, JobState::kRunning);
  EXPECT_EQ(world->Events(0).front().sequence(), 4) << "sequence numbers continue";
  auto saved = MembershipLog::Load(&store_, 10);
  ASSERT_TRUE(saved.ok() && saved->has_value());
  EXPECT_EQ((*saved)->format_version(), MembershipLog::kFormatVersion);
}

TEST_F(WorldManagerTest, HeartbeatWatchAnswersWhenTheWorldFormsNotOnEveryJoin) {
  auto world = Make(3);
  ASSERT_TRUE(world->Join(Params("a"), now_).ok());
  std::optional<absl::StatusOr<HeartbeatOutcome>> answer;
  HeartbeatParams params;
  params.worker_id = "a";
  params.incarnation = 1;
  params.known_generation = world->world().generation;
  params.known_state = JobState::kForming;
  params.wait = absl::Milliseconds(400);
  world->WatchHeartbeat(params, now_, [&](absl::StatusOr<HeartbeatOutcome> o) { answer = o; });
  EXPECT_FALSE(answer.has_value());
  ASSERT_TRUE(world->Join(Params("b"), now_).ok());
  EXPECT_FALSE(answer.has_value()) << "a join while forming concerns no one";
  ASSERT_TRUE(world->Join(Params("c"), now_).ok());
  ASSERT_TRUE(answer.has_value());
  ASSERT_TRUE(answer->ok());
  EXPECT_EQ((*answer)->world.state, JobState::kRunning);
  EXPECT_EQ((*answer)->rank, 0);
}

TEST_F(WorldManagerTest, HeartbeatWatchExpiresAndReportsADeadWorker) {
  auto world = Make(2, absl::Seconds(2));
  ASSERT_TRUE(world->Join(Params("a"), now_).ok());
  ASSERT_TRUE(world->Join(Params("b"), now_).ok());
  HeartbeatParams params;
  params.worker_id = "a";
  params.incarnation = 1;
  params.known_generation = world->world().generation;
  params.known_state = JobState::kRunning;
  params.wait = absl::Minutes(5);  // capped at a quarter lease
  int answers = 0;
  absl::StatusOr<HeartbeatOutcome> last = absl::UnknownError("none");
  auto record = [&](absl::StatusOr<HeartbeatOutcome> o) {
    ++answers;
    last = o;
  };
  world->WatchHeartbeat(params, now_, record);
  world->ExpireWatches(now_ + absl::Milliseconds(499));
  EXPECT_EQ(answers, 0);
  world->ExpireWatches(now_ + absl::Milliseconds(500));
  EXPECT_EQ(answers, 1);
  EXPECT_TRUE(last.ok());

  // A watch outstanding when its own worker is declared dead says so.
  params.worker_id = "b";
  world->WatchHeartbeat(params, now_, record);
  ASSERT_TRUE(world->Heartbeat("a", 1, now_ + absl::Milliseconds(1900)).ok());
  world->ExpireLeases(now_ + absl::Milliseconds(2100));
  EXPECT_EQ(answers, 2);
  EXPECT_EQ(last.status().code(), absl::StatusCode::kNotFound);
}

// At shutdown every held watch is answered with the reason, and so is every later one: a client
// that asks again at once (shardctl events --follow) must not hold the server open forever.
TEST_F(WorldManagerTest, AfterClosingHeldAndNewWatchesAreAnsweredWithTheReason) {
  auto world = Make(2);
  ASSERT_TRUE(world->Join(Params("a"), now_).ok());
  ASSERT_TRUE(world->Join(Params("b"), now_).ok());
  HeartbeatParams params;
  params.worker_id = "a";
  params.incarnation = 1;
  params.known_generation = world->world().generation;
  params.known_state = JobState::kRunning;
  params.wait = absl::Seconds(1);
  std::vector<absl::Status> heartbeats;
  std::vector<absl::Status> watches;
  auto beat = [&](absl::StatusOr<HeartbeatOutcome> o) { heartbeats.push_back(o.status()); };
  auto watch = [&](absl::StatusOr<std::vector<v1::MembershipEvent>> e) {
    watches.push_back(e.status());
  };
  const int64_t last = world->Events(0).back().sequence();
  world->WatchHeartbeat(params, now_, beat);
  world->WatchEvents(last, now_ + absl::Seconds(10), watch);
  ASSERT_TRUE(heartbeats.empty());
  ASSERT_TRUE(watches.empty());

  world->CloseWatches(absl::UnavailableError("shutting down"));
  world->WatchHeartbeat(params, now_, beat);
  world->WatchEvents(last, now_ + absl::Seconds(10), watch);
  ASSERT_EQ(heartbeats.size(), 2u) << "a heartbeat after closing must not be held";
  ASSERT_EQ(watches.size(), 2u) << "an event watch after closing must not be held";
  for (const absl::Status& status : heartbeats) EXPECT_TRUE(absl::IsUnavailable(status)) << status;
  for (const absl::Status& status : watches) EXPECT_TRUE(absl::IsUnavailable(status)) << status;
}

TEST_F(WorldManagerTest, AThousandWorkersFormAWorldWithDistinctRanks) {
  auto world = Make(1000);
  std::set<int> ranks;
  for (int i = 0; i < 1000; ++i) {
    auto joined = world->Join(Params(absl::StrCat("w", i)), now_);
    ASSERT_TRUE(joined.ok()) << joined.status();
    ranks.insert(joined->rank);
  }
  EXPECT_EQ(ranks.size(), 1000u);
  EXPECT_EQ(*ranks.rbegin(), 999);
  EXPECT_EQ(world->world().state, JobState::kRunning);
}

// --- Elasticity -----------------------------------------------------------------------------

class ElasticWorldTest : public WorldManagerTest {
 protected:
  // Four workers w0..w3 on ranks 0..3, formed at now_; re-forms down to `min` after `grace`.
  std::unique_ptr<WorldManager> Formed(int min, absl::Duration grace = absl::Seconds(5),
                                       std::function<absl::Status(int)> check_size = {}) {
    WorldOptions options = Options(4, absl::Seconds(2));
    options.min_world_size = min;
    options.reform_grace = grace;
    options.check_size = std::move(check_size);
    auto world = Make(options);
    for (int i = 0; i < 4; ++i) {
      EXPECT_EQ(world->Join(Params(absl::StrCat("w", i)), now_)->rank, i);
    }
    EXPECT_EQ(world->world().state, JobState::kRunning);
    return world;
  }
  // Everyone but `silent` heartbeats at `t`, then leases are checked.
  void Beat(WorldManager& world, absl::Time t, const std::set<std::string>& silent) {
    for (const WorkerSnapshot& w : world.Status(t).workers) {
      const bool live = w.rank >= 0 || w.state == WorkerState::kStandby;
      if (live && !silent.count(w.id)) {
        ASSERT_TRUE(world.Heartbeat(w.id, 1, t).ok()) << w.id;
      }
    }
    world.ExpireLeases(t);
  }
  static int RankOf(const StatusSnapshot& status, const std::string& id) {
    for (const WorkerSnapshot& w : status.workers) {
      if (w.id == id) return w.rank;
    }
    return -2;
  }
};

TEST_F(ElasticWorldTest, SurvivorsReFormWithRenumberedRanksOnlyAfterTheGracePeriod) {
  auto world = Formed(/*min=*/2, absl::Seconds(5));
  const int64_t formed = world->world().generation;
  // w1 dies at ~2s; the others wait for a replacement until 2s + 5s.
  for (int ms = 500; ms <= 6500; ms += 500) Beat(*world, now_ + absl::Milliseconds(ms), {"w1"});
  World waiting = world->world();
  EXPECT_EQ(waiting.state, JobState::kForming);
  EXPECT_EQ(waiting.generation, formed + 1) << "the death alone bumps the generation";
  EXPECT_NE(world->Status(now_ + absl::Milliseconds(6500)).world.transition.find("replacement"),
            std::string::npos);
  for (int ms = 7000; ms <= 7600; ms += 300) Beat(*world, now_ + absl::Milliseconds(ms), {"w1"});
  const World reformed = world->world();
  EXPECT_EQ(reformed.state, JobState::kRunning);
  EXPECT_EQ(reformed.ranks, 3);
  EXPECT_EQ(reformed.generation, formed + 1) << "no world ran at the generation the death began";
  const StatusSnapshot status = world->Status(now_ + absl::Seconds(8));
  EXPECT_EQ(RankOf(status, "w0"), 0);
  EXPECT_EQ(RankOf(status, "w2"), 2);
  EXPECT_EQ(RankOf(status, "w3"), 1) << "the highest rank moves into the hole";
  EXPECT_NE(status.world.transition.find("waiting for workers to join"), std::string::npos)
      << "below its target, the world grows again once workers join: " << status.world.transition;
  // A survivor's heartbeat carries its new rank.
  EXPECT_EQ(world->Heartbeat("w3", 1, now_ + absl::Seconds(8))->rank, 1);
}

// Fired heartbeats are answered with the world as it is when they are answered: a backlog that
// outlives the next change carries that change, so those workers hear once. At 10,000 workers the
// housekeeping pass answers a batch at a time; survivors not yet told of the death when the grace
// ends hear of the re-formed world directly.
TEST_F(ElasticWorldTest, FiredHeartbeatsCarryTheWorldAsItIsWhenAnswered) {
  auto world = Formed(/*min=*/2, absl::Seconds(1));
  const World formed = world->world();
  std::map<std::string, std::vector<World>> heard;
  auto hold = [&](const std::string& id, absl::Time t) {
    HeartbeatParams params;
    params.worker_id = id;
    params.incarnation = 1;
    params.known_generation = formed.generation;
    params.known_state = JobState::kRunning;
    params.wait = absl::Milliseconds(500);
    world->WatchHeartbeat(params, t, [&heard, id](absl::StatusOr<HeartbeatOutcome> o) {
      ASSERT_TRUE(o.ok()) << o.status();
      heard[id].push_back(o->world);
    });
  };
  // w3 falls silent; the others hold heartbeats when its lease runs out.
  const absl::Time expiry = now_ + absl::Milliseconds(2100);
  for (const char* id : {"w0", "w1", "w2"}) {
    ASSERT_TRUE(world->Heartbeat(id, 1, expiry).ok());
    hold(id, expiry);
  }
  world->ExpireLeases(expiry, /*fired_at_most=*/0);
  EXPECT_TRUE(heard.empty()) << "fired, not answered yet";
  EXPECT_EQ(world->AnswerFired(1), 2u) << "one answered, two wait";
  ASSERT_EQ(heard["w0"].size(), 1u);
  EXPECT_EQ(heard["w0"][0].state, JobState::kForming) << "told of the death";

  // The grace ends before the rest are answered: they hear of the re-formed world directly.
  const absl::Time regrace = expiry + absl::Milliseconds(1100);
  for (const char* id : {"w0", "w1", "w2"}) ASSERT_TRUE(world->Heartbeat(id, 1, regrace).ok());
  world->ExpireLeases(regrace, /*fired_at_most=*/0);
  ASSERT_EQ(world->world().state, JobState::kRunning);
  EXPECT_EQ(world->AnswerFired(WorldManager::kAllFired), 0u);
  for (const char* id : {"w1", "w2"}) {
    ASSERT_EQ(heard[id].size(), 1u) << id << " is answered once";
    EXPECT_EQ(heard[id][0].state, JobState::kRunning) << id;
    EXPECT_EQ(heard[id][0].ranks, 3) << id;
    EXPECT_GT(heard[id][0].generation, formed.generation) << id;
  }
}

TEST_F(ElasticWorldTest, AReplacementWithinTheGracePeriodKeepsTheWorldSize) {
  auto world = Formed(/*min=*/2, absl::Seconds(5));
  for (int ms = 500; ms <= 3000; ms += 500) Beat(*world, now_ + absl::Milliseconds(ms), {"w1"});
  ASSERT_EQ(world->world().state, JobState::kForming);
  auto joined = world->Join(Params("spare"), now_ + absl::Seconds(3));
  ASSERT_TRUE(joined.ok());
  EXPECT_EQ(joined->rank, 1);
  EXPECT_EQ(world->world().state, JobState::kRunning);
  EXPECT_EQ(world->world().ranks, 4);
}

TEST_F(ElasticWorldTest, BelowTheMinimumTheJobWaitsForWorkers) {
  auto world = Formed(/*min=*/3, absl::Seconds(1));
  for (int ms = 500; ms <= 6000; ms += 500) {
    Beat(*world, now_ + absl::Milliseconds(ms), {"w1", "w2"});
  }
  EXPECT_EQ(world->world().state, JobState::kForming);
  EXPECT_EQ(world->world().ranks, 4);
  EXPECT_NE(world->Status(now_ + absl::Seconds(6)).world.transition.find("at least 3"),
            std::string::npos);
}

TEST_F(ElasticWorldTest, SurvivorsBeyondAnAllowedSizeWaitAsStandbys) {
  auto even = [](int n) {
    return n % 2 == 0 ? absl::OkStatus() : absl::InvalidArgumentError("odd");
  };
  auto world = Formed(/*min=*/2, absl::Seconds(1), even);
  for (int ms = 500; ms <= 4000; ms += 500) Beat(*world, now_ + absl::Milliseconds(ms), {"w1"});
  const World reformed = world->world();
  EXPECT_EQ(reformed.state, JobState::kRunning);
  EXPECT_EQ(reformed.ranks, 2);
  EXPECT_EQ(reformed.standby, 1);
  EXPECT_EQ(Find(world->Status(now_ + absl::Seconds(4)), "w3")->state, WorkerState::kStandby);
}

TEST_F(ElasticWorldTest, ANewWorkerWaitsAsAStandbyAndIsFoldedInByAReshape) {
  auto world = Formed(/*min=*/2, absl::Seconds(1));
  for (int ms = 500; ms <= 4000; ms += 500) Beat(*world, now_ + absl::Milliseconds(ms), {"w3"});
  ASSERT_EQ(world->world().ranks, 3);
  const int64_t shrunk = world->world().generation;
  EXPECT_FALSE(world->PendingReshape().has_value()) << "nothing to fold in yet";

  const absl::Time t = now_ + absl::Seconds(4);
  auto joined = world->Join(Params("new"), t);
  ASSERT_TRUE(joined.ok());
  EXPECT_EQ(joined->rank, -1);
  EXPECT_EQ(world->world().generation, shrunk) << "a standby does not disturb the world";
  EXPECT_EQ(world->world().standby, 1);
  EXPECT_EQ(world->Heartbeat("new", 1, t)->rank, -1);

  std::optional<Reshape> reshape = world->PendingReshape();
  ASSERT_TRUE(reshape.has_value());
  EXPECT_EQ(reshape->from_size, 3);
  EXPECT_EQ(reshape->to_size, 4);
  EXPECT_EQ(reshape->promoted, std::vector<std::string>{"new"});
  EXPECT_TRUE(reshape->leavers.empty());
  ASSERT_TRUE(world->ApplyReshape(*reshape, t).ok());
  EXPECT_EQ(world->world().generation, shrunk + 1);
  EXPECT_EQ(world->world().ranks, 4);
  EXPECT_EQ(world->world().state, JobState::kRunning);
  EXPECT_EQ(RankOf(world->Status(t), "new"), 3);
  // A reshape planned for a world that has moved on is refused.
  EXPECT_EQ(world->ApplyReshape(*reshape, t).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST_F(ElasticWorldTest, AStandbyTakesTheRankOfAWorkerThatDiesAtOnce) {
  WorldOptions options = Options(2, absl::Seconds(2));
  options.min_world_size = 1;
  options.reform_grace = absl::Seconds(1);
  auto world = Make(options);
  ASSERT_TRUE(world->Join(Params("a"), now_).ok());
  ASSERT_TRUE(world->Join(Params("b"), now_).ok());
  for (int ms = 500; ms <= 4000; ms += 500) Beat(*world, now_ + absl::Milliseconds(ms), {"b"});
  ASSERT_EQ(world->world().ranks, 1);
  ASSERT_EQ(world->Join(Params("spare"), now_ + absl::Seconds(4))->rank, -1);
  // a dies now: the standby takes its rank without waiting for the grace period.
  const int64_t before = world->world().generation;
  for (int ms = 4500; ms <= 6500; ms += 500) Beat(*world, now_ + absl::Milliseconds(ms), {"a"});
  EXPECT_EQ(world->world().state, JobState::kRunning);
  EXPECT_EQ(world->world().generation, before + 1);
  EXPECT_EQ(RankOf(world->Status(now_ + absl::Seconds(7)), "spare"), 0);
}

// A world that became whole without forming (resized while it formed, then taken back by a
// restarted coordinator) has formed once it runs: a rank it then loses goes to the standby at once
// (the simulation's seed 42751 waited for a fourth worker forever).
TEST_F(ElasticWorldTest, AWorldMadeWholeByARestartGivesALostRankToAStandby) {
  WorldOptions options = Options(4, absl::Seconds(2));
  options.min_world_size = 1;
  {
    auto forming = Make(options);
    for (int i = 0; i < 3; ++i) {
      ASSERT_TRUE(forming->Join(Params(absl::StrCat("w", i)), now_).ok());
    }
    ASSERT_EQ(forming->world().state, JobState::kForming);
    ASSERT_TRUE(forming->SetTarget(3, now_).ok());
  }
  auto world = Make(options);
  ASSERT_TRUE(world->recovered());
  ASSERT_EQ(world->world().state, JobState::kRunning);
  ASSERT_EQ(world->Join(Params("spare"), now_)->rank, -1);

  now_ += absl::Seconds(1);
  Beat(*world, now_, {"w1"});
  now_ += absl::Seconds(5);  // past the two leases a taken-back member gets
  Beat(*world, now_, {"w1"});
  const StatusSnapshot status = world->Status(now_);
  EXPECT_EQ(RankOf(status, "w1"), -1);
  EXPECT_GE(RankOf(status, "spare"), 0);
  EXPECT_EQ(world->world().state, JobState::kRunning);
}

// An operator's resize of a world still forming takes effect at once: it has nothing to save or
// pause, and it must not wait for joins the operator no longer asks for (simulation seed 1285
// under reshape-and-restart: resized to 4 before anyone joined, it waited for a fifth worker).
TEST_F(ElasticWorldTest, AResizeOfAFormingWorldFormsItWithTheWorkersItHas) {
  WorldOptions options = Options(4, absl::Seconds(2));
  options.min_world_size = 1;
  auto world = Make(options);
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(world->Join(Params(absl::StrCat("w", i)), now_).ok());
  ASSERT_EQ(world->world().state, JobState::kForming);
  const int64_t generation = world->world().generation;

  ASSERT_TRUE(world->SetTarget(2, now_).ok());
  EXPECT_EQ(world->world().state, JobState::kRunning);
  EXPECT_EQ(world->world().ranks, 2);
  EXPECT_EQ(world->world().generation, generation) << "nothing had connected: no new generation";
  StatusSnapshot status = world->Status(now_);
  EXPECT_EQ(RankOf(status, "w0"), 0);
  EXPECT_EQ(RankOf(status, "w1"), 1);
  EXPECT_EQ(RankOf(status, "w2"), -1) << "beyond the new size it waits as a standby";
  EXPECT_EQ(world->world().standby, 1);

  // A restarted coordinator takes back the same world.
  auto restarted = Make(options);
  ASSERT_TRUE(restarted->recovered());
  EXPECT_EQ(restarted->world().state, JobState::kRunning);
  EXPECT_EQ(restarted->world().ranks, 2);
}

TEST_F(ElasticWorldTest, AFormingWorldResizedWaitsForTheNewSizeOnly) {
  WorldOptions options = Options(4, absl::Seconds(2));
  options.min_world_size = 1;
  auto world = Make(options);
  ASSERT_TRUE(world->SetTarget(2, now_).ok());
  ASSERT_TRUE(world->Join(Params("w0"), now_).ok());
  ASSERT_TRUE(world->SetTarget(3, now_).ok());
  EXPECT_EQ(world->world().state, JobState::kForming);
  EXPECT_EQ(world->world().ranks, 3);
  EXPECT_EQ(world->Status(now_).world.transition, "forming: waiting for 2 more of 3 workers");
  for (const char* id : {"w1", "w2"}) ASSERT_TRUE(world->Join(Params(id), now_).ok());
  EXPECT_EQ(world->world().state, JobState::kRunning);
  EXPECT_EQ(world->world().ranks, 3);
  EXPECT_EQ(world->Join(Params("w3"), now_)->rank, -1) << "the world of 3 is full: a standby";
}

// A world still forming with a free rank and a standby waiting (seed 98626: a coordinator restarted
// after a resize took back only a standby, and three joins filled three of four ranks) gives the
// standby the rank at the next pass, instead of waiting for a join nobody will make.
TEST(MembershipRulesTest, AFormingWorldGivesAFreeRankToAWaitingStandby) {
  const absl::Time now = absl::FromUnixSeconds(1700000000);
  Membership membership(3, 3);
  membership.Activate(membership.Upsert("a"), 0);
  membership.Activate(membership.Upsert("b"), 1);
  membership.MakeStandby(membership.Upsert("spare"), now);
  for (const char* id : {"a", "b", "spare"}) membership.Mutable(id)->last_heartbeat = now;
  ASSERT_FALSE(membership.formed);
  MembershipRules rules;
  rules.max_world_size = 3;
  rules.max_standbys = 3;
  Change change;
  EXPECT_TRUE(ExpireLeases(membership, rules, now, &change).empty());
  EXPECT_EQ(membership.Find("spare")->role, Role::kActive);
  EXPECT_EQ(membership.Find("spare")->rank, 2);
  EXPECT_TRUE(membership.formed);
  ASSERT_FALSE(change.events.empty());
  EXPECT_EQ(change.events.back().kind(), v1::MEMBERSHIP_EVENT_KIND_WORLD_FORMED);
}

TEST_F(ElasticWorldTest, ResizeAndDrainTellTheWorkersThatLeave) {
  auto world = Formed(/*min=*/1);
  EXPECT_EQ(world->SetTarget(5, now_).code(), absl::StatusCode::kInvalidArgument)
      << "above the job's world size";
  EXPECT_EQ(world->SetTarget(0, now_).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(world->SetTarget(2, now_).ok());
  ASSERT_TRUE(world->Drain("w0", now_).ok());
  EXPECT_EQ(world->Drain("nobody", now_).code(), absl::StatusCode::kNotFound);
  std::optional<Reshape> reshape = world->PendingReshape();
  ASSERT_TRUE(reshape.has_value());
  EXPECT_EQ(reshape->to_size, 2);
  EXPECT_EQ(std::set<std::string>(reshape->leavers.begin(), reshape->leavers.end()),
            (std::set<std::string>{"w0", "w3"}))
      << "the drained worker, then the highest rank";
  const int64_t before = world->world().generation;
  ASSERT_TRUE(world->ApplyReshape(*reshape, now_).ok());
  EXPECT_EQ(world->world().generation, before + 1);
  EXPECT_EQ(world->world().ranks, 2);
  auto told = world->Heartbeat("w0", 1, now_);
  ASSERT_TRUE(told.ok());
  EXPECT_TRUE(told->stop);
  EXPECT_NE(told->stop_reason.find("drained"), std::string::npos);
  EXPECT_NE(world->Heartbeat("w3", 1, now_)->stop_reason.find("resized out"), std::string::npos);
  EXPECT_FALSE(world->Heartbeat("w1", 1, now_)->stop);
  const StatusSnapshot status = world->Status(now_);
  EXPECT_EQ(std::set<int>({RankOf(status, "w1"), RankOf(status, "w2")}), (std::set<int>{0, 1}));
  // Leaving after being told does not disturb the world.
  ASSERT_TRUE(world->Leave({"w0", 1, "drained"}, now_).ok());
  ASSERT_TRUE(world->Leave({"w3", 1, "resized out"}, now_).ok());
  EXPECT_EQ(world->world().generation, before + 1);
  EXPECT_EQ(world->world().state, JobState::kRunning);
}

TEST_F(ElasticWorldTest, ALeaverThatHoldsStateTheNewWorldReadsStaysUntilReleased) {
  auto world = Formed(/*min=*/1);
  bool hold = true;
  world->set_leaver_hold([&hold](const std::string& id) { return hold && id == "w3"; });
  // Every world that first runs tells the listener, once, with who is live then.
  std::vector<std::pair<int64_t, bool>> running;  // generation, whether w3 was live
  world->set_running_listener([&](int64_t generation, const IsLiveMember& live) {
    running.push_back({generation, live("w3", 1)});
    v1::MembershipEvent event;
    event.set_kind(v1::MEMBERSHIP_EVENT_KIND_RESTORE_POINT);
    event.set_detail(absl::StrCat("generation ", generation, " restores something"));
    return std::vector<v1::MembershipEvent>{event};
  });
  ASSERT_TRUE(world->SetTarget(3, now_).ok());
  ASSERT_TRUE(world->ApplyReshape(*world->PendingReshape(), now_).ok());
  const int64_t reshaped = world->world().generation;
  ASSERT_EQ(running.size(), 1u);
  EXPECT_EQ(running[0], std::make_pair(reshaped, true)) << "the leaver is live, and holds state";
  EXPECT_EQ(world->Events(0).back().detail(),
            absl::StrCat("generation ", reshaped, " restores something"));
  // Held: no stop, and its heartbeat waits as a standby's does.
  auto told = world->Heartbeat("w3", 1, now_);
  ASSERT_TRUE(told.ok());
  EXPECT_FALSE(told->stop);
  EXPECT_EQ(told->rank, -1);
  std::optional<absl::StatusOr<HeartbeatOutcome>> answer;
  HeartbeatParams params;
  params.worker_id = "w3";
  params.incarnation = 1;
  params.known_generation = reshaped;
  params.known_state = JobState::kRunning;
  params.wait = absl::Seconds(1);
  world->WatchHeartbeat(params, now_,
                        [&](absl::StatusOr<HeartbeatOutcome> outcome) { answer = outcome; });
  EXPECT_FALSE(answer.has_value()) << "held, not answered at once";
  // Released (the new world restored): told to leave at once.
  hold = false;
  world->WakeWatches();
  ASSERT_TRUE(answer.has_value());
  ASSERT_TRUE(answer->ok());
  EXPECT_TRUE((*answer)->stop);
  EXPECT_NE((*answer)->stop_reason.find("resized out"), std::string::npos);
  // A stop overrides a hold.
  hold = true;
  world->RequestStop("operator", now_);
  EXPECT_TRUE(world->Heartbeat("w3", 1, now_)->stop);
  EXPECT_EQ(running.size(), 1u) << "once per generation";
}

TEST_F(ElasticWorldTest, ARestartedCoordinatorTakesBackAConnectedWorldAtTheSameGeneration) {
  int64_t generation = 0;
  {
    auto world = Formed(/*min=*/2);
    generation = world->world().generation;
    for (int i = 0; i < 4; ++i) {
      ASSERT_TRUE(world->ReportSelfCheck(absl::StrCat("w", i), 1, generation, true, "ok", now_).ok());
    }
  }  // SIGKILL: nothing more is written.
  const absl::Time later = now_ + absl::Seconds(30);
  now_ = later;
  auto again = Make(Options(4, absl::Seconds(2)));
  EXPECT_TRUE(again->recovered());
  EXPECT_EQ(again->world().generation, generation) << "training goes on undisturbed";
  EXPECT_EQ(again->world().state, JobState::kRunning);
  auto beat = again->Heartbeat("w2", 1, later);
  ASSERT_TRUE(beat.ok()) << beat.status();
  EXPECT_EQ(beat->rank, 2);
  // Every worker has two leases to reach the new coordinator (it may be backing off); one that
  // never comes back is then declared dead as usual.
  for (const char* id : {"w0", "w1", "w2"}) {
    ASSERT_TRUE(again->Heartbeat(id, 1, later + absl::Seconds(3)).ok());
  }
  EXPECT_TRUE(again->ExpireLeases(later + absl::Milliseconds(3900)).empty());
  EXPECT_EQ(again->ExpireLeases(later + absl::Milliseconds(4500)), std::vector<std::string>{"w3"});
  std::vector<v1::MembershipEvent> events = again->Events(0);
  bool recovered_event = false;
  for (const v1::MembershipEvent& e : events) {
    recovered_event |= e.kind() == v1::MEMBERSHIP_EVENT_KIND_COORDINATOR_RECOVERED;
  }
  EXPECT_TRUE(recovered_event);
  for (size_t i = 1; i < events.size(); ++i) {
    EXPECT_EQ(events[i].sequence(), events[i - 1].sequence() + 1);
  }
}

TEST_F(ElasticWorldTest, AWorldThatHadNotConnectedReconnectsAtANewGenerationAfterARestart) {
  int64_t generation = 0;
  {
    auto world = Formed(/*min=*/2);
    generation = world->world().generation;
    ASSERT_TRUE(world->ReportSelfCheck("w0", 1, generation, true, "ok", now_).ok());
  }
  auto again = Make(Options(4, absl::Seconds(2)));
  EXPECT_TRUE(again->recovered());
  EXPECT_EQ(again->world().generation, generation + 1);
  EXPECT_EQ(again->world().state, JobState::kRunning);
  // Its workers connect at the new generation at once, so a death there ends it (the
  // simulation's seed 2775 hung when it did not: the survivor kept waiting for a dead peer).
  now_ += absl::Seconds(3);
  Beat(*again, now_, {"w1"});
  now_ += absl::Seconds(2);
  Beat(*again, now_, {"w1"});
  EXPECT_EQ(RankOf(again->Status(now_), "w1"), -1);
  EXPECT_EQ(again->world().generation, generation + 2);
}

TEST_F(ElasticWorldTest, EventWatchersHearOfTheNextEvent) {
  auto world = Formed(/*min=*/2);
  const int64_t last = world->Events(0).back().sequence();
  std::vector<v1::MembershipEvent> heard;
  bool answered = false;
  world->WatchEvents(last, now_ + absl::Seconds(10),
                     [&](absl::StatusOr<std::vector<v1::MembershipEvent>> e) {
                       ASSERT_TRUE(e.ok()) << e.status();
                       heard = std::move(*e);
                       answered = true;
                     });
  EXPECT_FALSE(answered);
  ASSERT_TRUE(world->SetTarget(3, now_).ok());
  ASSERT_TRUE(answered);
  ASSERT_EQ(heard.size(), 1u);
  EXPECT_EQ(heard[0].kind(), v1::MEMBERSHIP_EVENT_KIND_RESIZE_REQUESTED);
  EXPECT_EQ(heard[0].sequence(), last + 1);
}

}  // namespace
}  // namespace shard
