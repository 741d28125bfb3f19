// CheckpointManager when saves fail (a full disk, EIO) or fall behind (a slow disk): a failed save
// leaves nothing on disk, also of the shards its other ranks report later, the committed
// checkpoints stay and still verify, the request learns why, later saves commit as usual; status
// (SaveHealth) and the event history (TakeNotices) say what happened (docs/checkpoints.md, "When
// the disk fails").
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/checkpoint.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/checkpoint_manager.h"
#include "server/checkpoint_storage.h"
#include "server/store/state_store.h"
#include "tests/support/status_assertions.h"
#include "tests/support/zero_shard.h"
#include "tests/support/test_directory.h"

namespace shard {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr int kWorld = 2;
constexpr int64_t kGeneration = 4;
const absl::Time kNow = absl::FromUnixSeconds(1700000000);
constexpr char kFull[] =
    "cannot write '/ck/shard-00001-of-00002.bin.tmp.77': No space left on device";

Manifest Model() {
  return Manifest{{ParamSpec{"layers.0.weight", {64, 32}, DataType::kFloat32, true},
                   ParamSpec{"layers.0.bias", {64}, DataType::kFloat32, true}}};
}

class CheckpointFailureTest : public ::testing::Test {
 protected:
  void SetUp() override {
    PlanOptions options;
    options.world_size = kWorld;
    SHARD_ASSERT_OK_AND_ASSIGN(Plan plan, MakePlan(Model(), options));
    view_.plan = std::make_shared<const Plan>(std::move(plan));
    view_.manifest = std::make_shared<const Manifest>(Model());
    view_.version = 1;
    root_ = FreshTestDirectory("shard-checkpoint-failure-test",
                               ::testing::UnitTest::GetInstance()->current_test_info()->name());
    CheckpointOptions checkpoint_options;
    checkpoint_options.job = "full";
    checkpoint_options.root = root_;
    checkpoint_options.zero_stage = 2;
    checkpoint_options.keep_last = 2;
    checkpoint_options.optimizer.kind = OptimizerKind::kAdam;
    SHARD_ASSERT_OK_AND_ASSIGN(
        manager_, CheckpointManager::Create(checkpoint_options, &store_, &storage_, kGeneration,
                                            /*generation_kept=*/false));
  }

  static std::string Id(int64_t step) { return CheckpointIdForStep(step, "g4"); }
  std::string Directory(const std::string& id) const {
    return CheckpointDirectory(root_, "full", id);
  }

  // Rank `rank`'s report of the checkpoint of `step`, without a shard.
  ShardReport Report(int64_t step, int rank, int64_t request = 0) const {
    ShardReport report;
    report.worker_id = absl::StrCat("w", rank);
    report.rank = rank;
    report.generation = kGeneration;
    report.id = Id(step);
    report.step = step;
    report.request = request;
    report.plan_version = view_.version;
    report.plan_hash = view_.plan->hash;
    report.counters = TrainingCounters{.optimizer_step = step};
    report.state = OptimizerStateKind{"", {"exp_avg", "exp_avg_sq"}};
    return report;
  }

  // The same after writing its shard (zeros of the plan's size) into the checkpoint's directory.
  ShardReport Written(int64_t step, int rank, int64_t request = 0) {
    ShardReport report = Report(step, rank, request);
    report.record = WriteZeroShard(Model(), *view_.plan, Directory(report.id), rank, kWorld);
    return report;
  }

  // Rank `rank` could not write its shard: the disk is full.
  ShardReport Failed(int64_t step, int rank, int64_t request = 0) const {
    ShardReport report = Report(step, rank, request);
    report.error = kFull;
    return report;
  }

  bool Commit(int64_t step) {
    absl::StatusOr<bool> first = manager_->ReportShard(Written(step, 0), view_, kNow);
    absl::StatusOr<bool> second = manager_->ReportShard(Written(step, 1), view_, kNow);
    return first.ok() && !*first && second.ok() && *second;
  }

  std::vector<std::string> Listed() const {
    std::vector<std::string> ids;
    for (const v1::CheckpointRecord& record : manager_->List()) ids.push_back(record.id());
    return ids;
  }

  void ExpectVerifies(const std::string& id) {
    SHARD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<CheckpointReader> reader,
                               CheckpointReader::Open(Directory(id)));
    for (int shard = 0; shard < kWorld; ++shard) {
      SHARD_EXPECT_OK(reader->VerifyShard(shard, nullptr));
    }
  }

  std::string root_;
  InMemoryStateStore store_;
  FilesystemCheckpointStorage storage_;
  PlanView view_;
  std::unique_ptr<CheckpointManager> manager_;
};

// The disk fills up while an operator's save is written: one rank's shard is on disk, the other
// rank's write fails. Nothing of that save is left, also of the shard written after the failure;
// the committed checkpoints stay; the operator's request fails naming the cause; once space
// returns, the next save commits and says that saves work again.
TEST_F(CheckpointFailureTest, AFailedSaveLeavesNothingAndTheCommittedCheckpointsStay) {
  ASSERT_TRUE(Commit(10));
  ASSERT_TRUE(Commit(20));
  EXPECT_TRUE(manager_->TakeNotices().empty()) << "commits of a healthy disk are no events";
  SHARD_ASSERT_OK_AND_ASSIGN(const int64_t request, manager_->RequestSave(kGeneration));
  EXPECT_EQ(manager_->Orders(kGeneration).save_request, request);

  SHARD_ASSERT_OK_AND_ASSIGN(bool committed,
                             manager_->ReportShard(Written(25, 0, request), view_, kNow));
  EXPECT_FALSE(committed);
  SHARD_ASSERT_OK_AND_ASSIGN(committed,
                             manager_->ReportShard(Failed(25, 1, request), view_, kNow));
  EXPECT_FALSE(committed);
  EXPECT_FALSE(std::filesystem::exists(Directory(Id(25)))) << "rank 0's shard is removed too";
  EXPECT_THAT(Listed(), ElementsAre(Id(10), Id(20))) << "a failed save deletes no checkpoint";
  ExpectVerifies(Id(10));
  ExpectVerifies(Id(20));
  // The operator's `shardctl checkpoint save` learns why; the ranks are asked for it no more.
  EXPECT_THAT(manager_->Progress(request).error,
              AllOf(HasSubstr("rank 1 could not write its shard"),
                    HasSubstr("No space left on device")));
  EXPECT_EQ(manager_->Orders(kGeneration).save_request, 0);
  // Status and the history say so.
  const SaveHealth health = manager_->health();
  EXPECT_EQ(health.failures, 1);
  EXPECT_THAT(health.last_failure, AllOf(HasSubstr(Id(25)), HasSubstr("No space left")));
  EXPECT_EQ(health.last_failure_at, kNow);
  std::vector<CheckpointNotice> notices = manager_->TakeNotices();
  ASSERT_EQ(notices.size(), 1u);
  EXPECT_EQ(notices[0].kind, v1::MEMBERSHIP_EVENT_KIND_CHECKPOINT_FAILED);
  EXPECT_THAT(notices[0].detail,
              AllOf(HasSubstr(absl::StrCat("checkpoint ", Id(25), " (step 25)")),
                    HasSubstr("No space left on device"), HasSubstr("nothing of it is left"),
                    HasSubstr(absl::StrCat("the latest committed checkpoint is ", Id(20)))));

  // The rank still writing when the save failed finishes later: its shard goes too, and the
  // failed save does not come back as pending.
  SHARD_ASSERT_OK_AND_ASSIGN(committed,
                             manager_->ReportShard(Written(25, 1, request), view_, kNow));
  EXPECT_FALSE(committed);
  EXPECT_FALSE(std::filesystem::exists(Directory(Id(25))));
  EXPECT_EQ(manager_->Progress(request).shards_done, 0);

  // Space returns: the next periodic save commits, retention goes on, and the history says that
  // saves work again.
  ASSERT_TRUE(Commit(30));
  EXPECT_THAT(Listed(), ElementsAre(Id(20), Id(30)));
  ExpectVerifies(Id(30));
  EXPECT_EQ(manager_->health().failures, 0);
  EXPECT_EQ(manager_->health().failures_total, 1);
  notices = manager_->TakeNotices();
  ASSERT_EQ(notices.size(), 1u);
  EXPECT_EQ(notices[0].kind, v1::MEMBERSHIP_EVENT_KIND_CHECKPOINT_RECOVERED);
  EXPECT_THAT(notices[0].detail, AllOf(HasSubstr(absl::StrCat("checkpoint ", Id(30))),
                                       HasSubstr("after 1 failed save")));
}

// The coordinator's own write of the manifest can hit the full disk too: the same clean failure.
TEST_F(CheckpointFailureTest, AManifestThatCannotBeWrittenFailsTheSaveCleanly) {
  ASSERT_TRUE(Commit(10));
  SHARD_ASSERT_OK(manager_->ReportShard(Written(20, 0), view_, kNow).status());
  ShardReport last = Written(20, 1);
  // A directory where the manifest's temporary file would go: its creation fails.
  std::filesystem::create_directories(Directory(Id(20)) + "/manifest.json.tmp." +
                                      std::to_string(getpid()));
  EXPECT_FALSE(manager_->ReportShard(last, view_, kNow).ok());
  EXPECT_FALSE(std::filesystem::exists(Directory(Id(20))));
  EXPECT_THAT(Listed(), ElementsAre(Id(10)));
  EXPECT_THAT(manager_->health().last_failure, HasSubstr("the coordinator could not commit it"));
  ExpectVerifies(Id(10));
}

// A disk full for hours fails every save: status counts them all, the history records the first
// few and then one at every power of two.
TEST_F(CheckpointFailureTest, EventsOfRepeatedFailuresAreThinnedOut) {
  for (int64_t step = 1; step <= 20; ++step) {
    SHARD_ASSERT_OK(manager_->ReportShard(Failed(step, 0), view_, kNow).status());
  }
  EXPECT_EQ(manager_->health().failures, 20);
  std::vector<std::string> counts;
  for (const CheckpointNotice& notice : manager_->TakeNotices()) {
    const size_t at = notice.detail.rfind(" (");
    counts.push_back(notice.detail.substr(at + 2, notice.detail.find(' ', at + 2) - at - 2));
  }
  EXPECT_THAT(counts, ElementsAre("1", "2", "3", "4", "8", "16"));
}

// A periodic save skipped on a slow disk (rank 0 reports it) is counted and recorded, writes
// nothing, and the count starts again at the next commit.
TEST_F(CheckpointFailureTest, ASkippedSaveIsShownUntilTheNextCommit) {
  ASSERT_TRUE(Commit(10));
  ShardReport skipped = Report(30, 0);
  skipped.skipped =
      "the periodic checkpoint of step 30 was skipped: the checkpoint of step 20 was still "
      "being written (saves fall behind the disk)";
  skipped.error = skipped.skipped;
  SHARD_ASSERT_OK_AND_ASSIGN(const bool committed, manager_->ReportShard(skipped, view_, kNow));
  EXPECT_FALSE(committed);
  EXPECT_FALSE(std::filesystem::exists(Directory(Id(30))));
  SaveHealth health = manager_->health();
  EXPECT_EQ(health.skipped, 1);
  EXPECT_EQ(health.failures, 0) << "a skip is no failure";
  EXPECT_EQ(health.last_skip, skipped.skipped);
  std::vector<CheckpointNotice> notices = manager_->TakeNotices();
  ASSERT_EQ(notices.size(), 1u);
  EXPECT_EQ(notices[0].kind, v1::MEMBERSHIP_EVENT_KIND_CHECKPOINT_SKIPPED);
  EXPECT_THAT(notices[0].detail, AllOf(HasSubstr("step 30 was skipped"),
                                       HasSubstr(absl::StrCat("is ", Id(10), " (step 10)"))));
  ASSERT_TRUE(Commit(20));
  health = manager_->health();
  EXPECT_EQ(health.skipped, 0);
  EXPECT_EQ(health.skipped_total, 1);
  EXPECT_TRUE(manager_->TakeNotices().empty());
  // A disk that stays slow skips a save between every two commits: counted every time, recorded
  // at most once a minute.
  skipped.id = Id(40);
  skipped.step = 40;
  SHARD_ASSERT_OK(manager_->ReportShard(skipped, view_, kNow + absl::Seconds(30)).status());
  EXPECT_EQ(manager_->health().skipped, 1);
  EXPECT_TRUE(manager_->TakeNotices().empty());
  skipped.id = Id(50);
  skipped.step = 50;
  SHARD_ASSERT_OK(manager_->ReportShard(skipped, view_, kNow + absl::Seconds(61)).status());
  EXPECT_EQ(manager_->health().skipped, 2);
  notices = manager_->TakeNotices();
  ASSERT_EQ(notices.size(), 1u);
  EXPECT_THAT(notices[0].detail, HasSubstr("2 periodic saves skipped since"));
}

// A shard written for a generation that ended (its report comes late) can never commit: what it
// left is removed. A committed checkpoint of that generation is never touched.
TEST_F(CheckpointFailureTest, AShardOfAnEndedGenerationIsRemoved) {
  ASSERT_TRUE(Commit(10));
  // A save the ranks gave up when the generation ended (a slow disk): nobody reports it.
  Written(12, 0);
  ASSERT_TRUE(std::filesystem::exists(Directory(Id(12))));
  manager_->OnGeneration(kGeneration + 1);
  EXPECT_FALSE(std::filesystem::exists(Directory(Id(12))));
  const absl::Status late = manager_->ReportShard(Written(15, 0), view_, kNow).status();
  EXPECT_EQ(late.code(), absl::StatusCode::kAborted) << late;
  EXPECT_FALSE(std::filesystem::exists(Directory(Id(15))));
  // A retried report of the committed one changes nothing.
  ShardReport retried = Report(10, 1);
  EXPECT_EQ(manager_->ReportShard(retried, view_, kNow).status().code(),
            absl::StatusCode::kAborted);
  ExpectVerifies(Id(10));
}

}  // namespace
}  // namespace shard
