// The coordinator's memory catalog (server/snapshot_manager.h) and what the checkpoint manager
// does with it (server/checkpoint_manager.h): which snapshot a new world can restore from memory,
// with whose help, when disk wins, and the orders and restore bookkeeping of memory restores.
// Managers with fakes: no sockets, no workers, the clock passed in.
#include "server/snapshot_manager.h"

#include <set>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/checkpoint_manager.h"
#include "server/checkpoint_storage.h"
#include "server/store/state_store.h"
#include "tests/support/status_assertions.h"

namespace shard {
namespace {

using ::testing::HasSubstr;
using ::testing::IsEmpty;

const absl::Time kNow = absl::FromUnixSeconds(1700000000);

// Rank `rank`'s shard of snapshot (generation, step) of a world of `world`, state `state`.
SnapshotShard Shard(int64_t generation, int64_t step, int rank, int world,
                    const std::string& state = "00000000000000aa", int64_t request = 0) {
  SnapshotShard shard;
  shard.id = SnapshotId(step, generation);
  shard.generation = generation;
  shard.step = step;
  shard.rank = rank;
  shard.plan.world_size = world;
  shard.plan_hash = "0123456789abcdef";
  shard.counters.optimizer_step = step;
  shard.record = ShardRecord{ShardFileName(rank, world), rank, 64, state, {state}, {}};
  shard.request = request;
  shard.state = StateKindOf(OptimizerConfig{});  // the default job's Adam
  return shard;
}

SnapshotReport Held(const std::string& worker, std::vector<SnapshotShard> held,
                    std::vector<std::string> dropped = {}) {
  SnapshotReport report;
  report.worker_id = worker;
  report.incarnation = 1;
  report.held = std::move(held);
  report.dropped = std::move(dropped);
  report.snapshot_address = worker + ":9000";
  return report;
}

// Live members: these ids at incarnation 1.
IsLive Alive(std::set<std::string> ids) {
  return [ids](const std::string& id, uint64_t incarnation) {
    return incarnation == 1 && ids.count(id) > 0;
  };
}

// Four workers w0..w3 hold their own shard of (g3, step 40) and their ring successor's replica.
std::unique_ptr<SnapshotManager> Replicated() {
  auto manager = std::make_unique<SnapshotManager>(SnapshotOptions{.replicas = 1});
  for (int rank = 0; rank < 4; ++rank) {
    const std::string me = absl::StrCat("w", rank);
    EXPECT_TRUE(manager->Report(Held(me, {Shard(3, 40, rank, 4)}), kNow).ok());
    const int source = (rank + 3) % 4;
    EXPECT_TRUE(manager->Report(Held(me, {Shard(3, 40, source, 4)}), kNow).ok());
  }
  return manager;
}

TEST(SnapshotManagerTest, ASnapshotIsUsableWhileEveryShardHasALiveHolder) {
  std::unique_ptr<SnapshotManager> replicated = Replicated();
  SnapshotManager& manager = *replicated;
  // One worker lost: its shard is on its buddy.
  SnapshotManager::Newest newest = manager.NewestUsable(Alive({"w0", "w1", "w3"}));
  ASSERT_TRUE(newest.point.has_value());
  EXPECT_EQ(newest.point->shards.size(), 4u);
  ASSERT_EQ(newest.point->holders[2].size(), 1u);
  EXPECT_EQ(newest.point->holders[2][0].worker_id, "w3");
  EXPECT_EQ(newest.point->holders[2][0].address, "w3:9000");
  EXPECT_EQ(newest.point->holders[0][0].worker_id, "w0") << "the owner first";
  // A worker and its buddy lost together: rank 2's shard is gone.
  newest = manager.NewestUsable(Alive({"w0", "w1"}));
  EXPECT_FALSE(newest.point.has_value());
  EXPECT_THAT(newest.why_not, HasSubstr("rank 2's shard of step-00000040-g3 is held by no live"));
  EXPECT_THAT(newest.why_not, HasSubstr("w2, w3"));
  // A restarted process (another incarnation) holds nothing.
  const IsLive restarted = [](const std::string& id, uint64_t incarnation) {
    return id == "w3" ? incarnation == 2 : incarnation == 1;
  };
  EXPECT_TRUE(manager.NewestUsable(restarted).point.has_value()) << "rank 3's shard is on w0";
  const SnapshotSummary summary = manager.Summary(Alive({"w0", "w1", "w2", "w3"}), kNow);
  EXPECT_EQ(summary.usable_id, "step-00000040-g3");
  EXPECT_EQ(summary.usable_copies, 2);
  EXPECT_EQ(summary.replica_lag_steps, 0);
}

TEST(SnapshotManagerTest, TheNewestUsableWinsAndANewerOneTakenByHalfIsNot) {
  std::unique_ptr<SnapshotManager> replicated = Replicated();
  SnapshotManager& manager = *replicated;
  // Step 50: rank 1's shard was never taken (its worker died first).
  for (int rank : {0, 2, 3}) {
    ASSERT_TRUE(manager.Report(Held(absl::StrCat("w", rank), {Shard(3, 50, rank, 4)}), kNow).ok());
  }
  SnapshotManager::Newest newest = manager.NewestUsable(Alive({"w0", "w2", "w3"}));
  ASSERT_TRUE(newest.point.has_value());
  EXPECT_EQ(newest.point->shards[0].id, "step-00000040-g3");
  const SnapshotSummary summary = manager.Summary(Alive({"w0", "w1", "w2", "w3"}), kNow);
  EXPECT_EQ(summary.replica_lag_steps, 10);
  EXPECT_TRUE(summary.replica_lag.has_value());
  // A later generation is newer, whatever its step.
  for (int rank = 0; rank < 2; ++rank) {
    ASSERT_TRUE(manager.Report(Held(absl::StrCat("w", rank), {Shard(4, 10, rank, 2)}), kNow).ok());
  }
  EXPECT_EQ(manager.NewestUsable(Alive({"w0", "w1"})).point->shards[0].id, "step-00000010-g4");
  // What a restore began a new timeline before is never offered again.
  manager.DiscardNewerThan(3, 40);
  EXPECT_EQ(manager.NewestUsable(Alive({"w0", "w1", "w2", "w3"})).point->shards[0].id,
            "step-00000040-g3");
  ASSERT_TRUE(manager.Report(Held("w0", {Shard(4, 10, 0, 2)}), kNow).ok());
  EXPECT_EQ(manager.NewestUsable(Alive({"w0", "w1", "w2", "w3"})).point->shards[0].id,
            "step-00000040-g3")
      << "a discarded snapshot reported again stays discarded";
}

TEST(SnapshotManagerTest, DropsAndDiscardsAreHonouredAndContradictionsRefused) {
  std::unique_ptr<SnapshotManager> replicated = Replicated();
  SnapshotManager& manager = *replicated;
  ASSERT_TRUE(manager.Report(Held("w3", {}, {"step-00000040-g3"}), kNow).ok());
  EXPECT_FALSE(manager.NewestUsable(Alive({"w0", "w1", "w3"})).point.has_value())
      << "w3 dropped rank 2's replica";
  absl::Status contradiction =
      manager.Report(Held("w1", {Shard(3, 40, 0, 4, "00000000000000bb")}), kNow);
  EXPECT_TRUE(absl::IsFailedPrecondition(contradiction)) << contradiction;
  EXPECT_THAT(contradiction.message(), HasSubstr("other checksums"));
  SnapshotReport no_address = Held("w9", {Shard(3, 40, 0, 4)});
  no_address.snapshot_address.clear();
  EXPECT_FALSE(manager.Report(no_address, kNow).ok());
  manager.Discard("step-00000040-g3", "a read failed");
  EXPECT_FALSE(manager.NewestUsable(Alive({"w0", "w1", "w2", "w3"})).point.has_value());
  std::unique_ptr<SnapshotManager> fresh = Replicated();
  fresh->DiscardAll("an operator restored a checkpoint");
  EXPECT_FALSE(fresh->NewestUsable(Alive({"w0", "w1", "w2", "w3"})).point.has_value());
}

TEST(SnapshotManagerTest, AJoiningWorkerBringsWhatItHoldsAndARestartedOneNothing) {
  SnapshotManager manager(SnapshotOptions{.replicas = 1});
  manager.OnJoin("w0", 1, "w0:9000", {Shard(2, 20, 0, 2), Shard(2, 20, 1, 2)}, kNow);
  EXPECT_TRUE(manager.NewestUsable(Alive({"w0"})).point.has_value());
  manager.OnJoin("w0", 2, "w0:9001", {}, kNow);
  EXPECT_FALSE(
      manager.NewestUsable([](const std::string&, uint64_t incarnation) { return incarnation == 2; })
          .point.has_value());
}

TEST(SnapshotManagerTest, APausingSnapshotIsDoneOnceUsableOrFailedWhenARankCouldNotTakeIt) {
  SnapshotManager manager(SnapshotOptions{.replicas = 0});
  ASSERT_TRUE(manager.Report(Held("w0", {Shard(5, 33, 0, 2, "00000000000000aa", 7)}), kNow).ok());
  SaveProgress progress = manager.PauseProgress(7, Alive({"w0", "w1"}));
  EXPECT_EQ(progress.shards_done, 1);
  EXPECT_EQ(progress.world_size, 2);
  EXPECT_TRUE(progress.committed_id.empty());
  ASSERT_TRUE(manager.Report(Held("w1", {Shard(5, 33, 1, 2, "00000000000000aa", 7)}), kNow).ok());
  EXPECT_EQ(manager.PauseProgress(7, Alive({"w0", "w1"})).committed_id, "step-00000033-g5");
  EXPECT_TRUE(manager.PauseProgress(7, Alive({"w0"})).committed_id.empty()) << "w1 is gone";
  SnapshotReport failed = Held("w1", {});
  failed.failed_id = "step-00000033-g5";
  failed.error = "out of memory";
  ASSERT_TRUE(manager.Report(failed, kNow).ok());
  EXPECT_THAT(manager.PauseProgress(7, Alive({"w0", "w1"})).error, HasSubstr("out of memory"));
}

// --- The checkpoint manager with memory restore points -------------------------------------------

std::unique_ptr<CheckpointManager> Checkpoints(StateStore* store, CheckpointStorage* storage) {
  CheckpointOptions options;
  options.job = "job";
  options.root = ::testing::TempDir() + "/shard-snapshot-manager-test";
  return *CheckpointManager::Create(options, store, storage, /*generation=*/1, false);
}

TEST(CheckpointManagerMemoryTest, ANewWorldRestoresTheNewestStateWhereverItIs) {
  InMemoryStateStore store;
  FilesystemCheckpointStorage storage;
  auto checkpoints = Checkpoints(&store, &storage);
  checkpoints->NoteTrainingStarted();
  std::unique_ptr<SnapshotManager> replicated = Replicated();
  SnapshotManager& snapshots = *replicated;
  checkpoints->OnGeneration(4);
  // No checkpoint on disk: memory.
  std::string why = checkpoints->ResolveStart(
      4, snapshots.NewestUsable(Alive({"w0", "w1", "w3"})).point, "");
  EXPECT_THAT(why, HasSubstr("generation 4 restores memory snapshot step-00000040-g3"));
  EXPECT_EQ(checkpoints->start(), (TrainingStartPoint{"step-00000040-g3", "", 40, true}));
  EXPECT_TRUE(checkpoints->NeededForRestore("w3"));
  EXPECT_FALSE(checkpoints->NeededForRestore("w7"));
  // The start is resolved once per generation.
  EXPECT_EQ(checkpoints->ResolveStart(4, std::nullopt, ""), "");
  // Every rank restores; then nobody is needed any more.
  RestoreReport report;
  report.checkpoint_id = "step-00000040-g3";
  report.in_memory = true;
  report.duration = absl::Milliseconds(5);
  report.bytes = 100;
  report.bytes_from_peers = 40;
  EXPECT_FALSE(checkpoints->NoteRestored(4, 0, 2, 47, report).has_value());
  EXPECT_FALSE(checkpoints->NoteRestored(4, 0, 2, 47, report).has_value())
      << "the same rank again";
  report.duration = absl::Milliseconds(9);
  std::optional<CheckpointManager::RestoreSummary> summary =
      checkpoints->NoteRestored(4, 1, 2, 47, report);
  ASSERT_TRUE(summary.has_value());
  EXPECT_EQ(summary->slowest, absl::Milliseconds(9));
  EXPECT_EQ(summary->bytes_from_peers, 80u);
  EXPECT_EQ(summary->steps_lost, 7);
  EXPECT_EQ(checkpoints->restores().from_memory, 1);
  EXPECT_EQ(checkpoints->restores().from_disk, 0);
  EXPECT_FALSE(checkpoints->NeededForRestore("w3"));
  // Without a usable snapshot, a world restores what disk has (nothing here), and says why.
  checkpoints->OnGeneration(5);
  why = checkpoints->ResolveStart(5, std::nullopt, "rank 2's shard of step-00000040-g3 is held "
                                                   "by no live worker (it was on w2, w3)");
  EXPECT_THAT(why, HasSubstr("restores the initial weights: no memory snapshot holds every range"));
  EXPECT_EQ(checkpoints->start(), TrainingStartPoint{});
}

TEST(CheckpointManagerMemoryTest, APauseInMemoryIsNoSaveRequestAndAnExplicitStartStays) {
  InMemoryStateStore store;
  FilesystemCheckpointStorage storage;
  auto checkpoints = Checkpoints(&store, &storage);
  checkpoints->NoteTrainingStarted();
  SHARD_ASSERT_OK_AND_ASSIGN(const int64_t save, checkpoints->RequestSave(1));
  SHARD_ASSERT_OK_AND_ASSIGN(const int64_t pause,
                             checkpoints->RequestSave(1, /*pause=*/true, /*in_memory=*/true));
  EXPECT_EQ(checkpoints->Orders(1), (StepOrders{1, save, pause, true}))
      << "the disk save asked for is the operator's, not the pause";
  // The reshape's snapshot becomes the start of the next generation, which keeps it.
  std::unique_ptr<SnapshotManager> replicated = Replicated();
  SnapshotManager& snapshots = *replicated;
  checkpoints->SetMemoryRestorePoint(
      *snapshots.Usable("step-00000040-g3", Alive({"w0", "w1", "w2", "w3"})));
  checkpoints->OnGeneration(2);
  EXPECT_EQ(checkpoints->ResolveStart(2, std::nullopt, ""), "") << "set for this generation";
  EXPECT_TRUE(checkpoints->start().in_memory);
  EXPECT_EQ(checkpoints->Orders(2), (StepOrders{2, 0, 0, false}));
  // A restarted coordinator takes the memory restore point back from its state directory.
  CheckpointOptions options;
  options.job = "job";
  options.root = ::testing::TempDir() + "/shard-snapshot-manager-test";
  options.recover = true;
  std::unique_ptr<CheckpointManager> again =
      *CheckpointManager::Create(options, &store, &storage, 2, /*generation_kept=*/true);
  EXPECT_EQ(again->start(), checkpoints->start());
  ASSERT_TRUE(again->memory_start().has_value());
  EXPECT_EQ(*again->memory_start(), *checkpoints->memory_start());
}

}  // namespace
}  // namespace shard
