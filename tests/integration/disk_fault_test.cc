// Faults of the disk and of memory under real coordinator and worker processes
// (docs/checkpoints.md, "When the disk fails"; docs/recovery.md):
// - the checkpoint disk runs full mid-save (a small tmpfs mounted as the checkpoint directory,
//   filled by the test: real ENOSPC; needs root, and skips itself otherwise): every save fails
//   cleanly and says so, no committed checkpoint is lost and every kept one verifies, training
//   never stops, an operator's save gets the error, and once space returns the next periodic
//   save commits by itself;
// - the disk slows to a crawl (SHARD_SLOW_WRITE_MS: this kernel has no dm-delay): training waits
//   at most checkpoint.maxWaitMs per save, periodic saves due while one is written are skipped
//   and recorded, and the checkpoints that are written are whole;
// - every replica a worker keeps for a buddy has a bit flipped in memory
//   (SHARD_CORRUPT_REPLICAS): when a worker is lost, the restore refuses its shard's copy by its
//   checksums, says so, falls back to the disk checkpoint, and the job ends equal to a run that
//   restored that checkpoint.
// Every process is killed by pid when its Process goes away; the tmpfs is unmounted whatever
// happens.
#include <errno.h>
#include <fcntl.h>
#include <sys/mount.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "common/files.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/support/cluster.h"
#include "tests/support/process.h"

namespace shard::testing {
namespace {

constexpr absl::Duration kLease = absl::Seconds(1);
constexpr char kGrace[] = "1500ms";

std::string FileBytes(const std::string& path) {
  absl::StatusOr<std::string> bytes = ReadFile(path);
  EXPECT_TRUE(bytes.ok()) << bytes.status();
  return bytes.ok() ? *bytes : std::string();
}

class DiskFaultTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = MakeTempDir("disk-fault");
    cluster_.emplace(dir_);
  }

  void TearDown() override {
    // The processes first (they hold files on the mount), then the mount.
    cluster_.reset();
    if (mounted_) {
      EXPECT_EQ(::umount2(mount_.c_str(), MNT_DETACH), 0) << std::strerror(errno);
      mounted_ = false;
    }
  }

  // Generates the job's data: the MLP `widths` (comma-separated), 2048 samples.
  void GenerateData(const std::string& widths) {
    CommandResult data = RunCommand({BinaryPath("shardctl"), "data", "generate", "--widths",
                                     widths, "--samples", "2048", "--seed", "9", "--out",
                                     dir_ + "/data.safetensors"},
                                    absl::Seconds(30));
    ASSERT_EQ(data.exit_code, 0) << data.output;
  }

  struct JobOptions {
    std::string widths = "64, 512, 256, 10";
    int world = 2;
    int min = 2;
    int64_t steps = 1000000;  // the test stops the job itself
    int every = 20;
    int keep = 2;
    int64_t max_wait_ms = -1;  // -1: the default
    int snapshot_every = 0;
    std::string checkpoints = "checkpoints";
    std::string out = "out";
  };

  std::string WriteJob(const std::string& name, const JobOptions& o) {
    const std::string path = absl::StrCat(dir_, "/", name, ".json");
    std::ofstream(path) << absl::StrCat(
        R"({"name": "disk", "worldSize": )", o.world, R"(, "minWorldSize": )", o.min, R"(,
        "model": {"mlp": {"widths": [)", o.widths, R"(]}}, "data": {"path": "data.safetensors"},
        "seed": 11, "optimizer": {"name": "adam", "lr": 0.002}, "globalBatch": 96,
        "steps": )", o.steps, R"(, "zeroStage": 2, "bucketCapMb": 0.25,
        "checkpoint": {"dir": ")", o.checkpoints, R"(", "everySteps": )", o.every,
        R"(, "keepLast": )", o.keep,
        o.max_wait_ms >= 0 ? absl::StrCat(R"(, "maxWaitMs": )", o.max_wait_ms) : "",
        R"(}, "snapshot": {"everySteps": )", o.snapshot_every, R"(, "replicas": 1},
        "outputDir": ")", o.out, R"("})");
    return path;
  }

  void StartCoordinator(const std::string& job, const std::vector<std::string>& extra = {},
                        const std::string& log_name = "coordinator.log") {
    std::vector<std::string> args = {"--job", job, "--state-dir", dir_ + "/state", "--lease",
                                     absl::FormatDuration(kLease), "--reform-grace", kGrace};
    args.insert(args.end(), extra.begin(), extra.end());
    const absl::Status started = cluster_->StartCoordinator(args, 0, log_name);
    ASSERT_TRUE(started.ok()) << started;
    cluster_->FollowEvents();
  }

  std::vector<Process> StartWorkers(const std::vector<std::string>& ids,
                                    const std::vector<std::string>& env = {}) {
    std::vector<Process> workers;
    for (const std::string& id : ids) workers.push_back(cluster_->StartWorker(id, {}, env));
    return workers;
  }

  // The job's training progress from `shardctl status --json` (null when it does not answer).
  nlohmann::json Progress() {
    const nlohmann::json status = cluster_->Status();
    return status.is_null() ? nlohmann::json() : status["progress"];
  }
  int64_t Step() {
    const nlohmann::json progress = Progress();
    return progress.is_object() ? progress.value("step", int64_t{0}) : 0;
  }

  // The details of the events of kind `kind`, oldest first.
  std::vector<std::string> EventsOf(absl::string_view kind) {
    std::vector<std::string> found;
    for (const nlohmann::json& event : cluster_->Events()) {
      if (event["kind"] == std::string(kind)) found.push_back(event["detail"].get<std::string>());
    }
    return found;
  }

  // `shardctl checkpoint verify` of every committed checkpoint passes.
  void ExpectEveryCheckpointVerifies(const std::vector<nlohmann::json>& checkpoints) {
    for (const nlohmann::json& checkpoint : checkpoints) {
      const CommandResult verify = cluster_->Shardctl(
          {"checkpoint", "verify", checkpoint["id"].get<std::string>()}, absl::Seconds(60));
      EXPECT_EQ(verify.exit_code, 0) << verify.output;
    }
  }

  // Stops the job; the coordinator and `workers` exit 0.
  void StopAndExpectCleanExit(std::vector<Process>& workers) {
    ASSERT_EQ(cluster_->Shardctl({"stop"}, absl::Seconds(60)).exit_code, 0);
    EXPECT_EQ(cluster_->coordinator().Wait(absl::Seconds(60)), 0) << cluster_->coordinator().Log();
    for (Process& worker : workers) EXPECT_EQ(worker.Wait(absl::Seconds(30)), 0) << worker.Log();
  }

  // Mounts a tmpfs of `megabytes` at DIR/`name`; false (and a skip) when not root.
  bool MountSmallDisk(const std::string& name, int megabytes) {
    mount_ = absl::StrCat(dir_, "/", name);
    std::filesystem::create_directories(mount_);
    if (::geteuid() != 0) return false;
    const std::string options = absl::StrCat("size=", megabytes, "m");
    if (::mount("tmpfs", mount_.c_str(), "tmpfs", 0, options.c_str()) != 0) {
      ADD_FAILURE() << "running as root but cannot mount a tmpfs at " << mount_ << ": "
                    << std::strerror(errno);
      return false;
    }
    mounted_ = true;
    return true;
  }

  // Fills the mounted disk with one file until the kernel says it is full; its size.
  uint64_t FillDisk(const std::string& path) {
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    EXPECT_GE(fd, 0) << std::strerror(errno);
    if (fd < 0) return 0;
    std::vector<char> chunk(64 << 10, 'f');
    uint64_t written = 0;
    while (true) {
      const ssize_t n = ::write(fd, chunk.data(), chunk.size());
      if (n > 0) {
        written += static_cast<uint64_t>(n);
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      EXPECT_EQ(errno, ENOSPC) << std::strerror(errno);
      break;
    }
    // Down to the last page.
    for (char c = 0; ::write(fd, &c, 1) == 1;) ++written;
    ::close(fd);
    return written;
  }

  // The checkpoint directories under `root` (named step-...) of a step after `after` and before
  // `before` that have no manifest, or hold a temporary file: what a failed save would have left
  // behind. Only steps where no save committed: retention removes committed checkpoints while
  // training goes on, and one caught half-removed has lost its manifest too.
  static std::vector<std::string> LeftBehind(const std::string& root, int64_t after,
                                             int64_t before) {
    std::vector<std::string> left;
    if (!std::filesystem::exists(root)) return left;
    for (const auto& entry : std::filesystem::directory_iterator(root)) {
      const std::string name = entry.path().filename().string();
      int64_t of = 0;
      if (std::sscanf(name.c_str(), "step-%ld", &of) != 1 || of <= after || of >= before) {
        continue;
      }
      if (!std::filesystem::exists(entry.path() / "manifest.json")) left.push_back(name);
      for (const auto& file : std::filesystem::directory_iterator(entry.path())) {
        if (absl::StrContains(file.path().filename().string(), ".tmp.")) {
          left.push_back(file.path().string());
        }
      }
    }
    return left;
  }

  std::string dir_;
  std::string mount_;
  bool mounted_ = false;
  std::optional<LocalCluster> cluster_;
};

// The scenario of issue 30: ENOSPC on the checkpoint disk mid-save, then space freed. No
// committed checkpoint is lost, every kept checkpoint verifies, training never stops, an
// operator's save gets the error, status and events say what happened, and the next periodic
// save succeeds.
TEST_F(DiskFaultTest, AFullDiskFailsSavesCleanlyAndTheyResumeWhenSpaceReturns) {
  if (!MountSmallDisk("disk", 16)) {
    if (::geteuid() != 0) {
      GTEST_SKIP() << "needs root to mount a small tmpfs as the checkpoint disk";
    }
    return;
  }
  ASSERT_NO_FATAL_FAILURE(GenerateData("64,512,256,10"));
  // 2 MB of state (Adam): a 1 MB shard per rank; two kept checkpoints and a third being
  // written fit the 16 MiB disk.
  StartCoordinator(WriteJob("job", JobOptions{.checkpoints = mount_}));
  std::vector<Process> workers = StartWorkers({"w0", "w1"});
  ASSERT_TRUE(Eventually([&] { return cluster_->Checkpoints().size() >= 2; }, absl::Seconds(60)))
      << cluster_->coordinator().Log();
  const std::string root = mount_ + "/disk";

  // The disk fills up while the workers save every 20 steps.
  const uint64_t filler = FillDisk(mount_ + "/filler");
  ASSERT_GT(filler, 0u);
  ASSERT_TRUE(Eventually([&] { return cluster_->HasEvent("checkpoint_failed: "); },
                         absl::Seconds(60)))
      << cluster_->coordinator().Log();
  // Whatever was committed is what the full disk keeps: list it once no save can commit.
  const std::vector<nlohmann::json> kept = cluster_->Checkpoints();
  ASSERT_GE(kept.size(), 2u);
  const int64_t failing_from = Step();

  // An operator's save gets the error.
  const CommandResult save =
      cluster_->Shardctl({"checkpoint", "save", "--wait-timeout", "60s"}, absl::Seconds(90));
  EXPECT_NE(save.exit_code, 0) << save.output;
  EXPECT_TRUE(absl::StrContains(save.output, "the save failed")) << save.output;
  EXPECT_TRUE(absl::StrContains(save.output, "No space left on device")) << save.output;

  // Training goes on while every save fails, and status says so.
  nlohmann::json progress;
  ASSERT_TRUE(Eventually(
      [&] {
        progress = Progress();
        return progress.is_object() && progress["step"].get<int64_t>() >= failing_from + 100 &&
               progress["checkpoint_failures"].get<int64_t>() >= 3;
      },
      absl::Seconds(60)))
      << progress.dump(2) << cluster_->coordinator().Log();
  EXPECT_TRUE(absl::StrContains(progress["last_checkpoint_failure"].get<std::string>(),
                                "No space left on device"))
      << progress.dump(2);
  const CommandResult status = cluster_->Shardctl({"status"});
  EXPECT_TRUE(absl::StrContains(status.output, "saves failed since, the last")) << status.output;
  // No committed checkpoint was lost; each still verifies.
  EXPECT_EQ(cluster_->Checkpoints(), kept);
  ExpectEveryCheckpointVerifies(kept);

  // Space returns: the next periodic save commits by itself.
  std::filesystem::remove(mount_ + "/filler");
  const int64_t freed_at = Step();
  std::vector<nlohmann::json> after;
  ASSERT_TRUE(Eventually(
      [&] {
        after = cluster_->Checkpoints();
        return !after.empty() && after.back()["step"].get<int64_t>() > freed_at;
      },
      absl::Seconds(60)))
      << cluster_->coordinator().Log();
  const int64_t recovered = after.back()["step"].get<int64_t>();
  EXPECT_EQ(recovered % 20, 0) << "a periodic save";
  // Nothing of the failed saves is left: every save before the one that committed is over.
  // Up to the first save that committed again: a later one may already be going to retention.
  const int64_t last_kept = kept.back()["step"].get<int64_t>();
  int64_t first_commit = recovered;
  for (const nlohmann::json& checkpoint : after) {
    const int64_t step = checkpoint["step"].get<int64_t>();
    if (step > last_kept) first_commit = std::min(first_commit, step);
  }
  EXPECT_TRUE(LeftBehind(root, last_kept, first_commit).empty())
      << absl::StrJoin(LeftBehind(root, last_kept, first_commit), ", ");
  progress = Progress();
  EXPECT_EQ(progress["checkpoint_failures"].get<int64_t>(), 0) << progress.dump(2);

  // The history tells the story: saves failed naming the cause, then committed again, and the
  // world never re-formed (training never stopped).
  const std::vector<std::string> failed = EventsOf("checkpoint_failed");
  ASSERT_FALSE(failed.empty());
  EXPECT_TRUE(absl::StrContains(failed[0], "No space left on device")) << failed[0];
  EXPECT_TRUE(absl::StrContains(failed[0], "nothing of it is left")) << failed[0];
  EXPECT_TRUE(Eventually([&] { return cluster_->HasEvent("checkpoint_recovered: checkpoint "); },
                         absl::Seconds(30)))
      << "announced";
  EXPECT_TRUE(EventsOf("reformed").empty());
  EXPECT_TRUE(EventsOf("resized").empty());
  EXPECT_TRUE(EventsOf("dead").empty());
  StopAndExpectCleanExit(workers);
  // Retention went on from there: the disk keeps the newest 2 checkpoints (keepLast), the
  // newest at least the one that committed when space returned, and each verifies.
  int committed = 0;
  int64_t newest = 0;
  for (const auto& entry : std::filesystem::directory_iterator(root)) {
    if (!std::filesystem::exists(entry.path() / "manifest.json")) continue;
    ++committed;
    int64_t step = 0;
    std::sscanf(entry.path().filename().string().c_str(), "step-%ld", &step);
    newest = std::max(newest, step);
    const CommandResult verify = RunCommand(
        {BinaryPath("shardctl"), "checkpoint", "verify", "--path", entry.path().string()},
        absl::Seconds(60));
    EXPECT_EQ(verify.exit_code, 0) << verify.output;
  }
  EXPECT_EQ(committed, 2);
  EXPECT_GE(newest, recovered);
}

// A disk that fails writes with EIO (SHARD_WRITE_ERROR: real EIO needs a failing device): the
// first three shard writes of one worker fail half-way. Each of those saves fails cleanly and
// says so, training goes on, and the next save commits.
TEST_F(DiskFaultTest, AWriteErrorFailsTheSaveCleanlyAndTheNextSaveCommits) {
  ASSERT_NO_FATAL_FAILURE(GenerateData("64,512,256,10"));
  StartCoordinator(WriteJob("job", JobOptions{.keep = 100}));
  std::vector<Process> workers;
  workers.push_back(cluster_->StartWorker("w0"));
  workers.push_back(cluster_->StartWorker(
      "w1", {}, {"SHARD_WRITE_ERROR=EIO", "SHARD_WRITE_ERROR_TIMES=3"}));
  std::vector<nlohmann::json> checkpoints;
  ASSERT_TRUE(Eventually(
      [&] {
        checkpoints = cluster_->Checkpoints();
        return !checkpoints.empty();
      },
      absl::Seconds(60)))
      << cluster_->coordinator().Log();
  ASSERT_TRUE(Eventually([&] { return cluster_->HasEvent("checkpoint_recovered: "); },
                         absl::Seconds(30)));
  const std::vector<std::string> failed = EventsOf("checkpoint_failed");
  ASSERT_EQ(failed.size(), 3u) << absl::StrJoin(failed, "\n");
  for (const std::string& detail : failed) {
    EXPECT_TRUE(absl::StrContains(detail, "Input/output error")) << detail;
  }
  EXPECT_EQ(checkpoints.front()["step"].get<int64_t>(), 80) << "the saves of 20, 40, 60 failed";
  EXPECT_TRUE(LeftBehind(dir_ + "/checkpoints/disk", 0, 80).empty())
      << absl::StrJoin(LeftBehind(dir_ + "/checkpoints/disk", 0, 80), ", ");
  ExpectEveryCheckpointVerifies(checkpoints);
  StopAndExpectCleanExit(workers);
}

// A disk slowed to a crawl: every shard write takes 1.5 s while a save is due every 20 steps.
// Training waits at most maxWaitMs (200 ms) per write, the periodic saves due meanwhile are
// skipped and recorded rather than queued, and what is written commits whole.
TEST_F(DiskFaultTest, ASlowDiskNeverStallsTrainingAndSavesFallBehindSayingSo) {
  ASSERT_NO_FATAL_FAILURE(GenerateData("64,512,256,10"));
  StartCoordinator(WriteJob("job", JobOptions{.keep = 10, .max_wait_ms = 200}));
  std::vector<Process> workers = StartWorkers({"w0", "w1"}, {"SHARD_SLOW_WRITE_MS=1500"});
  std::vector<nlohmann::json> checkpoints;
  ASSERT_TRUE(Eventually(
      [&] {
        checkpoints = cluster_->Checkpoints();
        return checkpoints.size() >= 3;
      },
      absl::Seconds(90)))
      << cluster_->coordinator().Log();
  const std::vector<std::string> skipped = EventsOf("checkpoint_skipped");
  ASSERT_FALSE(skipped.empty()) << cluster_->coordinator().Log();
  // Training waited the bounded 200 ms (a loaded machine wakes it a few ms late), not for the
  // 1.5 s write.
  const std::string waited_text = "was still being written after training waited ";
  const size_t waited_at = skipped[0].find(waited_text);
  ASSERT_NE(waited_at, std::string::npos) << skipped[0];
  int waited_ms = 0;
  ASSERT_TRUE(absl::SimpleAtoi(
      skipped[0].substr(waited_at + waited_text.size(),
                        skipped[0].find("ms", waited_at) - waited_at - waited_text.size()),
      &waited_ms))
      << skipped[0];
  EXPECT_GE(waited_ms, 200) << skipped[0];
  EXPECT_LT(waited_ms, 1000) << skipped[0];
  // Saves fell behind: between two commits, training went on for many periods; none queued up.
  for (size_t i = 1; i < checkpoints.size(); ++i) {
    EXPECT_GT(checkpoints[i]["step"].get<int64_t>() - checkpoints[i - 1]["step"].get<int64_t>(),
              20)
        << checkpoints[i].dump();
  }
  // Each write took its 1.5 s, and held training up for none of it: its pause was the copy.
  for (const nlohmann::json& checkpoint : checkpoints) {
    EXPECT_GE(checkpoint["max_write_ms"].get<double>(), 1500) << checkpoint.dump();
    EXPECT_LT(checkpoint["max_pause_ms"].get<double>(), 1000) << checkpoint.dump();
  }
  const nlohmann::json progress = Progress();
  EXPECT_GE(progress["checkpoints_skipped"].get<int64_t>(), 0) << progress.dump(2);
  ExpectEveryCheckpointVerifies(checkpoints);
  StopAndExpectCleanExit(workers);
  EXPECT_TRUE(EventsOf("checkpoint_failed").empty());
}

// A save still being written to a crawling disk (a minute per shard) when its generation ends
// (a worker is lost) can never commit: the survivors give it up instead of waiting for it, re-form
// and train on from memory within seconds, and what it left on disk is removed.
TEST_F(DiskFaultTest, ASaveWrittenWhenItsGenerationEndsIsGivenUpNotWaitedFor) {
  ASSERT_NO_FATAL_FAILURE(GenerateData("32,64,10"));
  StartCoordinator(WriteJob("job", JobOptions{.widths = "32, 64, 10", .world = 3, .min = 2,
                                              .every = 10, .keep = 100, .max_wait_ms = 100,
                                              .snapshot_every = 5}));
  std::vector<Process> workers =
      StartWorkers({"w0", "w1", "w2"}, {"SHARD_SLOW_WRITE_MS=60000"});
  // The save of step 10 is being written once a later one is skipped for it.
  ASSERT_TRUE(Eventually([&] { return cluster_->HasEvent("checkpoint_skipped: "); },
                         absl::Seconds(60)))
      << cluster_->coordinator().Log();
  const absl::Time lost = absl::Now();
  workers[1].Signal(SIGKILL);
  ASSERT_EQ(workers[1].Wait(absl::Seconds(5)), 128 + SIGKILL);
  // The new world restores the snapshot and trains on, long before the write would have ended.
  ASSERT_TRUE(Eventually(
      [&] {
        for (const std::string& detail : EventsOf("restored")) {
          if (absl::StrContains(detail, "from memory")) return true;
        }
        return false;
      },
      absl::Seconds(40)))
      << cluster_->coordinator().Log();
  const int64_t restored_at = Step();
  ASSERT_TRUE(Eventually([&] { return Step() > restored_at + 50; }, absl::Seconds(20)));
  EXPECT_LT(absl::Now() - lost, absl::Seconds(45))
      << "no survivor waited for its minute-long write";
  // The given-up save of generation 1 left nothing behind, the lost worker's half-written file
  // included.
  const std::string gone = dir_ + "/checkpoints/disk/step-00000010-g1";
  EXPECT_TRUE(Eventually([&] { return !std::filesystem::exists(gone); }, absl::Seconds(20)))
      << gone;
  EXPECT_TRUE(EventsOf("checkpoint_failed").empty()) << "a save given up is no disk failure";
}

// Every replica kept for a buddy has a bit flipped in memory. A worker is lost: its shard of the
// newest snapshot is held only as such a replica, whose checksums refuse it; the restore says
// so, and the world falls back to the disk checkpoint, ending where a run that restored that
// checkpoint on 2 workers ends.
TEST_F(DiskFaultTest, ACorruptReplicaIsRefusedAndTheRestoreFallsBackToDiskSayingSo) {
  constexpr int kSteps = 600;
  ASSERT_NO_FATAL_FAILURE(GenerateData("32,64,10"));
  // A snapshot halfway between checkpoints, and steps slowed to 10 ms: each replicated snapshot
  // stays the newest, and newer than the newest checkpoint, for about half a second, a window
  // the polls below cannot miss even when replication (at nice 10) waits for a loaded machine.
  StartCoordinator(WriteJob("job", JobOptions{.widths = "32, 64, 10", .world = 3, .min = 2,
                                              .steps = kSteps, .every = 100, .keep = 100,
                                              .snapshot_every = 50}));
  const std::vector<std::string> ids = {"w0", "w1", "w2"};
  std::vector<Process> workers =
      StartWorkers(ids, {"SHARD_CORRUPT_REPLICAS=1", "SHARD_SLOW_STEP_MS=10"});
  ASSERT_TRUE(Eventually([&] { return cluster_->Checkpoints().size() >= 2; }, absl::Seconds(60)))
      << cluster_->coordinator().Log();
  ASSERT_TRUE(Eventually(
      [&] {
        const nlohmann::json progress = Progress();
        return progress.is_object() && progress["last_snapshot_step"].is_number() &&
               progress["last_snapshot_step"].get<int64_t>() >
                   cluster_->Checkpoints().back()["step"].get<int64_t>() &&
               progress.value("last_snapshot_copies", 0) >= 2;
      },
      absl::Seconds(60)))
      << "a snapshot newer than the newest checkpoint, replicated (replication yields to "
         "training), so that the restore tries memory first";
  workers[1].Signal(SIGKILL);
  ASSERT_EQ(workers[1].Wait(absl::Seconds(5)), 128 + SIGKILL);
  EXPECT_EQ(cluster_->coordinator().Wait(absl::Seconds(120)), 0) << cluster_->coordinator().Log();
  EXPECT_EQ(workers[0].Wait(absl::Seconds(30)), 0) << workers[0].Log();
  EXPECT_EQ(workers[2].Wait(absl::Seconds(30)), 0) << workers[2].Log();

  // The memory restore refused the flipped copy by its checksums and said so.
  const std::vector<std::string> restored = EventsOf("restored");
  bool refused = false;
  for (const std::string& detail : restored) {
    refused = refused || (absl::StrContains(detail, "could not restore memory snapshot") &&
                          absl::StrContains(detail, "is corrupt") &&
                          absl::StrContains(detail, "do not match their checksum") &&
                          absl::StrContains(detail, "it is not used again"));
  }
  EXPECT_TRUE(refused) << absl::StrJoin(restored, "\n");
  // Then the world restored the disk checkpoint, and said so.
  const std::vector<std::string> points = EventsOf("restore_point");
  ASSERT_FALSE(points.empty());
  EXPECT_TRUE(absl::StrContains(points.back(), "from disk")) << points.back();
  ASSERT_FALSE(restored.empty());
  EXPECT_TRUE(absl::StrContains(restored.back(), "restored checkpoint ")) << restored.back();
  EXPECT_TRUE(absl::StrContains(restored.back(), "from disk")) << restored.back();
  const std::vector<std::string> restores = Restores(workers[0].Log());
  ASSERT_FALSE(restores.empty()) << workers[0].Log();
  const std::string checkpoint = restores.back();

  // The reference: a run that restores the same checkpoint on 2 workers.
  const std::string reference = WriteJob(
      "reference", JobOptions{.widths = "32, 64, 10", .world = 2, .min = 2, .steps = kSteps,
                              .every = 0, .keep = 100, .out = "reference"});
  StartCoordinator(reference, {"--restore", checkpoint}, "reference-coordinator.log");
  std::vector<Process> reference_workers = StartWorkers({"r0", "r1"});
  EXPECT_EQ(cluster_->coordinator().Wait(absl::Seconds(120)), 0) << cluster_->coordinator().Log();
  EXPECT_EQ(FileBytes(dir_ + "/out/final.safetensors"),
            FileBytes(dir_ + "/reference/final.safetensors"))
      << "the job must end as a run that restored " << checkpoint << " on 2 workers";
}

}  // namespace
}  // namespace shard::testing
