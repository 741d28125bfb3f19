#include "server/world_manager.h"

#include <optional>
#include <set>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace shard {
namespace {

// A store whose writes can be made to fail, to check that nothing changes when they do.
class FlakyStateStore : public InMemoryStateStore {
 public:
  absl::Status Save(absl::string_view key, const google::protobuf::Message& message) override {
    if (fail) return absl::InternalError("disk full");
    return InMemoryStateStore::Save(key, message);
  }
  // The saved membership record.
  std::optional<v1::CoordinatorState> Membership() {
    v1::CoordinatorState state;
    absl::StatusOr<bool> found = Load("membership", &state);
    if (!found.ok() || !*found) return std::nullopt;
    return state;
  }
  bool fail = false;
};

class WorldManagerTest : public ::testing::Test {
 protected:
  std::unique_ptr<WorldManager> Make(int world_size, absl::Duration lease = absl::Seconds(2)) {
    WorldOptions options;
    options.job = "job1";
    options.expected_world_size = world_size;
    options.lease = lease;
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

  FlakyStateStore store_;
  absl::Time now_ = absl::FromUnixSeconds(1700000000);
  std::vector<int64_t> generations_seen_;
};

TEST_F(WorldManagerTest, AssignsRanksInOrderAndFormsTheWorldWhenAllHaveJoined) {
  auto world = Make(3);
  const int64_t g0 = world->world().generation;
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(world->world().state, JobState::kForming);
    auto joined = world->Join(Params(absl::StrCat("w", i)), now_);
    ASSERT_TRUE(joined.ok()) << joined.status();
    EXPECT_EQ(joined->rank, i);
    EXPECT_EQ(joined->world.generation, g0 + i + 1);
  }
  const World formed = world->world();
  EXPECT_EQ(formed.state, JobState::kRunning);
  EXPECT_EQ(formed.world_size, 3);
  EXPECT_EQ(formed.generation, g0 + 3);
  EXPECT_EQ(generations_seen_.back(), g0 + 3);
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

TEST_F(WorldManagerTest, AFullWorldRefusesNewWorkersAndNamesTheHolders) {
  auto world = Make(2);
  ASSERT_TRUE(world->Join(Params("a"), now_).ok());
  ASSERT_TRUE(world->Join(Params("b"), now_).ok());
  const int64_t generation = world->world().generation;
  auto extra = world->Join(Params("c"), now_);
  EXPECT_EQ(extra.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(extra.status().message().find("world is full"), absl::string_view::npos);
  EXPECT_NE(extra.status().message().find("a, b"), absl::string_view::npos) << extra.status();
  EXPECT_EQ(world->world().generation, generation);
}

TEST_F(WorldManagerTest, InvalidJoinsAreRejected) {
  auto world = Make(2);
  EXPECT_EQ(world->Join(Params("../etc"), now_).status().code(),
            absl::StatusCode::kInvalidArgument);
  JoinParams no_host = Params("a");
  no_host.host = "";
  EXPECT_EQ(world->Join(no_host, now_).status().code(), absl::StatusCode::kInvalidArgument);
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
  EXPECT_EQ(world->world().generation, formed + 2);
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
  ASSERT_TRUE(world->Leave("a", 1, "maintenance", now_).ok());
  EXPECT_EQ(world->world().generation, formed + 1);
  EXPECT_TRUE(world->Leave("a", 1, "maintenance", now_).ok()) << "a retried leave is fine";

  World stopping = world->RequestStop("operator", now_);
  EXPECT_EQ(stopping.state, JobState::kStopping);
  auto heartbeat = world->Heartbeat("b", 1, now_);
  ASSERT_TRUE(heartbeat.ok());
  EXPECT_TRUE(heartbeat->stop);
  EXPECT_EQ(heartbeat->stop_reason, "operator");
  EXPECT_EQ(world->Join(Params("c"), now_).status().code(),
            absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(world->Leave("b", 1, "stopped", now_).ok());
  EXPECT_EQ(world->world().state, JobState::kStopped);
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
  ASSERT_TRUE(world->ReportSelfCheck("b", 1, g, false, "wrong sum", now_).ok());
  StatusSnapshot status = world->Status(now_);
  EXPECT_EQ(Find(status, "a")->state, WorkerState::kReady);
  EXPECT_EQ(Find(status, "b")->state, WorkerState::kFailed);
  EXPECT_EQ(Find(status, "b")->self_check.detail, "wrong sum");

  ASSERT_TRUE(world->Join(Params("b", 2), now_).ok());  // b restarts: new generation
  status = world->Status(now_);
  EXPECT_EQ(Find(status, "a")->state, WorkerState::kJoining);
  EXPECT_EQ(Find(status, "a")->self_check.state, SelfCheckState::kPending);
}

TEST_F(WorldManagerTest, GenerationsContinueAcrossACoordinatorRestart) {
  int64_t before = 0;
  {
    auto world = Make(2);
    ASSERT_TRUE(world->Join(Params("a"), now_).ok());
    before = world->world().generation;
  }
  auto again = Make(2);
  EXPECT_GT(again->world().generation, before);
  EXPECT_EQ(again->world().world_size, 0) << "workers must join the new coordinator";

  WorldOptions other;
  other.job = "another-job";
  other.expected_world_size = 2;
  auto wrong = WorldManager::Create(other, &store_, now_);
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(wrong.status().message().find("job1"), absl::string_view::npos);
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

TEST_F(WorldManagerTest, AFailedStateWriteRefusesTheJoinAndChangesNothing) {
  auto world = Make(2);
  ASSERT_TRUE(world->Join(Params("a"), now_).ok());
  const World before = world->world();
  store_.fail = true;
  auto joined = world->Join(Params("b"), now_);
  EXPECT_EQ(joined.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(joined.status().message().find("disk full"), absl::string_view::npos);
  EXPECT_EQ(world->world().generation, before.generation);
  EXPECT_EQ(world->world().world_size, 1);
  store_.fail = false;
  ASSERT_TRUE(world->Join(Params("b"), now_).ok());
  auto saved = store_.Membership();
  ASSERT_TRUE(saved.has_value());
  EXPECT_EQ(saved->generation(), world->world().generation);
  EXPECT_EQ(saved->events().rbegin()->kind(), v1::MEMBERSHIP_EVENT_KIND_WORLD_FORMED);
}

TEST_F(WorldManagerTest, DeathsAreNotLostWhenTheStateWriteFails) {
  auto world = Make(1, absl::Seconds(1));
  ASSERT_TRUE(world->Join(Params("a"), now_).ok());
  store_.fail = true;
  EXPECT_EQ(world->ExpireLeases(now_ + absl::Seconds(2)).size(), 1u);
  EXPECT_EQ(world->world().world_size, 0);
  store_.fail = false;
  world->ExpireLeases(now_ + absl::Seconds(3));  // retries the pending write
  auto saved = store_.Membership();
  ASSERT_TRUE(saved.has_value());
  EXPECT_EQ(saved->generation(), world->world().generation);
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

}  // namespace
}  // namespace shard
