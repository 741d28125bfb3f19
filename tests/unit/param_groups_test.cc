// Parameter groups and the learning-rate schedule (common/param_groups.h): the schedule against
// closed-form values, glob matching and first-match-wins, the errors, and the engine training
// the MLP on 1 and 2 ranks (threads over real loopback TCP) with groups, warm-up and decay,
// compared bit for bit with a plain per-parameter reference, and continuing the schedule exactly
// after a restore.
#include "common/param_groups.h"

#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "common/checkpoint.h"
#include "common/mlp.h"
#include "common/mlp_data.h"
#include "common/safetensors.h"
#include "gtest/gtest.h"
#include "tests/support/train_on_threads.h"
#include "tests/support/status_assertions.h"
#include "tests/support/test_directory.h"
#include "worker/dataplane/engine.h"
#include "worker/dataplane/gloo_communicator.h"
#include "worker/dataplane/trainer.h"

namespace shard {
namespace {

constexpr double kPi = 3.14159265358979323846;

// ---------------------------------------------------------------------------------------------
// The schedule.

OptimizerConfig Scheduled(double lr, int64_t warmup, LrDecay decay, double min_lr,
                          int64_t total) {
  OptimizerConfig o;
  o.kind = OptimizerKind::kAdamW;
  o.lr = lr;
  o.schedule.warmup_steps = warmup;
  o.schedule.decay = decay;
  o.schedule.min_lr = min_lr;
  o.total_steps = total;
  return o;
}

// Relative closeness for values that differ from the closed form only by rounding (a few
// double ulps: the schedule goes through min_lr / lr and back).
void ExpectClose(double actual, double expected) {
  EXPECT_NEAR(actual, expected, 1e-14 * std::abs(expected)) << "expected " << expected;
}

TEST(LearningRateScheduleTest, WithoutAScheduleTheLrIsExactlyTheConfiguredOne) {
  OptimizerConfig o;
  o.lr = 3e-4;
  o.weight_decay = 0.1;
  for (int64_t step : std::vector<int64_t>{1, 2, 10, 1000, int64_t{1} << 40}) {
    EXPECT_EQ(LearningRateFactor(o, step), 1.0);
    EXPECT_EQ(LearningRateAt(o, step), 3e-4);  // bit for bit: f(s) = 1 and no scaling
    const StepHyperParameters hyper = GroupHyperParameters(o, -1, step);
    EXPECT_EQ(hyper.lr, 3e-4);
    EXPECT_EQ(hyper.weight_decay, 0.1);
  }
}

TEST(LearningRateScheduleTest, WarmupIsLinearFromLrOverWToLr) {
  // Update s of 1..W uses lr * s / W: LambdaLR(lambda c: min(1, (c + 1) / W)).
  const OptimizerConfig o = Scheduled(3e-4, 4, LrDecay::kConstant, 0, 100);
  EXPECT_EQ(LearningRateAt(o, 1), 3e-4 * 0.25);
  EXPECT_EQ(LearningRateAt(o, 2), 3e-4 * 0.5);
  EXPECT_EQ(LearningRateAt(o, 3), 3e-4 * 0.75);
  EXPECT_EQ(LearningRateAt(o, 4), 3e-4);
  for (int64_t step : std::vector<int64_t>{5, 50, 100, 101}) {
    EXPECT_EQ(LearningRateAt(o, step), 3e-4) << step;
  }
}

TEST(LearningRateScheduleTest, CosineDecayMatchesTheClosedForm) {
  // W = 10, T = 110: the decay covers updates 11..110, p = (s - 10) / 100.
  const double lr = 3e-4, min_lr = 3e-5;
  const OptimizerConfig o = Scheduled(lr, 10, LrDecay::kCosine, min_lr, 110);
  EXPECT_EQ(LearningRateAt(o, 1), lr / 10);
  EXPECT_EQ(LearningRateAt(o, 10), lr);
  // p = 1/4: cos(pi / 4) = sqrt(2) / 2.
  ExpectClose(LearningRateAt(o, 35), min_lr + (lr - min_lr) * 0.5 * (1 + std::sqrt(2.0) / 2));
  // p = 1/2: halfway between lr and min_lr.
  ExpectClose(LearningRateAt(o, 60), (lr + min_lr) / 2);
  // p = 3/4.
  ExpectClose(LearningRateAt(o, 85), min_lr + (lr - min_lr) * 0.5 * (1 - std::sqrt(2.0) / 2));
  // The last step ends at min_lr (one rounding: lr * (min_lr / lr)), and stays there.
  ExpectClose(LearningRateAt(o, 110), min_lr);
  ExpectClose(LearningRateAt(o, 500), min_lr);
  // Never increasing after the warm-up.
  for (int64_t step = 11; step <= 110; ++step) {
    EXPECT_LE(LearningRateAt(o, step), LearningRateAt(o, step - 1)) << step;
  }
  // Decay to 0 by default.
  const OptimizerConfig to_zero = Scheduled(lr, 0, LrDecay::kCosine, 0, 100);
  EXPECT_EQ(LearningRateAt(to_zero, 100), 0.0);
  ExpectClose(LearningRateAt(to_zero, 50), lr / 2);
  ExpectClose(LearningRateAt(to_zero, 1), lr * 0.5 * (1 + std::cos(kPi / 100)));
}

TEST(LearningRateScheduleTest, LinearDecayMatchesTheClosedForm) {
  const double lr = 1e-3, min_lr = 1e-4;
  const OptimizerConfig o = Scheduled(lr, 5, LrDecay::kLinear, min_lr, 45);
  EXPECT_EQ(LearningRateAt(o, 5), lr);
  ExpectClose(LearningRateAt(o, 15), min_lr + (lr - min_lr) * 0.75);
  ExpectClose(LearningRateAt(o, 25), (lr + min_lr) / 2);
  ExpectClose(LearningRateAt(o, 45), min_lr);
  ExpectClose(LearningRateAt(o, 46), min_lr);
}

TEST(LearningRateScheduleTest, AWarmupAsLongAsTheJobNeverDecays) {
  const OptimizerConfig o = Scheduled(1e-3, 20, LrDecay::kCosine, 0, 20);
  EXPECT_EQ(LearningRateAt(o, 1), 1e-3 / 20);
  EXPECT_EQ(LearningRateAt(o, 20), 1e-3);
}

TEST(LearningRateScheduleTest, GroupsScaleTheScheduledLrAndOverrideTheWeightDecay) {
  OptimizerConfig o = Scheduled(2e-3, 4, LrDecay::kLinear, 0, 8);
  o.weight_decay = 0.1;
  o.param_groups = {ParamGroup{{"*.bias"}, 0.0, 1.0}, ParamGroup{{"head.*"}, std::nullopt, 0.5}};
  for (int64_t step = 1; step <= 8; ++step) {
    const double factor = LearningRateFactor(o, step);
    const StepHyperParameters none = GroupHyperParameters(o, -1, step);
    const StepHyperParameters biases = GroupHyperParameters(o, 0, step);
    const StepHyperParameters head = GroupHyperParameters(o, 1, step);
    EXPECT_EQ(none.lr, 2e-3 * factor);
    EXPECT_EQ(none.weight_decay, 0.1);
    EXPECT_EQ(biases.lr, none.lr);
    EXPECT_EQ(biases.weight_decay, 0.0);
    EXPECT_EQ(head.lr, (2e-3 * 0.5) * factor);  // as torch: the group's lr times the lambda
    EXPECT_EQ(head.weight_decay, 0.1) << "no override: the optimizer's";
  }
  EXPECT_EQ(GroupHyperParameters(o, 1, 2).lr, 1e-3 * 0.5);
  EXPECT_EQ(GroupHyperParameters(o, 1, 6).lr, 1e-3 * 0.5);
}

// ---------------------------------------------------------------------------------------------
// Matching.

TEST(ParamGroupMatchTest, PatternsAreFnmatchGlobs) {
  EXPECT_TRUE(MatchesParamPattern("*.bias", "layers.0.bias"));
  EXPECT_TRUE(MatchesParamPattern("*.bias", ".bias"));
  EXPECT_FALSE(MatchesParamPattern("*.bias", "layers.0.bias_hh"));
  EXPECT_FALSE(MatchesParamPattern("*.bias", "bias"));
  EXPECT_TRUE(MatchesParamPattern("*norm*", "blocks.3.norm1.weight"));
  EXPECT_TRUE(MatchesParamPattern("*norm*", "layernorm"));
  EXPECT_TRUE(MatchesParamPattern("*.ln_*", "h.0.ln_1.weight"));
  EXPECT_FALSE(MatchesParamPattern("*.ln_*", "h.0.attn.c_proj.weight"));
  // `*` crosses dots (no FNM_PATHNAME / FNM_PERIOD), `?` is one character.
  EXPECT_TRUE(MatchesParamPattern("*", "a.b.c"));
  EXPECT_TRUE(MatchesParamPattern("layers.?.weight", "layers.3.weight"));
  EXPECT_FALSE(MatchesParamPattern("layers.?.weight", "layers.10.weight"));
  EXPECT_TRUE(MatchesParamPattern("layers.[02].bias", "layers.2.bias"));
  EXPECT_FALSE(MatchesParamPattern("layers.[02].bias", "layers.1.bias"));
  // Whole names, case-sensitive.
  EXPECT_FALSE(MatchesParamPattern("layers.0", "layers.0.weight"));
  EXPECT_FALSE(MatchesParamPattern("*.Bias", "layers.0.bias"));
}

TEST(ParamGroupMatchTest, TheFirstMatchingGroupWins) {
  const std::vector<ParamGroup> groups = {ParamGroup{{"layers.0.*"}, 0.0, 2.0},
                                          ParamGroup{{"nothing", "*.bias"}, 0.0, 1.0}};
  EXPECT_EQ(FindParamGroup(groups, "layers.0.bias"), 0);
  EXPECT_EQ(FindParamGroup(groups, "layers.0.weight"), 0);
  EXPECT_EQ(FindParamGroup(groups, "layers.1.bias"), 1);
  EXPECT_EQ(FindParamGroup(groups, "layers.1.weight"), -1);
  EXPECT_EQ(FindParamGroup({}, "layers.1.weight"), -1);

  OptimizerConfig o;
  o.param_groups = groups;
  SHARD_ASSERT_OK_AND_ASSIGN(const std::vector<int> assigned,
                             AssignParamGroups(o, MlpManifest({4, 6, 3})));
  // layers.0.weight, layers.0.bias, layers.1.weight, layers.1.bias
  EXPECT_EQ(assigned, (std::vector<int>{0, 0, -1, 1}));
}

TEST(ParamGroupMatchTest, AGroupThatTakesNoParameterIsAnErrorNamingItsPatterns) {
  const Manifest mlp = MlpManifest({4, 6, 3});
  OptimizerConfig o;
  // A typo.
  o.param_groups = {ParamGroup{{"*.bias"}, 0.0, 1.0}, ParamGroup{{"*.wieght", "*norm*"}, 0.0, 1.0}};
  absl::Status status = AssignParamGroups(o, mlp).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(status.message(), "optimizer.param_groups[1]")) << status;
  EXPECT_TRUE(absl::StrContains(status.message(), "\"*.wieght\", \"*norm*\"")) << status;
  EXPECT_TRUE(absl::StrContains(status.message(), "matches no parameter")) << status;
  EXPECT_TRUE(absl::StrContains(status.message(), "layers.0.weight")) << status;
  // Shadowed: everything it matches went to an earlier group.
  o.param_groups = {ParamGroup{{"layers.*"}, 0.0, 1.0}, ParamGroup{{"*.bias"}, 0.0, 1.0}};
  status = AssignParamGroups(o, mlp).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(status.message(), "param_groups[1] (match [\"*.bias\"])"))
      << status;
  EXPECT_TRUE(absl::StrContains(status.message(), "earlier groups")) << status;
  // Only frozen parameters: the optimizer never sees them.
  Manifest frozen = mlp;
  frozen.params[1].requires_grad = false;
  o.param_groups = {ParamGroup{{"layers.0.bias"}, 0.0, 1.0}};
  status = AssignParamGroups(o, frozen).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(status.message(), "without gradients")) << status;
}

TEST(ParamGroupMatchTest, TheOptimizerChecksNameTheField) {
  struct Case {
    std::function<void(OptimizerConfig&)> change;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {[](OptimizerConfig& o) { o.param_groups[0].match.clear(); },
       "optimizer.param_groups[0].match needs at least one"},
      {[](OptimizerConfig& o) { o.param_groups[0].match.push_back(""); },
       "optimizer.param_groups[0].match[1] is an empty pattern"},
      {[](OptimizerConfig& o) { o.param_groups[0].weight_decay = -0.1; },
       "optimizer.param_groups[0].weight_decay"},
      {[](OptimizerConfig& o) { o.param_groups[0].lr_scale = 0; },
       "optimizer.param_groups[0].lr_scale must be > 0"},
      {[](OptimizerConfig& o) {
         o.param_groups[0].lr_scale = std::numeric_limits<double>::infinity();
       },
       "optimizer.param_groups[0].lr_scale"},
      {[](OptimizerConfig& o) { o.schedule.warmup_steps = -1; },
       "optimizer.schedule.warmup_steps must be >= 0"},
      {[](OptimizerConfig& o) { o.schedule.warmup_steps = 11; },
       "optimizer.schedule.warmup_steps is 11, more than the 10 steps"},
      {[](OptimizerConfig& o) { o.schedule.min_lr = 0.5; }, "optimizer.schedule.min_lr must be in"},
      {[](OptimizerConfig& o) {
         o.schedule.decay = LrDecay::kConstant;
         o.schedule.min_lr = 1e-4;
       },
       "optimizer.schedule.min_lr needs decay cosine or linear"},
      {[](OptimizerConfig& o) { o.total_steps = 0; }, "optimizer.total_steps must be set"},
  };
  for (const Case& c : cases) {
    OptimizerConfig o = Scheduled(1e-3, 2, LrDecay::kCosine, 1e-5, 10);
    o.param_groups = {ParamGroup{{"*.bias"}, 0.0, 1.0}};
    SHARD_ASSERT_OK(ValidateOptimizerConfig(o));
    c.change(o);
    const absl::Status status = ValidateOptimizerConfig(o);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << c.expected;
    EXPECT_TRUE(absl::StrContains(status.message(), c.expected))
        << "expected '" << c.expected << "' in " << status;
  }
}

// ---------------------------------------------------------------------------------------------
// Training.

const std::vector<int64_t> kWidths = {10, 24, 16, 5};
constexpr int64_t kGlobalBatch = 32;
constexpr uint64_t kSeed = 13;

using Tensors = std::map<std::string, std::vector<float>>;

std::string Root(const std::string& name) {
  return FreshTestDirectory("shard-param-groups-test", name);
}

const std::string& DataFile() {
  static const std::string path = [] {
    const std::string p = Root("data") + "/data.safetensors";
    EXPECT_TRUE(GenerateMlpData(kWidths, 256, 3, p).ok());
    return p;
  }();
  return path;
}

// Biases without decay; layers.1's weight (its bias went to the first group) with its own decay
// at half the learning rate; layers.0's and layers.2's weights with the optimizer's settings.
// Warm-up over 3 updates, then cosine decay to lr / 10 at the last step.
JobConfig Job(const std::string& root, OptimizerKind kind, int world, int stage, ShardMode mode,
              int64_t steps) {
  JobConfig job;
  job.name = "groups";
  job.world_size = world;
  job.min_world_size = 1;
  job.widths = kWidths;
  job.data_path = DataFile();
  job.seed = kSeed;
  OptimizerConfig& o = job.optimizer;
  o.kind = kind;
  o.lr = kind == OptimizerKind::kSgd ? 0.05 : 0.01;
  o.momentum = kind == OptimizerKind::kSgd ? 0.9 : 0;
  o.weight_decay = 0.1;
  o.param_groups = {ParamGroup{{"*.bias"}, 0.0, 1.0},
                    ParamGroup{{"layers.0.bias", "layers.1.*"}, 0.02, 0.5}};
  o.schedule.warmup_steps = 3;
  o.schedule.decay = LrDecay::kCosine;
  o.schedule.min_lr = o.lr / 10;
  o.total_steps = steps;
  job.global_batch = kGlobalBatch;
  job.steps = steps;
  job.zero_stage = stage;
  job.shard_mode = mode;
  // Small caps: several buckets, and in range mode shards that cut through parameters of
  // different groups.
  job.bucket_cap_bytes = 1024;
  job.first_bucket_cap_bytes = 256;
  job.output_dir = root + "/out";
  job.checkpoint_dir = root + "/checkpoints";
  std::filesystem::create_directories(job.output_dir);
  return job;
}

// The reference's own settings of a parameter, written out from the job: which group a name
// falls in, by hand, and the schedule's formula (docs/training.md) in the same double
// operations, so that the learning rates are the same doubles.
struct ReferenceSettings {
  double lr_scale = 1;
  double weight_decay = 0;
};

ReferenceSettings ReferenceSettingsOf(const JobConfig& job, const std::string& name) {
  const bool bias = absl::EndsWith(name, ".bias");
  if (bias) return {1.0, 0.0};
  if (absl::StartsWith(name, "layers.1.")) return {0.5, 0.02};
  return {1.0, job.optimizer.weight_decay};
}

double ReferenceLr(const JobConfig& job, double lr_scale, int64_t s) {
  const OptimizerConfig& o = job.optimizer;
  const int64_t w = o.schedule.warmup_steps;
  double factor;
  if (s <= w) {
    factor = static_cast<double>(s) / static_cast<double>(w);
  } else {
    const double p =
        std::min(1.0, static_cast<double>(s - w) / static_cast<double>(job.steps - w));
    const double m = o.schedule.min_lr / o.lr;
    factor = m + (1.0 - m) * (0.5 * (1.0 + std::cos(kPi * p)));
  }
  return (o.lr * lr_scale) * factor;
}

// One process: each rank's slice of the global batch through the same Mlp (as each rank computes
// it), the slices' gradients added in fp32, and torch's update rules written out element by
// element with each parameter's own learning rate and weight decay.
std::vector<std::vector<float>> ReferenceTraining(const JobConfig& job) {
  const Manifest manifest = MlpManifest(job.widths);
  std::vector<std::vector<float>> params = InitMlpParameters(job.widths, job.seed);
  std::vector<std::vector<float>> grads, part, m, v;
  for (const auto& p : params) {
    grads.emplace_back(p.size());
    part.emplace_back(p.size());
    m.emplace_back(p.size(), 0.0f);
    v.emplace_back(p.size(), 0.0f);
  }
  auto data = MlpBatchReader::Open(job.data_path, job.widths.front());
  EXPECT_TRUE(data.ok()) << data.status();
  Mlp model(job.widths);
  std::vector<float> x;
  std::vector<int64_t> y;
  const OptimizerConfig& o = job.optimizer;
  const int64_t rows = job.global_batch / job.world_size;
  for (int64_t step = 1; step <= job.steps; ++step) {
    for (int rank = 0; rank < job.world_size; ++rank) {
      EXPECT_TRUE((*data)->Read(step - 1, job.global_batch, rank, job.world_size, &x, &y).ok());
      std::vector<const float*> views;
      std::vector<float*> grad_views;
      for (size_t i = 0; i < params.size(); ++i) {
        views.push_back(params[i].data());
        grad_views.push_back(part[i].data());
      }
      EXPECT_TRUE(model.Forward(views, x.data(), y.data(), rows).ok());
      EXPECT_TRUE(
          model.Backward(views, grad_views, 1.0f / static_cast<float>(job.global_batch), [](int) {})
              .ok());
      for (size_t i = 0; i < params.size(); ++i) {
        for (size_t k = 0; k < params[i].size(); ++k) {
          grads[i][k] = rank == 0 ? part[i][k] : grads[i][k] + part[i][k];
        }
      }
    }
    const double bc1 = 1 - std::pow(o.beta1, static_cast<double>(step));
    const double bc2 = 1 - std::pow(o.beta2, static_cast<double>(step));
    for (size_t i = 0; i < params.size(); ++i) {
      const ReferenceSettings settings = ReferenceSettingsOf(job, manifest.params[i].name);
      const double lr = ReferenceLr(job, settings.lr_scale, step);
      const double wd = settings.weight_decay;
      for (size_t k = 0; k < params[i].size(); ++k) {
        float& p = params[i][k];
        float g = grads[i][k];
        if (o.kind == OptimizerKind::kSgd) {
          if (wd != 0) g = g + static_cast<float>(wd) * p;
          m[i][k] = step == 1 ? g : m[i][k] * static_cast<float>(o.momentum) + g;
          p = p - static_cast<float>(lr) * m[i][k];
          continue;
        }
        if (o.kind == OptimizerKind::kAdamW) {
          p = p * static_cast<float>(1 - lr * wd);
        } else if (wd != 0) {
          g = g + static_cast<float>(wd) * p;
        }
        m[i][k] = m[i][k] + static_cast<float>(1 - o.beta1) * (g - m[i][k]);
        v[i][k] = v[i][k] * static_cast<float>(o.beta2) + static_cast<float>(1 - o.beta2) * g * g;
        const float denom =
            std::sqrt(v[i][k]) / static_cast<float>(std::sqrt(bc2)) + static_cast<float>(o.eps);
        p = p + static_cast<float>(-(lr / bc1)) * m[i][k] / denom;
      }
    }
  }
  return params;
}

std::vector<std::vector<float>> FinalParameters(const JobConfig& job) {
  std::vector<std::vector<float>> params;
  auto file = SafetensorsReader::Open(job.output_dir + "/final.safetensors");
  EXPECT_TRUE(file.ok()) << file.status();
  if (!file.ok()) return params;
  for (const ParamSpec& spec : MlpManifest(job.widths).params) {
    auto tensor = (*file)->Expect(spec.name, DataType::kFloat32, spec.shape);
    EXPECT_TRUE(tensor.ok()) << tensor.status();
    std::vector<float> values(spec.numel());
    if (tensor.ok()) {
      SHARD_EXPECT_OK((*file)->ReadElements(**tensor, 0, spec.numel(), values.data()));
    }
    params.push_back(std::move(values));
  }
  return params;
}

// "" when every element holds the same bits, else where the first difference is.
std::string BitDifference(const std::vector<std::vector<float>>& a,
                          const std::vector<std::vector<float>>& b) {
  if (a.size() != b.size()) return "different parameter counts";
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].size() != b[i].size()) return absl::StrCat("parameter ", i, ": sizes differ");
    for (size_t k = 0; k < a[i].size(); ++k) {
      if (std::memcmp(&a[i][k], &b[i][k], sizeof(float)) != 0) {
        return absl::StrFormat("parameter %d element %d: %.9g vs %.9g", i, k, a[i][k], b[i][k]);
      }
    }
  }
  return "";
}

// Whether, in range mode, a rank's shard of some bucket starts inside a parameter in a bucket
// holding parameters of different groups: an owned span the engine must cut. (The plan without
// a gradient order is the rebuilt one here: the MLP's backward readies parameters in reverse
// registration order.)
bool SomeShardStartsInsideAMixedBucket(const JobConfig& job) {
  const Manifest manifest = MlpManifest(job.widths);
  const absl::StatusOr<Plan> plan = MakePlan(manifest, PlanOptionsForJob(job));
  const absl::StatusOr<std::vector<int>> groups = AssignParamGroups(job.optimizer, manifest);
  EXPECT_TRUE(plan.ok() && groups.ok());
  if (!plan.ok() || !groups.ok()) return false;
  for (const Bucket& bucket : plan->buckets) {
    bool mixed = false;
    for (const BucketEntry& entry : bucket.entries) {
      mixed |= (*groups)[entry.param] != (*groups)[bucket.entries.front().param];
    }
    const int64_t shard = ShardNumel(bucket, job.world_size);
    for (int rank = 1; rank < job.world_size && mixed; ++rank) {
      for (const BucketEntry& entry : bucket.entries) {
        if (entry.offset < rank * shard && rank * shard < entry.offset + entry.numel) return true;
      }
    }
  }
  return false;
}

struct Case {
  OptimizerKind optimizer;
  int world;
  int stage;
  ShardMode mode;
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << OptimizerKindName(c.optimizer) << " " << c.world << " ranks stage " << c.stage << " "
      << ShardModeName(c.mode);
}

class ParamGroupTrainingTest : public ::testing::TestWithParam<Case> {};

// Bit for bit, not within a tolerance: with 1 or 2 ranks each gradient element is one rank's
// sgemm result or the fp32 sum of two (commutative, so the ring's order does not matter), the
// reference computes the same, and the update is the same fp32 operations in the same order
// with the same double scalars rounded the same way. Any group or step mix-up shows as a
// different bit.
TEST_P(ParamGroupTrainingTest, MatchesThePerParameterReferenceBitForBit) {
  const Case c = GetParam();
  const JobConfig job = Job(Root(absl::StrCat(OptimizerKindName(c.optimizer), c.world, "-stage",
                                              c.stage, ShardModeName(c.mode))),
                            c.optimizer, c.world, c.stage, c.mode, 12);
  if (c.world > 1 && c.stage > 0 && c.mode == ShardMode::kRange) {
    ASSERT_TRUE(SomeShardStartsInsideAMixedBucket(job)) << "the case should cut owned spans";
  }
  ASSERT_NO_FATAL_FAILURE(TrainMlpOnThreads(job, ""));
  const std::vector<std::vector<float>> trained = FinalParameters(job);
  const std::vector<std::vector<float>> reference = ReferenceTraining(job);
  EXPECT_EQ(BitDifference(trained, reference), "");

  // Not trivially equal: the groups and the schedule matter. The same training without them
  // ends elsewhere.
  JobConfig plain = job;
  plain.optimizer.param_groups.clear();
  plain.optimizer.schedule = LrSchedule{};
  EXPECT_NE(BitDifference(ReferenceTraining(plain), reference), "");
}

INSTANTIATE_TEST_SUITE_P(
    Stages, ParamGroupTrainingTest,
    ::testing::Values(Case{OptimizerKind::kAdamW, 1, 0, ShardMode::kRange},
                      Case{OptimizerKind::kAdamW, 2, 2, ShardMode::kRange},
                      Case{OptimizerKind::kAdamW, 2, 1, ShardMode::kParam},
                      Case{OptimizerKind::kAdam, 2, 0, ShardMode::kRange},
                      Case{OptimizerKind::kSgd, 2, 2, ShardMode::kRange},
                      Case{OptimizerKind::kSgd, 1, 1, ShardMode::kParam}),
    [](const ::testing::TestParamInfo<Case>& info) {
      return absl::StrCat(OptimizerKindName(info.param.optimizer), "_", info.param.world,
                          "ranks_stage", info.param.stage, "_", ShardModeName(info.param.mode));
    });

TEST(ParamGroupTrainingTest, GroupsWithTheOptimizersOwnSettingsChangeNoBit) {
  // Spans cut at every group boundary, each updated with the settings it had anyway: exactly
  // the run without groups.
  JobConfig plain = Job(Root("plain"), OptimizerKind::kAdamW, 2, 2, ShardMode::kRange, 6);
  plain.optimizer.param_groups.clear();
  JobConfig same = Job(Root("same"), OptimizerKind::kAdamW, 2, 2, ShardMode::kRange, 6);
  same.optimizer.param_groups = {ParamGroup{{"*.bias"}, std::nullopt, 1.0},
                                 ParamGroup{{"layers.1.*"}, plain.optimizer.weight_decay, 1.0}};
  ASSERT_NO_FATAL_FAILURE(TrainMlpOnThreads(plain, ""));
  ASSERT_NO_FATAL_FAILURE(TrainMlpOnThreads(same, ""));
  EXPECT_EQ(BitDifference(FinalParameters(same), FinalParameters(plain)), "");
}

TEST(ParamGroupTrainingTest, ARestoredRunContinuesTheScheduleExactly) {
  // 12 steps straight, saving after step 5 (the third update after the warm-up), against 5
  // steps restored from that checkpoint and trained on to 12: the schedule is a function of the
  // optimizer's step count, which the checkpoint keeps.
  constexpr int64_t kSteps = 12;
  constexpr int64_t kSaved = 5;
  JobConfig straight =
      Job(Root("straight"), OptimizerKind::kAdamW, 2, 2, ShardMode::kRange, kSteps);
  straight.checkpoint_every = kSaved;
  ASSERT_NO_FATAL_FAILURE(TrainMlpOnThreads(straight, ""));
  const std::string saved =
      CheckpointDirectory(straight.checkpoint_dir, straight.name, CheckpointIdForStep(kSaved));
  SHARD_ASSERT_OK_AND_ASSIGN(const CheckpointManifest manifest, ReadCheckpointManifest(saved));
  ASSERT_EQ(manifest.step, kSaved);

  JobConfig restored =
      Job(Root("restored"), OptimizerKind::kAdamW, 2, 2, ShardMode::kRange, kSteps);
  ASSERT_NO_FATAL_FAILURE(TrainMlpOnThreads(restored, saved));
  const std::vector<std::vector<float>> expected = FinalParameters(straight);
  EXPECT_EQ(BitDifference(FinalParameters(restored), expected), "");
  EXPECT_EQ(BitDifference(expected, ReferenceTraining(straight)), "");
}

TEST(ParamGroupEngineTest, CreateRefusesAGroupThatMatchesNoParameterNamingThePattern) {
  Manifest manifest;
  manifest.params = {ParamSpec{"encoder.weight", {4, 4}, DataType::kFloat32, true},
                     ParamSpec{"encoder.bias", {4}, DataType::kFloat32, true}};
  InProcessKeyValueStore store;
  GlooOptions gloo;
  gloo.rank = 0;
  gloo.size = 1;
  gloo.timeout = absl::Seconds(30);
  SHARD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<GlooCommunicator> communicator,
                             CreateGlooCommunicator(&store, gloo));
  PlanOptions planning;
  LocalPlanProvider plans(planning);
  EngineOptions options;
  options.optimizer.kind = OptimizerKind::kAdamW;
  options.optimizer.param_groups = {ParamGroup{{"*.bias", "*.ln_*"}, 0.0, 1.0},
                                    ParamGroup{{"*norm*"}, 0.0, 1.0}};
  const absl::Status status =
      Engine::Create(manifest, communicator.get(), &plans, options).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_TRUE(absl::StrContains(status.message(), "param_groups[1] (match [\"*norm*\"])"))
      << status;
  EXPECT_TRUE(absl::StrContains(status.message(), "encoder.weight")) << status;

  // Without the stray group it trains; a decay without total_steps does not.
  options.optimizer.param_groups.pop_back();
  SHARD_EXPECT_OK(Engine::Create(manifest, communicator.get(), &plans, options).status());
  options.optimizer.schedule.decay = LrDecay::kCosine;
  EXPECT_EQ(Engine::Create(manifest, communicator.get(), &plans, options).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace shard
