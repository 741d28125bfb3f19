// The staged communicator: several ranks (threads) sharing one GPU over an in-process host
// world, every collective against a serial reference computed in the same rank order (so the
// comparison is exact), aborts, and data-parallel training on one GPU matching a one-process
// CPU run.
#include "worker/gpu/staged_communicator.h"

#include <atomic>
#include <cmath>
#include <random>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "common/mlp.h"
#include "gtest/gtest.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/gpu/in_process_communicator.h"
#include "worker/dataplane/optimizer.h"
#include "worker/gpu/gpu_mlp.h"
#include "worker/gpu/kernels.h"

namespace shard {
namespace {

// Runs body(rank, communicator, compute stream) on `size` threads sharing device 0.
template <typename Body>
void RunRanks(int size, Body body) {
  InProcessWorld world(size);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < size; ++rank) {
    threads.emplace_back([&, rank] {
      ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
      std::unique_ptr<Communicator> host = world.Join(rank);
      SHARD_ASSERT_OK_AND_ASSIGN(CudaStream compute, CudaStream::Create());
      SHARD_ASSERT_OK_AND_ASSIGN(
          std::unique_ptr<StagedCommunicator> comm,
          StagedCommunicator::Create(host.get(), {.device = 0, .compute_stream = compute.get()}));
      body(rank, *comm, compute.get());
    });
  }
  for (std::thread& t : threads) t.join();
}

// Rank r's input: a seeded random vector, the same in every thread that asks.
std::vector<float> Input(int rank, size_t count) {
  std::mt19937_64 rng(1000 + rank);
  return RandomFloats(count, rng, -1.0f, 1.0f);
}

// Copies `values` to `device` on the compute stream (as a kernel producing them would).
void Produce(const std::vector<float>& values, void* device, cudaStream_t compute) {
  ASSERT_EQ(cudaMemcpyAsync(device, values.data(), values.size() * sizeof(float),
                            cudaMemcpyHostToDevice, compute),
            cudaSuccess);
}

std::vector<float> Consume(DeviceCommunicator& comm, const void* device, size_t count,
                           cudaStream_t compute) {
  EXPECT_TRUE(comm.OrderComputeAfterCollectives().ok());
  std::vector<float> values(count);
  EXPECT_EQ(cudaMemcpyAsync(values.data(), device, count * sizeof(float),
                            cudaMemcpyDeviceToHost, compute),
            cudaSuccess);
  EXPECT_EQ(cudaStreamSynchronize(compute), cudaSuccess);
  return values;
}

TEST(StagedCommunicatorTest, ThreeRanksOnOneGpuMatchASerialReference) {
  SHARD_REQUIRE_GPU();
  constexpr int kRanks = 3;
  constexpr size_t kBlock = 20011;  // per-rank block of the scatter and gather
  constexpr size_t kCount = kRanks * kBlock;
  std::vector<std::vector<float>> inputs;
  for (int r = 0; r < kRanks; ++r) inputs.push_back(Input(r, kCount));
  std::vector<float> sum(kCount), max(kCount);
  for (size_t i = 0; i < kCount; ++i) {
    sum[i] = (inputs[0][i] + inputs[1][i]) + inputs[2][i];  // the host world's order
    max[i] = std::max(std::max(inputs[0][i], inputs[1][i]), inputs[2][i]);
  }
  RunRanks(kRanks, [&](int rank, StagedCommunicator& comm, cudaStream_t compute) {
    EXPECT_EQ(comm.backend(), "in-process+staged");
    SHARD_ASSERT_OK_AND_ASSIGN(DeviceBuffer in, DeviceBuffer::Allocate(kCount * sizeof(float)));
    SHARD_ASSERT_OK_AND_ASSIGN(DeviceBuffer out, DeviceBuffer::Allocate(kCount * sizeof(float)));
    const std::vector<float> poison(kCount, kPoison);
    const std::vector<float>& mine = inputs[rank];

    Produce(mine, in.data(), compute);
    Produce(poison, out.data(), compute);
    SHARD_ASSERT_OK(comm.AllReduce(in.data(), out.data(), kCount, DataType::kFloat32,
                                   ReduceOp::kSum));
    EXPECT_EQ(Consume(comm, out.data(), kCount, compute), sum) << "all-reduce sum";

    Produce(mine, in.data(), compute);
    SHARD_ASSERT_OK(comm.AllReduce(in.data(), in.data(), kCount, DataType::kFloat32,
                                   ReduceOp::kMax));
    EXPECT_EQ(Consume(comm, in.data(), kCount, compute), max) << "all-reduce max in place";

    Produce(mine, in.data(), compute);
    Produce(poison, out.data(), compute);
    SHARD_ASSERT_OK(comm.ReduceScatter(in.data(), out.data(), kBlock, DataType::kFloat32,
                                       ReduceOp::kSum));
    EXPECT_EQ(Consume(comm, out.data(), kBlock, compute),
              std::vector<float>(sum.begin() + rank * kBlock, sum.begin() + (rank + 1) * kBlock))
        << "reduce-scatter";

    Produce(mine, in.data(), compute);
    Produce(poison, out.data(), compute);
    SHARD_ASSERT_OK(comm.AllGather(in.data(), out.data(), kBlock, DataType::kFloat32));
    std::vector<float> gathered;
    for (int r = 0; r < kRanks; ++r) {
      gathered.insert(gathered.end(), inputs[r].begin(), inputs[r].begin() + kBlock);
    }
    EXPECT_EQ(Consume(comm, out.data(), kCount, compute), gathered) << "all-gather";

    Produce(mine, in.data(), compute);
    Produce(poison, out.data(), compute);
    SHARD_ASSERT_OK(comm.Reduce(in.data(), out.data(), kCount, DataType::kFloat32,
                                ReduceOp::kSum, 1));
    const std::vector<float> reduced = Consume(comm, out.data(), kCount, compute);
    if (rank == 1) {
      EXPECT_EQ(reduced, sum) << "reduce to rank 1";
    } else {
      for (float v : reduced) ASSERT_TRUE(std::isnan(v)) << "a non-root's output was written";
    }

    Produce(mine, in.data(), compute);
    SHARD_ASSERT_OK(comm.Broadcast(in.data(), kCount, DataType::kFloat32, 2));
    EXPECT_EQ(Consume(comm, in.data(), kCount, compute), inputs[2]) << "broadcast from 2";

    SHARD_EXPECT_OK(comm.Barrier());
    SHARD_EXPECT_OK(comm.Synchronize());
  });
}

TEST(StagedCommunicatorTest, AbortWakesARankWaitingForItsPeers) {
  SHARD_REQUIRE_GPU();
  InProcessWorld world(2);  // rank 1 never calls
  std::unique_ptr<Communicator> host = world.Join(0);
  SHARD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<StagedCommunicator> comm,
                             StagedCommunicator::Create(host.get(), {}));
  SHARD_ASSERT_OK_AND_ASSIGN(DeviceBuffer buffer, DeviceBuffer::Allocate(256 * sizeof(float)));
  absl::Status status;
  absl::Time returned;
  std::thread rank0([&] {
    status = comm->AllReduce(buffer.data(), buffer.data(), 256, DataType::kFloat32,
                             ReduceOp::kSum);
    returned = absl::Now();
  });
  absl::SleepFor(absl::Milliseconds(200));
  const absl::Time aborted = absl::Now();
  comm->Abort("peer lost");
  rank0.join();
  EXPECT_EQ(status.code(), absl::StatusCode::kAborted) << status;
  EXPECT_LT(returned - aborted, absl::Seconds(1));
  EXPECT_TRUE(comm->aborted());
  EXPECT_TRUE(host->aborted());
  EXPECT_EQ(comm->Broadcast(buffer.data(), 256, DataType::kFloat32, 0).code(),
            absl::StatusCode::kAborted);
}

// Two ranks sharing the GPU train the MLP data-parallel (each on half the batch, gradients
// summed by the staged all-reduce, the fused Adam on the device) and end where one CPU process
// training on the whole batch ends. The only differences are fp32 summation orders (cuBLAS vs
// OpenBLAS, two half-batch sums vs one): gradients agree to ~1e-6 relative and Adam's
// normalised steps of lr = 1e-3 keep parameter differences far below 2e-5 over 10 steps, the
// bound the CPU engine's own distributed-vs-serial test uses.
TEST(StagedCommunicatorTest, DataParallelTrainingOnOneGpuMatchesOneCpuProcess) {
  SHARD_REQUIRE_GPU();
  const std::vector<int64_t> widths = {24, 48, 32, 6};
  constexpr int kRanks = 2;
  constexpr int64_t kBatch = 32;
  constexpr int kSteps = 10;
  OptimizerConfig adam;
  adam.lr = 1e-3;
  const std::vector<std::vector<float>> init = InitMlpParameters(widths, 17);
  std::vector<int64_t> offsets;
  int64_t total = 0;
  for (const std::vector<float>& p : init) {
    offsets.push_back(total);
    total += static_cast<int64_t>(p.size());
  }
  std::mt19937_64 rng(23);
  std::vector<std::vector<float>> xs;
  std::vector<std::vector<int64_t>> ys;
  for (int s = 0; s < kSteps; ++s) {
    xs.push_back(RandomFloats(kBatch * widths[0], rng, -1.0f, 1.0f));
    std::vector<int64_t> y(kBatch);
    for (int64_t& label : y) label = static_cast<int64_t>(rng() % widths.back());
    ys.push_back(y);
  }

  // One CPU process on the whole batch.
  std::vector<std::vector<float>> cpu_params = init;
  std::vector<std::vector<float>> grads, exp_avg, exp_avg_sq;
  for (const std::vector<float>& p : init) {
    grads.emplace_back(p.size());
    exp_avg.emplace_back(p.size(), 0.0f);
    exp_avg_sq.emplace_back(p.size(), 0.0f);
  }
  Mlp cpu(widths);
  const OptimizerKernel cpu_adam(adam);
  for (int s = 0; s < kSteps; ++s) {
    std::vector<const float*> views;
    std::vector<float*> grad_views;
    for (size_t i = 0; i < init.size(); ++i) {
      views.push_back(cpu_params[i].data());
      grad_views.push_back(grads[i].data());
    }
    ASSERT_TRUE(cpu.Forward(views, xs[s].data(), ys[s].data(), kBatch).ok());
    ASSERT_TRUE(cpu.Backward(views, grad_views, 1.0f / kBatch, [](int) {}).ok());
    for (size_t i = 0; i < init.size(); ++i) {
      float* state[2] = {exp_avg[i].data(), exp_avg_sq[i].data()};
      cpu_adam.Update(s + 1, cpu_params[i].data(), grads[i].data(), state, init[i].size());
    }
  }

  std::vector<std::vector<float>> gpu_params(kRanks);
  RunRanks(kRanks, [&](int rank, StagedCommunicator& comm, cudaStream_t compute) {
    std::vector<float> flat;
    for (const std::vector<float>& p : init) flat.insert(flat.end(), p.begin(), p.end());
    SHARD_ASSERT_OK_AND_ASSIGN(DeviceBuffer params, ToDevice(flat));
    SHARD_ASSERT_OK_AND_ASSIGN(DeviceBuffer grad, DeviceBuffer::Allocate(total * sizeof(float)));
    SHARD_ASSERT_OK_AND_ASSIGN(DeviceBuffer m, ToDevice(std::vector<float>(total, 0.0f)));
    SHARD_ASSERT_OK_AND_ASSIGN(DeviceBuffer v, ToDevice(std::vector<float>(total, 0.0f)));
    TensorSlot slot;
    slot.param = params.as<float>();
    slot.grad = grad.as<float>();
    slot.state[0] = m.as<float>();
    slot.state[1] = v.as<float>();
    slot.count = total;
    SHARD_ASSERT_OK_AND_ASSIGN(TensorList list,
                               TensorList::Create({slot}, DataType::kFloat32, compute));
    const FusedOptimizer optimizer(adam);
    std::vector<const void*> param_views;
    std::vector<float*> grad_views;
    for (int64_t offset : offsets) {
      param_views.push_back(params.as<float>() + offset);
      grad_views.push_back(grad.as<float>() + offset);
    }
    constexpr int64_t kRows = kBatch / kRanks;
    SHARD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<GpuMlp> model,
                               GpuMlp::Create(widths, kRows, compute));
    SHARD_ASSERT_OK_AND_ASSIGN(DeviceBuffer x, DeviceBuffer::Allocate(kRows * widths[0] * 4));
    SHARD_ASSERT_OK_AND_ASSIGN(DeviceBuffer y, DeviceBuffer::Allocate(kRows * sizeof(int64_t)));
    for (int s = 0; s < kSteps; ++s) {
      Produce(std::vector<float>(xs[s].begin() + rank * kRows * widths[0],
                                 xs[s].begin() + (rank + 1) * kRows * widths[0]),
              x.data(), compute);
      ASSERT_EQ(cudaMemcpyAsync(y.data(), ys[s].data() + rank * kRows, kRows * sizeof(int64_t),
                                cudaMemcpyHostToDevice, compute),
                cudaSuccess);
      ASSERT_EQ(cudaStreamSynchronize(compute), cudaSuccess);  // the host vectors are temporaries
      SHARD_ASSERT_OK(model->Forward(param_views, x.as<float>(), y.as<int64_t>(), kRows));
      SHARD_ASSERT_OK(model->Backward(param_views, grad_views, 1.0f / kBatch, [](int) {}));
      SHARD_ASSERT_OK(comm.AllReduce(grad.data(), grad.data(), total, DataType::kFloat32,
                                     ReduceOp::kSum));
      SHARD_ASSERT_OK(comm.OrderComputeAfterCollectives());
      SHARD_ASSERT_OK(optimizer.Step(s + 1, list, compute));
    }
    ASSERT_EQ(cudaStreamSynchronize(compute), cudaSuccess);
    SHARD_ASSERT_OK_AND_ASSIGN(gpu_params[rank], ToHost<float>(params.data(), total));
  });
  for (int rank = 0; rank < kRanks; ++rank) {
    ASSERT_EQ(gpu_params[rank].size(), static_cast<size_t>(total));
    for (size_t i = 0; i < init.size(); ++i) {
      for (size_t j = 0; j < init[i].size(); ++j) {
        ASSERT_NEAR(gpu_params[rank][offsets[i] + j], cpu_params[i][j], 2e-5)
            << "rank " << rank << ", parameter " << i << ", element " << j;
      }
    }
  }
  EXPECT_EQ(gpu_params[0], gpu_params[1]) << "replicas diverged";
}

}  // namespace
}  // namespace shard
