#include "worker/dataplane/self_check.h"

#include <cstring>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "worker/dataplane/gloo_communicator.h"

namespace shard {
namespace {

// A one-rank communicator that corrupts one element of each all-reduce or all-gather, to prove
// that the self-check looks at the numbers.
class CorruptingCommunicator : public Communicator {
 public:
  explicit CorruptingCommunicator(size_t corrupt_at) : corrupt_at_(corrupt_at) {}
  int rank() const override { return 0; }
  int size() const override { return 1; }
  absl::string_view backend() const override { return "corrupting"; }
  absl::Status AllReduce(const void* send, void* recv, size_t count, DataType dtype,
                         ReduceOp) override {
    std::memmove(recv, send, count * DataTypeSize(dtype));
    static_cast<float*>(recv)[corrupt_at_] += 1.0f;
    return absl::OkStatus();
  }
  absl::Status ReduceScatter(const void*, void*, size_t, DataType, ReduceOp) override {
    return absl::UnimplementedError("unused");
  }
  absl::Status AllGather(const void* send, void* recv, size_t count, DataType dtype) override {
    std::memmove(recv, send, count * DataTypeSize(dtype));
    return absl::OkStatus();
  }
  absl::Status Reduce(const void*, void*, size_t, DataType, ReduceOp, int) override {
    return absl::UnimplementedError("unused");
  }
  absl::Status Broadcast(void*, size_t, DataType, int) override { return absl::OkStatus(); }
  absl::Status Barrier() override { return absl::OkStatus(); }
  void Abort(absl::string_view) override {}
  bool aborted() const override { return false; }

 private:
  size_t corrupt_at_;
};

TEST(SelfCheckTest, PassesOnARealThreeRankWorld) {
  InProcessKeyValueStore store;
  std::vector<std::thread> ranks;
  for (int rank = 0; rank < 3; ++rank) {
    ranks.emplace_back([&store, rank] {
      GlooOptions options;
      options.rank = rank;
      options.size = 3;
      options.timeout = absl::Seconds(20);
      auto communicator = CreateGlooCommunicator(&store, options);
      ASSERT_TRUE(communicator.ok()) << communicator.status();
      auto result = RunSelfCheck(**communicator, 100000);
      ASSERT_TRUE(result.ok()) << result.status();
      EXPECT_NE(result->summary.find("3 ranks"), std::string::npos) << result->summary;
    });
  }
  for (std::thread& t : ranks) t.join();
}

TEST(SelfCheckTest, AWrongElementFailsTheCheckAndIsNamed) {
  CorruptingCommunicator corrupting(/*corrupt_at=*/777);
  auto result = RunSelfCheck(corrupting, 1000);
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(result.status().message().find("element 777"), absl::string_view::npos)
      << result.status();
}

}  // namespace
}  // namespace shard
