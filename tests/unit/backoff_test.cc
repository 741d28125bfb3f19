#include "common/backoff.h"

#include <vector>

#include "gtest/gtest.h"

namespace shard {
namespace {

std::vector<absl::Duration> Take(Backoff& backoff, int n) {
  std::vector<absl::Duration> delays;
  for (int i = 0; i < n; ++i) delays.push_back(backoff.Next());
  return delays;
}

TEST(BackoffTest, GrowsByTheFactorUpToTheCap) {
  Backoff backoff(absl::Milliseconds(100), absl::Seconds(2));
  EXPECT_EQ(Take(backoff, 7),
            (std::vector<absl::Duration>{absl::Milliseconds(100), absl::Milliseconds(200),
                                         absl::Milliseconds(400), absl::Milliseconds(800),
                                         absl::Milliseconds(1600), absl::Seconds(2),
                                         absl::Seconds(2)}));
}

TEST(BackoffTest, TakesAnyFactor) {
  Backoff backoff(absl::Milliseconds(10), absl::Seconds(1), /*factor=*/3);
  EXPECT_EQ(Take(backoff, 3), (std::vector<absl::Duration>{absl::Milliseconds(10),
                                                           absl::Milliseconds(30),
                                                           absl::Milliseconds(90)}));
}

TEST(BackoffTest, ResetStartsOver) {
  Backoff backoff(absl::Milliseconds(200), absl::Seconds(2));
  Take(backoff, 10);
  backoff.Reset();
  EXPECT_EQ(Take(backoff, 2),
            (std::vector<absl::Duration>{absl::Milliseconds(200), absl::Milliseconds(400)}));
}

TEST(BackoffTest, ANewCapAppliesToTheNextDelay) {
  Backoff backoff(absl::Milliseconds(50), absl::Seconds(1));
  EXPECT_EQ(Take(backoff, 6),
            (std::vector<absl::Duration>{absl::Milliseconds(50), absl::Milliseconds(100),
                                         absl::Milliseconds(200), absl::Milliseconds(400),
                                         absl::Milliseconds(800), absl::Seconds(1)}));
  // A lower cap takes effect at once; a higher one lets the delays grow from there again.
  backoff.set_max(absl::Milliseconds(250));
  EXPECT_EQ(backoff.Next(), absl::Milliseconds(250));
  backoff.set_max(absl::Seconds(1));
  EXPECT_EQ(Take(backoff, 3), (std::vector<absl::Duration>{absl::Milliseconds(500),
                                                           absl::Seconds(1), absl::Seconds(1)}));
}

TEST(BackoffTest, TheFirstDelayIsCappedToo) {
  Backoff backoff(absl::Milliseconds(50), absl::Milliseconds(20));
  EXPECT_EQ(Take(backoff, 2),
            (std::vector<absl::Duration>{absl::Milliseconds(20), absl::Milliseconds(20)}));
}

TEST(BackoffTest, OnlyUnavailableAndDeadlineExceededAreTransient) {
  EXPECT_TRUE(IsTransient(absl::UnavailableError("connection refused")));
  EXPECT_TRUE(IsTransient(absl::DeadlineExceededError("no answer")));
  EXPECT_FALSE(IsTransient(absl::OkStatus()));
  EXPECT_FALSE(IsTransient(absl::AbortedError("stale generation")));
  EXPECT_FALSE(IsTransient(absl::FailedPreconditionError("taken over")));
  EXPECT_FALSE(IsTransient(absl::ResourceExhaustedError("world full")));
}

}  // namespace
}  // namespace shard
