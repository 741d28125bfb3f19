// The pure parts of in-memory snapshots (common/snapshot.h) and of the step boundary that takes
// them (common/step_boundary.h): who keeps whose replicas, which snapshot is newer, the manifest a
// snapshot is read by (the same as a checkpoint's of the same plan), the peers' description of a
// shard, and when ranks snapshot, save and pause.
#include "common/snapshot.h"

#include <algorithm>
#include <map>
#include <set>

#include "absl/strings/str_cat.h"
#include "common/step_boundary.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/status_assertions.h"

namespace shard {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(SnapshotBuddiesTest, OnOneHostTheyAreTheRingSuccessorsAndEveryRankKeepsAsManyAsItSends) {
  const std::vector<std::string> hosts(4, "10.0.0.1");
  EXPECT_THAT(SnapshotBuddies(hosts, 0, 1), ElementsAre(1));
  EXPECT_THAT(SnapshotBuddies(hosts, 3, 1), ElementsAre(0));
  EXPECT_THAT(SnapshotBuddies(hosts, 2, 2), ElementsAre(3, 0));
  EXPECT_THAT(SnapshotSources(hosts, 0, 2), ElementsAre(3, 2));
  // Never more replicas than other ranks, and none for a world of one.
  EXPECT_THAT(SnapshotBuddies(hosts, 1, 7), ElementsAre(2, 3, 0));
  EXPECT_TRUE(SnapshotBuddies({"a"}, 0, 1).empty());
  EXPECT_TRUE(SnapshotBuddies(hosts, 1, 0).empty());
}

TEST(SnapshotBuddiesTest, WithSeveralHostsAReplicaIsOnAnotherHost) {
  // Ranks 0, 1 on host a; 2, 3 on host b; 4, 5 on host c.
  const std::vector<std::string> hosts = {"a", "a", "b", "b", "c", "c"};
  std::map<int, int> kept;  // rank -> replicas it keeps
  for (int rank = 0; rank < 6; ++rank) {
    const std::vector<int> buddies = SnapshotBuddies(hosts, rank, 2);
    ASSERT_EQ(buddies.size(), 2u);
    for (int buddy : buddies) {
      EXPECT_NE(hosts[buddy], hosts[rank]) << "rank " << rank << " -> " << buddy;
      ++kept[buddy];
      const std::vector<int> sources = SnapshotSources(hosts, buddy, 2);
      EXPECT_NE(std::find(sources.begin(), sources.end(), rank), sources.end())
          << "sources are the inverse of buddies";
    }
  }
  for (int rank = 0; rank < 6; ++rank) EXPECT_EQ(kept[rank], 2) << "rank " << rank;
}

TEST(SnapshotTest, ALaterGenerationIsNewerWhateverItsStep) {
  EXPECT_TRUE(NewerSnapshot(5, 10, 4, 900));  // a restore to step 0 began a new timeline
  EXPECT_TRUE(NewerSnapshot(5, 20, 5, 10));
  EXPECT_FALSE(NewerSnapshot(5, 10, 5, 10));
  EXPECT_EQ(SnapshotId(40, 3), "step-00000040-g3");
}

Manifest Model() {
  Manifest model;
  model.params.push_back({"layers.0.weight", {64, 32}, DataType::kFloat32, true});
  model.params.push_back({"layers.0.bias", {64}, DataType::kFloat32, true});
  model.params.push_back({"layers.1.weight", {10, 64}, DataType::kFloat32, true});
  return model;
}

// The shards rank by rank of a snapshot of Model() on `world` ranks, as the ranks report them.
std::vector<SnapshotShard> Shards(int world) {
  PlanOptions options;
  options.world_size = world;
  options.bucket_cap_bytes = 4096;
  options.first_bucket_cap_bytes = 1024;
  options.gradient_order = {2, 1, 0};
  const Plan plan = *MakePlan(Model(), options);
  std::vector<SnapshotShard> shards;
  for (int rank = 0; rank < world; ++rank) {
    SnapshotShard shard;
    shard.id = SnapshotId(40, 3);
    shard.generation = 3;
    shard.step = 40;
    shard.rank = rank;
    shard.plan = plan.options;
    shard.plan_hash = plan.hash;
    shard.counters = TrainingCounters{40, 0, 0};
    const uint64_t bytes = MakeShardLayout(Model(), plan, rank, 2).bytes;
    shard.record = ShardRecord{ShardFileName(rank, world), rank, bytes,
                               absl::StrCat("000000000000000", rank), {"0000000000000001"}, {}};
    shard.state = StateKindOf(OptimizerConfig{});  // Adam's exp_avg, exp_avg_sq
    shards.push_back(shard);
  }
  return shards;
}

TEST(SnapshotTest, ASnapshotIsReadByTheManifestACheckpointOfItsPlanWouldHave) {
  OptimizerConfig adam;
  const std::vector<SnapshotShard> shards = Shards(3);
  absl::StatusOr<CheckpointManifest> manifest = SnapshotManifest("job", 2, Model(), adam, shards);
  ASSERT_TRUE(manifest.ok()) << manifest.status();
  std::vector<ShardRecord> records;
  for (const SnapshotShard& shard : shards) records.push_back(shard.record);
  const CheckpointManifest checkpoint =
      *MakeCheckpointManifest("job", shards[0].id, 40, 2, Model(), *MakePlan(Model(), shards[0].plan),
                              adam, {"exp_avg", "exp_avg_sq"}, records);
  EXPECT_EQ(manifest->id, "step-00000040-g3");
  EXPECT_EQ(manifest->step, 40);
  EXPECT_EQ(manifest->plan_hash, checkpoint.plan_hash);
  ASSERT_EQ(manifest->tensors.size(), checkpoint.tensors.size());
  for (size_t t = 0; t < checkpoint.tensors.size(); ++t) {
    ASSERT_EQ(manifest->tensors[t].pieces.size(), checkpoint.tensors[t].pieces.size());
    for (size_t p = 0; p < checkpoint.tensors[t].pieces.size(); ++p) {
      EXPECT_EQ(manifest->tensors[t].pieces[p].offset, checkpoint.tensors[t].pieces[p].offset);
      EXPECT_EQ(manifest->tensors[t].pieces[p].shard, checkpoint.tensors[t].pieces[p].shard);
    }
  }
  EXPECT_EQ(manifest->counters, (TrainingCounters{40, 0, 0}));
  // It reads back through the checkpoint manifest's own parser.
  EXPECT_TRUE(CheckpointManifestFromJson(CheckpointManifestToJson(*manifest), "snapshot").ok());
}

TEST(SnapshotTest, ShardsOfDifferentSnapshotsOrPlansMakeNoManifest) {
  OptimizerConfig adam;
  std::vector<SnapshotShard> shards = Shards(2);
  shards[1].step = 50;
  shards[1].id = SnapshotId(50, 3);
  EXPECT_THAT(SnapshotManifest("job", 2, Model(), adam, shards).status().message(),
              HasSubstr("not of the same snapshot"));
  shards = Shards(2);
  shards[0].plan_hash = shards[1].plan_hash = "ffffffffffffffff";
  EXPECT_THAT(SnapshotManifest("job", 2, Model(), adam, shards).status().message(),
              HasSubstr("its plan options make plan"));
  shards = Shards(2);
  shards.pop_back();
  EXPECT_FALSE(SnapshotManifest("job", 2, Model(), adam, shards).ok());
  shards = Shards(2);
  std::swap(shards[0], shards[1]);
  EXPECT_FALSE(SnapshotManifest("job", 2, Model(), adam, shards).ok()) << "by rank";
}

TEST(SnapshotTest, ThePeersDescriptionRoundTripsAndRefusesWhatIsMalformed) {
  SnapshotShard shard = Shards(3)[2];
  shard.request = 9;
  shard.counters.loss_scale = 1024;
  shard.counters.loss_scale_growth_tracker = 12;
  shard.plan.min_buckets = 3;
  absl::StatusOr<SnapshotShard> back = SnapshotShardFromJson(SnapshotShardToJson(shard));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, shard);

  EXPECT_FALSE(SnapshotShardFromJson("").ok());
  EXPECT_FALSE(SnapshotShardFromJson("[]").ok());
  EXPECT_FALSE(SnapshotShardFromJson(R"({"id": 3})").ok());
  std::string json = SnapshotShardToJson(shard);
  const auto mutate = [&](const std::string& from, const std::string& to) {
    std::string text = json;
    const size_t at = text.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    return SnapshotShardFromJson(text.replace(at, from.size(), to)).status();
  };
  EXPECT_THAT(mutate(R"("step":40)", R"("step":-40)").message(), HasSubstr("out of range"));
  EXPECT_THAT(mutate(R"("step":40)", R"("step":41)").message(), HasSubstr("is not that of step"));
  EXPECT_THAT(mutate(R"("rank":2)", R"("rank":3)").message(), HasSubstr("in a world of 3"));
  EXPECT_THAT(mutate(R"("block_xxh3":["0000000000000001"])", R"("block_xxh3":[])").message(),
              HasSubstr("block checksums"));
  EXPECT_THAT(mutate(R"("file":"shard-00002-of-00003.bin")", R"("file":"../x")").message(),
              HasSubstr("shard name"));
  EXPECT_THAT(mutate(R"("gradient_order":[2,1,0])", R"("gradient_order":[2,-1,0])").message(),
              HasSubstr("gradient_order"));
  EXPECT_THAT(mutate(R"("optimizer_step":40)", R"("optimizer_step":41)").message(),
              HasSubstr("optimizer_step"));
}

// A training script's own optimizer: the shards say what state they hold and carry extras after
// their pieces; the manifest takes both, and the ranks must agree.
TEST(SnapshotTest, AScriptsOwnOptimizersShardsMakeTheManifestOfTheStateTheyHold) {
  OptimizerConfig torch;
  torch.kind = OptimizerKind::kTorch;
  const OptimizerStateKind rmsprop{"torch.optim.rmsprop.RMSprop", {"square_avg"}};
  std::vector<SnapshotShard> shards = Shards(2);
  const Plan plan = *MakePlan(Model(), shards[0].plan);
  for (SnapshotShard& shard : shards) {
    shard.state = rmsprop;
    const uint64_t pieces = MakeShardLayout(Model(), plan, shard.rank, 1).bytes;
    shard.record.bytes = pieces + 5;
    shard.record.extras = {{shard.rank == 0 ? -1 : 1, pieces, 5}};
    shard.record.block_xxh3.assign(1, shard.record.block_xxh3[0]);
  }
  SHARD_ASSERT_OK_AND_ASSIGN(const CheckpointManifest manifest,
                             SnapshotManifest("job", 2, Model(), torch, shards));
  EXPECT_EQ(manifest.optimizer.torch_class, rmsprop.torch_class);
  EXPECT_EQ(manifest.state_names, rmsprop.names);
  EXPECT_EQ(manifest.shards[1].extras, shards[1].record.extras);

  // The description peers exchange keeps both.
  SHARD_ASSERT_OK_AND_ASSIGN(const SnapshotShard back,
                             SnapshotShardFromJson(SnapshotShardToJson(shards[1])));
  EXPECT_EQ(back, shards[1]);
  std::string json = SnapshotShardToJson(shards[1]);
  const std::string offset = absl::StrCat(R"("offset":)", shards[1].record.extras[0].offset);
  json.replace(json.find(offset), offset.size(), R"("offset":999999)");
  EXPECT_THAT(SnapshotShardFromJson(json).status().message(), HasSubstr("extras lie outside"));

  // Ranks that disagree on the optimizer make no manifest, nor does a built-in optimizer's job.
  shards[1].state.torch_class = "torch.optim.adagrad.Adagrad";
  EXPECT_THAT(SnapshotManifest("job", 2, Model(), torch, shards).status().message(),
              HasSubstr("not of the same snapshot"));
  shards[1].state = rmsprop;
  EXPECT_THAT(SnapshotManifest("job", 2, Model(), OptimizerConfig{}, shards).status().message(),
              HasSubstr("square_avg"));
}

// --- The step boundary -------------------------------------------------------------------------

TEST(StepBoundaryTest, DiskCheckpointsArePeriodicOrRequestedAndAPauseWaitsForItsSave) {
  StepBoundaryState state;
  const StepBoundaryRules rules{100, 10, 0};
  EXPECT_FALSE(DecideStepBoundary(9, rules, StepOrders{1, 0, 0}, false, &state).save);
  StepBoundary boundary = DecideStepBoundary(10, rules, StepOrders{1, 0, 0}, false, &state);
  EXPECT_TRUE(boundary.save);
  EXPECT_EQ(boundary.request, 0);
  boundary = DecideStepBoundary(11, rules, StepOrders{1, 3, 3}, false, &state);
  EXPECT_TRUE(boundary.save);
  EXPECT_EQ(boundary.request, 3);
  EXPECT_TRUE(boundary.pause);
  EXPECT_FALSE(boundary.snapshot);
  // Once saved, the same request saves nothing again; the last step never pauses.
  EXPECT_FALSE(DecideStepBoundary(12, rules, StepOrders{1, 3, 0}, false, &state).save);
  EXPECT_FALSE(DecideStepBoundary(100, rules, StepOrders{1, 4, 4}, false, &state).pause);
}

TEST(StepBoundaryTest, PeriodicSnapshotsWaitForTheFirstBoundaryNobodyIsReplicatingAt) {
  StepBoundaryState state;
  state.last_snapshot_step = 37;  // training started there (a restore)
  const StepBoundaryRules rules{1000, 0, 10};
  std::vector<int64_t> taken;
  for (int64_t step = 38; step <= 75; ++step) {
    const bool busy = step == 60 || step == 61;  // the snapshot of step 50 is still replicating
    if (DecideStepBoundary(step, rules, StepOrders{2, 0, 0}, busy, &state).snapshot) {
      taken.push_back(step);
    }
  }
  EXPECT_THAT(taken, ElementsAre(40, 50, 62, 70));
}

TEST(StepBoundaryTest, APauseInMemoryIsAnsweredByASnapshotTakenEvenWhileReplicating) {
  StepBoundaryState state;
  const StepBoundaryRules rules{1000, 10, 10};
  StepOrders orders{4, 0, 7, /*pause_in_memory=*/true};
  StepBoundary boundary = DecideStepBoundary(13, rules, orders, /*snapshots_busy=*/true, &state);
  EXPECT_TRUE(boundary.snapshot);
  EXPECT_EQ(boundary.snapshot_request, 7);
  EXPECT_TRUE(boundary.pause);
  EXPECT_FALSE(boundary.save) << "no disk checkpoint for a pause in memory";
  // The periodic disk checkpoint still comes at its step.
  orders.pause_request = 0;
  EXPECT_TRUE(DecideStepBoundary(20, rules, orders, false, &state).save);
}

// A save due while a rank still writes the previous checkpoint (a slow disk): a periodic one is
// skipped (the next comes at its own step), a requested one and the pause after it wait for the
// first boundary nobody writes at; saves never queue up.
TEST(StepBoundaryTest, ASaveDueWhileARankStillWritesTheLastIsSkippedOrWaits) {
  StepBoundaryState state;
  const StepBoundaryRules rules{100, 10, 0};
  const StepOrders none{1, 0, 0};
  StepBoundary boundary = DecideStepBoundary(10, rules, none, BoundaryWork{false, 0}, &state);
  EXPECT_TRUE(boundary.save);
  EXPECT_FALSE(boundary.save_skipped);
  // Step 10's shard is still being written at step 20.
  EXPECT_TRUE(SaveDue(20, rules, none, state));
  boundary = DecideStepBoundary(20, rules, none, BoundaryWork{false, 10}, &state);
  EXPECT_FALSE(boundary.save);
  EXPECT_TRUE(boundary.save_skipped);
  EXPECT_FALSE(SaveDue(21, rules, none, state)) << "a skipped periodic save is not owed later";
  // An operator's request with a pause after it, while the write goes on: nothing yet.
  const StepOrders requested{1, 5, 5};
  EXPECT_TRUE(SaveDue(21, rules, requested, state));
  boundary = DecideStepBoundary(21, rules, requested, BoundaryWork{false, 10}, &state);
  EXPECT_FALSE(boundary.save);
  EXPECT_FALSE(boundary.save_skipped) << "a request is not skipped, it waits";
  EXPECT_FALSE(boundary.pause) << "the pause waits for its save";
  // The write is done: the request is saved, and training pauses after it.
  boundary = DecideStepBoundary(22, rules, requested, BoundaryWork{false, 0}, &state);
  EXPECT_TRUE(boundary.save);
  EXPECT_EQ(boundary.request, 5);
  EXPECT_TRUE(boundary.pause);
  // And the next periodic save comes at its step.
  EXPECT_TRUE(DecideStepBoundary(30, rules, none, BoundaryWork{false, 0}, &state).save);
  // A snapshot is not held back by a disk write.
  const StepBoundaryRules with_snapshots{100, 10, 5};
  boundary = DecideStepBoundary(40, with_snapshots, none, BoundaryWork{false, 30}, &state);
  EXPECT_TRUE(boundary.save_skipped);
  EXPECT_TRUE(boundary.snapshot);
}

}  // namespace
}  // namespace shard
