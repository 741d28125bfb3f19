// WaitList: answered entries leave, expiry goes by deadline then by arrival, and a closed list
// hands back everything it held and says why it closed.
#include "server/wait_list.h"

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shard {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

const absl::Time kStart = absl::FromUnixSeconds(1000);

TEST(WaitListTest, ExpiresByDeadlineThenByArrivalAndSkipsEntriesAnsweredEarly) {
  WaitList<std::string> list;
  list.Add(kStart + absl::Seconds(2), "late");
  const auto early = list.Add(kStart + absl::Seconds(1), "early");
  list.Add(kStart + absl::Seconds(1), "early too");
  list.Add(kStart + absl::Seconds(1), "answered");
  EXPECT_EQ(list.TakeIf([](const std::string& e) { return e == "answered"; }),
            std::vector<std::string>{"answered"});
  EXPECT_TRUE(list.contains(early));

  EXPECT_THAT(list.TakeExpired(kStart), IsEmpty());
  EXPECT_THAT(list.TakeExpired(kStart + absl::Seconds(1)), ElementsAre("early", "early too"));
  EXPECT_FALSE(list.contains(early));
  EXPECT_EQ(list.Take(early), std::nullopt);
  EXPECT_THAT(list.TakeExpired(kStart + absl::Seconds(5)), ElementsAre("late"));
  EXPECT_TRUE(list.empty());
}

TEST(WaitListTest, ClosingHandsBackEveryEntryAndKeepsTheReason) {
  WaitList<int> list;
  EXPECT_TRUE(list.closed().ok());
  list.Add(kStart + absl::Seconds(3), 1);
  list.Add(kStart + absl::Seconds(1), 2);
  const absl::Status reason = absl::UnavailableError("shutting down");
  EXPECT_THAT(list.Close(reason), ElementsAre(1, 2));
  EXPECT_EQ(list.closed(), reason);
  EXPECT_TRUE(list.empty());
  // The heap nodes of the closed entries expire to nothing.
  EXPECT_THAT(list.TakeExpired(kStart + absl::Hours(1)), IsEmpty());
}

}  // namespace
}  // namespace shard
