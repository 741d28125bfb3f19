// The coordinator served on a real port, driven through the real clients in this process.
#include <filesystem>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/admin_client.h"
#include "gtest/gtest.h"
#include "server/coordinator_server.h"
#include "tests/support/process.h"
#include "worker/coordinator_client.h"
#include "worker/dataplane/gloo_communicator.h"
#include "worker/dataplane/self_check.h"
#include "worker/plan_session.h"

namespace shard {
namespace {

class CoordinatorServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    state_dir_ = ::testing::TempDir() + "/shard-service-test-" +
                 ::testing::UnitTest::GetInstance()->current_test_info()->name();
    std::filesystem::remove_all(state_dir_);
    CoordinatorOptions options;
    options.listen_address = "127.0.0.1:0";
    options.state_dir = state_dir_;
    options.world.job = "svc";
    options.world.expected_world_size = 3;
    options.world.lease = absl::Seconds(4);
    auto server = CoordinatorServer::Start(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
  }

  std::unique_ptr<CoordinatorClient> Client() {
    return std::make_unique<CoordinatorClient>(server_->address(), absl::Seconds(10));
  }

  static v1::JoinRequest JoinRequest(const std::string& id) {
    v1::JoinRequest request;
    request.set_worker_id(id);
    request.set_host("127.0.0.1");
    request.set_device("cpu");
    request.set_incarnation(1);
    return request;
  }

  std::string state_dir_;
  std::unique_ptr<CoordinatorServer> server_;
};

TEST_F(CoordinatorServiceTest, ThreeWorkersFormAWorldRendezvousCheckAndStop) {
  std::vector<std::thread> workers;
  for (int i = 0; i < 3; ++i) {
    workers.emplace_back([this, i] {
      auto client = Client();
      const std::string id = absl::StrCat("w", i);
      auto joined = client->Join(JoinRequest(id));
      // A new channel's first connect can fail (UNAVAILABLE, seen once in CI); shard-worker
      // joins again, on a new channel here since a failed one waits out its reconnect backoff.
      for (int attempt = 1; absl::IsUnavailable(joined.status()) && attempt < 3; ++attempt) {
        client = Client();
        joined = client->Join(JoinRequest(id));
      }
      ASSERT_TRUE(joined.ok()) << joined.status();
      // Long-poll until the world forms.
      v1::HeartbeatRequest beat;
      beat.set_worker_id(id);
      beat.set_incarnation(1);
      beat.set_known_generation(joined->world().generation());
      beat.set_known_state(joined->world().state());
      beat.set_wait_ms(1000);
      v1::WorldView world = joined->world();
      for (int tries = 0; tries < 50 && world.state() != v1::JOB_STATE_RUNNING; ++tries) {
        auto reply = client->Heartbeat(beat);
        ASSERT_TRUE(reply.ok()) << reply.status();
        world = reply->world();
        beat.set_known_generation(world.generation());
        beat.set_known_state(world.state());
      }
      ASSERT_EQ(world.state(), v1::JOB_STATE_RUNNING);
      ASSERT_EQ(world.world_size(), 3);

      auto rendezvous = client->RendezvousStore(world.scope());
      GlooOptions options;
      options.rank = joined->rank();
      options.size = 3;
      options.timeout = absl::Seconds(20);
      auto communicator = CreateGlooCommunicator(rendezvous.get(), options);
      ASSERT_TRUE(communicator.ok()) << communicator.status();
      auto checked = RunSelfCheck(**communicator, 10000);
      ASSERT_TRUE(checked.ok()) << checked.status();
      v1::ReportSelfCheckRequest report;
      report.set_worker_id(id);
      report.set_incarnation(1);
      report.set_generation(world.generation());
      report.set_passed(true);
      report.set_detail(checked->summary);
      ASSERT_TRUE(client->ReportSelfCheck(report).ok());
    });
  }
  for (std::thread& t : workers) t.join();

  AdminClient admin(server_->address(), absl::Seconds(5));
  auto status = admin.GetStatus();
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ(status->job(), "svc");
  EXPECT_EQ(status->world().state(), v1::JOB_STATE_RUNNING);
  ASSERT_EQ(status->workers_size(), 3);
  for (const v1::WorkerStatus& worker : status->workers()) {
    EXPECT_EQ(worker.state(), v1::WORKER_STATE_READY) << worker.id();
    EXPECT_EQ(worker.self_check().state(), v1::SELF_CHECK_STATE_PASSED);
  }

  auto stopped = admin.Stop("test over");
  ASSERT_TRUE(stopped.ok());
  EXPECT_EQ(stopped->world().state(), v1::JOB_STATE_STOPPING);
  auto client = Client();
  for (int i = 0; i < 3; ++i) {
    v1::HeartbeatRequest beat;
    beat.set_worker_id(absl::StrCat("w", i));
    beat.set_incarnation(1);
    auto reply = client->Heartbeat(beat);
    ASSERT_TRUE(reply.ok());
    EXPECT_EQ(reply->order().kind(), v1::ORDER_KIND_STOP);
    EXPECT_EQ(reply->order().reason(), "test over");
    v1::LeaveRequest leave;
    leave.set_worker_id(absl::StrCat("w", i));
    leave.set_incarnation(1);
    ASSERT_TRUE(client->Leave(leave).ok());
  }
  EXPECT_TRUE(server_->WaitUntilStopped(absl::Seconds(5)));
}

TEST_F(CoordinatorServiceTest, ErrorCodesSurviveTheWire) {
  auto client = Client();
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(client->Join(JoinRequest(absl::StrCat("w", i))).ok());
  // A full world keeps up to world-size standbys (the default of --max-standbys); one more is
  // told to come back later.
  for (int i = 3; i < 6; ++i) {
    auto standby = client->Join(JoinRequest(absl::StrCat("w", i)));
    ASSERT_TRUE(standby.ok()) << standby.status();
    EXPECT_EQ(standby->rank(), -1);
  }
  auto full = client->Join(JoinRequest("w6"));
  EXPECT_EQ(full.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(full.status().message().find("world is full"), absl::string_view::npos);
  EXPECT_NE(full.status().message().find("--max-standbys"), absl::string_view::npos);

  v1::JoinRequest taken = JoinRequest("w9");
  taken.set_requested_rank(0);
  EXPECT_EQ(client->Join(taken).status().code(), absl::StatusCode::kAlreadyExists);

  v1::HeartbeatRequest stranger;
  stranger.set_worker_id("nobody");
  EXPECT_EQ(client->Heartbeat(stranger).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(CoordinatorServiceTest, RendezvousWaitTimesOutAndStaleGenerationsAreAborted) {
  auto client = Client();
  absl::StatusOr<v1::JoinResponse> joined;
  for (int i = 0; i < 3; ++i) {
    joined = client->Join(JoinRequest(absl::StrCat("w", i)));
    ASSERT_TRUE(joined.ok()) << joined.status();
  }
  ASSERT_EQ(joined->world().state(), v1::JOB_STATE_RUNNING);
  auto rendezvous = client->RendezvousStore(joined->world().scope());
  ASSERT_TRUE(rendezvous->Set("k", "v").ok());
  auto value = rendezvous->Get("k");
  ASSERT_TRUE(value.ok());
  EXPECT_EQ(*value, "v");
  absl::Status waited = rendezvous->Wait({"k", "never"}, absl::Milliseconds(300));
  EXPECT_EQ(waited.code(), absl::StatusCode::kDeadlineExceeded) << waited;
  EXPECT_NE(waited.message().find("'never'"), absl::string_view::npos) << waited;

  // A member leaving a world that has run starts a new generation: the old scope is closed.
  v1::LeaveRequest leave;
  leave.set_worker_id("w2");
  leave.set_incarnation(1);
  ASSERT_TRUE(client->Leave(leave).ok());
  EXPECT_EQ(rendezvous->Set("k", "v2").code(), absl::StatusCode::kAborted);
}

TEST_F(CoordinatorServiceTest, CancellingTheRendezvousReleasesABlockedWait) {
  auto client = Client();
  auto joined = client->Join(JoinRequest("w0"));
  ASSERT_TRUE(joined.ok());
  auto rendezvous = client->RendezvousStore(joined->world().scope());
  std::thread canceller([&] {
    // Cancels only once the coordinator holds the wait.
    EXPECT_TRUE(testing::Eventually([&] { return server_->core().kv().pending_waiters() == 1; },
                           absl::Seconds(20)));
    rendezvous->Cancel();
  });
  absl::Status waited = rendezvous->Wait({"never"}, absl::Seconds(30));
  canceller.join();
  EXPECT_EQ(waited.code(), absl::StatusCode::kCancelled) << waited;
}

TEST_F(CoordinatorServiceTest, StateDirectoryIsLockedWhileServing) {
  CoordinatorOptions options;
  options.listen_address = "127.0.0.1:0";
  options.state_dir = state_dir_;
  options.world.job = "svc";
  options.world.expected_world_size = 3;
  auto second = CoordinatorServer::Start(options);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition) << second.status();
}

Manifest SmallModel() {
  return Manifest{{ParamSpec{"layers.0.weight", {256, 128}, DataType::kFloat32, true},
                   ParamSpec{"layers.0.bias", {256}, DataType::kFloat32, true},
                   ParamSpec{"layers.1.weight", {10, 256}, DataType::kFloat32, true},
                   ParamSpec{"layers.1.bias", {10}, DataType::kFloat32, true}}};
}

TEST_F(CoordinatorServiceTest, WorkersAgreeOnAPlanAndRebuildItFromRankZerosOrder) {
  auto client = Client();
  std::vector<std::unique_ptr<PlanSession>> sessions;
  std::vector<int> ranks;
  for (int i = 0; i < 3; ++i) {
    auto joined = client->Join(JoinRequest(absl::StrCat("w", i)));
    ASSERT_TRUE(joined.ok());
    ranks.push_back(joined->rank());
  }
  for (int i = 0; i < 3; ++i) {
    sessions.push_back(
        std::make_unique<PlanSession>(client.get(), absl::StrCat("w", i), 1, absl::Seconds(20)));
  }
  std::vector<AppliedPlan> v1;
  for (auto& session : sessions) {
    auto applied = session->Initial(SmallModel());
    ASSERT_TRUE(applied.ok()) << applied.status();
    v1.push_back(*applied);
  }
  EXPECT_EQ(v1[0].plan->hash, v1[2].plan->hash);
  EXPECT_EQ(v1[0].version, 1);

  // A worker with another model is turned away, naming the parameter.
  Manifest other = SmallModel();
  other.params[3].shape = {11};
  PlanSession odd(client.get(), "w1", 1, absl::Seconds(20));
  absl::StatusOr<AppliedPlan> rejected = odd.Initial(other);
  EXPECT_EQ(rejected.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(rejected.status().message().find("layers.1.bias"), absl::string_view::npos)
      << rejected.status();

  // Ranks other than 0 wait for rank 0's order; then all switch to v2 together.
  const std::vector<int> observed = {0, 1, 2, 3};
  std::vector<absl::StatusOr<AppliedPlan>> rebuilt(3, absl::UnknownError("not run"));
  std::vector<std::thread> reporters;
  for (int i = 0; i < 3; ++i) {
    if (ranks[i] == 0) continue;
    reporters.emplace_back([&, i] {
      std::vector<int> order = observed;
      if (ranks[i] == 2) std::swap(order[1], order[2]);  // this rank disagrees
      rebuilt[i] = sessions[i]->Rebuild(1, order);
    });
  }
  // Rank 0 reports only once the others are held waiting for it.
  ASSERT_TRUE(testing::Eventually([&] { return server_->core().plan().pending_waiters() == 2; },
                         absl::Seconds(20)));
  for (int i = 0; i < 3; ++i) {
    if (ranks[i] == 0) rebuilt[i] = sessions[i]->Rebuild(1, observed);
  }
  for (std::thread& t : reporters) t.join();
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(rebuilt[i].ok()) << rebuilt[i].status();
    EXPECT_EQ(rebuilt[i]->version, 2);
    EXPECT_EQ(rebuilt[i]->plan->options.gradient_order, observed);
  }

  AdminClient admin(server_->address(), absl::Seconds(5));
  auto stats = admin.GetStats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->status(), v1::OVERLAP_STATUS_INITIALIZED);
  EXPECT_EQ(stats->plan_version(), 2);
  ASSERT_EQ(stats->disagreements_size(), 1);
  EXPECT_EQ(stats->disagreements(0).rank(), 2);
  auto plan = admin.GetPlan();
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->spec().hash(), rebuilt[0]->plan->hash);
  EXPECT_EQ(plan->ranks_size(), 3);
}

}  // namespace
}  // namespace shard
