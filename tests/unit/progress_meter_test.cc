#include "common/progress_meter.h"

#include "gtest/gtest.h"

namespace shard {
namespace {

const absl::Time kStart = absl::FromUnixSeconds(1700000000);

TEST(ProgressMeterTest, NothingIsKnownBeforeTwoReports) {
  ProgressMeter meter;
  EXPECT_FALSE(meter.has_step());
  EXPECT_EQ(meter.steps_per_second(), 0);
  EXPECT_FALSE(meter.Remaining(100).has_value());
  meter.Note(1, 10, 2.5, kStart);
  EXPECT_TRUE(meter.has_step());
  EXPECT_EQ(meter.step(), 10);
  EXPECT_EQ(meter.loss(), 2.5);
  EXPECT_EQ(meter.steps_per_second(), 0) << "one report is no rate";
  EXPECT_FALSE(meter.Remaining(100).has_value());
}

TEST(ProgressMeterTest, RateAndTimeLeftFollowTheReports) {
  ProgressMeter meter;
  // 4 steps a second: step 10 at 0 s ... step 30 at 5 s; every rank reports every step.
  for (int64_t step = 10; step <= 30; ++step) {
    for (int rank = 0; rank < 3; ++rank) {
      meter.Note(1, step, 1.0 / static_cast<double>(step),
                 kStart + absl::Milliseconds(250) * (step - 10));
    }
  }
  EXPECT_EQ(meter.step(), 30);
  EXPECT_DOUBLE_EQ(meter.loss(), 1.0 / 30);
  EXPECT_DOUBLE_EQ(meter.steps_per_second(), 4.0);
  ASSERT_TRUE(meter.Remaining(130).has_value());
  EXPECT_EQ(*meter.Remaining(130), absl::Seconds(25));
  EXPECT_EQ(*meter.Remaining(30), absl::ZeroDuration());
  // A late report of an earlier step in the same generation changes nothing.
  meter.Note(1, 12, 9.0, kStart + absl::Seconds(6));
  EXPECT_EQ(meter.step(), 30);
  EXPECT_DOUBLE_EQ(meter.loss(), 1.0 / 30);
}

TEST(ProgressMeterTest, TheRateIsOverTheRecentWindow) {
  ProgressMeter meter(absl::Seconds(10));
  // 1 step/s for a minute, then 10 steps/s: the rate is the new one once the window passed.
  int64_t step = 0;
  absl::Time now = kStart;
  for (int i = 0; i < 60; ++i) meter.Note(1, ++step, 0, now += absl::Seconds(1));
  EXPECT_DOUBLE_EQ(meter.steps_per_second(), 1.0);
  for (int i = 0; i < 200; ++i) meter.Note(1, ++step, 0, now += absl::Milliseconds(100));
  EXPECT_NEAR(meter.steps_per_second(), 10.0, 1e-9);
}

TEST(ProgressMeterTest, ANewGenerationStartsOverFromItsFirstReport) {
  ProgressMeter meter;
  meter.Note(1, 40, 0.5, kStart);
  meter.Note(1, 50, 0.4, kStart + absl::Seconds(1));
  // A re-formation restored step 30's checkpoint: the world trains step 31 again.
  meter.Note(2, 31, 0.6, kStart + absl::Seconds(5));
  EXPECT_EQ(meter.step(), 31);
  EXPECT_EQ(meter.loss(), 0.6);
  EXPECT_EQ(meter.steps_per_second(), 0) << "the pause is not part of the new rate";
  meter.Note(2, 33, 0.55, kStart + absl::Seconds(6));
  EXPECT_DOUBLE_EQ(meter.steps_per_second(), 2.0);
}

}  // namespace
}  // namespace shard
