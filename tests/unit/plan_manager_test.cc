#include "server/plan_manager.h"

#include <optional>

#include "absl/strings/str_cat.h"

#include "gtest/gtest.h"

namespace shard {
namespace {

Manifest Model() {
  return Manifest{{ParamSpec{"layers.0.weight", {64, 32}, DataType::kFloat32, true},
                   ParamSpec{"layers.0.bias", {64}, DataType::kFloat32, true},
                   ParamSpec{"layers.1.weight", {10, 64}, DataType::kFloat32, true},
                   ParamSpec{"layers.1.bias", {10}, DataType::kFloat32, true}}};
}

class PlanManagerTest : public ::testing::Test {
 protected:
  void SetUp() override { plans_.OnGeneration(kGeneration); }

  MemberRef Member(int rank, int64_t generation = kGeneration) {
    return MemberRef{absl::StrCat("w", rank), rank, generation, kWorld};
  }

  // Registers every rank and acks the plan each receives.
  PlanView RegisterAll() {
    PlanView view;
    for (int rank = 0; rank < kWorld; ++rank) {
      auto registered = plans_.RegisterManifest(Member(rank), Model());
      EXPECT_TRUE(registered.ok()) << registered.status();
      view = *registered;
    }
    return view;
  }

  void AckAll(const PlanView& view, int except = -1) {
    for (int rank = 0; rank < kWorld; ++rank) {
      if (rank == except) continue;
      ASSERT_TRUE(plans_.AckPlan(Member(rank), view.version, view.plan->hash).ok());
    }
  }

  // Reports an order and returns the answer if one came at once.
  std::optional<absl::StatusOr<PlanView>> Report(int rank, int64_t version,
                                                 std::vector<int> order) {
    std::optional<absl::StatusOr<PlanView>> answer;
    plans_.ReportGradientOrder(Member(rank), version, std::move(order), absl::Seconds(5), now_,
                               [&answer](absl::StatusOr<PlanView> v) { answer = std::move(v); });
    return answer;
  }

  static constexpr int64_t kGeneration = 7;
  static constexpr int kWorld = 3;
  PlanManager plans_{PlanConfig{}};
  absl::Time now_ = absl::FromUnixSeconds(1700000000);
};

TEST_F(PlanManagerTest, EveryWorkerGetsTheSamePlanAndAckingIsChecked) {
  PlanView view = RegisterAll();
  EXPECT_EQ(view.version, 1);
  EXPECT_EQ(view.status, OverlapStatus::kUninitialized);
  EXPECT_EQ(view.plan->options.world_size, kWorld);
  EXPECT_EQ(plans_.AckPlan(Member(0), 1, "0000000000000000").status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(plans_.AckPlan(Member(0), 2, view.plan->hash).status().code(),
            absl::StatusCode::kAborted);
  AckAll(view);
  EXPECT_TRUE(plans_.Stats().pending_acks.empty());
  EXPECT_EQ(plans_.Stats().status, OverlapStatus::kUninitialized) << "no rebuild yet";
}

TEST_F(PlanManagerTest, ADifferentManifestIsRejectedNamingTheParameter) {
  RegisterAll();
  Manifest other = Model();
  other.params[2].shape = {10, 63};
  auto rejected = plans_.RegisterManifest(Member(1), other);
  EXPECT_EQ(rejected.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(rejected.status().message().find("layers.1.weight"), absl::string_view::npos)
      << rejected.status();
  EXPECT_NE(rejected.status().message().find("w0"), absl::string_view::npos)
      << "names who registered the job's manifest: " << rejected.status();
}

TEST_F(PlanManagerTest, RankZerosOrderRebuildsTheBucketsAndAllAcksInitialize) {
  PlanView v1 = RegisterAll();
  AckAll(v1);
  const std::vector<int> forward = {0, 1, 2, 3};  // not the default reverse order
  // Ranks 1 and 2 report first and wait for rank 0.
  EXPECT_FALSE(Report(1, 1, forward).has_value());
  std::optional<absl::StatusOr<PlanView>> rank2;
  plans_.ReportGradientOrder(Member(2), 1, {0, 2, 1, 3}, absl::Seconds(5), now_,
                             [&rank2](absl::StatusOr<PlanView> v) { rank2 = std::move(v); });
  EXPECT_FALSE(rank2.has_value());
  auto rank0 = Report(0, 1, forward);
  ASSERT_TRUE(rank0.has_value() && rank0->ok());
  ASSERT_TRUE(rank2.has_value() && rank2->ok()) << "waiters are answered by rank 0's report";
  const PlanView v2 = **rank0;
  EXPECT_EQ(v2.version, 2);
  EXPECT_EQ(v2.status, OverlapStatus::kRebuilt);
  EXPECT_EQ(v2.plan->options.gradient_order, forward);
  EXPECT_EQ((*rank2)->plan->hash, v2.plan->hash) << "rank 0's order wins";

  PlanStats stats = plans_.Stats();
  ASSERT_EQ(stats.disagreements.size(), 1u);
  EXPECT_EQ(stats.disagreements[0].rank, 2);
  EXPECT_EQ(stats.disagreements[0].position, 1);
  EXPECT_EQ(stats.disagreements[0].expected, "layers.0.bias");
  EXPECT_EQ(stats.disagreements[0].reported, "layers.1.weight");

  AckAll(v2, /*except=*/2);
  stats = plans_.Stats();
  EXPECT_EQ(stats.status, OverlapStatus::kRebuilt) << "rank 2 has not acknowledged";
  EXPECT_EQ(stats.pending_acks, std::vector<int>{2});
  ASSERT_TRUE(plans_.AckPlan(Member(2), 2, v2.plan->hash).ok());
  EXPECT_EQ(plans_.Stats().status, OverlapStatus::kInitialized);
}

TEST_F(PlanManagerTest, AWaiterTimesOutWhenRankZeroNeverReports) {
  RegisterAll();
  std::optional<absl::StatusOr<PlanView>> answer;
  plans_.ReportGradientOrder(Member(1), 1, {3, 2, 1, 0}, absl::Seconds(2), now_,
                             [&answer](absl::StatusOr<PlanView> v) { answer = std::move(v); });
  plans_.ExpireWaits(now_ + absl::Seconds(1));
  EXPECT_FALSE(answer.has_value());
  plans_.ExpireWaits(now_ + absl::Seconds(2));
  ASSERT_TRUE(answer.has_value());
  EXPECT_EQ(answer->status().code(), absl::StatusCode::kDeadlineExceeded);
}

// A wait that arrives after the coordinator closed (a retry racing its shutdown) is answered at
// once: nothing would answer it later, and the server could not drain.
TEST_F(PlanManagerTest, AfterClosingHeldAndNewWaitsAreAnsweredWithTheReason) {
  RegisterAll();
  std::optional<absl::StatusOr<PlanView>> held;
  plans_.ReportGradientOrder(Member(1), 1, {3, 2, 1, 0}, absl::Seconds(5), now_,
                             [&held](absl::StatusOr<PlanView> v) { held = std::move(v); });
  ASSERT_FALSE(held.has_value());
  plans_.CloseWaits(absl::UnavailableError("shutting down"));
  ASSERT_TRUE(held.has_value());
  EXPECT_EQ(held->status().code(), absl::StatusCode::kUnavailable);

  auto late = Report(2, 1, {3, 2, 1, 0});
  ASSERT_TRUE(late.has_value()) << "a wait after closing must not be held";
  EXPECT_EQ(late->status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(plans_.pending_waiters(), 0u);
}

TEST_F(PlanManagerTest, BadOrdersAndStaleRequestsAreRefused) {
  RegisterAll();
  auto duplicate = Report(0, 1, {0, 0, 1, 2});
  ASSERT_TRUE(duplicate.has_value());
  EXPECT_EQ(duplicate->status().code(), absl::StatusCode::kInvalidArgument);
  auto stale_version = Report(0, 9, {0, 1, 2, 3});
  EXPECT_EQ(stale_version->status().code(), absl::StatusCode::kAborted);
  EXPECT_EQ(plans_.RegisterManifest(Member(0, kGeneration - 1), Model()).status().code(),
            absl::StatusCode::kAborted);
}

TEST_F(PlanManagerTest, ANewGenerationKeepsTheRebuiltOrderAndAbortsWaiters) {
  RegisterAll();
  ASSERT_TRUE(Report(0, 1, {0, 1, 2, 3}).has_value());
  AckAll(*plans_.Current());
  EXPECT_EQ(plans_.Stats().status, OverlapStatus::kInitialized);

  // The world shrinks to 2: a new plan (v3) with the rebuilt order.
  plans_.OnGeneration(kGeneration + 1);
  EXPECT_FALSE(plans_.Current().has_value());
  EXPECT_EQ(plans_.Stats().status, OverlapStatus::kRebuilt);
  MemberRef survivor{"w0", 0, kGeneration + 1, 2};
  auto v3 = plans_.RegisterManifest(survivor, Model());
  ASSERT_TRUE(v3.ok());
  EXPECT_EQ(v3->version, 3);
  EXPECT_EQ(v3->plan->options.world_size, 2);
  EXPECT_EQ(v3->plan->options.gradient_order, (std::vector<int>{0, 1, 2, 3}));

  // A wait pending when a generation ends is aborted.
  std::optional<absl::StatusOr<PlanView>> aborted;
  PlanManager fresh{PlanConfig{}};
  fresh.OnGeneration(1);
  MemberRef one{"a", 1, 1, 2};
  MemberRef zero{"b", 0, 1, 2};
  ASSERT_TRUE(fresh.RegisterManifest(zero, Model()).ok());
  fresh.ReportGradientOrder(one, 1, {0, 1, 2, 3}, absl::Seconds(5), now_,
                            [&aborted](absl::StatusOr<PlanView> v) { aborted = std::move(v); });
  fresh.OnGeneration(2);
  ASSERT_TRUE(aborted.has_value());
  EXPECT_EQ(aborted->status().code(), absl::StatusCode::kAborted);
}

TEST_F(PlanManagerTest, StepStatisticsAreAggregated) {
  RegisterAll();
  for (int rank = 0; rank < 2; ++rank) {
    for (int step = 0; step < 4; ++step) {
      StepReport report;
      report.step = step;
      report.step_ms = 10;
      report.backward_ms = 6;
      report.communication_ms = 4;
      report.hidden_ms = rank == 0 ? 3 : 1;
      report.bucket_bytes = {100, 200};
      ASSERT_TRUE(plans_.ReportStepStats(Member(rank), report, now_).ok());
    }
  }
  PlanStats stats = plans_.Stats();
  EXPECT_EQ(stats.steps_reported, 8);
  EXPECT_DOUBLE_EQ(stats.mean_step_ms, 10);
  EXPECT_DOUBLE_EQ(stats.mean_communication_ms, 4);
  EXPECT_DOUBLE_EQ(stats.mean_hidden_ms, 2);
  EXPECT_DOUBLE_EQ(stats.overlap_fraction, 0.5);
  EXPECT_EQ(stats.bucket_bytes, (std::vector<int64_t>{100, 200}));
  ASSERT_TRUE(stats.ranks[0].last.has_value());
  EXPECT_EQ(stats.ranks[0].last->step, 3);
}

}  // namespace
}  // namespace shard
