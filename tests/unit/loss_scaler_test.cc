// The dynamic loss scaler's rules, step by step against torch.cuda.amp.GradScaler's (host-only:
// these run everywhere, GPU or not).
#include "worker/dataplane/loss_scaler.h"

#include <cmath>
#include <limits>

#include "gtest/gtest.h"
#include "tests/support/status_assertions.h"

namespace shard {
namespace {

TEST(LossScalerTest, DefaultsAreGradScalers) {
  SHARD_ASSERT_OK_AND_ASSIGN(LossScaler scaler, LossScaler::Create());
  EXPECT_EQ(scaler.scale(), 65536.0f);
  EXPECT_EQ(scaler.inv_scale(), 1.0f / 65536.0f);
  EXPECT_EQ(scaler.growth_tracker(), 0);
}

TEST(LossScalerTest, OverflowSkipsTheStepHalvesTheScaleAndRestartsTheCount) {
  SHARD_ASSERT_OK_AND_ASSIGN(LossScaler scaler, LossScaler::Create());
  EXPECT_TRUE(scaler.Update(false));
  EXPECT_TRUE(scaler.Update(false));
  EXPECT_EQ(scaler.growth_tracker(), 2);
  EXPECT_FALSE(scaler.Update(true));
  EXPECT_EQ(scaler.scale(), 32768.0f);
  EXPECT_EQ(scaler.growth_tracker(), 0);
  EXPECT_FALSE(scaler.Update(true));
  EXPECT_EQ(scaler.scale(), 16384.0f);
}

TEST(LossScalerTest, GrowsAfterGrowthIntervalCleanStepsInARow) {
  SHARD_ASSERT_OK_AND_ASSIGN(
      LossScaler scaler,
      LossScaler::Create({.init_scale = 1024.0f, .growth_factor = 2.0f, .backoff_factor = 0.5f,
                          .growth_interval = 3}));
  for (int i = 0; i < 2; ++i) EXPECT_TRUE(scaler.Update(false));
  EXPECT_EQ(scaler.scale(), 1024.0f);
  EXPECT_TRUE(scaler.Update(false));
  EXPECT_EQ(scaler.scale(), 2048.0f);
  EXPECT_EQ(scaler.growth_tracker(), 0);
  // An overflow in between restarts the count: two clean, one overflow, three clean.
  EXPECT_TRUE(scaler.Update(false));
  EXPECT_TRUE(scaler.Update(false));
  EXPECT_FALSE(scaler.Update(true));
  EXPECT_EQ(scaler.scale(), 1024.0f);
  for (int i = 0; i < 2; ++i) EXPECT_TRUE(scaler.Update(false));
  EXPECT_EQ(scaler.scale(), 1024.0f);
  EXPECT_TRUE(scaler.Update(false));
  EXPECT_EQ(scaler.scale(), 2048.0f);
}

TEST(LossScalerTest, NeverGrowsPastTheLargestFloat) {
  const float big = std::ldexp(1.0f, 127);
  SHARD_ASSERT_OK_AND_ASSIGN(LossScaler scaler,
                             LossScaler::Create({.init_scale = big, .growth_interval = 1}));
  EXPECT_TRUE(scaler.Update(false));
  EXPECT_EQ(scaler.scale(), big);  // 2^128 is not a float: torch keeps the scale
  EXPECT_EQ(scaler.growth_tracker(), 0);
}

TEST(LossScalerTest, RejectsMeaninglessOptions) {
  for (LossScalerOptions options :
       {LossScalerOptions{.init_scale = 0.0f}, LossScalerOptions{.init_scale = -1.0f},
        LossScalerOptions{.init_scale = std::numeric_limits<float>::infinity()},
        LossScalerOptions{.growth_factor = 1.0f}, LossScalerOptions{.backoff_factor = 1.0f},
        LossScalerOptions{.backoff_factor = 0.0f}, LossScalerOptions{.growth_interval = 0}}) {
    const auto scaler = LossScaler::Create(options);
    EXPECT_EQ(scaler.status().code(), absl::StatusCode::kInvalidArgument);
  }
}

}  // namespace
}  // namespace shard
