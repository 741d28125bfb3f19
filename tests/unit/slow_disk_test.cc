// A slow disk and the checkpoint writer (docs/checkpoints.md, "When the disk fails"): a save in
// flight can be given up and leaves no file; on ranks that train as threads, a periodic save due
// while the previous one is still being written waits at most checkpoint.max_wait_ms for it,
// then is skipped on every rank alike (rank 0 says so), and every checkpoint that is written is
// whole. The disk is slowed by the SHARD_SLOW_WRITE_MS hook (common/fault.h).
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/checkpoint.h"
#include "common/mlp_data.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/status_assertions.h"
#include "tests/support/train_on_threads.h"
#include "worker/dataplane/checkpoint_saver.h"

namespace shard {
namespace {

using ::testing::HasSubstr;

std::string Root(const std::string& name) {
  const std::string dir = absl::StrCat(::testing::TempDir(), "/shard-slow-disk-test-", getpid(),
                                       "/", name);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

// Sets an environment variable for the scope (the hooks read it at every write).
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const std::string& value) : name_(name) {
    ::setenv(name, value.c_str(), 1);
  }
  ~ScopedEnv() { ::unsetenv(name_); }

 private:
  const char* name_;
};

// A save given up (its generation ended) stops within one slow MiB, leaves no file and is not
// reported: nobody would commit it, and the coordinator removes what an ended generation's
// saves left. The saver takes the next save as usual.
// `bytes` bytes of `fill`, as the copy at a step boundary leaves them.
SnapshotBytes Filled(uint64_t bytes, char fill) {
  auto buffer = std::make_shared<StateBuffer>(*StateBuffer::Make(bytes));
  (void)buffer->Resize(bytes);  // within its capacity: it cannot fail
  std::memset(buffer->data(), fill, bytes);
  return buffer;
}

TEST(CheckpointSaverTest, ASaveGivenUpStopsLeavesNoFileAndIsNotReported) {
  const std::string root = Root("cancel");
  absl::Mutex mu;
  std::vector<SavedShard> reports;
  CheckpointSaver saver([&](const SavedShard& saved) {
    absl::MutexLock lock(&mu);
    reports.push_back(saved);
  });
  EXPECT_EQ(saver.writing_step(), 0);
  SavedShard saved;
  saved.id = "step-00000007";
  saved.dir = root + "/step-00000007";
  saved.step = 7;
  {
    ScopedEnv slow("SHARD_SLOW_WRITE_MS", "60000");  // a minute per MiB
    saver.Start(saved, 1, Filled(4 << 20, 'x'));
    EXPECT_EQ(saver.writing_step(), 7);
    saver.Cancel();
    saver.WaitIdle();
  }
  EXPECT_EQ(saver.writing_step(), 0);
  EXPECT_TRUE(std::filesystem::is_empty(saved.dir));
  {
    absl::MutexLock lock(&mu);
    EXPECT_TRUE(reports.empty());
  }
  saved.id = "step-00000008";
  saved.dir = root + "/step-00000008";
  saved.step = 8;
  saver.Start(saved, 1, Filled(1000, 'y'));
  saver.WaitIdle();
  absl::MutexLock lock(&mu);
  ASSERT_EQ(reports.size(), 1u);
  SHARD_EXPECT_OK(reports[0].record.status());
  EXPECT_EQ(reports[0].step, 8);
}

TEST(CheckpointSaverTest, ASkippedSaveIsReportedOffTheCallersThread) {
  absl::Mutex mu;
  std::vector<SavedShard> reports;
  {
    CheckpointSaver saver([&](const SavedShard& saved) {
      absl::MutexLock lock(&mu);
      reports.push_back(saved);
    });
    SavedShard skipped;
    skipped.id = "step-00000020";
    skipped.step = 20;
    skipped.skipped = "the periodic checkpoint of step 20 was skipped";
    saver.ReportSkipped(skipped);
  }  // destroyed: a report still waiting is delivered first
  absl::MutexLock lock(&mu);
  ASSERT_EQ(reports.size(), 1u);
  EXPECT_EQ(reports[0].skipped, "the periodic checkpoint of step 20 was skipped");
}

const std::vector<int64_t> kWidths = {12, 40, 24, 6};

JobConfig Job(const std::string& root) {
  JobConfig job = SmallMlpJob("slow", root, kWidths,
                              ::testing::TempDir() + "/shard-slow-disk-test-data.safetensors",
                              /*world=*/2, /*global_batch=*/16, /*steps=*/8, /*seed=*/5);
  job.checkpoint_every = 1;  // every step: each save is due while the one before is written
  return job;
}

struct SlowRun {
  std::vector<TrainResult> results;
  std::vector<std::string> skipped;  // what rank 0 reported
};

// Notes the skipped saves a rank reports into `run` (under `mu`: from the writer thread, and
// rank 0's from another).
class SkippedSaves : public TrainingObserver {
 public:
  SkippedSaves(int rank, SlowRun& run, absl::Mutex& mu) : rank_(rank), run_(run), mu_(mu) {}

  void OnCheckpoint(const SavedShard& saved) override {
    if (saved.skipped.empty()) return;
    EXPECT_EQ(rank_, 0) << "only rank 0 reports a skipped save";
    absl::MutexLock lock(&mu_);
    run_.skipped.push_back(saved.skipped);
  }

 private:
  const int rank_;
  SlowRun& run_;
  absl::Mutex& mu_;
};

// Trains `job` on threads with every shard write taking at least 200 ms.
SlowRun TrainOnASlowDisk(const JobConfig& job) {
  if (!std::filesystem::exists(job.data_path)) {
    EXPECT_TRUE(GenerateMlpData(kWidths, 64, 4, job.data_path).ok());
  }
  ScopedEnv slow("SHARD_SLOW_WRITE_MS", "200");
  SlowRun run;
  absl::Mutex mu;
  std::vector<SkippedSaves> observers;
  for (int rank = 0; rank < job.world_size; ++rank) observers.emplace_back(rank, run, mu);
  RankThreadsOptions options;
  options.results = &run.results;
  options.configure = [&](int rank, TrainerOptions* trainer) {
    trainer->observer = &observers[rank];
  };
  TrainMlpOnThreads(job, options);
  return run;
}

// Within the bounded wait, a save due while the one before is being written waits for it:
// every step's checkpoint is written, as on a healthy disk.
TEST(SlowDiskTrainingTest, WithinTheBoundedWaitEverySaveIsTaken) {
  JobConfig job = Job(Root("wait"));
  job.checkpoint_max_wait_ms = 60000;
  SlowRun run = TrainOnASlowDisk(job);
  ASSERT_EQ(run.results.size(), 2u);
  for (const TrainResult& result : run.results) {
    EXPECT_EQ(result.checkpoints_saved, job.steps);
    EXPECT_EQ(result.checkpoints_skipped, 0);
  }
  EXPECT_TRUE(run.skipped.empty());
  for (int64_t step = 1; step <= job.steps; ++step) {
    const std::string dir =
        CheckpointDirectory(job.checkpoint_dir, job.name, CheckpointIdForStep(step));
    SHARD_EXPECT_OK(ReadCheckpointManifest(dir).status());
  }
}

// With no wait allowed, training never waits for the slow disk: the saves due while one is being
// written are skipped on every rank alike (the ranks agree), rank 0 says so, and every checkpoint
// that was written is whole and commits (TrainMlpOnThreads commits them).
TEST(SlowDiskTrainingTest, PeriodicSavesDueWhileOneIsWrittenAreSkippedOnEveryRank) {
  JobConfig job = Job(Root("skip"));
  job.checkpoint_max_wait_ms = 0;
  SlowRun run = TrainOnASlowDisk(job);
  ASSERT_EQ(run.results.size(), 2u);
  const TrainResult& first = run.results[0];
  EXPECT_GT(first.checkpoints_skipped, 0);
  EXPECT_GT(first.checkpoints_saved, 0);
  EXPECT_EQ(first.checkpoints_saved + first.checkpoints_skipped, job.steps);
  EXPECT_EQ(run.results[1].checkpoints_saved, first.checkpoints_saved);
  EXPECT_EQ(run.results[1].checkpoints_skipped, first.checkpoints_skipped);
  // One report waits at a time (a newer replaces it), so at most one per skip arrives.
  ASSERT_FALSE(run.skipped.empty());
  EXPECT_LE(static_cast<int>(run.skipped.size()), first.checkpoints_skipped);
  // (A loaded machine may add "after training waited 3ms for it" between the two.)
  EXPECT_THAT(run.skipped[0], HasSubstr("was still being written"));
  EXPECT_THAT(run.skipped[0], HasSubstr("(saves fall behind the disk)"));
  int written = 0;
  for (int64_t step = 1; step <= job.steps; ++step) {
    written += std::filesystem::exists(
                   CheckpointDirectory(job.checkpoint_dir, job.name, CheckpointIdForStep(step)))
                   ? 1
                   : 0;
  }
  EXPECT_EQ(written, first.checkpoints_saved) << "a skipped save writes nothing";
}

}  // namespace
}  // namespace shard
