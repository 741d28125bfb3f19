#include "server/store/state_store.h"

#include <filesystem>
#include <fstream>

#include "gtest/gtest.h"

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

TYPED_TEST(StateStoreContractTest, EmptyThenSavedThenReplaced) {
  std::unique_ptr<StateStore> store = this->Open();
  auto empty = store->Load();
  ASSERT_TRUE(empty.ok());
  EXPECT_FALSE(empty->has_value());
  v1::CoordinatorState state = SampleState();
  ASSERT_TRUE(store->Save(state).ok());
  state.set_generation(43);
  ASSERT_TRUE(store->Save(state).ok());
  auto loaded = store->Load();
  ASSERT_TRUE(loaded.ok() && loaded->has_value());
  EXPECT_EQ((*loaded)->generation(), 43);
  EXPECT_EQ((*loaded)->events(0).worker_id(), "w1");
}

TEST(DirectoryStateStoreTest, SurvivesReopeningAndLocksTheDirectory) {
  const std::string dir = FreshDir("reopen");
  {
    auto store = DirectoryStateStore::Open(dir);
    ASSERT_TRUE(store.ok());
    ASSERT_TRUE((*store)->Save(SampleState()).ok());
    auto second = DirectoryStateStore::Open(dir);
    EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_NE(second.status().message().find("in use"), absl::string_view::npos);
  }
  auto reopened = DirectoryStateStore::Open(dir);
  ASSERT_TRUE(reopened.ok()) << "the lock is released with the store";
  auto loaded = (*reopened)->Load();
  ASSERT_TRUE(loaded.ok() && loaded->has_value());
  EXPECT_EQ((*loaded)->generation(), 42);
}

TEST(DirectoryStateStoreTest, ACorruptFileIsDataLossNamingTheFile) {
  const std::string dir = FreshDir("corrupt");
  auto store = DirectoryStateStore::Open(dir);
  ASSERT_TRUE(store.ok());
  std::ofstream((*store)->state_file()) << "{\"generation\": \"not a number\"";
  auto loaded = (*store)->Load();
  EXPECT_EQ(loaded.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(loaded.status().message().find("coordinator-state.json"), absl::string_view::npos);
}

TEST(DirectoryStateStoreTest, AnUnknownFormatVersionIsRefused) {
  const std::string dir = FreshDir("version");
  auto store = DirectoryStateStore::Open(dir);
  ASSERT_TRUE(store.ok());
  v1::CoordinatorState future = SampleState();
  future.set_format_version(9);
  ASSERT_TRUE((*store)->Save(future).ok());
  EXPECT_EQ((*store)->Load().status().code(), absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace shard
