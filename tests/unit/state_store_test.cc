#include "server/store/state_store.h"

#include <filesystem>
#include <fstream>

#include "gtest/gtest.h"
#include "shard/v1/state.pb.h"

namespace shard {
namespace {

std::string FreshDir(const std::string& name) {
  const std::string dir = ::testing::TempDir() + "/shard-state-store-test-" + name;
  std::filesystem::remove_all(dir);
  return dir;
}

v1::CoordinatorState SampleState() {
  v1::CoordinatorState state;
  state.set_format_version(1);
  state.set_job("job1");
  state.set_generation(42);
  v1::MembershipEvent* event = state.add_events();
  event->set_kind(v1::MEMBERSHIP_EVENT_KIND_DEAD);
  event->set_worker_id("w1");
  event->set_rank(1);
  event->set_generation(42);
  return state;
}

// The contract every StateStore keeps.
template <typename T>
class StateStoreContractTest : public ::testing::Test {
 protected:
  std::unique_ptr<StateStore> Open() {
    if constexpr (std::is_same_v<T, InMemoryStateStore>) {
      return std::make_unique<InMemoryStateStore>();
    } else {
      auto store = DirectoryStateStore::Open(FreshDir("contract"));
      EXPECT_TRUE(store.ok()) << store.status();
      return std::move(*store);
    }
  }
};
using StoreTypes = ::testing::Types<InMemoryStateStore, DirectoryStateStore>;
TYPED_TEST_SUITE(StateStoreContractTest, StoreTypes);

TYPED_TEST(StateStoreContractTest, RecordsAreEmptyThenSavedThenReplacedIndependently) {
  std::unique_ptr<StateStore> store = this->Open();
  v1::CoordinatorState loaded;
  auto empty = store->Load("membership", &loaded);
  ASSERT_TRUE(empty.ok());
  EXPECT_FALSE(*empty);
  v1::CoordinatorState state = SampleState();
  ASSERT_TRUE(store->Save("membership", state).ok());
  state.set_generation(43);
  ASSERT_TRUE(store->Save("membership", state).ok());
  v1::CoordinatorState other = SampleState();
  other.set_job("other");
  ASSERT_TRUE(store->Save("other", other).ok());
  auto found = store->Load("membership", &loaded);
  ASSERT_TRUE(found.ok() && *found);
  EXPECT_EQ(loaded.generation(), 43);
  EXPECT_EQ(loaded.events(0).worker_id(), "w1");
  ASSERT_TRUE(*store->Load("other", &loaded));
  EXPECT_EQ(loaded.job(), "other");
}

TEST(DirectoryStateStoreTest, SurvivesReopeningAndLocksTheDirectory) {
  const std::string dir = FreshDir("reopen");
  {
    auto store = DirectoryStateStore::Open(dir);
    ASSERT_TRUE(store.ok());
    ASSERT_TRUE((*store)->Save("membership", SampleState()).ok());
    auto second = DirectoryStateStore::Open(dir);
    EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_NE(second.status().message().find("in use"), absl::string_view::npos);
  }
  auto reopened = DirectoryStateStore::Open(dir);
  ASSERT_TRUE(reopened.ok()) << "the lock is released with the store";
  v1::CoordinatorState loaded;
  auto found = (*reopened)->Load("membership", &loaded);
  ASSERT_TRUE(found.ok() && *found);
  EXPECT_EQ(loaded.generation(), 42);
}

TEST(DirectoryStateStoreTest, ACorruptFileIsDataLossNamingTheFile) {
  const std::string dir = FreshDir("corrupt");
  auto store = DirectoryStateStore::Open(dir);
  ASSERT_TRUE(store.ok());
  std::ofstream((*store)->PathOf("membership")) << "{\"generation\": \"not a number\"";
  v1::CoordinatorState loaded;
  auto found = (*store)->Load("membership", &loaded);
  EXPECT_EQ(found.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(found.status().message().find("membership.json"), absl::string_view::npos);
}

}  // namespace
}  // namespace shard
