// The host data path's choice of transport (ConnectHostCollectives), and the hierarchical
// collectives for ranks that span hosts: four ranks as threads of one process, each given a
// shared-memory domain to stand in for its host, results checked against closed forms.
#include <algorithm>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/data_path.h"
#include "worker/dataplane/hierarchical_communicator.h"

namespace shard {
namespace {

using ::testing::HasSubstr;

struct RankSetup {
  std::string domain;
  HostTransport transport = HostTransport::kAuto;
};

// Connects one rank per entry of `setups` on threads; returns what each connect returned.
std::vector<absl::StatusOr<std::unique_ptr<Communicator>>> ConnectAll(
    const std::vector<RankSetup>& setups) {
  InProcessKeyValueStore store;
  const int size = static_cast<int>(setups.size());
  std::vector<absl::StatusOr<std::unique_ptr<Communicator>>> results;
  for (int rank = 0; rank < size; ++rank) results.emplace_back(absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (int rank = 0; rank < size; ++rank) {
    threads.emplace_back([&, rank] {
      HostPathOptions options;
      options.timeout = absl::Seconds(20);
      options.transport = setups[rank].transport;
      options.domain = setups[rank].domain;
      results[rank] = ConnectHostCollectives(&store, rank, size, options);
    });
  }
  for (std::thread& thread : threads) thread.join();
  return results;
}

// Runs `body` on every rank of `communicators` at once.
void OnEveryRank(std::vector<std::unique_ptr<Communicator>>& communicators,
                 const std::function<void(Communicator&)>& body) {
  std::vector<std::thread> threads;
  for (auto& communicator : communicators) {
    threads.emplace_back([&body, c = communicator.get()] { body(*c); });
  }
  for (std::thread& thread : threads) thread.join();
}

std::vector<std::unique_ptr<Communicator>> Connected(const std::vector<std::string>& domains) {
  std::vector<RankSetup> setups;
  for (const std::string& domain : domains) setups.push_back({domain});
  std::vector<std::unique_ptr<Communicator>> communicators;
  for (auto& result : ConnectAll(setups)) {
    EXPECT_TRUE(result.ok()) << result.status();
    if (result.ok()) communicators.push_back(std::move(*result));
  }
  return communicators;
}

TEST(HostTransportTest, OneHostIsSharedMemoryOneRankPerHostIsTcp) {
  for (auto& c : Connected({"a", "a", "a"})) EXPECT_EQ(c->backend(), "shm");
  for (auto& c : Connected({"a", "b", "c"})) EXPECT_EQ(c->backend(), "gloo");
  for (auto& c : Connected({"a", "a", "b", "b"})) EXPECT_EQ(c->backend(), "shm+gloo");
}

TEST(HostTransportTest, OneRankAskingForTcpMakesItTcpForEveryRank) {
  for (auto& result : ConnectAll({{"a"}, {"a", HostTransport::kTcp}, {"a"}})) {
    ASSERT_TRUE(result.ok()) << result.status();
    EXPECT_EQ((*result)->backend(), "gloo");
  }
}

TEST(HostTransportTest, SharedMemoryAcrossHostsIsRefusedNamingTheRankElsewhere) {
  for (auto& result : ConnectAll({{"a", HostTransport::kShm}, {"a"}, {"b"}})) {
    ASSERT_FALSE(result.ok());
    EXPECT_EQ(result.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(result.status().message(), HasSubstr("rank 2 is elsewhere"));
    EXPECT_THAT(result.status().message(), HasSubstr("--transport auto or tcp"));
  }
}

TEST(HostTransportTest, ParseNamesTheTransports) {
  EXPECT_EQ(*ParseHostTransport("shm"), HostTransport::kShm);
  EXPECT_EQ(*ParseHostTransport("tcp"), HostTransport::kTcp);
  EXPECT_EQ(*ParseHostTransport("auto"), HostTransport::kAuto);
  EXPECT_THAT(ParseHostTransport("rdma").status().message(), HasSubstr("auto, tcp or shm"));
}

TEST(HostLayoutTest, HostsAreNumberedByTheirLowestRank) {
  const HostLayout layout = HostLayout::FromDomains({"y", "x", "y", "z"});
  EXPECT_EQ(layout.host, (std::vector<int>{0, 1, 0, 2}));
  EXPECT_EQ(layout.hosts(), 3);
  EXPECT_EQ(layout.RanksOn(0), (std::vector<int>{0, 2}));
}

// Hosts of two ranks each, with consecutive and with interleaved ranks, and uneven hosts.
class HierarchicalTest : public ::testing::TestWithParam<std::vector<std::string>> {};

TEST_P(HierarchicalTest, EveryCollectiveMatchesItsClosedForm) {
  std::vector<std::unique_ptr<Communicator>> communicators = Connected(GetParam());
  ASSERT_EQ(communicators.size(), GetParam().size());
  const int world = static_cast<int>(communicators.size());
  const float rank_sum = world * (world + 1) / 2.0f;  // of (rank + 1)
  for (size_t count : {size_t{1}, size_t{1001}, size_t{300000}}) {
    OnEveryRank(communicators, [&](Communicator& c) {
      const float mine = static_cast<float>(c.rank() + 1);
      // All-reduce in place: small integers add exactly in any order.
      std::vector<float> data(count);
      for (size_t i = 0; i < count; ++i) data[i] = mine * static_cast<float>(i % 7);
      ASSERT_TRUE(c.AllReduce(data.data(), data.data(), count, DataType::kFloat32,
                              ReduceOp::kSum).ok());
      for (size_t i = 0; i < count; ++i) ASSERT_EQ(data[i], rank_sum * (i % 7)) << i;

      // Reduce-scatter: block b of rank r holds (r + 1) * (b + 1).
      std::vector<float> blocks(count * world);
      for (int b = 0; b < world; ++b) {
        std::fill_n(blocks.begin() + b * count, count, mine * static_cast<float>(b + 1));
      }
      std::vector<float> own(count);
      ASSERT_TRUE(c.ReduceScatter(blocks.data(), own.data(), count, DataType::kFloat32,
                                  ReduceOp::kSum).ok());
      for (float value : own) ASSERT_EQ(value, rank_sum * (c.rank() + 1));

      // All-gather: block r is rank r's.
      std::vector<float> gathered(count * world, -1.0f);
      std::vector<float> send(count, mine);
      ASSERT_TRUE(c.AllGather(send.data(), gathered.data(), count, DataType::kFloat32).ok());
      for (int r = 0; r < world; ++r) {
        ASSERT_EQ(gathered[r * count], r + 1.0f);
        ASSERT_EQ(gathered[(r + 1) * count - 1], r + 1.0f);
      }

      // Reduce (max of int64) to every root, and broadcast from every root.
      for (int root = 0; root < world; ++root) {
        std::vector<int64_t> values(count, c.rank() == 2 ? 100 : c.rank());
        std::vector<int64_t> out(count, -7);
        ASSERT_TRUE(c.Reduce(values.data(), out.data(), count, DataType::kInt64, ReduceOp::kMax,
                             root).ok());
        ASSERT_EQ(out[count - 1], c.rank() == root ? 100 : -7) << "root " << root;
        std::vector<int64_t> broadcast(count, c.rank() == root ? 40 + root : 0);
        ASSERT_TRUE(c.Broadcast(broadcast.data(), count, DataType::kInt64, root).ok());
        ASSERT_EQ(broadcast[0], 40 + root);
        ASSERT_EQ(broadcast[count - 1], 40 + root);
      }
      ASSERT_TRUE(c.Barrier().ok());
    });
  }
}

INSTANTIATE_TEST_SUITE_P(Hosts, HierarchicalTest,
                         ::testing::Values(std::vector<std::string>{"a", "a", "b", "b"},
                                           std::vector<std::string>{"a", "b", "a", "b"},
                                           std::vector<std::string>{"a", "a", "a", "b"},
                                           std::vector<std::string>{"a", "b", "b", "c"}));

TEST(HierarchicalCommunicatorTest, ARankThatAbortsFailsEveryRankOnEveryHost) {
  std::vector<std::unique_ptr<Communicator>> communicators = Connected({"a", "a", "b", "b"});
  ASSERT_EQ(communicators.size(), 4u);
  std::vector<absl::Status> results(4);
  std::vector<std::thread> waiting;
  for (int rank = 0; rank < 3; ++rank) {
    waiting.emplace_back([&, rank] {
      std::vector<float> data(1 << 16, 1.0f);
      results[rank] = communicators[rank]->AllReduce(data.data(), data.data(), data.size(),
                                                     DataType::kFloat32, ReduceOp::kSum);
    });
  }
  // Rank 3 (not a leader, on the other host than rank 0) never joins: it aborts.
  communicators[3]->Abort("rank 3's generation ended");
  for (std::thread& thread : waiting) thread.join();
  for (int rank = 0; rank < 3; ++rank) {
    EXPECT_FALSE(results[rank].ok()) << "rank " << rank;
    EXPECT_THAT(results[rank].message(), HasSubstr(absl::StrCat("on rank ", rank, " of 4")));
  }
}

}  // namespace
}  // namespace shard
