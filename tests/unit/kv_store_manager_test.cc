#include "server/kv_store_manager.h"

#include <optional>

#include "gtest/gtest.h"

namespace shard {
namespace {

class KvStoreManagerTest : public ::testing::Test {
 protected:
  KvScope Scope(int64_t generation) { return KvScope{"job1", generation}; }
  // Records the one answer a wait gets.
  KvStoreManager::WaitCallback Record(std::optional<absl::Status>* out) {
    return [out](absl::Status status) {
      ASSERT_FALSE(out->has_value()) << "a wait was answered twice";
      *out = status;
    };
  }

  KvStoreManager kv_{"job1", 5};
  absl::Time now_ = absl::FromUnixSeconds(1700000000);
};

TEST_F(KvStoreManagerTest, SetThenGet) {
  ASSERT_TRUE(kv_.Set(Scope(5), "rank/0", "addr0").ok());
  auto value = kv_.Get(Scope(5), "rank/0");
  ASSERT_TRUE(value.ok());
  EXPECT_EQ(*value, "addr0");
  EXPECT_EQ(kv_.Get(Scope(5), "rank/1").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(KvStoreManagerTest, WaitIsAnsweredWhenTheLastKeyArrives) {
  std::optional<absl::Status> answer;
  kv_.Wait(Scope(5), {"a", "b"}, absl::Seconds(5), now_, Record(&answer));
  ASSERT_TRUE(kv_.Set(Scope(5), "a", "1").ok());
  EXPECT_FALSE(answer.has_value());
  ASSERT_TRUE(kv_.Set(Scope(5), "b", "2").ok());
  ASSERT_TRUE(answer.has_value());
  EXPECT_TRUE(answer->ok());
  EXPECT_EQ(kv_.pending_waiters(), 0u);
}

TEST_F(KvStoreManagerTest, WaitOnKeysAlreadySetAnswersAtOnce) {
  ASSERT_TRUE(kv_.Set(Scope(5), "a", "1").ok());
  std::optional<absl::Status> answer;
  kv_.Wait(Scope(5), {"a"}, absl::Seconds(5), now_, Record(&answer));
  ASSERT_TRUE(answer.has_value());
  EXPECT_TRUE(answer->ok());
}

TEST_F(KvStoreManagerTest, WaitTimesOutAndNamesTheMissingKeys) {
  ASSERT_TRUE(kv_.Set(Scope(5), "a", "1").ok());
  std::optional<absl::Status> answer;
  kv_.Wait(Scope(5), {"a", "b"}, absl::Milliseconds(300), now_, Record(&answer));
  kv_.ExpireWaiters(now_ + absl::Milliseconds(299));
  EXPECT_FALSE(answer.has_value());
  kv_.ExpireWaiters(now_ + absl::Milliseconds(300));
  ASSERT_TRUE(answer.has_value());
  EXPECT_EQ(answer->code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(answer->message().find("'b'"), absl::string_view::npos) << *answer;
  EXPECT_EQ(answer->message().find("'a'"), absl::string_view::npos) << *answer;
}

TEST_F(KvStoreManagerTest, ScopesAreCheckedByJobAndGeneration) {
  EXPECT_EQ(kv_.Set(Scope(4), "a", "1").code(), absl::StatusCode::kAborted);
  EXPECT_EQ(kv_.Set(Scope(6), "a", "1").code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(kv_.Set(KvScope{"other", 5}, "a", "1").code(), absl::StatusCode::kNotFound);
  std::optional<absl::Status> answer;
  kv_.Wait(Scope(4), {"a"}, absl::Seconds(1), now_, Record(&answer));
  ASSERT_TRUE(answer.has_value());
  EXPECT_EQ(answer->code(), absl::StatusCode::kAborted);
}

TEST_F(KvStoreManagerTest, ANewGenerationDropsKeysAndAbortsWaiters) {
  ASSERT_TRUE(kv_.Set(Scope(5), "a", "1").ok());
  std::optional<absl::Status> answer;
  kv_.Wait(Scope(5), {"b"}, absl::Seconds(5), now_, Record(&answer));
  kv_.SetCurrentGeneration(6);
  ASSERT_TRUE(answer.has_value());
  EXPECT_EQ(answer->code(), absl::StatusCode::kAborted);
  EXPECT_EQ(kv_.Get(Scope(6), "a").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(kv_.Get(Scope(5), "a").status().code(), absl::StatusCode::kAborted);
}

TEST_F(KvStoreManagerTest, OversizedInputIsRejected) {
  EXPECT_EQ(kv_.Set(Scope(5), "", "1").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(kv_.Set(Scope(5), std::string(513, 'k'), "1").code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(kv_.Set(Scope(5), "a", std::string((1 << 20) + 1, 'v')).code(),
            absl::StatusCode::kInvalidArgument);
  std::optional<absl::Status> answer;
  kv_.Wait(Scope(5), {}, absl::Seconds(1), now_, Record(&answer));
  EXPECT_EQ(answer->code(), absl::StatusCode::kInvalidArgument);
  answer.reset();
  kv_.Wait(Scope(5), {"a"}, absl::Hours(1), now_, Record(&answer));
  EXPECT_EQ(answer->code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(KvStoreManagerTest, AScopeHasAByteBudget) {
  KvLimits limits;
  limits.max_scope_bytes = 100;
  KvStoreManager small("job1", 1, limits);
  ASSERT_TRUE(small.Set(KvScope{"job1", 1}, "a", std::string(60, 'x')).ok());
  EXPECT_EQ(small.Set(KvScope{"job1", 1}, "b", std::string(60, 'x')).code(),
            absl::StatusCode::kResourceExhausted);
  // Replacing a value counts only the difference.
  EXPECT_TRUE(small.Set(KvScope{"job1", 1}, "a", std::string(90, 'x')).ok());
}

TEST_F(KvStoreManagerTest, CloseAnswersWaitersAndRefusesLaterCalls) {
  std::optional<absl::Status> answer;
  kv_.Wait(Scope(5), {"a"}, absl::Seconds(5), now_, Record(&answer));
  kv_.Close(absl::UnavailableError("shutting down"));
  ASSERT_TRUE(answer.has_value());
  EXPECT_EQ(answer->code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(kv_.Set(Scope(5), "a", "1").code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace shard
