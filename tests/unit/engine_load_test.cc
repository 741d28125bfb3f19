// Loading state into the engine (Engine::LoadState; Engine::Restore reads the same way) at ZeRO
// stages 1 and 2 on host memory, the parameters all-gathered after the reads or, bucket by bucket,
// on a second thread during them (EngineOptions::gather_during_reads). Every rank must end with
// every parameter, in both sharding modes, and a rank whose read fails must return that failure,
// at whatever read it fails, and leave no gathering thread behind.
#include <memory>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/shard_hasher.h"
#include "gtest/gtest.h"
#include "tests/support/status_assertions.h"
#include "worker/dataplane/engine.h"
#include "worker/dataplane/gloo_communicator.h"
#include "worker/dataplane/key_value_store.h"
#include "worker/dataplane/plan_provider.h"

namespace shard {
namespace {

// Sizes that make buckets of one entry, of several, and an entry larger than the cap.
Manifest Model() {
  Manifest model;
  const std::vector<std::vector<int64_t>> shapes = {{7, 13}, {300}, {5}, {40, 9}, {64}, {3, 3}};
  for (size_t p = 0; p < shapes.size(); ++p) {
    model.params.push_back(
        ParamSpec{absl::StrCat("p", p), shapes[p], DataType::kFloat32, true});
  }
  return model;
}

float Value(int param, int array, int64_t element) {
  return static_cast<float>(param * 1000 + element) + 0.125f * static_cast<float>(array + 2);
}

// Every element's value from Value(). With `fail_at` >= 0, that call (counting from 0) fails;
// `calls` (may be null) counts the calls.
class FormulaSource : public StateSource {
 public:
  explicit FormulaSource(int fail_at, int* calls = nullptr) : fail_at_(fail_at), calls_(calls) {}
  absl::Status ReadElements(int param, int array, int64_t begin, int64_t count,
                            float* out) override {
    if (calls_ != nullptr) ++*calls_;
    if (call_++ == fail_at_) {
      return absl::DataLossError(absl::StrCat("read ", fail_at_, " failed on purpose"));
    }
    for (int64_t i = 0; i < count; ++i) out[i] = Value(param, array, begin + i);
    return absl::OkStatus();
  }

 private:
  const int fail_at_;
  int* const calls_;
  int call_ = 0;
};

struct Rank {
  std::unique_ptr<GlooCommunicator> communicator;
  std::unique_ptr<LocalPlanProvider> plans;
  std::unique_ptr<Engine> engine;
};

// `world` ranks' engines, connected in parallel (Gloo's rendezvous needs every rank).
std::vector<Rank> MakeRanks(InProcessKeyValueStore* store, int world, ShardMode mode, int stage,
                            bool gather_during_reads, const Manifest& model = Model(),
                            bool overlap = false) {
  std::vector<Rank> ranks(world);
  std::vector<absl::Status> created(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      created[r] = [&]() -> absl::Status {
        GlooOptions gloo;
        gloo.rank = r;
        gloo.size = world;
        gloo.timeout = absl::Seconds(30);
        SHARD_ASSIGN_OR_RETURN(ranks[r].communicator, CreateGlooCommunicator(store, gloo));
        PlanOptions plan;
        plan.world_size = world;
        plan.mode = mode;
        plan.bucket_cap_bytes = 512;
        plan.first_bucket_cap_bytes = 128;
        for (int p = static_cast<int>(model.params.size()) - 1; p >= 0; --p) {
          // Rebuilt: the state loads at once.
          if (model.params[p].requires_grad) plan.gradient_order.push_back(p);
        }
        ranks[r].plans = std::make_unique<LocalPlanProvider>(plan);
        EngineOptions options;
        options.zero_stage = stage;
        options.optimizer.kind = OptimizerKind::kAdam;
        options.gather_during_reads = gather_during_reads;
        options.overlap = overlap;
        SHARD_ASSIGN_OR_RETURN(ranks[r].engine,
                               Engine::Create(model, ranks[r].communicator.get(),
                                              ranks[r].plans.get(), options));
        return absl::OkStatus();
      }();
    });
  }
  for (std::thread& t : threads) t.join();
  for (const absl::Status& status : created) SHARD_EXPECT_OK(status);
  return ranks;
}

absl::Status Load(Engine& engine, int fail_at) {
  return engine.LoadState(std::make_unique<FormulaSource>(fail_at), /*with_state=*/true, 3,
                          TrainingCounters{.optimizer_step = 3});
}

struct LoadSetup {
  int world;
  ShardMode mode;
  int stage;
  bool gather_during_reads;
};

class EngineLoadTest : public ::testing::TestWithParam<LoadSetup> {};

TEST_P(EngineLoadTest, EveryRankEndsWithEveryParameter) {
  const LoadSetup setup = GetParam();
  InProcessKeyValueStore store;
  std::vector<Rank> ranks =
      MakeRanks(&store, setup.world, setup.mode, setup.stage, setup.gather_during_reads);
  ASSERT_EQ(ranks.size(), static_cast<size_t>(setup.world));
  ASSERT_GT(ranks[0].engine->plan().buckets.size(), 3u);  // several buckets to gather
  std::vector<absl::Status> loaded(setup.world);
  std::vector<std::thread> threads;
  for (int r = 0; r < setup.world; ++r) {
    threads.emplace_back([&, r] { loaded[r] = Load(*ranks[r].engine, -1); });
  }
  for (std::thread& t : threads) t.join();
  const Manifest model = Model();
  for (int r = 0; r < setup.world; ++r) {
    ASSERT_TRUE(loaded[r].ok()) << "rank " << r << ": " << loaded[r];
    for (size_t p = 0; p < model.params.size(); ++p) {
      SHARD_ASSERT_OK_AND_ASSIGN(std::vector<float> values,
                                 ranks[r].engine->ParamValues(static_cast<int>(p)));
      ASSERT_EQ(static_cast<int64_t>(values.size()), model.params[p].numel());
      for (size_t i = 0; i < values.size(); ++i) {
        ASSERT_EQ(values[i], Value(static_cast<int>(p), -1, static_cast<int64_t>(i)))
            << "rank " << r << ", parameter " << p << ", element " << i;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    WorldsModesStages, EngineLoadTest,
    ::testing::Values(LoadSetup{2, ShardMode::kRange, 1, true},
                      LoadSetup{2, ShardMode::kRange, 2, true},
                      LoadSetup{3, ShardMode::kRange, 2, true},
                      LoadSetup{2, ShardMode::kParam, 1, true},
                      LoadSetup{3, ShardMode::kParam, 2, true},
                      LoadSetup{3, ShardMode::kRange, 2, false},
                      LoadSetup{3, ShardMode::kParam, 1, false}),
    [](const ::testing::TestParamInfo<LoadSetup>& info) {
      return absl::StrCat("World", info.param.world,
                          info.param.mode == ShardMode::kRange ? "Range" : "Param", "Stage",
                          info.param.stage,
                          info.param.gather_during_reads ? "DuringReads" : "AfterReads");
    });

// Rank 1's read fails at its n-th read, for n from the first to its last: it must return that
// failure (during the reads, its gatherer stops at the first bucket it did not read), while rank
// 0, which read everything, either finishes (the failure came after rank 1's last parameter) or
// waits in a gather until its communicator is aborted, as a worker's is when the generation ends.
class EngineLoadFailureTest : public ::testing::TestWithParam<bool> {};

TEST_P(EngineLoadFailureTest, ARankWhoseReadFailsReturnsThatFailureAtEveryPoint) {
  const bool during = GetParam();
  int rank1_reads = 0;
  {
    InProcessKeyValueStore store;
    std::vector<Rank> ranks = MakeRanks(&store, 2, ShardMode::kRange, 2, during);
    ASSERT_EQ(ranks.size(), 2u);
    // Rank 1's reads, counted on a load that succeeds.
    std::thread rank0([&] { SHARD_EXPECT_OK(Load(*ranks[0].engine, -1)); });
    SHARD_EXPECT_OK(ranks[1].engine->LoadState(std::make_unique<FormulaSource>(-1, &rank1_reads),
                                               true, 3, TrainingCounters{.optimizer_step = 3}));
    rank0.join();
  }
  ASSERT_GT(rank1_reads, 6);
  for (int fail_at = 0; fail_at < rank1_reads; ++fail_at) {
    SCOPED_TRACE(absl::StrCat("rank 1 fails at read ", fail_at, " of ", rank1_reads));
    InProcessKeyValueStore store;
    std::vector<Rank> ranks = MakeRanks(&store, 2, ShardMode::kRange, 2, during);
    ASSERT_EQ(ranks.size(), 2u);
    absl::Status rank0_loaded;
    std::thread rank0([&] { rank0_loaded = Load(*ranks[0].engine, -1); });
    const absl::Status rank1_loaded = Load(*ranks[1].engine, fail_at);
    EXPECT_EQ(rank1_loaded.code(), absl::StatusCode::kDataLoss) << rank1_loaded;
    EXPECT_NE(rank1_loaded.message().find("failed on purpose"), std::string::npos)
        << rank1_loaded;
    ranks[0].communicator->Abort("rank 1's load failed");
    rank0.join();
    // Rank 0 read all it owns; it ends either loaded or told why its gather stopped.
    if (!rank0_loaded.ok()) {
      EXPECT_NE(rank0_loaded.message().find("rank 1's load failed"), std::string::npos)
          << rank0_loaded;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(GatherDuringOrAfterReads, EngineLoadFailureTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "DuringReads" : "AfterReads";
                         });

// A periodic snapshot's copy on the communication thread hands every byte it copies to the
// snapshot's hasher as it goes, piece by piece (Engine::CopyOwnedStateInBackground): the bytes
// must be those a copy at the boundary gives, and the checksums those of the bytes, across the
// copy's 64 KiB pieces, the checksum blocks and a frozen parameter's zero state (rank 0's).
TEST(EngineStateCopyTest, ACopyInTheBackgroundChecksumsExactlyWhatItCopies) {
  Manifest model = Model();
  // Each rank's state over a checksum block (4 MiB), and ranges of many pieces.
  model.params.push_back(ParamSpec{"large", {1000, 800}, DataType::kFloat32, true});
  model.params.push_back(ParamSpec{"frozen", {70}, DataType::kFloat32, false});
  InProcessKeyValueStore store;
  std::vector<Rank> ranks = MakeRanks(&store, 2, ShardMode::kRange, 2, /*gather_during_reads=*/true,
                                      model, /*overlap=*/true);
  ASSERT_EQ(ranks.size(), 2u);
  std::vector<absl::Status> loaded(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] { loaded[r] = Load(*ranks[r].engine, -1); });
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE(absl::StrCat("rank ", r));
    SHARD_ASSERT_OK(loaded[r]);
    Engine& engine = *ranks[r].engine;
    ASSERT_TRUE(engine.CopiesStateInBackground());
    ASSERT_GT(engine.OwnedStateBytes(), kCheckpointBlockBytes);
    std::vector<char> at_boundary;
    SHARD_ASSERT_OK(engine.CopyOwnedState(&at_boundary));
    auto copied = std::make_shared<std::vector<char>>(at_boundary.size(), '\x5a');
    auto hasher = std::make_shared<ShardHasher>(ShardHasher::Sums::kBlocksOnly);
    SHARD_ASSERT_OK_AND_ASSIGN(
        const CommunicationQueue::Ticket ticket,
        engine.CopyOwnedStateInBackground(absl::MakeSpan(*copied), copied, hasher));
    SHARD_ASSERT_OK(engine.WaitCollective(ticket));
    EXPECT_TRUE(*copied == at_boundary);
    ASSERT_EQ(hasher->bytes(), at_boundary.size());
    const ShardRecord as_copied = hasher->Finish("shard", r);
    const ShardRecord afterwards = HashShard(at_boundary.data(), at_boundary.size(), "shard", r);
    EXPECT_GT(as_copied.block_xxh3.size(), 1u);
    EXPECT_EQ(as_copied.block_xxh3, afterwards.block_xxh3);
  }
}

}  // namespace
}  // namespace shard
