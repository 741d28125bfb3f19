// An update rule outside the engine (a training script's own optimizer: kind kTorch), run
// between Engine::ReduceGradients and Engine::EndStep on the ranges Engine::UpdatedRanges names,
// must train exactly as the engine's built-in rule does when it is the same rule, at every stage
// and in both shard modes; what it keeps in the engine's state arrays must come back whole on
// one rank (GatherToRank), and a parameter's extras must reach that rank from the one that saves
// them (ExtrasHolder, SendBytes).
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/support/status_assertions.h"
#include "worker/dataplane/engine.h"
#include "worker/dataplane/gloo_communicator.h"
#include "worker/dataplane/key_value_store.h"
#include "worker/dataplane/optimizer.h"
#include "worker/dataplane/plan_provider.h"

namespace shard {
namespace {

constexpr int kSteps = 4;

// Buckets of one entry, of several, and an entry larger than the cap; a frozen parameter.
Manifest Model() {
  Manifest model;
  const std::vector<std::vector<int64_t>> shapes = {{7, 13}, {300}, {5}, {40, 9}, {64}};
  for (size_t p = 0; p < shapes.size(); ++p) {
    model.params.push_back(ParamSpec{absl::StrCat("p", p), shapes[p], DataType::kFloat32, true});
  }
  model.params.push_back(ParamSpec{"frozen", {6}, DataType::kFloat32, false});
  return model;
}

OptimizerConfig Adam() {
  OptimizerConfig adam;
  adam.kind = OptimizerKind::kAdamW;
  adam.lr = 0.01;
  adam.weight_decay = 0.1;
  return adam;
}

// The script's own optimizer as the engine knows it: state names and nothing else.
OptimizerConfig External() {
  OptimizerConfig torch;
  torch.kind = OptimizerKind::kTorch;
  torch.torch_class = "test.AdamW";
  torch.torch_state = {"exp_avg", "exp_avg_sq"};
  return torch;
}

// Rank `rank`'s gradient of element i of parameter p at step s: different on every rank.
float Gradient(int rank, int step, int param, int64_t i) {
  return 0.001f * static_cast<float>((param * 131 + i * 7 + step * 17 + rank * 29) % 97 - 48);
}

struct Case {
  ShardMode mode;
  int stage;
  int world;
};

struct Trained {
  std::vector<std::vector<float>> params;  // by parameter, rank 0's
  std::vector<std::vector<std::vector<float>>> states;  // [param][state] gathered on rank 0
  std::vector<std::string> extras;  // [param] what rank 0 received from each holder
};

// Trains Model() for kSteps on `c.world` ranks: with the engine's AdamW, or (`external`) with
// the same rule applied by the test to each updated range between ReduceGradients and EndStep.
// Then gathers every parameter's state on rank 0 and sends each parameter's "extras" there.
Trained Train(const Case& c, bool external) {
  InProcessKeyValueStore store;
  Trained trained;
  std::vector<absl::Status> results(c.world);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < c.world; ++rank) {
    threads.emplace_back([&, rank] {
      results[rank] = [&]() -> absl::Status {
        GlooOptions gloo;
        gloo.rank = rank;
        gloo.size = c.world;
        gloo.timeout = absl::Seconds(30);
        SHARD_ASSIGN_OR_RETURN(std::unique_ptr<GlooCommunicator> communicator,
                               CreateGlooCommunicator(&store, gloo));
        PlanOptions plan;
        plan.world_size = c.world;
        plan.mode = c.mode;
        plan.bucket_cap_bytes = 512;
        plan.first_bucket_cap_bytes = 128;
        LocalPlanProvider plans(plan);
        EngineOptions options;
        options.zero_stage = c.stage;
        options.optimizer = external ? External() : Adam();
        const Manifest model = Model();
        SHARD_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine,
                               Engine::Create(model, communicator.get(), &plans, options));
        for (size_t p = 0; p < model.params.size(); ++p) {
          std::vector<float> initial(model.params[p].numel());
          for (size_t i = 0; i < initial.size(); ++i) initial[i] = 0.01f * (p + 1) * (i % 11);
          SHARD_RETURN_IF_ERROR(engine->SetParamValues(static_cast<int>(p), initial.data()));
        }
        SHARD_RETURN_IF_ERROR(engine->BroadcastParameters());
        const OptimizerKernel adamw(Adam());
        for (int step = 0; step < kSteps; ++step) {
          SHARD_RETURN_IF_ERROR(engine->ZeroGradients());
          engine->StartBackward();
          for (int p = static_cast<int>(model.params.size()) - 1; p >= 0; --p) {
            float* grad = engine->grad(p);
            if (grad == nullptr) continue;
            for (int64_t i = 0; i < model.params[p].numel(); ++i) {
              grad[i] = Gradient(rank, step, p, i);
            }
            engine->MarkGradReady(p);
          }
          StepTimings timings;
          if (!external) {
            SHARD_RETURN_IF_ERROR(engine->Step(&timings));
            continue;
          }
          SHARD_ASSIGN_OR_RETURN(const bool update, engine->ReduceGradients(&timings));
          if (update) {
            for (const OwnedRange& range : engine->UpdatedRanges()) {
              float* state[2] = {engine->RangeData(range, 0), engine->RangeData(range, 1)};
              adamw.Update(step + 1, engine->RangeData(range, -1), engine->RangeGrad(range),
                           state, static_cast<size_t>(range.numel));
            }
          }
          SHARD_RETURN_IF_ERROR(engine->EndStep(update, &timings));
        }
        // Consolidation, one parameter at a time.
        std::vector<std::vector<float>> params(model.params.size());
        std::vector<std::vector<std::vector<float>>> states(model.params.size());
        std::vector<std::string> extras(model.params.size());
        for (size_t p = 0; p < model.params.size(); ++p) {
          const int param = static_cast<int>(p);
          const int64_t numel = model.params[p].numel();
          params[p].resize(numel);
          SHARD_RETURN_IF_ERROR(engine->GatherToRank(param, -1, 0, rank == 0 ? params[p].data()
                                                                             : nullptr));
          if (!model.params[p].requires_grad) continue;
          for (int k = 0; k < 2; ++k) {
            states[p].emplace_back(numel);
            SHARD_RETURN_IF_ERROR(engine->GatherToRank(
                param, k, 0, rank == 0 ? states[p].back().data() : nullptr));
          }
          const int holder = engine->ExtrasHolder(param);
          if (holder < 0 || holder >= c.world) {
            return absl::InternalError(absl::StrCat("no holder for ", model.params[p].name));
          }
          std::string bytes =
              rank == holder ? absl::StrCat("extras of ", param, " from rank ", rank) : "";
          SHARD_RETURN_IF_ERROR(engine->SendBytes(holder, 0, &bytes));
          extras[p] = bytes;
        }
        if (rank == 0) {
          trained.params = std::move(params);
          trained.states = std::move(states);
          trained.extras = std::move(extras);
        }
        return absl::OkStatus();
      }();
    });
  }
  for (std::thread& t : threads) t.join();
  for (const absl::Status& result : results) EXPECT_TRUE(result.ok()) << result;
  return trained;
}

class ExternalOptimizerTest : public ::testing::TestWithParam<Case> {};

TEST_P(ExternalOptimizerTest, TheSameRuleOnTheUpdatedRangesTrainsBitForBitLikeTheEngine) {
  const Trained builtin = Train(GetParam(), /*external=*/false);
  const Trained external = Train(GetParam(), /*external=*/true);
  ASSERT_EQ(builtin.params.size(), Model().params.size());
  ASSERT_EQ(external.params.size(), Model().params.size());
  for (size_t p = 0; p < builtin.params.size(); ++p) {
    EXPECT_EQ(external.params[p], builtin.params[p]) << Model().params[p].name;
    EXPECT_EQ(external.states[p], builtin.states[p]) << Model().params[p].name;
    // Training moved it, and the gathered state is not zeros: there was something to compare.
    if (Model().params[p].requires_grad) {
      EXPECT_NE(external.states[p][0], std::vector<float>(Model().params[p].numel(), 0.0f));
    }
  }
}

TEST_P(ExternalOptimizerTest, EachParametersExtrasReachRankZeroFromTheRankThatSavesThem) {
  const Trained trained = Train(GetParam(), /*external=*/true);
  ASSERT_EQ(trained.extras.size(), Model().params.size());
  for (size_t p = 0; p < trained.extras.size(); ++p) {
    if (!Model().params[p].requires_grad) continue;
    EXPECT_TRUE(absl::StartsWith(trained.extras[p], absl::StrCat("extras of ", p, " from rank ")))
        << trained.extras[p];
  }
}

INSTANTIATE_TEST_SUITE_P(
    StagesAndModes, ExternalOptimizerTest,
    ::testing::Values(Case{ShardMode::kRange, 2, 3}, Case{ShardMode::kParam, 2, 3},
                      Case{ShardMode::kRange, 1, 2}, Case{ShardMode::kParam, 0, 2},
                      Case{ShardMode::kRange, 2, 1}),
    [](const ::testing::TestParamInfo<Case>& info) {
      return absl::StrCat(info.param.mode == ShardMode::kRange ? "Range" : "Param", "Stage",
                          info.param.stage, "World", info.param.world);
    });

TEST(ExternalOptimizerTest, TheEngineRefusesToRunAnUpdateItHasNoRuleFor) {
  InProcessKeyValueStore store;
  GlooOptions gloo;
  auto communicator = CreateGlooCommunicator(&store, gloo);
  SHARD_ASSERT_OK(communicator.status());
  LocalPlanProvider plans(PlanOptions{});
  EngineOptions options;
  options.optimizer = External();
  SHARD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Engine> engine,
                             Engine::Create(Model(), communicator->get(), &plans, options));
  EXPECT_EQ(engine->optimizer_state_names(), External().torch_state);
  for (int p = 0; p < 5; ++p) engine->MarkGradReady(p);
  StepTimings timings;
  const absl::Status stepped = engine->Step(&timings);
  EXPECT_EQ(stepped.code(), absl::StatusCode::kFailedPrecondition) << stepped;
  EXPECT_NE(stepped.message().find("training script's own optimizer"), std::string::npos)
      << stepped;
}

}  // namespace
}  // namespace shard
