// The progress lease's pure parts (common/progress_lease.h): timeouts derived from step times
// within their floor and ceiling, and which rank holds a stalled world up.
#include "common/progress_lease.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shard {
namespace {

using ::testing::HasSubstr;

const absl::Time kNow = absl::FromUnixSeconds(1700000000);

TEST(ProgressLeaseTest, TimeoutsFollowTheStepTimeWithinTheirFloorAndCeiling) {
  EXPECT_EQ(Quantile({}, 0.99), 0);
  EXPECT_EQ(Quantile({5, 1, 3}, 0.5), 3);
  std::vector<double> steps(100, 80);
  steps[37] = 900;  // one slow step is the p99 of a hundred
  EXPECT_EQ(Quantile(steps, 0.99), 80);
  steps[12] = 700;
  EXPECT_EQ(Quantile(steps, 0.99), 700);
  EXPECT_EQ(DerivedTimeout(absl::Milliseconds(80), 10, absl::Seconds(30), absl::Minutes(30)),
            absl::Seconds(30));
  EXPECT_EQ(DerivedTimeout(absl::Seconds(20), 10, absl::Seconds(30), absl::Minutes(30)),
            absl::Seconds(200));
  EXPECT_EQ(DerivedTimeout(absl::Minutes(10), 10, absl::Seconds(30), absl::Minutes(30)),
            absl::Minutes(30));
}

// Ranks 0..3 of generation 5 at step 811, told `ago` before now; `waiting` says who is in a
// collective.
std::vector<RankProgress> World(std::vector<bool> waiting, absl::Duration since_step,
                                absl::Duration ago = absl::ZeroDuration()) {
  std::vector<RankProgress> ranks;
  for (int rank = 0; rank < static_cast<int>(waiting.size()); ++rank) {
    RankProgress progress;
    progress.worker_id = "w" + std::to_string(rank + 5);
    progress.incarnation = 1;
    progress.rank = rank;
    progress.activity = TrainingActivity{5, 811, since_step,
                                         waiting[rank] ? since_step : absl::ZeroDuration()};
    progress.reported = kNow - ago;
    ranks.push_back(progress);
  }
  return ranks;
}

TEST(ProgressLeaseTest, TheRankOutsideTheCollectiveItsPeersWaitInIsStuck) {
  const absl::Duration lease = absl::Seconds(10);
  const absl::Duration median = absl::Milliseconds(80);
  std::optional<Stall> stall =
      FindStall(World({true, true, false, true}, absl::Seconds(14)), 4, 5, lease, median, kNow);
  ASSERT_TRUE(stall.has_value());
  ASSERT_EQ(stall->stuck.size(), 1u);
  EXPECT_EQ(stall->stuck[0].rank, 2);
  EXPECT_EQ(stall->step, 812);
  EXPECT_EQ(stall->description,
            "rank 2 (worker w7) has not finished step 812 for 14.0 s; median step 80 ms; 3 of 4 "
            "ranks wait for it in a collective");
  // What a rank said a while ago has gone on since.
  stall = FindStall(World({true, true, false, true}, absl::Seconds(7), absl::Seconds(4)), 4, 5,
                    lease, median, kNow);
  ASSERT_TRUE(stall.has_value());
  EXPECT_EQ(stall->stalled, absl::Seconds(11));
}

TEST(ProgressLeaseTest, NothingIsStuckWithinTheLeaseOrBeforeEveryRankTrains) {
  const absl::Duration lease = absl::Seconds(10);
  EXPECT_FALSE(FindStall(World({true, true, false, true}, absl::Seconds(9)), 4, 5, lease,
                         absl::Milliseconds(80), kNow)
                   .has_value());
  std::vector<RankProgress> restoring = World({true, true, false, true}, absl::Seconds(14));
  restoring[1].activity.generation = 4;  // still in the generation before
  EXPECT_FALSE(FindStall(restoring, 4, 5, lease, absl::Milliseconds(80), kNow).has_value());
  EXPECT_FALSE(FindStall(World({true, true, false}, absl::Seconds(14)), 4, 5, lease,
                         absl::Milliseconds(80), kNow)
                   .has_value())
      << "a rank not heard from";
}

TEST(ProgressLeaseTest, AStallNobodyCanBeBlamedForIsReportedWithoutNamingARank) {
  std::optional<Stall> stall = FindStall(World({true, true, true, true}, absl::Seconds(40)), 4, 5,
                                         absl::Seconds(30), absl::Seconds(2), kNow);
  ASSERT_TRUE(stall.has_value());
  EXPECT_TRUE(stall->stuck.empty());
  EXPECT_THAT(stall->description, HasSubstr("every rank waits in a collective"));
  stall = FindStall(World({false, false}, absl::Seconds(40)), 2, 5, absl::Seconds(30),
                    absl::Seconds(2), kNow);
  ASSERT_TRUE(stall.has_value());
  EXPECT_TRUE(stall->stuck.empty());
  EXPECT_THAT(stall->description, HasSubstr("no rank waits in a collective"));
}

}  // namespace
}  // namespace shard
