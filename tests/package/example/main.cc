// A user's own model on Shard's data path: linear regression y = x·Wᵀ + b with a mean-squared
// error, trained data-parallel by N ranks (threads of this process, talking over loopback TCP
// through Gloo) with ZeRO stage 2 and Adam. The model is written by hand; Shard only sees its
// parameter manifest, the gradients it marks ready, and Step().
//
//   linear_regression [ranks] [steps]      (defaults: 2 ranks, 60 steps)
//
// Prints the global loss as it trains and exits 1 unless the loss fell below a tenth of the
// first step's. A program that joins a coordinator instead takes its rendezvous store from
// CoordinatorClient::RendezvousStore and its plans from PlanSession (worker/), in place of the
// in-process store and LocalPlanProvider used here.
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "common/manifest.h"
#include "shard/config.h"
#include "shard/v1/job.pb.h"
#include "worker/dataplane/engine.h"
#include "worker/dataplane/gloo_communicator.h"
#include "worker/dataplane/key_value_store.h"
#include "worker/dataplane/plan_provider.h"

namespace {

constexpr int kIn = 16;
constexpr int kOut = 4;
constexpr int kSamples = 1024;
constexpr int kGlobalBatch = 64;

// A fixed data set from a random linear "teacher" plus a little noise; every rank builds the
// same one and reads its own slice of each global batch.
struct DataSet {
  std::vector<float> x;  // [kSamples, kIn]
  std::vector<float> y;  // [kSamples, kOut]
};

DataSet MakeData() {
  std::mt19937 rng(42);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::normal_distribution<float> noise(0.0f, 0.01f);
  std::vector<float> teacher_w(kOut * kIn), teacher_b(kOut);
  for (float& v : teacher_w) v = uniform(rng);
  for (float& v : teacher_b) v = uniform(rng);
  DataSet data{std::vector<float>(kSamples * kIn), std::vector<float>(kSamples * kOut)};
  for (float& v : data.x) v = uniform(rng);
  for (int s = 0; s < kSamples; ++s) {
    for (int o = 0; o < kOut; ++o) {
      float sum = teacher_b[o];
      for (int i = 0; i < kIn; ++i) sum += teacher_w[o * kIn + i] * data.x[s * kIn + i];
      data.y[s * kOut + o] = sum + noise(rng);
    }
  }
  return data;
}

struct RankResult {
  absl::Status status;
  std::vector<double> losses;
};

// One rank's training loop: the whole of what a model does with Shard's engine.
absl::Status TrainRank(int rank, int ranks, int steps, const DataSet& data,
                       shard::KeyValueStore* store, std::vector<double>* losses) {
  shard::GlooOptions gloo;
  gloo.rank = rank;
  gloo.size = ranks;
  gloo.timeout = absl::Seconds(30);
  absl::StatusOr<std::unique_ptr<shard::GlooCommunicator>> communicator =
      shard::CreateGlooCommunicator(store, gloo);
  if (!communicator.ok()) return communicator.status();

  // The parameter manifest, in registration (forward) order.
  shard::Manifest manifest;
  shard::ParamSpec weight;
  weight.name = "linear.weight";
  weight.shape = {kOut, kIn};
  shard::ParamSpec bias;
  bias.name = "linear.bias";
  bias.shape = {kOut};
  manifest.params = {weight, bias};
  constexpr int kWeight = 0;
  constexpr int kBias = 1;

  shard::PlanOptions plan;
  plan.world_size = ranks;
  plan.first_bucket_cap_bytes = 64;  // small caps: the bias and the weight get a bucket each
  plan.bucket_cap_bytes = 1024;
  shard::LocalPlanProvider plans(plan);

  shard::EngineOptions options;
  options.zero_stage = 2;
  options.optimizer.kind = shard::OptimizerKind::kAdam;
  options.optimizer.lr = 0.05;
  absl::StatusOr<std::unique_ptr<shard::Engine>> created =
      shard::Engine::Create(manifest, communicator->get(), &plans, options);
  if (!created.ok()) return created.status();
  shard::Engine& engine = **created;

  // Initial values on rank 0 (any rank's would do), then everyone takes rank 0's.
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> init(-0.25f, 0.25f);
  for (int k = 0; k < kOut * kIn; ++k) engine.param(kWeight)[k] = init(rng);
  for (int k = 0; k < kOut; ++k) engine.param(kBias)[k] = 0.0f;
  if (absl::Status s = engine.BroadcastParameters(); !s.ok()) return s;

  const int local_batch = kGlobalBatch / ranks;
  std::vector<float> error(local_batch * kOut);
  for (int step = 0; step < steps; ++step) {
    // This rank's samples of the global batch.
    const int first = (step * kGlobalBatch + rank * local_batch) % kSamples;
    const float* x = &data.x[first * kIn];
    const float* y = &data.y[first * kOut];

    // Forward. The views are valid until the next Step() (the first one rebuilds the buckets).
    const float* w = engine.param(kWeight);
    const float* b = engine.param(kBias);
    double loss_sum = 0;
    for (int s = 0; s < local_batch; ++s) {
      for (int o = 0; o < kOut; ++o) {
        float prediction = b[o];
        for (int i = 0; i < kIn; ++i) prediction += w[o * kIn + i] * x[s * kIn + i];
        const float e = prediction - y[s * kOut + o];
        loss_sum += static_cast<double>(e) * e;
        // d(loss)/d(prediction) for loss = mean over the global batch and the outputs, so the
        // engine's sum over ranks is the gradient of the global loss.
        error[s * kOut + o] = 2.0f * e / (kGlobalBatch * kOut);
      }
    }

    // Backward, last layer first; each gradient is marked ready as soon as it is written, so
    // its bucket's reduction starts while the rest of backward runs.
    engine.StartBackward();
    float* grad_b = engine.grad(kBias);
    for (int o = 0; o < kOut; ++o) {
      grad_b[o] = 0;
      for (int s = 0; s < local_batch; ++s) grad_b[o] += error[s * kOut + o];
    }
    engine.MarkGradReady(kBias);
    float* grad_w = engine.grad(kWeight);
    for (int o = 0; o < kOut; ++o) {
      for (int i = 0; i < kIn; ++i) {
        float sum = 0;
        for (int s = 0; s < local_batch; ++s) sum += error[s * kOut + o] * x[s * kIn + i];
        grad_w[o * kIn + i] = sum;
      }
    }
    engine.MarkGradReady(kWeight);

    shard::StepTimings timings;
    if (absl::Status s = engine.Step(&timings); !s.ok()) return s;

    // The global loss: every rank's share, summed over the ranks.
    double loss = loss_sum / (kGlobalBatch * kOut);
    if (absl::Status s = (*communicator)->AllReduce(&loss, &loss, 1, shard::DataType::kFloat64,
                                                    shard::ReduceOp::kSum);
        !s.ok()) {
      return s;
    }
    losses->push_back(loss);
  }
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  const int ranks = argc > 1 ? std::atoi(argv[1]) : 2;
  const int steps = argc > 2 ? std::atoi(argv[2]) : 60;
  if (ranks < 1 || kGlobalBatch % ranks != 0 || steps < 2) {
    std::fprintf(stderr, "usage: %s [ranks dividing %d] [steps >= 2]\n", argv[0], kGlobalBatch);
    return 2;
  }
  std::printf("Shard %s, protocol %s: linear regression on %d ranks, %d steps\n", SHARD_VERSION,
              shard::v1::JobSpec::descriptor()->file()->package().c_str(), ranks, steps);

  const DataSet data = MakeData();
  shard::InProcessKeyValueStore store;  // the rendezvous of the ranks
  std::vector<RankResult> results(ranks);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < ranks; ++rank) {
    threads.emplace_back([&, rank] {
      results[rank].status =
          TrainRank(rank, ranks, steps, data, &store, &results[rank].losses);
    });
  }
  for (std::thread& t : threads) t.join();
  for (int rank = 0; rank < ranks; ++rank) {
    if (!results[rank].status.ok()) {
      std::fprintf(stderr, "rank %d: %s\n", rank, results[rank].status.ToString().c_str());
      return 1;
    }
  }

  const std::vector<double>& losses = results[0].losses;
  for (int step = 0; step < steps; ++step) {
    if (step % 10 == 0 || step == steps - 1) {
      std::printf("step %3d  loss %.6f\n", step + 1, losses[step]);
    }
  }
  const double first = losses.front();
  const double last = losses.back();
  std::printf("first_loss %.6f last_loss %.6f\n", first, last);
  if (!(last < 0.1 * first)) {
    std::fprintf(stderr, "the loss did not fall below a tenth of the first step's\n");
    return 1;
  }
  return 0;
}
