// Data-parallel training against a plain, unsharded single-process run of the same MLP: every
// ZeRO stage, both shard modes, 2 and 4 ranks (threads over real loopback TCP), Adam and SGD
// with momentum.
#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "common/mlp.h"
#include "common/mlp_data.h"
#include "common/safetensors.h"
#include "gtest/gtest.h"
#include "tests/support/train_on_threads.h"
#include "worker/dataplane/trainer.h"

namespace shard {
namespace {

const std::vector<int64_t> kWidths = {16, 48, 32, 8};

std::string TempPath(const std::string& name) {
  const std::string dir = ::testing::TempDir() + "/shard-training-test";
  std::filesystem::create_directories(dir);
  return dir + "/" + name;
}

const std::string& DataFile() {
  static const std::string path = [] {
    const std::string p = TempPath("data.safetensors");
    EXPECT_TRUE(GenerateMlpData(kWidths, 512, 7, p).ok());
    return p;
  }();
  return path;
}

JobConfig Job(OptimizerKind kind, int world, int stage, ShardMode mode, int64_t steps = 20) {
  JobConfig job;
  job.name = "test";
  job.world_size = world;
  job.min_world_size = world;
  job.widths = kWidths;
  job.data_path = DataFile();
  job.seed = 3;
  job.optimizer.kind = kind;
  job.optimizer.lr = kind == OptimizerKind::kSgd ? 0.05 : 0.01;
  job.optimizer.momentum = kind == OptimizerKind::kSgd ? 0.9 : 0;
  job.optimizer.weight_decay = 0.01;
  job.global_batch = world == 3 ? 96 : 64;  // divisible by the world size
  job.steps = steps;
  job.zero_stage = stage;
  job.shard_mode = mode;
  // Small caps: several buckets, so overlap and bucket ordering are exercised.
  job.bucket_cap_bytes = 2048;
  job.first_bucket_cap_bytes = 512;
  job.output_dir = TempPath(absl::StrCat("out-", world, "-", stage, "-", ShardModeName(mode), "-",
                                         OptimizerKindName(kind)));
  return job;
}

// The reference: one process, the whole global batch, no buckets, no sharding, and the
// optimizer written out plainly (torch's formulas, element by element).
std::vector<std::vector<float>> ReferenceTraining(const JobConfig& job) {
  std::vector<std::vector<float>> params = InitMlpParameters(job.widths, job.seed);
  std::vector<std::vector<float>> grads, m, v;
  for (const auto& p : params) {
    grads.emplace_back(p.size());
    m.emplace_back(p.size(), 0.0f);
    v.emplace_back(p.size(), 0.0f);
  }
  auto data = MlpBatchReader::Open(job.data_path, job.widths.front());
  EXPECT_TRUE(data.ok());
  Mlp model(job.widths);
  std::vector<float> x;
  std::vector<int64_t> y;
  const OptimizerConfig& o = job.optimizer;
  for (int64_t step = 1; step <= job.steps; ++step) {
    EXPECT_TRUE((*data)->Read(step - 1, job.global_batch, 0, 1, &x, &y).ok());
    std::vector<const float*> views;
    std::vector<float*> grad_views;
    for (size_t i = 0; i < params.size(); ++i) {
      views.push_back(params[i].data());
      grad_views.push_back(grads[i].data());
    }
    EXPECT_TRUE(model.Forward(views, x.data(), y.data(), job.global_batch).ok());
    EXPECT_TRUE(model.Backward(views, grad_views, 1.0f / job.global_batch, [](int) {}).ok());
    if (job.grad_clip_norm > 0) {  // torch.nn.utils.clip_grad_norm_
      double sum = 0;
      for (const auto& g : grads) {
        for (float e : g) sum += static_cast<double>(e) * e;
      }
      const double coefficient = std::min(1.0, job.grad_clip_norm / (std::sqrt(sum) + 1e-6));
      for (auto& g : grads) {
        for (float& e : g) e *= static_cast<float>(coefficient);
      }
    }
    for (size_t i = 0; i < params.size(); ++i) {
      for (size_t k = 0; k < params[i].size(); ++k) {
        float& p = params[i][k];
        float g = grads[i][k];
        if (o.kind == OptimizerKind::kSgd) {
          g = g + static_cast<float>(o.weight_decay) * p;
          m[i][k] = step == 1 ? g : m[i][k] * static_cast<float>(o.momentum) + g;
          p = p - static_cast<float>(o.lr) * m[i][k];
        } else {
          if (o.kind == OptimizerKind::kAdamW) {
            p = p * static_cast<float>(1 - o.lr * o.weight_decay);
          } else {
            g = g + static_cast<float>(o.weight_decay) * p;
          }
          m[i][k] = m[i][k] + static_cast<float>(1 - o.beta1) * (g - m[i][k]);
          v[i][k] = v[i][k] * static_cast<float>(o.beta2) + static_cast<float>(1 - o.beta2) * g * g;
          const double bc1 = 1 - std::pow(o.beta1, step);
          const double bc2 = 1 - std::pow(o.beta2, step);
          const float denom = std::sqrt(v[i][k]) / static_cast<float>(std::sqrt(bc2)) +
                              static_cast<float>(o.eps);
          p = p + static_cast<float>(-(o.lr / bc1)) * m[i][k] / denom;
        }
      }
    }
  }
  return params;
}

// What each rank's TrainMlp returned (every rank must succeed: the harness asserts it).
std::vector<TrainResult> TrainWithThreads(const JobConfig& job) {
  std::vector<TrainResult> results;
  TrainMlpOnThreads(job, "", "", &results);
  return results;
}

std::vector<std::vector<float>> ReadOutputOf(const std::string& path,
                                             const std::vector<int64_t>& widths) {
  auto file = SafetensorsReader::Open(path);
  EXPECT_TRUE(file.ok()) << file.status();
  std::vector<std::vector<float>> params;
  for (const ParamSpec& spec : MlpManifest(widths).params) {
    auto tensor = (*file)->Expect(spec.name, DataType::kFloat32, spec.shape);
    EXPECT_TRUE(tensor.ok()) << tensor.status();
    std::vector<float> values(spec.numel());
    EXPECT_TRUE((*file)->ReadElements(**tensor, 0, spec.numel(), values.data()).ok());
    params.push_back(std::move(values));
  }
  return params;
}

std::vector<std::vector<float>> ReadOutput(const std::string& path) {
  return ReadOutputOf(path, kWidths);
}

// Largest element-wise difference between two sets of parameters.
double MaxDifference(const std::vector<std::vector<float>>& a,
                     const std::vector<std::vector<float>>& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    for (size_t k = 0; k < a[i].size(); ++k) {
      worst = std::max(worst, std::abs(static_cast<double>(a[i][k]) - b[i][k]));
    }
  }
  return worst;
}

struct Case {
  OptimizerKind optimizer;
  int world;
  int stage;
  ShardMode mode;
  double clip = 0;
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << OptimizerKindName(c.optimizer) << " " << c.world << " ranks stage " << c.stage << " "
      << ShardModeName(c.mode) << " clip " << c.clip;
}

class ShardedMatchesReferenceTest : public ::testing::TestWithParam<Case> {};

TEST_P(ShardedMatchesReferenceTest, FinalParametersAgree) {
  const Case c = GetParam();
  JobConfig job = Job(c.optimizer, c.world, c.stage, c.mode);
  job.grad_clip_norm = c.clip;
  std::vector<TrainResult> outcomes;
  ASSERT_NO_FATAL_FAILURE(outcomes = TrainWithThreads(job));
  const auto sharded = ReadOutput(outcomes[0].output_path);
  const auto reference = ReferenceTraining(job);
  // The only difference is the order of fp32 summation: each rank's slice of the batch is
  // summed by its own sgemm, then the slices are added in ring order. Gradients agree to a
  // few ulps (relative ~1e-6); over 20 steps with lr 0.01 (Adam moves each element by at most
  // ~lr per step) or 0.05 with momentum, parameters of magnitude ~0.3 stay within 2e-5.
  EXPECT_LT(MaxDifference(sharded, reference), 2e-5);
  // Not trivially equal: training moved the parameters.
  EXPECT_GT(MaxDifference(reference, InitMlpParameters(job.widths, job.seed)), 1e-2);
}

std::vector<Case> AllCases() {
  std::vector<Case> cases;
  for (OptimizerKind optimizer : {OptimizerKind::kAdam, OptimizerKind::kSgd}) {
    for (int world : {2, 4}) {
      for (int stage : {0, 1, 2}) {
        for (ShardMode mode : {ShardMode::kRange, ShardMode::kParam}) {
          cases.push_back(Case{optimizer, world, stage, mode});
        }
      }
    }
  }
  // Stage 3 (parameters sharded, gathered per bucket) at 3 ranks with every update rule.
  for (OptimizerKind optimizer : {OptimizerKind::kAdam, OptimizerKind::kAdamW, OptimizerKind::kSgd}) {
    for (ShardMode mode : {ShardMode::kRange, ShardMode::kParam}) {
      cases.push_back(Case{optimizer, 3, 3, mode});
    }
  }
  // Global-norm clipping across shards (0.05 is below the gradient norm, so it scales).
  for (int stage : {0, 1, 2, 3}) {
    for (ShardMode mode : {ShardMode::kRange, ShardMode::kParam}) {
      cases.push_back(Case{OptimizerKind::kAdamW, 2, stage, mode, 0.05});
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(
    AllStages, ShardedMatchesReferenceTest, ::testing::ValuesIn(AllCases()),
    [](const ::testing::TestParamInfo<Case>& info) {
      return absl::StrCat(OptimizerKindName(info.param.optimizer), "_", info.param.world,
                          "ranks_stage", info.param.stage, "_", ShardModeName(info.param.mode),
                          info.param.clip > 0 ? "_clipped" : "");
    });

// The lines of /proc/self/maps that map the shared-memory transport's segments: its slots,
// and the buckets it shares.
int SharedMemoryMappings() {
  std::ifstream maps("/proc/self/maps");
  int count = 0;
  for (std::string line; std::getline(maps, line);) {
    if (line.find("/dev/shm/shard-") != std::string::npos) ++count;
  }
  return count;
}

// Records the most shared-memory mappings seen at a step of rank 0.
class MappingCounter : public TrainingObserver {
 public:
  void OnStep(const StepRecord&) override {
    most_ = std::max(most_.load(), SharedMemoryMappings());
  }
  int most() const { return most_.load(); }

 private:
  std::atomic<int> most_{0};
};

// Over shared memory, buckets of 1 MiB and more are shared, and the peers reduce and gather
// them in place (reduce-scatter and all-gather in range mode, reduce and broadcast in param
// mode): the same bits as the TCP ring, at every stage that keeps whole buckets.
TEST(TrainingTest, SharedMemoryBucketsReadInPlaceTrainTheBitsOfTheTcpRing) {
  const std::vector<int64_t> widths = {64, 1024, 512, 10};  // 2.4 MB of parameters
  const std::string data = TempPath("data-wide.safetensors");
  ASSERT_TRUE(GenerateMlpData(widths, 256, 11, data).ok());
  for (const auto& [world, mode] : {std::pair{2, ShardMode::kRange}, {3, ShardMode::kRange},
                                    {3, ShardMode::kParam}}) {
    for (int stage : {0, 1, 2}) {
      SCOPED_TRACE(absl::StrCat(world, " ranks, stage ", stage, ", ", ShardModeName(mode)));
      JobConfig job = Job(OptimizerKind::kAdamW, world, stage, mode, 6);
      job.widths = widths;
      job.data_path = data;
      job.bucket_cap_bytes = 4 << 20;
      job.first_bucket_cap_bytes = 1 << 20;
      job.min_buckets = 1;
      std::vector<std::vector<float>> trained[2];
      for (bool shared_memory : {false, true}) {
        job.output_dir = TempPath(absl::StrCat("wide-", world, "-", stage, "-",
                                               ShardModeName(mode), "-", shared_memory));
        MappingCounter counter;
        std::vector<TrainResult> results;
        RankThreadsOptions run;
        run.results = &results;
        run.shared_memory = shared_memory;
        run.configure = [&](int rank, TrainerOptions* options) {
          if (rank == 0) options->observer = &counter;
        };
        ASSERT_NO_FATAL_FAILURE(TrainMlpOnThreads(job, run));
        trained[shared_memory] = ReadOutputOf(results[0].output_path, widths);
        for (const TrainResult& result : results) EXPECT_EQ(result.unshared_reason, "");
        // Each rank maps every rank's slots; the shared buckets add as many again at least.
        if (shared_memory) {
          EXPECT_GT(counter.most(), 2 * world * world);
        }
      }
      ASSERT_EQ(trained[0].size(), trained[1].size());
      for (size_t p = 0; p < trained[0].size(); ++p) {
        EXPECT_EQ(std::memcmp(trained[0][p].data(), trained[1][p].data(),
                              trained[0][p].size() * sizeof(float)),
                  0)
            << "parameter " << p;
      }
      EXPECT_GT(MaxDifference(trained[1], InitMlpParameters(widths, job.seed)), 1e-3);
    }
  }
}

TEST(TrainingTest, OptimizerStateIsOneWthOfTheTotalPlusPadding) {
  int64_t total_params = 0;
  for (const ParamSpec& p : MlpManifest(kWidths).params) total_params += p.numel();
  const int64_t adam_total = 2 * total_params * 4;  // exp_avg and exp_avg_sq, f32
  for (int stage : {0, 1, 2}) {
    const JobConfig job = Job(OptimizerKind::kAdam, 4, stage, ShardMode::kRange, 2);
    std::vector<TrainResult> outcomes;
    ASSERT_NO_FATAL_FAILURE(outcomes = TrainWithThreads(job));
    for (const TrainResult& outcome : outcomes) {
      const int64_t bytes = outcome.optimizer_state_bytes;
      if (stage == 0) {
        // Everything, plus bucket padding and alignment gaps.
        EXPECT_GE(bytes, adam_total);
        EXPECT_LT(bytes, adam_total * 1.1);
      } else {
        EXPECT_GE(bytes, adam_total / 4);
        // Padding: each bucket is padded to a multiple of 4 ranks x 16 floats.
        EXPECT_LT(bytes, adam_total / 4 * 1.1) << "stage " << stage;
      }
    }
  }
}

// Gathering on demand changes when the parameters move, not what is computed: stage 3 equals
// stage 2 bit for bit on the same world (the same reductions of the same gradients, the same
// update), and so do stages 1 and 2 with and without overlapParamGather.
TEST(TrainingTest, GatheringOnDemandChangesNoBit) {
  for (ShardMode mode : {ShardMode::kRange, ShardMode::kParam}) {
    struct Run {
      int stage;
      bool overlap_param_gather;
    };
    std::vector<std::vector<std::vector<float>>> outputs;
    const std::vector<Run> runs = {{2, false}, {3, false}, {2, true}, {1, false}, {1, true}};
    for (const Run& run : runs) {
      JobConfig job = Job(OptimizerKind::kAdam, 3, run.stage, mode);
      job.overlap_param_gather = run.overlap_param_gather;
      job.output_dir += run.overlap_param_gather ? "-gather-on-demand" : "-gather-at-end";
      std::vector<TrainResult> outcomes;
      ASSERT_NO_FATAL_FAILURE(outcomes = TrainWithThreads(job));
      outputs.push_back(ReadOutput(outcomes[0].output_path));
    }
    for (size_t r = 1; r < runs.size(); ++r) {
      SCOPED_TRACE(absl::StrCat(ShardModeName(mode), " stage ", runs[r].stage,
                                " overlapParamGather ", runs[r].overlap_param_gather));
      const auto& against = runs[r].stage == 1 ? outputs[3] : outputs[0];
      EXPECT_EQ(MaxDifference(outputs[r], against), 0.0);
    }
  }
}

// Updating each bucket as soon as its reduction completes (overlapUpdate, during backward, and
// at stages 1 and 2 without overlapParamGather its gather right after) changes when the update
// runs, not what it computes: every stage and shard mode ends with the same bits as the update
// after backward. The overlapped runs did overlap every step after the
// first (the rebuild), and clipping turns it off.
TEST(TrainingTest, UpdatingDuringBackwardChangesNoBit) {
  struct Config {
    int stage;
    bool overlap_param_gather;  // false at stages 1 and 2: each bucket gathered after its update
  };
  const std::vector<Config> configs = {{0, true}, {1, true}, {1, false}, {2, true}, {2, false},
                                       {3, true}};
  for (ShardMode mode : {ShardMode::kRange, ShardMode::kParam}) {
    for (const Config& config : configs) {
      const int stage = config.stage;
      for (double clip : {0.0, 0.5}) {
        SCOPED_TRACE(absl::StrCat(ShardModeName(mode), " stage ", stage, " clip ", clip,
                                  " overlapParamGather ", config.overlap_param_gather));
        std::vector<std::vector<std::vector<float>>> outputs;
        for (bool overlap_update : {false, true}) {
          JobConfig job = Job(OptimizerKind::kAdamW, 3, stage, mode);
          job.overlap_param_gather = config.overlap_param_gather;
          job.grad_clip_norm = clip;
          job.overlap_update = overlap_update;
          job.output_dir += overlap_update ? "-update-overlapped" : "-update-after";
          // Every rank's steps that updated during backward.
          struct OverlappedSteps : TrainingObserver {
            void OnStep(const StepRecord& record) override {
              if (record.timings.update_overlapped) ++count;
            }
            std::atomic<int> count{0};
          } overlapped_steps;
          RankThreadsOptions run;
          run.configure = [&](int, TrainerOptions* options) {
            options->observer = &overlapped_steps;
          };
          ASSERT_NO_FATAL_FAILURE(TrainMlpOnThreads(job, run));
          const int expected = overlap_update && clip == 0 ? 3 * (job.steps - 1) : 0;
          EXPECT_EQ(overlapped_steps.count.load(), expected)
              << "steps updated during backward, 3 ranks";
          outputs.push_back(ReadOutput(job.output_dir + "/final.safetensors"));
        }
        EXPECT_EQ(MaxDifference(outputs[1], outputs[0]), 0.0);
      }
    }
  }
}

// At stage 3 a rank holds its owned spans of the parameters and gradients and its optimizer
// state (16 P / W bytes for Adam, plus padding) and at most prefetch + 1 gathered buckets.
TEST(TrainingTest, StageThreeHoldsOneWthOfTheModelStatePlusTheGatheredBuckets) {
  int64_t total_params = 0;
  for (const ParamSpec& p : MlpManifest(kWidths).params) total_params += p.numel();
  JobConfig job = Job(OptimizerKind::kAdam, 4, 3, ShardMode::kRange, 3);
  std::vector<TrainResult> outcomes;
  ASSERT_NO_FATAL_FAILURE(outcomes = TrainWithThreads(job));
  // The largest bucket: the plan caps buckets at 2048 bytes (one parameter may exceed it).
  int64_t largest = 0;
  for (const ParamSpec& p : MlpManifest(kWidths).params) largest = std::max(largest, p.numel());
  for (const TrainResult& outcome : outcomes) {
    const HeldBytes& held = outcome.held_bytes;
    const int64_t sharded = held.params + held.grads + held.optimizer_state;
    EXPECT_GE(sharded, 16 * total_params / 4);
    EXPECT_LT(sharded, 16 * total_params / 4 * 1.1);
    // prefetch + 1 = 2 slots for parameters and 2 for gradients, each the largest bucket.
    EXPECT_GT(held.gathered, 0);
    EXPECT_LE(held.gathered, 4 * (largest + 64) * 4);
    EXPECT_EQ(held.frozen, 0);
  }
}

TEST(TrainingTest, LossFallsOnGeneratedData) {
  const JobConfig job = Job(OptimizerKind::kAdam, 2, 2, ShardMode::kRange, 150);
  std::vector<TrainResult> outcomes;
  ASSERT_NO_FATAL_FAILURE(outcomes = TrainWithThreads(job));
  EXPECT_LT(outcomes[0].last_loss, 0.6 * outcomes[0].first_loss)
      << "first " << outcomes[0].first_loss << " last " << outcomes[0].last_loss;
  EXPECT_EQ(outcomes[1].last_loss, outcomes[0].last_loss) << "a global loss";
}

// Gradient accumulation: 4 micro-batches per rank and step add up to the gradient of the whole
// share, so training equals the run without micro-batches up to the order of float additions;
// one reduction per step (the last micro-batch marks the gradients ready).
TEST(TrainingTest, MicroBatchesAccumulateToTheSameTraining) {
  JobConfig whole = Job(OptimizerKind::kSgd, 2, 2, ShardMode::kRange);
  JobConfig micro = whole;
  micro.micro_batches = 4;
  micro.output_dir = whole.output_dir + "-micro";
  std::vector<TrainResult> a, b;
  ASSERT_NO_FATAL_FAILURE(a = TrainWithThreads(whole));
  ASSERT_NO_FATAL_FAILURE(b = TrainWithThreads(micro));
  const auto expected = ReadOutput(a[0].output_path);
  const auto actual = ReadOutput(b[0].output_path);
  ASSERT_EQ(actual.size(), expected.size());
  double largest = 0;
  for (size_t p = 0; p < expected.size(); ++p) {
    for (size_t k = 0; k < expected[p].size(); ++k) {
      largest = std::max(largest, std::abs(double{actual[p][k]} - expected[p][k]));
    }
  }
  EXPECT_LT(largest, 1e-5);
  EXPECT_NEAR(b[0].last_loss, a[0].last_loss, 1e-5);
  // Not the same bits: the run did accumulate (a wrong sum would be far off, above).
  EXPECT_GT(largest, 0);
}

TEST(MlpTest, GradientsMatchFiniteDifferences) {
  const std::vector<int64_t> widths = {5, 7, 4};
  std::vector<std::vector<float>> params = InitMlpParameters(widths, 11);
  std::mt19937_64 rng(5);
  std::vector<float> x(6 * 5);
  for (float& v : x) v = 2 * UniformFloat(rng) - 1;
  const std::vector<int64_t> y = {0, 3, 1, 2, 3, 0};
  Mlp model(widths);
  auto views = [&] {
    std::vector<const float*> v;
    for (const auto& p : params) v.push_back(p.data());
    return v;
  };
  std::vector<std::vector<float>> grads;
  std::vector<float*> grad_views;
  for (const auto& p : params) grads.emplace_back(p.size());
  for (auto& g : grads) grad_views.push_back(g.data());
  ASSERT_TRUE(model.Forward(views(), x.data(), y.data(), 6).ok());
  std::vector<int> ready;
  ASSERT_TRUE(model.Backward(views(), grad_views, 1.0f, [&](int i) { ready.push_back(i); }).ok());
  EXPECT_EQ(ready, (std::vector<int>{3, 2, 1, 0})) << "last layer first, bias before weight";
  // Central differences in fp32 with h = 1e-2: truncation error O(h^2) on a smooth loss, and
  // rounding ~1e-7 / h; a gradient component agrees to 2e-3 (none sits on a ReLU kink here).
  const float h = 1e-2f;
  for (size_t i = 0; i < params.size(); ++i) {
    for (size_t k = 0; k < params[i].size(); ++k) {
      const float saved = params[i][k];
      params[i][k] = saved + h;
      const double up = *model.Forward(views(), x.data(), y.data(), 6);
      params[i][k] = saved - h;
      const double down = *model.Forward(views(), x.data(), y.data(), 6);
      params[i][k] = saved;
      EXPECT_NEAR(grads[i][k], (up - down) / (2 * h), 2e-3) << "param " << i << " element " << k;
    }
  }
}

}  // namespace
}  // namespace shard
