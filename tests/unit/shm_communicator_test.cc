// The shared-memory communicator: N ranks as threads of one process over an in-process store,
// checked against closed forms and bit for bit against the TCP ring (GlooCommunicator); then a
// peer in another process that is killed or stopped; and nothing left behind in /dev/shm.
#include "worker/dataplane/shm_communicator.h"

#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/directory_store.h"
#include "tests/support/status_assertions.h"
#include "tests/support/test_directory.h"
#include "worker/dataplane/gloo_communicator.h"

namespace shard {
namespace {

using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Not;

using Factory = std::function<absl::StatusOr<std::unique_ptr<Communicator>>(
    KeyValueStore* store, int rank, int size)>;
using RankBody = std::function<void(Communicator& communicator)>;

// Small slots and a shallow pipeline, so that even small collectives take many rounds.
ShmOptions SmallSlots(int rank, int size) {
  ShmOptions options;
  options.rank = rank;
  options.size = size;
  options.timeout = absl::Seconds(20);
  options.slot_bytes = 4096;
  options.depth = 2;
  return options;
}

absl::StatusOr<std::unique_ptr<Communicator>> Shm(KeyValueStore* store, int rank, int size) {
  return CreateShmCommunicator(store, SmallSlots(rank, size));
}

absl::StatusOr<std::unique_ptr<Communicator>> Gloo(KeyValueStore* store, int rank, int size) {
  GlooOptions options;
  options.rank = rank;
  options.size = size;
  options.timeout = absl::Seconds(20);
  absl::StatusOr<std::unique_ptr<GlooCommunicator>> communicator =
      CreateGlooCommunicator(store, options);
  if (!communicator.ok()) return communicator.status();
  return std::unique_ptr<Communicator>(std::move(*communicator));
}

// Creates `size` ranks, each in its own thread (creation is collective). A rank that fails is
// reported and left null.
std::vector<std::unique_ptr<Communicator>> ConnectRanks(KeyValueStore* store, int size,
                                                        const Factory& factory) {
  std::vector<std::unique_ptr<Communicator>> communicators(size);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < size; ++rank) {
    threads.emplace_back([&, rank] {
      absl::StatusOr<std::unique_ptr<Communicator>> communicator = factory(store, rank, size);
      if (communicator.ok()) {
        communicators[rank] = std::move(*communicator);
      } else {
        ADD_FAILURE() << "rank " << rank << " of " << size << ": " << communicator.status();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  return communicators;
}

bool AllConnected(const std::vector<std::unique_ptr<Communicator>>& communicators) {
  return std::all_of(communicators.begin(), communicators.end(),
                     [](const auto& c) { return c != nullptr; });
}

// Connects `size` ranks and runs `body` on each in its own thread.
void RunRanks(int size, const Factory& factory, const RankBody& body) {
  InProcessKeyValueStore store;
  std::vector<std::unique_ptr<Communicator>> communicators = ConnectRanks(&store, size, factory);
  if (!AllConnected(communicators)) return;
  std::vector<std::thread> threads;
  for (auto& communicator : communicators) {
    threads.emplace_back([&body, &communicator] { body(*communicator); });
  }
  for (std::thread& t : threads) t.join();
}

// Empty, one element, fewer elements than ranks, not divisible, many slots' worth.
constexpr size_t kAwkwardCounts[] = {0, 1, 3, 1001, 70000};

class ShmCollectivesTest : public ::testing::TestWithParam<int> {};

TEST_P(ShmCollectivesTest, AllReduceSumInPlaceAndOutOfPlace) {
  const int world = GetParam();
  RunRanks(world, Shm, [&](Communicator& c) {
    const float ranks = world * (world + 1) / 2.0f;
    for (size_t count : kAwkwardCounts) {
      std::vector<float> send(count);
      for (size_t i = 0; i < count; ++i) send[i] = (c.rank() + 1) * static_cast<float>(i % 97);
      std::vector<float> in_place = send;
      std::vector<float> out(count, -1.0f);
      SHARD_ASSERT_OK(c.AllReduce(send.data(), out.data(), count, DataType::kFloat32,
                                  ReduceOp::kSum));
      SHARD_ASSERT_OK(c.AllReduce(in_place.data(), in_place.data(), count, DataType::kFloat32,
                                  ReduceOp::kSum));
      for (size_t i = 0; i < count; ++i) {
        const float expected = ranks * static_cast<float>(i % 97);
        ASSERT_EQ(out[i], expected) << "out of place, count " << count << " i " << i;
        ASSERT_EQ(in_place[i], expected) << "in place, count " << count << " i " << i;
        ASSERT_EQ(send[i], (c.rank() + 1) * static_cast<float>(i % 97)) << "input changed";
      }
    }
  });
}

TEST_P(ShmCollectivesTest, AllReduceMaxAndMinOfInt64) {
  const int world = GetParam();
  RunRanks(world, Shm, [&](Communicator& c) {
    // Which rank holds the largest value changes from element to element (7 is prime to every
    // world size here), and half the values are negative.
    auto base = [](size_t i) {
      const int64_t magnitude = static_cast<int64_t>(i) * 1000000007LL;
      return i % 2 == 0 ? magnitude : -magnitude;
    };
    for (size_t count : kAwkwardCounts) {
      std::vector<int64_t> in(count);
      for (size_t i = 0; i < count; ++i) {
        in[i] = base(i) + static_cast<int64_t>((c.rank() * 7 + i) % world);
      }
      std::vector<int64_t> max(count, -1), min(count, -1);
      SHARD_ASSERT_OK(c.AllReduce(in.data(), max.data(), count, DataType::kInt64, ReduceOp::kMax));
      SHARD_ASSERT_OK(c.AllReduce(in.data(), min.data(), count, DataType::kInt64, ReduceOp::kMin));
      for (size_t i = 0; i < count; ++i) {
        ASSERT_EQ(max[i], base(i) + world - 1) << "count " << count << " i " << i;
        ASSERT_EQ(min[i], base(i)) << "count " << count << " i " << i;
      }
    }
  });
}

TEST_P(ShmCollectivesTest, ReduceScatterGivesEachRankTheSumOfItsBlock) {
  const int world = GetParam();
  RunRanks(world, Shm, [&](Communicator& c) {
    for (size_t count : kAwkwardCounts) {
      std::vector<float> in(count * world);
      for (size_t j = 0; j < in.size(); ++j) {
        in[j] = (c.rank() + 1) * static_cast<float>(j % 1013) + static_cast<float>(j);
      }
      std::vector<float> out(count, -1.0f);
      SHARD_ASSERT_OK(
          c.ReduceScatter(in.data(), out.data(), count, DataType::kFloat32, ReduceOp::kSum));
      for (size_t i = 0; i < count; ++i) {
        const size_t j = c.rank() * count + i;
        const float expected = world * (world + 1) / 2.0f * static_cast<float>(j % 1013) +
                               world * static_cast<float>(j);
        ASSERT_EQ(out[i], expected) << "rank " << c.rank() << " count " << count << " i " << i;
      }
    }
  });
}

TEST_P(ShmCollectivesTest, AllGatherPlacesEachRanksBlockInOrder) {
  const int world = GetParam();
  RunRanks(world, Shm, [&](Communicator& c) {
    for (size_t count : kAwkwardCounts) {
      std::vector<float> mine(count);
      for (size_t i = 0; i < count; ++i) mine[i] = static_cast<float>(c.rank() * 100000 + i);
      std::vector<float> all(count * world, -1.0f);
      SHARD_ASSERT_OK(c.AllGather(mine.data(), all.data(), count, DataType::kFloat32));
      for (int r = 0; r < world; ++r) {
        for (size_t i = 0; i < count; ++i) {
          ASSERT_EQ(all[r * count + i], static_cast<float>(r * 100000 + i))
              << "count " << count << " block " << r << " i " << i;
        }
      }
      // In place: the rank's block already sits in the output.
      std::vector<float> in_place(count * world, 0.0f);
      std::copy(mine.begin(), mine.end(), in_place.begin() + c.rank() * count);
      SHARD_ASSERT_OK(c.AllGather(in_place.data() + c.rank() * count, in_place.data(), count,
                                  DataType::kFloat32));
      ASSERT_EQ(in_place, all) << "count " << count;
    }
  });
}

TEST_P(ShmCollectivesTest, ReduceWritesTheSumOnTheRootOnly) {
  const int world = GetParam();
  RunRanks(world, Shm, [&](Communicator& c) {
    const float ranks = world * (world + 1) / 2.0f;
    for (size_t count : kAwkwardCounts) {
      for (int root = 0; root < world; ++root) {
        std::vector<float> in(count);
        for (size_t i = 0; i < count; ++i) in[i] = (c.rank() + 1) * static_cast<float>(i % 97);
        std::vector<float> out(count, -7.0f);
        SHARD_ASSERT_OK(
            c.Reduce(in.data(), out.data(), count, DataType::kFloat32, ReduceOp::kSum, root));
        for (size_t i = 0; i < count; ++i) {
          const float expected = c.rank() == root ? ranks * static_cast<float>(i % 97) : -7.0f;
          ASSERT_EQ(out[i], expected)
              << "root " << root << " rank " << c.rank() << " count " << count << " i " << i;
        }
      }
    }
  });
}

TEST_P(ShmCollectivesTest, BroadcastFromEveryRoot) {
  const int world = GetParam();
  RunRanks(world, Shm, [&](Communicator& c) {
    for (size_t count : kAwkwardCounts) {
      for (int root = 0; root < world; ++root) {
        std::vector<float> data(count, static_cast<float>(-1 - c.rank()));
        if (c.rank() == root) {
          for (size_t i = 0; i < count; ++i) data[i] = static_cast<float>(root * 7 + i);
        }
        SHARD_ASSERT_OK(c.Broadcast(data.data(), count, DataType::kFloat32, root));
        for (size_t i = 0; i < count; ++i) {
          ASSERT_EQ(data[i], static_cast<float>(root * 7 + i))
              << "root " << root << " rank " << c.rank() << " count " << count << " i " << i;
        }
      }
    }
    EXPECT_EQ(c.Broadcast(nullptr, 0, DataType::kFloat32, world).code(),
              absl::StatusCode::kInvalidArgument);
  });
}

TEST_P(ShmCollectivesTest, BarrierHoldsEveryRankUntilAllArrive) {
  const int world = GetParam();
  std::atomic<int> arrived{0};
  RunRanks(world, Shm, [&](Communicator& c) {
    for (int round = 1; round <= 50; ++round) {
      // Stagger the ranks so that a barrier that lets one through early would show.
      if ((round + c.rank()) % world == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      arrived.fetch_add(1);
      SHARD_ASSERT_OK(c.Barrier());
      ASSERT_GE(arrived.load(), world * round) << "rank " << c.rank() << " round " << round;
    }
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, ShmCollectivesTest, ::testing::Values(1, 2, 3, 4),
                         [](const auto& info) { return absl::StrCat("ranks", info.param); });

// Values of both signs spread over 2^-20..2^21, so that the order in which a sum is taken
// shows in its bits.
std::vector<float> MixedMagnitudes(int rank, size_t count) {
  std::mt19937 generator(20240611 + rank);
  std::uniform_real_distribution<float> mantissa(1.0f, 2.0f);
  std::uniform_int_distribution<int> exponent(-20, 20);
  std::bernoulli_distribution negative(0.5);
  std::vector<float> values(count);
  for (float& v : values) {
    v = std::ldexp(mantissa(generator), exponent(generator)) * (negative(generator) ? -1 : 1);
  }
  return values;
}

template <typename T>
std::vector<char> Bytes(const T* data, size_t count) {
  const char* begin = reinterpret_cast<const char*>(data);
  return std::vector<char>(begin, begin + count * sizeof(T));
}

// Each rank's result of `collective`, as bytes, on `world` ranks made by `factory`.
using Collective = std::function<std::vector<char>(Communicator& communicator)>;

std::vector<std::vector<char>> Results(int world, const Factory& factory,
                                       const Collective& collective) {
  std::vector<std::vector<char>> results(world);
  RunRanks(world, factory, [&](Communicator& c) { results[c.rank()] = collective(c); });
  return results;
}

// The shared-memory transport gives every rank the same bytes as the TCP ring; returns the
// ring's.
std::vector<std::vector<char>> ExpectSameBitsAsGloo(int world, const std::string& what,
                                                    const Collective& collective) {
  const std::vector<std::vector<char>> shm = Results(world, Shm, collective);
  const std::vector<std::vector<char>> gloo = Results(world, Gloo, collective);
  for (int r = 0; r < world; ++r) {
    EXPECT_FALSE(gloo[r].empty()) << what << " rank " << r;
    if (shm[r].size() != gloo[r].size()) {
      ADD_FAILURE() << what << ": rank " << r << " has " << shm[r].size() << " bytes, not "
                    << gloo[r].size();
      continue;
    }
    const auto differ = std::mismatch(shm[r].begin(), shm[r].end(), gloo[r].begin());
    EXPECT_EQ(std::memcmp(shm[r].data(), gloo[r].data(), shm[r].size()), 0)
        << what << ": rank " << r << " differs first at byte " << (differ.first - shm[r].begin())
        << " of " << shm[r].size();
  }
  return gloo;
}

class ShmMatchesGlooTest : public ::testing::TestWithParam<int> {};

TEST_P(ShmMatchesGlooTest, ReduceScatterOutOfPlaceAndInPlace) {
  const int world = GetParam();
  const size_t block = 10007;
  ExpectSameBitsAsGloo(world, "reduce-scatter", [&](Communicator& c) {
    const std::vector<float> send = MixedMagnitudes(c.rank(), block * world);
    std::vector<float> recv(block, -1.0f);
    EXPECT_TRUE(
        c.ReduceScatter(send.data(), recv.data(), block, DataType::kFloat32, ReduceOp::kSum).ok());
    return Bytes(recv.data(), block);
  });
  // The output is the rank's own block of the input.
  ExpectSameBitsAsGloo(world, "in-place reduce-scatter", [&](Communicator& c) {
    std::vector<float> buffer = MixedMagnitudes(c.rank(), block * world);
    float* own = buffer.data() + c.rank() * block;
    EXPECT_TRUE(
        c.ReduceScatter(buffer.data(), own, block, DataType::kFloat32, ReduceOp::kSum).ok());
    return Bytes(own, block);
  });
}

TEST_P(ShmMatchesGlooTest, AllReduceOutOfPlaceAndInPlace) {
  const int world = GetParam();
  const size_t count = 100003;
  ExpectSameBitsAsGloo(world, "all-reduce", [&](Communicator& c) {
    const std::vector<float> send = MixedMagnitudes(c.rank(), count);
    std::vector<float> recv(count, -1.0f);
    EXPECT_TRUE(
        c.AllReduce(send.data(), recv.data(), count, DataType::kFloat32, ReduceOp::kSum).ok());
    return Bytes(recv.data(), count);
  });
  const std::vector<std::vector<char>> ring =
      ExpectSameBitsAsGloo(world, "in-place all-reduce", [&](Communicator& c) {
        std::vector<float> data = MixedMagnitudes(c.rank(), count);
        EXPECT_TRUE(
            c.AllReduce(data.data(), data.data(), count, DataType::kFloat32, ReduceOp::kSum)
                .ok());
        return Bytes(data.data(), count);
      });
  if (world < 3) return;  // a + b == b + a: two ranks have one order only
  // The comparison means something: summing the ranks in order 0, 1, ... gives other bits.
  std::vector<float> in_rank_order(count, 0.0f);
  for (int r = 0; r < world; ++r) {
    const std::vector<float> values = MixedMagnitudes(r, count);
    for (size_t i = 0; i < count; ++i) in_rank_order[i] += values[i];
  }
  ASSERT_EQ(ring[0].size(), count * sizeof(float));
  EXPECT_NE(std::memcmp(in_rank_order.data(), ring[0].data(), ring[0].size()), 0);
}

TEST_P(ShmMatchesGlooTest, ReduceToEveryRoot) {
  const int world = GetParam();
  const size_t count = 30011;
  ExpectSameBitsAsGloo(world, "reduce", [&](Communicator& c) {
    const std::vector<float> send = MixedMagnitudes(c.rank(), count);
    std::vector<char> outputs;  // every root's output on this rank, untouched ones included
    for (int root = 0; root < world; ++root) {
      std::vector<float> recv(count, -7.0f);
      EXPECT_TRUE(c.Reduce(send.data(), recv.data(), count, DataType::kFloat32, ReduceOp::kSum,
                           root)
                      .ok());
      const std::vector<char> bytes = Bytes(recv.data(), count);
      outputs.insert(outputs.end(), bytes.begin(), bytes.end());
    }
    return outputs;
  });
}

TEST_P(ShmMatchesGlooTest, BFloat16AllReduce) {
  const int world = GetParam();
  const size_t count = 50021;
  ExpectSameBitsAsGloo(world, "bfloat16 all-reduce", [&](Communicator& c) {
    std::vector<uint16_t> data;
    for (float v : MixedMagnitudes(c.rank(), count)) data.push_back(FloatToBFloat16(v));
    EXPECT_TRUE(
        c.AllReduce(data.data(), data.data(), count, DataType::kBFloat16, ReduceOp::kSum).ok());
    return Bytes(data.data(), count);
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, ShmMatchesGlooTest, ::testing::Values(2, 3, 4),
                         [](const auto& info) { return absl::StrCat("ranks", info.param); });

// Whole pages of an anonymous mapping, as the engine's large arrays are: what
// ShareHostBuffer takes.
class PageBuffer {
 public:
  explicit PageBuffer(size_t bytes) {
    const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
    bytes_ = std::max<size_t>(1, (bytes + page - 1) / page) * page;
    data_ = ::mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (data_ == MAP_FAILED) ADD_FAILURE() << "mmap: " << std::strerror(errno);
  }
  PageBuffer(const PageBuffer&) = delete;
  PageBuffer& operator=(const PageBuffer&) = delete;
  ~PageBuffer() { ::munmap(data_, bytes_); }

  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  size_t bytes() const { return bytes_; }

  // Shares it through `c`: expects a share from the shared-memory transport and none from TCP.
  std::unique_ptr<SharedHostBuffer> Share(Communicator& c) const {
    absl::StatusOr<std::unique_ptr<SharedHostBuffer>> shared = c.ShareHostBuffer(data_, bytes_);
    EXPECT_TRUE(shared.ok()) << shared.status();
    if (!shared.ok()) return nullptr;
    EXPECT_EQ(*shared != nullptr, c.backend() == "shm") << c.backend();
    return std::move(*shared);
  }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

template <typename T>
void Fill(T* to, const std::vector<T>& values) {
  std::copy(values.begin(), values.end(), to);
}

// Collectives whose buffers the peers read in place (ShareHostBuffer) give the TCP ring's bits,
// as the copies through the slots do.
class ShmSharedBuffersTest : public ::testing::TestWithParam<int> {};

TEST_P(ShmSharedBuffersTest, ReduceScatterInPlaceAndOutOfPlaceGiveTheRingsBits) {
  const int world = GetParam();
  const size_t block = 10007;
  ExpectSameBitsAsGloo(world, "shared in-place reduce-scatter", [&](Communicator& c) {
    PageBuffer buffer(block * world * sizeof(float));
    Fill(buffer.as<float>(), MixedMagnitudes(c.rank(), block * world));
    const std::unique_ptr<SharedHostBuffer> shared = buffer.Share(c);
    float* own = buffer.as<float>() + c.rank() * block;
    SHARD_EXPECT_OK(
        c.ReduceScatter(buffer.as<float>(), own, block, DataType::kFloat32, ReduceOp::kSum));
    return Bytes(own, block);
  });
  ExpectSameBitsAsGloo(world, "shared reduce-scatter", [&](Communicator& c) {
    PageBuffer send(block * world * sizeof(float));
    Fill(send.as<float>(), MixedMagnitudes(c.rank(), block * world));
    const std::unique_ptr<SharedHostBuffer> shared = send.Share(c);
    std::vector<float> recv(block, -1.0f);
    SHARD_EXPECT_OK(
        c.ReduceScatter(send.as<float>(), recv.data(), block, DataType::kFloat32, ReduceOp::kSum));
    return Bytes(recv.data(), block);
  });
}

TEST_P(ShmSharedBuffersTest, AllReduceInPlaceAndOutOfPlaceGiveTheRingsBits) {
  const int world = GetParam();
  const size_t count = 100003;
  ExpectSameBitsAsGloo(world, "shared in-place all-reduce", [&](Communicator& c) {
    PageBuffer data(count * sizeof(float));
    Fill(data.as<float>(), MixedMagnitudes(c.rank(), count));
    const std::unique_ptr<SharedHostBuffer> shared = data.Share(c);
    SHARD_EXPECT_OK(c.AllReduce(data.as<float>(), data.as<float>(), count, DataType::kFloat32,
                                ReduceOp::kSum));
    return Bytes(data.as<float>(), count);
  });
  ExpectSameBitsAsGloo(world, "shared out-of-place all-reduce", [&](Communicator& c) {
    PageBuffer send(count * sizeof(float));
    PageBuffer recv(count * sizeof(float));
    Fill(send.as<float>(), MixedMagnitudes(c.rank(), count));
    const std::unique_ptr<SharedHostBuffer> shared_send = send.Share(c);
    const std::unique_ptr<SharedHostBuffer> shared_recv = recv.Share(c);
    SHARD_EXPECT_OK(c.AllReduce(send.as<float>(), recv.as<float>(), count, DataType::kFloat32,
                                ReduceOp::kSum));
    return Bytes(recv.as<float>(), count);
  });
  ExpectSameBitsAsGloo(world, "shared bfloat16 all-reduce", [&](Communicator& c) {
    PageBuffer data(count * sizeof(uint16_t));
    uint16_t* values = data.as<uint16_t>();
    for (float v : MixedMagnitudes(c.rank(), count)) *values++ = FloatToBFloat16(v);
    const std::unique_ptr<SharedHostBuffer> shared = data.Share(c);
    SHARD_EXPECT_OK(c.AllReduce(data.as<uint16_t>(), data.as<uint16_t>(), count,
                                DataType::kBFloat16, ReduceOp::kSum));
    return Bytes(data.as<uint16_t>(), count);
  });
}

TEST_P(ShmSharedBuffersTest, AllGatherInPlaceAndOutOfPlacePlaceEachRanksBlock) {
  const int world = GetParam();
  const size_t block = 10007;
  ExpectSameBitsAsGloo(world, "shared in-place all-gather", [&](Communicator& c) {
    PageBuffer buffer(block * world * sizeof(float));
    float* own = buffer.as<float>() + c.rank() * block;
    Fill(own, MixedMagnitudes(c.rank(), block));
    const std::unique_ptr<SharedHostBuffer> shared = buffer.Share(c);
    SHARD_EXPECT_OK(c.AllGather(own, buffer.as<float>(), block, DataType::kFloat32));
    return Bytes(buffer.as<float>(), block * world);
  });
  ExpectSameBitsAsGloo(world, "shared out-of-place all-gather", [&](Communicator& c) {
    PageBuffer send(block * sizeof(float));
    Fill(send.as<float>(), MixedMagnitudes(c.rank(), block));
    const std::unique_ptr<SharedHostBuffer> shared = send.Share(c);
    std::vector<float> recv(block * world, -1.0f);
    SHARD_EXPECT_OK(c.AllGather(send.as<float>(), recv.data(), block, DataType::kFloat32));
    return Bytes(recv.data(), block * world);
  });
}

TEST_P(ShmSharedBuffersTest, ReduceToEveryRootAndBroadcastFromEveryRootGiveTheRingsBits) {
  const int world = GetParam();
  const size_t count = 30011;
  ExpectSameBitsAsGloo(world, "shared in-place reduce", [&](Communicator& c) {
    std::vector<char> outputs;  // every root's output on this rank, untouched ones included
    for (int root = 0; root < world; ++root) {
      PageBuffer data(count * sizeof(float));
      Fill(data.as<float>(), MixedMagnitudes(c.rank(), count));
      const std::unique_ptr<SharedHostBuffer> shared = data.Share(c);
      SHARD_EXPECT_OK(c.Reduce(data.as<float>(), data.as<float>(), count, DataType::kFloat32,
                               ReduceOp::kSum, root));
      const std::vector<char> bytes = Bytes(data.as<float>(), count);
      outputs.insert(outputs.end(), bytes.begin(), bytes.end());
    }
    return outputs;
  });
  ExpectSameBitsAsGloo(world, "shared broadcast", [&](Communicator& c) {
    std::vector<char> outputs;
    for (int root = 0; root < world; ++root) {
      PageBuffer data(count * sizeof(float));
      Fill(data.as<float>(), MixedMagnitudes(c.rank() + 10 * root, count));
      const std::unique_ptr<SharedHostBuffer> shared = data.Share(c);
      SHARD_EXPECT_OK(c.Broadcast(data.as<float>(), count, DataType::kFloat32, root));
      const std::vector<char> bytes = Bytes(data.as<float>(), count);
      outputs.insert(outputs.end(), bytes.begin(), bytes.end());
    }
    return outputs;
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, ShmSharedBuffersTest, ::testing::Values(2, 3, 4),
                         [](const auto& info) { return absl::StrCat("ranks", info.param); });

// The line of /proc/self/maps that maps `address`.
std::string MappingOf(const void* address) {
  std::ifstream maps("/proc/self/maps");
  const uintptr_t at = reinterpret_cast<uintptr_t>(address);
  for (std::string line; std::getline(maps, line);) {
    uintptr_t begin = 0;
    uintptr_t end = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx", &begin, &end) == 2 && at >= begin && at < end) {
      return line;
    }
  }
  return "";
}

TEST(ShmBufferSharingTest, ASharedBufferKeepsItsAddressAndContentsInSharedMemory) {
  RunRanks(2, Shm, [](Communicator& c) {
    PageBuffer buffer(3 * 4096);
    std::vector<float> values = MixedMagnitudes(c.rank(), buffer.bytes() / sizeof(float));
    Fill(buffer.as<float>(), values);
    EXPECT_THAT(MappingOf(buffer.as<float>()), Not(HasSubstr("/dev/shm/shard-")));
    {
      const std::unique_ptr<SharedHostBuffer> shared = buffer.Share(c);
      EXPECT_THAT(MappingOf(buffer.as<float>()), HasSubstr("/dev/shm/shard-"));
      EXPECT_EQ(std::memcmp(buffer.as<float>(), values.data(), buffer.bytes()), 0);
    }
    // No longer shared: the collective copies through the slots, and still adds up.
    std::fill(buffer.as<float>(), buffer.as<float>() + 10, 1.0f + c.rank());
    SHARD_EXPECT_OK(c.AllReduce(buffer.as<float>(), buffer.as<float>(), 10, DataType::kFloat32,
                                ReduceOp::kSum));
    EXPECT_EQ(buffer.as<float>()[9], 3.0f);
  });
}

TEST(ShmBufferSharingTest, ABufferThatIsNotWholePagesIsSharedByNoRankAndTheRanksGoOn) {
  RunRanks(3, Shm, [](Communicator& c) {
    PageBuffer buffer(2 * 4096);
    // Rank 1 alone passes part of a page.
    const size_t bytes = c.rank() == 1 ? 4096 + 64 : 2 * 4096;
    const absl::StatusOr<std::unique_ptr<SharedHostBuffer>> shared =
        c.ShareHostBuffer(buffer.as<char>(), bytes);
    EXPECT_EQ(shared.status().code(), absl::StatusCode::kResourceExhausted) << shared.status();
    EXPECT_THAT(shared.status().message(),
                HasSubstr(c.rank() == 1 ? "is not whole pages" : "a peer could not share"));
    EXPECT_THAT(MappingOf(buffer.as<float>()), Not(HasSubstr("/dev/shm/shard-")));
    float value = 1.0f;
    SHARD_EXPECT_OK(c.AllReduce(&value, &value, 1, DataType::kFloat32, ReduceOp::kSum));
    EXPECT_EQ(value, 3.0f);
  });
}

TEST(ShmBufferSharingTest, ARankPassingAnotherBufferThanItsPeerFailsTheCollective) {
  std::vector<absl::Status> statuses(2);
  RunRanks(2, Shm, [&](Communicator& c) {
    PageBuffer buffer(2 * 4096);
    const std::unique_ptr<SharedHostBuffer> shared = buffer.Share(c);
    std::vector<float> unshared(2 * 1024);
    // Rank 0 passes the shared buffer, rank 1 a copy of its own.
    float* send = c.rank() == 0 ? buffer.as<float>() : unshared.data();
    statuses[c.rank()] = c.AllGather(send + c.rank() * 1024, send, 1024, DataType::kFloat32);
    if (statuses[c.rank()].ok()) {
      float value = 1.0f;
      statuses[c.rank()] = c.AllReduce(&value, &value, 1, DataType::kFloat32, ReduceOp::kSum);
    }
  });
  EXPECT_EQ(statuses[0].code(), absl::StatusCode::kInternal) << statuses[0];
  EXPECT_THAT(statuses[0].message(), HasSubstr("did not pass shared buffers"));
  EXPECT_FALSE(statuses[1].ok());
}

TEST(ShmCommunicatorTest, AbortWakesACollectiveWaitingForAPeer) {
  InProcessKeyValueStore store;
  std::vector<std::unique_ptr<Communicator>> ranks = ConnectRanks(&store, 2, Shm);
  ASSERT_TRUE(AllConnected(ranks));
  // Rank 1 never joins the all-reduce; rank 0 would wait 20 s for it.
  std::vector<float> data(1 << 16, 1.0f);
  std::thread aborter([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    ranks[0]->Abort("generation 7 ended");
  });
  const absl::Status status = ranks[0]->AllReduce(data.data(), data.data(), data.size(),
                                                  DataType::kFloat32, ReduceOp::kSum);
  aborter.join();
  EXPECT_EQ(status.code(), absl::StatusCode::kAborted) << status;
  EXPECT_THAT(status.message(), HasSubstr("generation 7 ended"));
  EXPECT_TRUE(ranks[0]->aborted());
  // Later calls are refused, and say why.
  const absl::Status barrier = ranks[0]->Barrier();
  EXPECT_EQ(barrier.code(), absl::StatusCode::kAborted) << barrier;
  EXPECT_THAT(barrier.message(), HasSubstr("generation 7 ended"));
  EXPECT_EQ(ranks[0]->Broadcast(data.data(), data.size(), DataType::kFloat32, 0).code(),
            absl::StatusCode::kAborted);
}

TEST(ShmCommunicatorTest, APeerThatAbortsFailsTheWaitingRankUnavailable) {
  InProcessKeyValueStore store;
  std::vector<std::unique_ptr<Communicator>> ranks = ConnectRanks(&store, 2, Shm);
  ASSERT_TRUE(AllConnected(ranks));
  std::thread peer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    ranks[1]->Abort("peer process is going away");
  });
  std::vector<float> data(1 << 16, 1.0f);
  const absl::Status status = ranks[0]->AllReduce(data.data(), data.data(), data.size(),
                                                  DataType::kFloat32, ReduceOp::kSum);
  peer.join();
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
  EXPECT_THAT(status.message(), HasSubstr("peer process is going away"));
  // A peer that aborted is not a broken link: nothing to report against it.
  EXPECT_FALSE(ranks[0]->peer_fault().has_value());
}

TEST(ShmCommunicatorTest, APeerThatLeavesFailsTheWaitingRankUnavailable) {
  InProcessKeyValueStore store;
  std::vector<std::unique_ptr<Communicator>> ranks = ConnectRanks(&store, 2, Shm);
  ASSERT_TRUE(AllConnected(ranks));
  std::thread peer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    ranks[1].reset();
  });
  std::vector<float> data(1 << 16, 1.0f);
  const absl::Status status = ranks[0]->AllReduce(data.data(), data.data(), data.size(),
                                                  DataType::kFloat32, ReduceOp::kSum);
  peer.join();
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
}

TEST(ShmCommunicatorTest, SharedMemoryDomainIsStable) {
  const std::string domain = SharedMemoryDomain();
  EXPECT_FALSE(domain.empty());
  EXPECT_EQ(SharedMemoryDomain(), domain);
}

TEST(ShmCommunicatorTest, RankOutsideTheWorldIsRejected) {
  InProcessKeyValueStore store;
  EXPECT_EQ(CreateShmCommunicator(&store, SmallSlots(2, 2)).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// The communicators' segments in /dev/shm.
std::set<std::string> ShmSegments() {
  std::set<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm")) {
    const std::string name = entry.path().filename().string();
    if (absl::StartsWith(name, "shard-")) names.insert(name);
  }
  return names;
}

std::vector<std::string> SegmentsNotIn(const std::set<std::string>& before) {
  std::vector<std::string> added;
  for (const std::string& name : ShmSegments()) {
    if (!before.count(name)) added.push_back(name);
  }
  return added;
}

// The segments not in `before`, once those of communicators being created concurrently (other
// test processes) had time to be unlinked: a leaked one stays.
std::vector<std::string> NewSegments(const std::set<std::string>& before) {
  const absl::Time deadline = absl::Now() + absl::Seconds(2);
  std::vector<std::string> added = SegmentsNotIn(before);
  while (!added.empty() && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(50));
    added = SegmentsNotIn(before);
  }
  return added;
}

TEST(ShmSegmentsTest, NoneRemainOnceTheRanksAreConnectedOrAfterTheirRun) {
  const std::set<std::string> before = ShmSegments();
  {
    InProcessKeyValueStore store;
    std::vector<std::unique_ptr<Communicator>> ranks = ConnectRanks(&store, 4, Shm);
    ASSERT_TRUE(AllConnected(ranks));
    // Every rank mapped every segment, so they are unlinked already.
    EXPECT_THAT(NewSegments(before), IsEmpty());
  }
  RunRanks(3, Shm, [](Communicator& c) {
    std::vector<float> data(70000, 1.0f);
    SHARD_EXPECT_OK(
        c.AllReduce(data.data(), data.data(), data.size(), DataType::kFloat32, ReduceOp::kSum));
  });
  EXPECT_THAT(NewSegments(before), IsEmpty());
}

TEST(ShmSegmentsTest, ARankWhosePeerNeverArrivesTimesOutAndLeavesNoSegment) {
  const std::set<std::string> before = ShmSegments();
  InProcessKeyValueStore store;
  ShmOptions options = SmallSlots(0, 2);
  options.timeout = absl::Seconds(1);
  // While it waits, its segment is there (so the check below can see one).
  std::atomic<bool> seen{false};
  std::thread watcher([&] {
    const absl::Time deadline = absl::Now() + absl::Milliseconds(800);
    while (!seen.load() && absl::Now() < deadline) {
      seen.store(!SegmentsNotIn(before).empty());
      absl::SleepFor(absl::Milliseconds(10));
    }
  });
  const absl::Status status = CreateShmCommunicator(&store, options).status();
  watcher.join();
  EXPECT_TRUE(seen.load());
  EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded) << status;
  EXPECT_THAT(NewSegments(before), IsEmpty());
}

constexpr size_t kProcessCount = size_t{1} << 20;

// Both processes' side of the loop: the all-reduce, a byte to `progress` (when not -1) after
// each of the first 100, until one fails (or 90 s pass). With `shared` its buffer is shared
// first (ShareHostBuffer), so the peers read each other's memory in place.
absl::Status AllReduceUntilFailure(Communicator& communicator, bool shared, int progress) {
  PageBuffer send(kProcessCount * sizeof(float));
  PageBuffer recv(kProcessCount * sizeof(float));
  std::fill(send.as<float>(), send.as<float>() + kProcessCount, 1.0f);
  std::unique_ptr<SharedHostBuffer> shared_send;
  std::unique_ptr<SharedHostBuffer> shared_recv;
  if (shared) {
    shared_send = send.Share(communicator);
    shared_recv = recv.Share(communicator);
    if (shared_send == nullptr || shared_recv == nullptr) {
      return absl::InternalError("the buffers could not be shared");
    }
  }
  const absl::Time give_up = absl::Now() + absl::Seconds(90);
  absl::Status status;
  for (int i = 0; status.ok() && absl::Now() < give_up; ++i) {
    status = communicator.AllReduce(send.as<float>(), recv.as<float>(), kProcessCount,
                                    DataType::kFloat32, ReduceOp::kSum);
    if (status.ok() && progress >= 0 && i < 100) {
      const char byte = 1;
      if (::write(progress, &byte, 1) != 1) ::_exit(3);
    }
  }
  return status;
}

// Rank 1 of 2 in a child process: the parent's all-reduce, forever. Exits 1 if it cannot
// connect, 2 once a collective fails.
[[noreturn]] void RunPeerProcess(const std::string& dir, int progress, bool shared) {
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // never outlives a test that failed half-way
  DirectoryKeyValueStore store(dir);
  ShmOptions options;
  options.rank = 1;
  options.size = 2;
  absl::StatusOr<std::unique_ptr<Communicator>> communicator =
      CreateShmCommunicator(&store, options);
  if (!communicator.ok()) ::_exit(1);
  AllReduceUntilFailure(**communicator, shared, progress).IgnoreError();
  ::_exit(2);
}

// Rank 0 here, rank 1 in a child process; the child is signalled while both loop over an
// all-reduce, through the slots or (the parameter) on buffers they read in place. No segment
// may be left in /dev/shm afterwards.
class ShmProcessTest : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    segments_before_ = ShmSegments();
    std::string name = ::testing::UnitTest::GetInstance()->current_test_info()->name();
    std::replace(name.begin(), name.end(), '/', '-');
    dir_ = FreshTestDirectory("shm-process", name);
    ASSERT_EQ(::pipe(progress_), 0);
  }

  void TearDown() override {
    if (child_ > 0) KillAndReap();
    for (int fd : progress_) {
      if (fd >= 0) ::close(fd);
    }
    std::filesystem::remove_all(dir_);
    EXPECT_THAT(NewSegments(segments_before_), IsEmpty());
  }

  // Forks rank 1 and connects this process as rank 0 of 2 (collective timeout 60 s).
  std::unique_ptr<Communicator> Connect() {
    child_ = ::fork();
    if (child_ == 0) RunPeerProcess(dir_, progress_[1], GetParam());
    if (child_ < 0) {
      ADD_FAILURE() << "fork: " << std::strerror(errno);
      return nullptr;
    }
    ::close(progress_[1]);
    progress_[1] = -1;
    DirectoryKeyValueStore store(dir_);
    ShmOptions options;
    options.rank = 0;
    options.size = 2;
    options.timeout = absl::Seconds(60);
    absl::StatusOr<std::unique_ptr<Communicator>> communicator =
        CreateShmCommunicator(&store, options);
    EXPECT_TRUE(communicator.ok()) << communicator.status();
    return communicator.ok() ? std::move(*communicator) : nullptr;
  }

  // Blocks until the child finished 10 collectives (or ended) and then sends it `signal`.
  void SignalAfterTenCollectives(int signal) {
    char byte;
    for (int read = 0; read < 10 && ::read(progress_[0], &byte, 1) == 1; ++read) {
    }
    ::kill(child_, signal);
  }

  // Kills the child if it is still there and reaps it; its wait status.
  int KillAndReap() {
    ::kill(child_, SIGKILL);
    int wait_status = 0;
    ::waitpid(child_, &wait_status, 0);
    child_ = -1;
    return wait_status;
  }

  std::set<std::string> segments_before_;
  std::string dir_;
  int progress_[2] = {-1, -1};
  pid_t child_ = -1;
};

// The death is found by the liveness check, not by the 60 s collective timeout. The child is
// reaped only once the collective failed: a zombie is gone too (a launcher may be slow to reap).
TEST_P(ShmProcessTest, AKilledPeerFailsTheCollectiveUnavailableNamingIt) {
  std::unique_ptr<Communicator> communicator = Connect();
  ASSERT_NE(communicator, nullptr);
  std::thread killer([&] { SignalAfterTenCollectives(SIGKILL); });
  const absl::Status status = AllReduceUntilFailure(*communicator, GetParam(), -1);
  killer.join();
  const int child_status = KillAndReap();
  EXPECT_TRUE(WIFSIGNALED(child_status) && WTERMSIG(child_status) == SIGKILL)
      << "the child ended before it was killed: wait status " << child_status;
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
  EXPECT_THAT(status.message(), HasSubstr("rank 1"));
}

TEST_P(ShmProcessTest, AStoppedPeerFailsTheCollectiveAtTheTimeoutNamingIt) {
  std::unique_ptr<Communicator> communicator = Connect();
  ASSERT_NE(communicator, nullptr);
  communicator->SetCollectiveTimeout(absl::Seconds(1));
  std::thread stopper([&] { SignalAfterTenCollectives(SIGSTOP); });
  const absl::Status status = AllReduceUntilFailure(*communicator, GetParam(), -1);
  stopper.join();
  const int child_status = KillAndReap();
  EXPECT_TRUE(WIFSIGNALED(child_status) && WTERMSIG(child_status) == SIGKILL)
      << "the child ended before it was killed: wait status " << child_status;
  EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded) << status;
  EXPECT_THAT(status.message(), HasSubstr("rank 1"));
}

// The coordinator's lease ends the generation and aborts the communicator of the rank that
// waits for the stopped one.
TEST_P(ShmProcessTest, AStoppedPeersWaitingRankIsReleasedByAbort) {
  std::unique_ptr<Communicator> communicator = Connect();
  ASSERT_NE(communicator, nullptr);
  std::thread stopper([&] {
    SignalAfterTenCollectives(SIGSTOP);
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    communicator->Abort("lease expired");
  });
  const absl::Status status = AllReduceUntilFailure(*communicator, GetParam(), -1);
  stopper.join();
  const int child_status = KillAndReap();
  EXPECT_TRUE(WIFSIGNALED(child_status) && WTERMSIG(child_status) == SIGKILL)
      << "the child ended before it was killed: wait status " << child_status;
  EXPECT_EQ(status.code(), absl::StatusCode::kAborted) << status;
  EXPECT_THAT(status.message(), HasSubstr("lease expired"));
}

INSTANTIATE_TEST_SUITE_P(Buffers, ShmProcessTest, ::testing::Bool(), [](const auto& info) {
  return std::string(info.param ? "Shared" : "ThroughSlots");
});

}  // namespace
}  // namespace shard
