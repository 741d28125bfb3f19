#include "common/rate_limiter.h"

#include "gtest/gtest.h"

namespace shard {
namespace {

TEST(RateLimiterTest, AllowsABurstThenRefillsAtTheRate) {
  RateLimiter limiter(/*per_second=*/10, /*burst=*/3);
  const absl::Time start = absl::FromUnixSeconds(1000);
  EXPECT_TRUE(limiter.Allow(start));
  EXPECT_TRUE(limiter.Allow(start));
  EXPECT_TRUE(limiter.Allow(start));
  EXPECT_FALSE(limiter.Allow(start)) << "the burst is spent";
  EXPECT_FALSE(limiter.Allow(start + absl::Milliseconds(50))) << "half a token";
  EXPECT_TRUE(limiter.Allow(start + absl::Milliseconds(110)));
  EXPECT_FALSE(limiter.Allow(start + absl::Milliseconds(110)));
  // A long quiet spell refills only up to the burst.
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(limiter.Allow(start + absl::Seconds(60)));
  EXPECT_FALSE(limiter.Allow(start + absl::Seconds(60)));
}

TEST(RateLimiterTest, ATimeGoingBackwardsGivesNothingBack) {
  RateLimiter limiter(1, 1);
  const absl::Time start = absl::FromUnixSeconds(1000);
  EXPECT_TRUE(limiter.Allow(start));
  EXPECT_FALSE(limiter.Allow(start - absl::Seconds(10)));
  EXPECT_FALSE(limiter.Allow(start + absl::Milliseconds(500)));
  EXPECT_TRUE(limiter.Allow(start + absl::Seconds(1)));
}

}  // namespace
}  // namespace shard
