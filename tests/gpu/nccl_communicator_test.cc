// The NCCL communicator at world size 1 (one GPU): every collective with its result checked,
// ordering after the compute stream, and aborts that end waits promptly, including an
// initialisation that can never complete because the second rank never comes.
#include "worker/gpu/nccl_communicator.h"

#include <atomic>
#include <bit>
#include <cmath>
#include <random>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/gpu/gpu_test_util.h"
#include "worker/dataplane/key_value_store.h"
#include "worker/gpu/kernels.h"

namespace shard {
namespace {

class NcclCommunicatorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    SHARD_REQUIRE_GPU();
    int version = 0;
    ASSERT_EQ(ncclGetVersion(&version), ncclSuccess);
    RecordProperty("nccl_version", version);
    SHARD_ASSERT_OK_AND_ASSIGN(compute_, CudaStream::Create());
  }

  absl::StatusOr<std::unique_ptr<NcclCommunicator>> Create(int rank, int size,
                                                           absl::Duration init_timeout) {
    NcclOptions options;
    options.compute_stream = compute_.get();
    options.init_timeout = init_timeout;
    options.wait_timeout = absl::Seconds(30);
    return NcclCommunicator::Create(rank, size, KeyValueIdExchange(&store_, absl::Seconds(5)),
                                    options);
  }

  // `count` floats of `buffer` after the collectives, read on the compute stream.
  std::vector<float> Read(NcclCommunicator& comm, const DeviceBuffer& buffer, size_t count) {
    EXPECT_TRUE(comm.OrderComputeAfterCollectives().ok());
    std::vector<float> values(count);
    EXPECT_EQ(cudaMemcpyAsync(values.data(), buffer.data(), count * sizeof(float),
                              cudaMemcpyDeviceToHost, compute_.get()),
              cudaSuccess);
    EXPECT_EQ(cudaStreamSynchronize(compute_.get()), cudaSuccess);
    return values;
  }

  InProcessKeyValueStore store_;
  CudaStream compute_;
};

TEST_F(NcclCommunicatorTest, WorldOfOneRunsEveryCollective) {
  SHARD_ASSERT_OK_AND_ASSIGN(auto comm, Create(0, 1, absl::Seconds(60)));
  SHARD_ASSERT_OK(comm->WaitReady());
  EXPECT_EQ(comm->backend(), "nccl");
  EXPECT_EQ(comm->size(), 1);
  constexpr size_t kCount = 100003;
  SHARD_ASSERT_OK_AND_ASSIGN(DeviceBuffer in, DeviceBuffer::Allocate(kCount * sizeof(float)));
  SHARD_ASSERT_OK_AND_ASSIGN(DeviceBuffer out, DeviceBuffer::Allocate(kCount * sizeof(float)));
  for (uint64_t seed = 1; seed <= 3; ++seed) {
    // The input is written by a kernel on the compute stream just before each collective, and
    // the output poisoned there: a collective not ordered after it would see stale data.
    const auto produce = [&] {
      EXPECT_TRUE(Fill(out.as<float>(), kCount, kPoison, compute_.get()).ok());
      EXPECT_TRUE(FillUniform(in.as<float>(), kCount, seed, -1.0f, 1.0f, compute_.get()).ok());
    };
    produce();
    const std::vector<float> expected = Read(*comm, in, kCount);
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kMin}) {
      produce();
      SHARD_ASSERT_OK(comm->AllReduce(in.data(), out.data(), kCount, DataType::kFloat32, op));
      EXPECT_EQ(Read(*comm, out, kCount), expected);
    }
    produce();
    SHARD_ASSERT_OK(comm->ReduceScatter(in.data(), out.data(), kCount, DataType::kFloat32,
                                        ReduceOp::kSum));
    EXPECT_EQ(Read(*comm, out, kCount), expected);
    produce();
    SHARD_ASSERT_OK(comm->AllGather(in.data(), out.data(), kCount, DataType::kFloat32));
    EXPECT_EQ(Read(*comm, out, kCount), expected);
    produce();
    SHARD_ASSERT_OK(comm->Reduce(in.data(), out.data(), kCount, DataType::kFloat32,
                                 ReduceOp::kSum, 0));
    EXPECT_EQ(Read(*comm, out, kCount), expected);
    produce();
    SHARD_ASSERT_OK(comm->Broadcast(in.data(), kCount, DataType::kFloat32, 0));
    SHARD_ASSERT_OK(comm->AllReduce(in.data(), in.data(), kCount, DataType::kFloat32,
                                    ReduceOp::kSum));  // in place
    EXPECT_EQ(Read(*comm, in, kCount), expected);
  }
  // The other element types go through as bits.
  std::mt19937_64 rng(5);
  std::vector<int64_t> ints(1000);
  for (int64_t& v : ints) v = static_cast<int64_t>(rng());
  SHARD_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_ints, ToDevice(ints));
  for (DataType dtype : {DataType::kInt64, DataType::kFloat64, DataType::kBFloat16,
                         DataType::kFloat16}) {
    const size_t count = ints.size() * sizeof(int64_t) / DataTypeSize(dtype);
    SHARD_ASSERT_OK(comm->Broadcast(d_ints.data(), count, dtype, 0));
  }
  SHARD_ASSERT_OK(comm->AllReduce(d_ints.data(), d_ints.data(), ints.size(), DataType::kInt64,
                                  ReduceOp::kMax));
  SHARD_ASSERT_OK(comm->Synchronize());
  SHARD_ASSERT_OK_AND_ASSIGN(std::vector<int64_t> back, ToHost<int64_t>(d_ints.data(), 1000));
  EXPECT_EQ(back, ints);
  SHARD_EXPECT_OK(comm->Barrier());
  EXPECT_EQ(comm->Reduce(in.data(), out.data(), 1, DataType::kFloat32, ReduceOp::kSum, 1).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(NcclCommunicatorTest, AbortMakesEveryLaterCallReturnAbortedPromptly) {
  SHARD_ASSERT_OK_AND_ASSIGN(auto comm, Create(0, 1, absl::Seconds(60)));
  SHARD_ASSERT_OK(comm->WaitReady());
  SHARD_ASSERT_OK_AND_ASSIGN(DeviceBuffer buffer, DeviceBuffer::Allocate(1024 * sizeof(float)));
  SHARD_ASSERT_OK(comm->AllReduce(buffer.data(), buffer.data(), 1024, DataType::kFloat32,
                                  ReduceOp::kSum));
  // Concurrent, repeated aborts: one wins, the rest are no-ops.
  std::vector<std::thread> aborters;
  for (int i = 0; i < 4; ++i) {
    aborters.emplace_back([&comm] { comm->Abort("generation 7 ended"); });
  }
  for (std::thread& t : aborters) t.join();
  EXPECT_TRUE(comm->aborted());
  const absl::Time start = absl::Now();
  const absl::Status status =
      comm->AllReduce(buffer.data(), buffer.data(), 1024, DataType::kFloat32, ReduceOp::kSum);
  EXPECT_EQ(status.code(), absl::StatusCode::kAborted);
  EXPECT_NE(status.message().find("generation 7 ended"), absl::string_view::npos) << status;
  EXPECT_EQ(comm->Synchronize().code(), absl::StatusCode::kAborted);
  EXPECT_EQ(comm->Barrier().code(), absl::StatusCode::kAborted);
  EXPECT_EQ(comm->OrderComputeAfterCollectives().code(), absl::StatusCode::kAborted);
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));
}

TEST_F(NcclCommunicatorTest, AbortEndsAnInitialisationThatCannotComplete) {
  // Rank 0 of 2; rank 1 never comes.
  SHARD_ASSERT_OK_AND_ASSIGN(auto comm, Create(0, 2, absl::Minutes(5)));
  std::atomic<bool> done{false};
  absl::Status waited;
  absl::Time returned;
  std::thread waiter([&] {
    waited = comm->WaitReady();
    returned = absl::Now();
    done = true;
  });
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_FALSE(done.load()) << "initialisation cannot finish without rank 1";
  const absl::Time aborted = absl::Now();
  comm->Abort("rank 1 was declared dead");
  waiter.join();
  EXPECT_EQ(waited.code(), absl::StatusCode::kAborted) << waited;
  EXPECT_LT(returned - aborted, absl::Seconds(5));
}

TEST_F(NcclCommunicatorTest, InitialisationTimesOutAndAborts) {
  SHARD_ASSERT_OK_AND_ASSIGN(auto comm, Create(0, 2, absl::Milliseconds(500)));
  const absl::Time start = absl::Now();
  const absl::Status status = comm->WaitReady();
  EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded) << status;
  EXPECT_NE(status.message().find("not every rank joined"), absl::string_view::npos) << status;
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  EXPECT_TRUE(comm->aborted());
}

TEST_F(NcclCommunicatorTest, IdExchangeFailuresAreReturned) {
  // Rank 1 waits for an id that rank 0 never publishes.
  NcclOptions options;
  options.compute_stream = compute_.get();
  const auto comm = NcclCommunicator::Create(
      1, 2, KeyValueIdExchange(&store_, absl::Milliseconds(100)), options);
  EXPECT_EQ(comm.status().code(), absl::StatusCode::kDeadlineExceeded) << comm.status();
  SHARD_ASSERT_OK(store_.Set("bad_id", "short"));
  options.key = "bad_id";
  const auto bad = NcclCommunicator::Create(
      1, 2, KeyValueIdExchange(&store_, absl::Milliseconds(100)), options);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << bad.status();
  EXPECT_EQ(NcclCommunicator::Create(2, 2, KeyValueIdExchange(&store_, absl::Seconds(1)), options)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace shard
