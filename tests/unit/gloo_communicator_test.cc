// N ranks as threads of one process, over real loopback TCP, rendezvousing through an
// in-process store; results checked against closed forms.
#include "worker/dataplane/gloo_communicator.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <numeric>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/support/directory_store.h"

namespace shard {
namespace {

using RankBody = std::function<void(GlooCommunicator& communicator)>;

GlooOptions Options(int rank, int size, size_t segment_bytes) {
  GlooOptions options;
  options.rank = rank;
  options.size = size;
  options.timeout = absl::Seconds(20);
  options.segment_bytes = segment_bytes;
  return options;
}

// Connects `size` ranks and runs `body` on each in its own thread.
void RunRanks(int size, const RankBody& body, size_t segment_bytes = size_t{1} << 20) {
  InProcessKeyValueStore store;
  std::vector<std::thread> threads;
  for (int rank = 0; rank < size; ++rank) {
    threads.emplace_back([&, rank] {
      auto communicator = CreateGlooCommunicator(&store, Options(rank, size, segment_bytes));
      ASSERT_TRUE(communicator.ok()) << communicator.status();
      body(**communicator);
    });
  }
  for (std::thread& t : threads) t.join();
}

class CollectivesTest : public ::testing::TestWithParam<int> {};

TEST_P(CollectivesTest, AllReduceSumMatchesTheClosedFormForAwkwardSizes) {
  const int world = GetParam();
  // Sizes: empty, one element, fewer elements than ranks, not divisible, many segments.
  for (size_t count : {size_t{0}, size_t{1}, size_t{3}, size_t{1001}, size_t{70000}}) {
    RunRanks(
        world,
        [&](GlooCommunicator& c) {
          std::vector<float> data(count);
          for (size_t i = 0; i < count; ++i) data[i] = static_cast<float>((c.rank() + 1) * (i % 97));
          ASSERT_TRUE(c.AllReduce(data.data(), data.data(), count, DataType::kFloat32,
                                  ReduceOp::kSum)
                          .ok());
          const float ranks = world * (world + 1) / 2.0f;
          for (size_t i = 0; i < count; ++i) {
            ASSERT_EQ(data[i], ranks * static_cast<float>(i % 97)) << "count " << count << " i " << i;
          }
        },
        /*segment_bytes=*/4096);
  }
}

TEST_P(CollectivesTest, AllReduceOutOfPlaceMaxMinAndInt64) {
  const int world = GetParam();
  RunRanks(world, [&](GlooCommunicator& c) {
    const size_t n = 5000;
    std::vector<int64_t> in(n), out(n, -1);
    for (size_t i = 0; i < n; ++i) in[i] = static_cast<int64_t>(i) * 1000000007LL + c.rank();
    ASSERT_TRUE(c.AllReduce(in.data(), out.data(), n, DataType::kInt64, ReduceOp::kMax).ok());
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(out[i], static_cast<int64_t>(i) * 1000000007LL + world - 1);
    ASSERT_TRUE(c.AllReduce(in.data(), out.data(), n, DataType::kInt64, ReduceOp::kMin).ok());
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(out[i], static_cast<int64_t>(i) * 1000000007LL);
    // The input is left untouched by an out-of-place call.
    EXPECT_EQ(in[7], 7 * 1000000007LL + c.rank());
  });
}

TEST_P(CollectivesTest, SixteenBitFloatsAreSummedInFloatAndRoundedOnce) {
  const int world = GetParam();
  RunRanks(world, [&](GlooCommunicator& c) {
    const size_t n = 1000;
    std::vector<uint16_t> half(n), bf16(n);
    for (size_t i = 0; i < n; ++i) {
      half[i] = FloatToHalf(0.25f * static_cast<float>(i % 13));
      bf16[i] = FloatToBFloat16(static_cast<float>(i % 31));
    }
    ASSERT_TRUE(c.AllReduce(half.data(), half.data(), n, DataType::kFloat16, ReduceOp::kSum).ok());
    ASSERT_TRUE(c.AllReduce(bf16.data(), bf16.data(), n, DataType::kBFloat16, ReduceOp::kSum).ok());
    for (size_t i = 0; i < n; ++i) {
      ASSERT_EQ(HalfToFloat(half[i]), 0.25f * static_cast<float>(i % 13) * world);
      ASSERT_EQ(BFloat16ToFloat(bf16[i]), static_cast<float>((i % 31) * world));
    }
  });
}

TEST_P(CollectivesTest, ReduceScatterGivesEachRankTheSumOfItsBlock) {
  const int world = GetParam();
  RunRanks(
      world,
      [&](GlooCommunicator& c) {
        const size_t block = 3000;
        std::vector<float> in(block * world);
        for (size_t i = 0; i < in.size(); ++i) in[i] = static_cast<float>(c.rank() * 10000 + i);
        std::vector<float> out(block, -1.0f);
        ASSERT_TRUE(c.ReduceScatter(in.data(), out.data(), block, DataType::kFloat32,
                                    ReduceOp::kSum)
                        .ok());
        const float rank_sum = 10000.0f * world * (world - 1) / 2.0f;
        for (size_t i = 0; i < block; ++i) {
          const float index = static_cast<float>(c.rank() * block + i);
          ASSERT_EQ(out[i], rank_sum + world * index) << "rank " << c.rank() << " i " << i;
        }
      },
      /*segment_bytes=*/1024);
}

TEST_P(CollectivesTest, AllGatherPlacesEachRanksBlockInOrder) {
  const int world = GetParam();
  RunRanks(
      world,
      [&](GlooCommunicator& c) {
        const size_t block = 2500;
        std::vector<float> mine(block);
        for (size_t i = 0; i < block; ++i) mine[i] = static_cast<float>(c.rank() * 100000 + i);
        std::vector<float> all(block * world, -1.0f);
        ASSERT_TRUE(c.AllGather(mine.data(), all.data(), block, DataType::kFloat32).ok());
        for (int r = 0; r < world; ++r) {
          for (size_t i = 0; i < block; ++i) {
            ASSERT_EQ(all[r * block + i], static_cast<float>(r * 100000 + i));
          }
        }
        // In place: the rank's block already sits in the output.
        std::vector<float> in_place(block * world, 0.0f);
        std::copy(mine.begin(), mine.end(), in_place.begin() + c.rank() * block);
        ASSERT_TRUE(c.AllGather(in_place.data() + c.rank() * block, in_place.data(), block,
                                DataType::kFloat32)
                        .ok());
        EXPECT_EQ(in_place, all);
      },
      /*segment_bytes=*/2048);
}

TEST_P(CollectivesTest, BroadcastFromEveryRootAndBarrier) {
  const int world = GetParam();
  RunRanks(
      world,
      [&](GlooCommunicator& c) {
        for (int root = 0; root < world; ++root) {
          std::vector<float> data(4099, static_cast<float>(c.rank()));
          if (c.rank() == root) {
            for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<float>(root * 7 + i);
          }
          ASSERT_TRUE(c.Broadcast(data.data(), data.size(), DataType::kFloat32, root).ok());
          for (size_t i = 0; i < data.size(); ++i) ASSERT_EQ(data[i], static_cast<float>(root * 7 + i));
          ASSERT_TRUE(c.Barrier().ok());
        }
        EXPECT_EQ(c.Broadcast(nullptr, 0, DataType::kFloat32, world).code(),
                  absl::StatusCode::kInvalidArgument);
      },
      /*segment_bytes=*/1000);
}

TEST_P(CollectivesTest, ReduceDeliversTheSumToTheRootOnly) {
  const int world = GetParam();
  RunRanks(
      world,
      [&](GlooCommunicator& c) {
        for (int root = 0; root < world; ++root) {
          const size_t n = 3001;
          std::vector<double> in(n);
          for (size_t i = 0; i < n; ++i) in[i] = (c.rank() + 1) * 0.5 + static_cast<double>(i);
          std::vector<double> out(n, -7.0);
          ASSERT_TRUE(c.Reduce(in.data(), out.data(), n, DataType::kFloat64, ReduceOp::kSum, root)
                          .ok());
          for (size_t i = 0; i < n; ++i) {
            const double expected =
                c.rank() == root ? world * (world + 1) / 4.0 + world * static_cast<double>(i)
                                 : -7.0;
            ASSERT_EQ(out[i], expected) << "root " << root << " rank " << c.rank() << " i " << i;
          }
        }
      },
      /*segment_bytes=*/4096);
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, CollectivesTest, ::testing::Values(1, 2, 3, 4),
                         [](const auto& info) { return absl::StrCat("ranks", info.param); });

TEST(GlooCommunicatorTest, AbortWakesACollectiveWaitingForAPeerAtOnce) {
  InProcessKeyValueStore store;
  std::unique_ptr<GlooCommunicator> communicators[2];
  std::thread connect1([&] {
    auto c = CreateGlooCommunicator(&store, Options(1, 2, 1 << 20));
    ASSERT_TRUE(c.ok());
    communicators[1] = std::move(*c);
  });
  auto c0 = CreateGlooCommunicator(&store, Options(0, 2, 1 << 20));
  connect1.join();
  ASSERT_TRUE(c0.ok());
  communicators[0] = std::move(*c0);

  // Rank 1 never joins the all-reduce; rank 0 would wait 20s for it.
  std::vector<float> data(1 << 16, 1.0f);
  std::thread aborter([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    communicators[0]->Abort("generation 7 ended");
  });
  const absl::Time start = absl::Now();
  absl::Status status =
      communicators[0]->AllReduce(data.data(), data.data(), data.size(), DataType::kFloat32,
                                  ReduceOp::kSum);
  const absl::Duration waited = absl::Now() - start;
  aborter.join();
  EXPECT_EQ(status.code(), absl::StatusCode::kAborted) << status;
  EXPECT_NE(status.message().find("generation 7 ended"), absl::string_view::npos) << status;
  EXPECT_LT(waited, absl::Seconds(5));
  EXPECT_TRUE(communicators[0]->aborted());
  // Later calls are refused at once.
  EXPECT_EQ(communicators[0]->Barrier().code(), absl::StatusCode::kAborted);
}

TEST(GlooCommunicatorTest, APeerThatAbortsReleasesTheOtherRankPromptly) {
  InProcessKeyValueStore store;
  std::unique_ptr<GlooCommunicator> c1;
  std::thread connect1([&] {
    auto c = CreateGlooCommunicator(&store, Options(1, 2, 1 << 20));
    ASSERT_TRUE(c.ok());
    c1 = std::move(*c);
  });
  auto c0 = CreateGlooCommunicator(&store, Options(0, 2, 1 << 20));
  connect1.join();
  ASSERT_TRUE(c0.ok());
  std::thread peer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    c1->Abort("peer process is going away");  // closes its connections
  });
  std::vector<float> data(1 << 16, 1.0f);
  const absl::Time start = absl::Now();
  absl::Status status = (*c0)->AllReduce(data.data(), data.data(), data.size(),
                                         DataType::kFloat32, ReduceOp::kSum);
  const absl::Duration waited = absl::Now() - start;
  peer.join();
  EXPECT_FALSE(status.ok());
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
  EXPECT_LT(waited, absl::Seconds(5)) << status;
  // A peer that went away (or aborted) is not a broken link: nothing to report against it.
  EXPECT_FALSE((*c0)->peer_fault().has_value());
}

// A peer process killed while three ranks stream a large all-reduce: rank 0's writes to it may
// hit a reset connection, which by default raises SIGPIPE and would end rank 0 silently. Rank 0
// must get an error instead: Unavailable when the reset is seen, DeadlineExceeded when a send
// that the kernel had buffered simply never completes (the coordinator's abort ends that sooner
// in a real job).
TEST(GlooCommunicatorTest, APeerKilledInTheMiddleOfASendFailsTheCollectiveNotTheProcess) {
  const std::string dir = ::testing::TempDir() + "/gloo-sigpipe-" + std::to_string(::getpid());
  std::filesystem::create_directories(dir);
  std::vector<float> data(size_t{32} << 20, 1.0f);
  std::vector<pid_t> peers;
  for (int rank = 1; rank <= 2; ++rank) {
    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      DirectoryKeyValueStore store(dir);
      GlooOptions options = Options(rank, 3, 1 << 20);
      options.timeout = absl::Seconds(5);
      auto peer = CreateGlooCommunicator(&store, options);
      absl::Status status = peer.status();
      for (int i = 0; status.ok() && i < 1000; ++i) {
        status = (*peer)->AllReduce(data.data(), data.data(), data.size(), DataType::kFloat32,
                                    ReduceOp::kSum);
      }
      ::_exit(0);
    }
    peers.push_back(child);
  }
  DirectoryKeyValueStore store(dir);
  GlooOptions options = Options(0, 3, 1 << 20);
  options.timeout = absl::Seconds(5);
  auto survivor = CreateGlooCommunicator(&store, options);
  ASSERT_TRUE(survivor.ok()) << survivor.status();
  std::thread killer([&peers] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    ::kill(peers[0], SIGKILL);
  });
  absl::Status status;
  for (int i = 0; status.ok() && i < 1000; ++i) {
    status = (*survivor)->AllReduce(data.data(), data.data(), data.size(), DataType::kFloat32,
                                    ReduceOp::kSum);
  }
  killer.join();
  for (pid_t peer : peers) {
    ::kill(peer, SIGKILL);
    ::waitpid(peer, nullptr, 0);
  }
  std::filesystem::remove_all(dir);
  EXPECT_TRUE(status.code() == absl::StatusCode::kUnavailable ||
              status.code() == absl::StatusCode::kDeadlineExceeded)
      << status;
}

// Every connection of the mesh gets the link timeout (TCP_USER_TIMEOUT and keepalive), so a
// partitioned link fails within it: read back from the process's own sockets.
TEST(GlooCommunicatorTest, TheMeshsConnectionsCarryTheLinkTimeout) {
  InProcessKeyValueStore store;
  std::vector<std::unique_ptr<GlooCommunicator>> communicators(3);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < 3; ++rank) {
    threads.emplace_back([&, rank] {
      GlooOptions options = Options(rank, 3, 1 << 20);
      options.link_timeout = absl::Milliseconds(7000);
      auto c = CreateGlooCommunicator(&store, options);
      ASSERT_TRUE(c.ok()) << c.status();
      communicators[rank] = std::move(*c);
    });
  }
  for (std::thread& t : threads) t.join();
  int with_timeout = 0;
  int with_keepalive = 0;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) {
    const int fd = std::stoi(entry.path().filename().string());
    unsigned user_timeout = 0;
    socklen_t length = sizeof(user_timeout);
    if (::getsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &user_timeout, &length) != 0) continue;
    with_timeout += user_timeout == 7000 ? 1 : 0;
    int keepalive = 0;
    length = sizeof(keepalive);
    if (::getsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &keepalive, &length) == 0 && keepalive) {
      ++with_keepalive;
    }
  }
  // Three ranks in one process: both ends of each of the three pairs.
  EXPECT_GE(with_timeout, 6);
  EXPECT_GE(with_keepalive, 6);
}

TEST(GlooCommunicatorTest, ACollectiveWithAMissingPeerTimesOut) {
  InProcessKeyValueStore store;
  std::unique_ptr<GlooCommunicator> c1;
  GlooOptions short_timeout = Options(0, 2, 1 << 20);
  short_timeout.timeout = absl::Milliseconds(500);
  std::thread connect1([&] {
    GlooOptions options = short_timeout;
    options.rank = 1;
    auto c = CreateGlooCommunicator(&store, options);
    ASSERT_TRUE(c.ok());
    c1 = std::move(*c);
  });
  auto c0 = CreateGlooCommunicator(&store, short_timeout);
  connect1.join();
  ASSERT_TRUE(c0.ok());
  std::vector<float> data(1024, 1.0f);
  absl::Status status = (*c0)->AllReduce(data.data(), data.data(), data.size(),
                                         DataType::kFloat32, ReduceOp::kSum);
  EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded) << status;
  EXPECT_NE(status.message().find("rank 0 of 2"), absl::string_view::npos) << status;
  // The link it waited on is named, for the coordinator (server/reachability.h).
  const std::optional<PeerFault> fault = (*c0)->peer_fault();
  ASSERT_TRUE(fault.has_value());
  EXPECT_EQ(fault->peer_rank, 1);
  EXPECT_EQ(fault->how, LinkFailure::kReceive);
  EXPECT_NE(status.message().find("rank 1 did not respond"), absl::string_view::npos) << status;
}

TEST(GlooCommunicatorTest, RendezvousWithoutThePeerTimesOutWithTheStoresError) {
  InProcessKeyValueStore store;
  GlooOptions options = Options(0, 2, 1 << 20);
  options.timeout = absl::Milliseconds(300);
  auto c = CreateGlooCommunicator(&store, options);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kDeadlineExceeded) << c.status();
  EXPECT_NE(c.status().message().find("rendezvous"), absl::string_view::npos) << c.status();
}

TEST(GlooCommunicatorTest, RankOutsideTheWorldIsRejected) {
  InProcessKeyValueStore store;
  EXPECT_EQ(CreateGlooCommunicator(&store, Options(2, 2, 1 << 20)).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace shard
