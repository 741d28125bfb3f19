// CheckpointManager and the training counters the ranks report with their shards: the committed
// manifest keeps them, and ranks whose counters differ (their updates diverged) are refused.
#include <filesystem>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/checkpoint.h"
#include "gtest/gtest.h"
#include "server/checkpoint_manager.h"
#include "server/checkpoint_storage.h"
#include "server/store/state_store.h"
#include "tests/support/status_assertions.h"
#include "tests/support/zero_shard.h"
#include "tests/support/test_directory.h"

namespace shard {
namespace {

constexpr int kWorld = 2;
constexpr int64_t kStep = 6;
constexpr int64_t kGeneration = 3;
const absl::Time kNow = absl::FromUnixSeconds(1700000000);

Manifest Model() {
  return Manifest{{ParamSpec{"layers.0.weight", {64, 32}, DataType::kFloat32, true},
                   ParamSpec{"layers.0.bias", {64}, DataType::kFloat32, true}}};
}

class CheckpointCountersTest : public ::testing::Test {
 protected:
  void SetUp() override {
    PlanOptions options;
    options.world_size = kWorld;
    SHARD_ASSERT_OK_AND_ASSIGN(Plan plan, MakePlan(Model(), options));
    view_.plan = std::make_shared<const Plan>(std::move(plan));
    view_.manifest = std::make_shared<const Manifest>(Model());
    view_.version = 1;
    root_ = FreshTestDirectory("shard-checkpoint-counters-test",
                               ::testing::UnitTest::GetInstance()->current_test_info()->name());
    SHARD_ASSERT_OK_AND_ASSIGN(
        manager_, CheckpointManager::Create(Options(), &store_, &storage_, kGeneration,
                                            /*generation_kept=*/false));
  }

  CheckpointOptions Options() const {
    CheckpointOptions options;
    options.job = "counters";
    options.root = root_;
    options.zero_stage = 2;
    options.optimizer.kind = OptimizerKind::kAdam;
    return options;
  }

  // Writes rank `rank`'s shard of checkpoint `id` (zeros of the plan's size) and returns its
  // report, with `counters`.
  ShardReport Shard(const std::string& id, int rank, const TrainingCounters& counters) {
    ShardReport report = Report(id, rank, counters);
    report.record = WriteZeroShard(Model(), *view_.plan, Directory(id), rank, kWorld);
    return report;
  }

  // Rank `rank`'s report of checkpoint `id` at kStep, with `counters` and Adam's state, without
  // a shard.
  ShardReport Report(const std::string& id, int rank, const TrainingCounters& counters) const {
    ShardReport report;
    report.worker_id = absl::StrCat("w", rank);
    report.rank = rank;
    report.generation = kGeneration;
    report.id = id;
    report.step = kStep;
    report.plan_version = view_.version;
    report.plan_hash = view_.plan->hash;
    report.counters = counters;
    report.state = OptimizerStateKind{"", {"exp_avg", "exp_avg_sq"}};
    return report;
  }

  std::string Directory(const std::string& id) const {
    return CheckpointDirectory(manager_->root(), "counters", id);
  }

  std::string root_;
  InMemoryStateStore store_;
  FilesystemCheckpointStorage storage_;
  PlanView view_;
  std::unique_ptr<CheckpointManager> manager_;
};

// A new run on a fresh state directory over an earlier run's checkpoint directory meets that
// run's ids: its ranks cannot write into the committed checkpoint, and the failed save must
// leave it as it is (it used to be removed as "a failed checkpoint").
TEST_F(CheckpointCountersTest, AFailedSaveNeverRemovesAnotherRunsCommittedCheckpoint) {
  const TrainingCounters counters{.optimizer_step = kStep};
  const std::string id = CheckpointIdForStep(kStep);
  SHARD_ASSERT_OK(manager_->ReportShard(Shard(id, 0, counters), view_, kNow).status());
  SHARD_ASSERT_OK_AND_ASSIGN(const bool done,
                             manager_->ReportShard(Shard(id, 1, counters), view_, kNow));
  ASSERT_TRUE(done);

  InMemoryStateStore fresh_store;
  SHARD_ASSERT_OK_AND_ASSIGN(
      std::unique_ptr<CheckpointManager> fresh,
      CheckpointManager::Create(Options(), &fresh_store, &storage_, kGeneration,
                                /*generation_kept=*/false));
  // Its ranks' writers refuse the committed directory and report so.
  ShardReport refused = Report(id, 0, counters);
  refused.error = "checkpoint '...' is already committed; it is never overwritten";
  SHARD_ASSERT_OK_AND_ASSIGN(const bool committed, fresh->ReportShard(refused, view_, kNow));
  EXPECT_FALSE(committed);
  EXPECT_TRUE(storage_.IsCommitted(Directory(id)));
  SHARD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<CheckpointReader> reader,
                             CheckpointReader::Open(Directory(id)));
  for (int shard = 0; shard < kWorld; ++shard) SHARD_EXPECT_OK(reader->VerifyShard(shard, nullptr));
  // Nor when the world moves on while a save of that id is pending.
  const std::string next = CheckpointIdForStep(2 * kStep);
  refused.id = next;
  refused.step = 2 * kStep;
  refused.error.clear();
  refused.record = ShardRecord{ShardFileName(0, kWorld), 0, 0, "", {}, {}};
  SHARD_ASSERT_OK(manager_->ReportShard(Shard(next, 0, counters), view_, kNow).status());
  SHARD_ASSERT_OK_AND_ASSIGN(const bool both, manager_->ReportShard(Shard(next, 1, counters),
                                                                      view_, kNow));
  ASSERT_TRUE(both);
  (void)fresh->ReportShard(refused, view_, kNow);  // pending in the new run
  fresh->OnGeneration(kGeneration + 1);
  EXPECT_TRUE(storage_.IsCommitted(Directory(next)));
}

TEST_F(CheckpointCountersTest, TheCommittedManifestKeepsTheRanksCounters) {
  // A skipped update: the optimizer is a step behind, the scale backed off.
  const TrainingCounters counters{
      .optimizer_step = kStep - 1, .loss_scale = 32768, .loss_scale_growth_tracker = 3};
  const std::string id = CheckpointIdForStep(kStep);
  SHARD_ASSERT_OK_AND_ASSIGN(const bool first,
                             manager_->ReportShard(Shard(id, 1, counters), view_, kNow));
  EXPECT_FALSE(first);
  SHARD_ASSERT_OK_AND_ASSIGN(const bool second,
                             manager_->ReportShard(Shard(id, 0, counters), view_, kNow));
  EXPECT_TRUE(second);
  SHARD_ASSERT_OK_AND_ASSIGN(const CheckpointManifest manifest,
                             ReadCheckpointManifest(Directory(id)));
  EXPECT_EQ(manifest.step, kStep);
  ASSERT_TRUE(manifest.counters.has_value());
  EXPECT_EQ(*manifest.counters, counters);
}

// A coordinator starting on a fresh state directory (its catalog empty) removes the directories
// of saves that never committed, and keeps the committed checkpoints it does not know: another
// state directory's catalog lists them, or an operator restores them by path.
TEST_F(CheckpointCountersTest, AFreshCatalogRemovesPartialSavesAndKeepsCommittedCheckpoints) {
  const TrainingCounters counters{.optimizer_step = kStep};
  const std::string committed = CheckpointIdForStep(kStep);
  SHARD_ASSERT_OK(manager_->ReportShard(Shard(committed, 0, counters), view_, kNow).status());
  SHARD_ASSERT_OK_AND_ASSIGN(const bool done,
                             manager_->ReportShard(Shard(committed, 1, counters), view_, kNow));
  ASSERT_TRUE(done);
  const std::string partial = CheckpointIdForStep(2 * kStep);
  Shard(partial, 0, counters);  // one rank's shard, never reported: no manifest

  InMemoryStateStore fresh_store;
  SHARD_ASSERT_OK_AND_ASSIGN(
      std::unique_ptr<CheckpointManager> fresh,
      CheckpointManager::Create(Options(), &fresh_store, &storage_, kGeneration,
                                /*generation_kept=*/false));
  EXPECT_FALSE(std::filesystem::exists(Directory(partial)));
  SHARD_ASSERT_OK_AND_ASSIGN(const CheckpointManifest manifest,
                             ReadCheckpointManifest(Directory(committed)));
  EXPECT_EQ(manifest.step, kStep);
}

// The checkpoint fails as one with an unwritable shard does: the save request learns why and
// the shards are removed.
TEST_F(CheckpointCountersTest, RanksReportingDifferentCountersFailTheCheckpoint) {
  const TrainingCounters counters{
      .optimizer_step = kStep - 1, .loss_scale = 32768, .loss_scale_growth_tracker = 3};
  TrainingCounters other_step = counters;
  other_step.optimizer_step = kStep;
  TrainingCounters other_scale = counters;
  other_scale.loss_scale = 65536;
  TrainingCounters other_tracker = counters;
  other_tracker.loss_scale_growth_tracker = 0;
  int checkpoint = 0;
  for (const TrainingCounters& other : {other_step, other_scale, other_tracker}) {
    const std::string id = absl::StrCat("diverged-", ++checkpoint);
    SCOPED_TRACE(id);
    ShardReport first = Shard(id, 0, counters);
    ShardReport second = Shard(id, 1, other);
    first.request = second.request = checkpoint;
    SHARD_ASSERT_OK_AND_ASSIGN(const bool committed_first, manager_->ReportShard(first, view_, kNow));
    EXPECT_FALSE(committed_first);
    SHARD_ASSERT_OK_AND_ASSIGN(const bool committed_second, manager_->ReportShard(second, view_, kNow));
    EXPECT_FALSE(committed_second);
    const std::string error = manager_->Progress(checkpoint).error;
    for (const std::string& part : {std::string("rank 1"), id, std::string("diverged")}) {
      EXPECT_NE(error.find(part), std::string::npos) << part << " in " << error;
    }
    // Nothing committed: no manifest, no catalog entry, the shards removed.
    EXPECT_FALSE(std::filesystem::exists(Directory(id)));
    EXPECT_FALSE(manager_->Find(id).ok());
  }
  EXPECT_TRUE(manager_->List().empty());
}

// Counters no manifest reader would accept: refused now, not committed and then unrestorable.
TEST_F(CheckpointCountersTest, ImpossibleCountersFailTheCheckpoint) {
  const TrainingCounters impossible{
      .optimizer_step = kStep + 1, .loss_scale = 1024, .loss_scale_growth_tracker = 0};
  const std::string id = CheckpointIdForStep(kStep);
  ShardReport first = Shard(id, 0, impossible);
  ShardReport second = Shard(id, 1, impossible);
  first.request = second.request = 1;
  SHARD_ASSERT_OK_AND_ASSIGN(const bool committed_first, manager_->ReportShard(first, view_, kNow));
  EXPECT_FALSE(committed_first);
  SHARD_ASSERT_OK_AND_ASSIGN(const bool committed_second, manager_->ReportShard(second, view_, kNow));
  EXPECT_FALSE(committed_second);
  const std::string error = manager_->Progress(1).error;
  EXPECT_NE(error.find("\"optimizer_step\" is 7"), std::string::npos) << error;
  EXPECT_FALSE(std::filesystem::exists(Directory(id)));
  EXPECT_TRUE(manager_->List().empty());
}

// A report that does not fit (a rank beyond the world, another step) is refused, and the
// checkpoint the other ranks are writing still commits.
TEST_F(CheckpointCountersTest, AReportThatDoesNotFitIsRefusedWithoutFailingTheCheckpoint) {
  const TrainingCounters counters{.optimizer_step = kStep};
  const std::string id = CheckpointIdForStep(kStep);
  SHARD_ASSERT_OK_AND_ASSIGN(const bool first,
                             manager_->ReportShard(Shard(id, 0, counters), view_, kNow));
  EXPECT_FALSE(first);
  ShardReport beyond = Shard(id, 1, counters);
  beyond.rank = kWorld;
  EXPECT_EQ(manager_->ReportShard(beyond, view_, kNow).status().code(),
            absl::StatusCode::kInvalidArgument);
  ShardReport other_step = Shard(id, 1, TrainingCounters{.optimizer_step = kStep - 1});
  other_step.step = kStep - 1;
  EXPECT_EQ(manager_->ReportShard(other_step, view_, kNow).status().code(),
            absl::StatusCode::kInvalidArgument);
  SHARD_ASSERT_OK_AND_ASSIGN(const bool second,
                             manager_->ReportShard(Shard(id, 1, counters), view_, kNow));
  EXPECT_TRUE(second);
  SHARD_EXPECT_OK(ReadCheckpointManifest(Directory(id)).status());
}

}  // namespace
}  // namespace shard
