// Chaos: real coordinator and worker processes on 127.0.0.1 (their collectives over shared
// memory, the default on one host) lose a worker (SIGKILL, SIGSTOP),
// gain a replacement, are resized by an operator, and lose their coordinator (SIGKILL and
// restart). Every job must finish, survivors must abort promptly instead of hanging, and the
// final parameters must equal those of a run without failures that restored at the same
// checkpoint. Each test is bounded in time; every process is killed by pid when its Process
// goes away; the logs in the test's directory show the sequence of generations.
#include <signal.h>

#include <algorithm>

#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/match.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
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
// For the workers of a test that acts while the job trains: the tiny model trains thousands of
// steps a second over shared memory, and would finish before an operator's resize lands.
const std::vector<std::string> kSlowSteps = {"SHARD_SLOW_STEP_MS=3"};

std::string FileBytes(const std::string& path) {
  absl::StatusOr<std::string> bytes = ReadFile(path);
  EXPECT_TRUE(bytes.ok()) << bytes.status();
  return bytes.ok() ? *bytes : std::string();
}

class ChaosTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = MakeTempDir("chaos");
    cluster_.emplace(dir_);
    CommandResult data = RunCommand({BinaryPath("shardctl"), "data", "generate", "--widths",
                                     "32,64,10", "--samples", "4096", "--seed", "9", "--out",
                                     dir_ + "/data.safetensors"},
                                    absl::Seconds(30));
    ASSERT_EQ(data.exit_code, 0) << data.output;
  }

  // The workers talk through shared memory (every one is on this host): whatever was killed,
  // no segment of theirs is left in /dev/shm.
  void TearDown() override {
    const std::vector<std::string> left = cluster_->WorkerSegmentsLeft();
    EXPECT_TRUE(left.empty()) << absl::StrJoin(left, ", ");
  }

  struct JobOptions {
    int world = 4;
    int min = 4;          // re-forms with at least this many workers
    int steps = 300;
    int every = 0;        // a disk checkpoint every this many steps
    std::string out = "out";
    int keep = 100;
    int snapshot_every = 0;  // memory snapshots (0: none)
    int replicas = 1;
    std::string checkpoints = "checkpoints";
    int zero_stage = 2;      // 3 shards the parameters too
  };

  // A job of the MLP 32,64,10 on DIR/data.safetensors (the global batch 96 divides over 1, 2, 3
  // and 4 workers), its checkpoints in DIR/`checkpoints`, its parameters in DIR/`out`.
  std::string WriteJob(const std::string& name, const JobOptions& o) {
    const std::string path = absl::StrCat(dir_, "/", name, ".json");
    std::ofstream(path) << absl::StrCat(
        R"({"name": "chaos", "worldSize": )", o.world, R"(, "minWorldSize": )", o.min, R"(,
        "model": {"mlp": {"widths": [32, 64, 10]}}, "data": {"path": "data.safetensors"},
        "seed": 11, "optimizer": {"name": "adam", "lr": 0.002}, "globalBatch": 96,
        "steps": )", o.steps, R"(, "zeroStage": )", o.zero_stage, R"(, "bucketCapMb": 0.004,
        "checkpoint": {"dir": ")", o.checkpoints, R"(", "everySteps": )", o.every,
        R"(, "keepLast": )", o.keep, R"(}, "snapshot": {"everySteps": )", o.snapshot_every,
        R"(, "replicas": )", o.replicas, R"(}, "outputDir": ")", o.out, R"("})");
    return path;
  }

  // The same checkpointing every `every` steps and taking no memory snapshots: most tests here
  // are of recovery from disk (those of recovery from memory say so).
  std::string WriteJob(const std::string& name, int world, int min, int steps, int every,
                       const std::string& out, int keep = 100) {
    return WriteJob(name, JobOptions{.world = world, .min = min, .steps = steps, .every = every,
                                     .out = out, .keep = keep});
  }

  // Starts the job's coordinator on its state directory and follows its events.
  void StartCoordinator(const std::string& job, std::vector<std::string> extra = {},
                        int port = 0, const std::string& log_name = "coordinator.log") {
    StartCoordinatorOn(state(), job, extra, port, log_name);
    cluster_->FollowEvents();
  }
  void StartCoordinatorOn(const std::string& state_dir, const std::string& job,
                          const std::vector<std::string>& extra, int port,
                          const std::string& log_name) {
    std::vector<std::string> args = {"--job", job, "--state-dir", state_dir, "--lease",
                                     absl::FormatDuration(lease_), "--reform-grace", kGrace};
    args.insert(args.end(), extra.begin(), extra.end());
    const absl::Status started = cluster_->StartCoordinator(args, port, log_name);
    ASSERT_TRUE(started.ok()) << started;
  }

  std::vector<Process> StartWorkers(const std::vector<std::string>& ids,
                                    const std::vector<std::string>& extra = {},
                                    const std::vector<std::string>& env = {}) {
    std::vector<Process> workers;
    for (const std::string& id : ids) workers.push_back(cluster_->StartWorker(id, extra, env));
    return workers;
  }

  void WaitForCheckpoints(size_t count) {
    ASSERT_TRUE(Eventually([&] { return cluster_->Checkpoints().size() >= count; },
                           absl::Seconds(60)))
        << cluster_->coordinator().Log();
  }

  // Waits for the world to run with `ranks` ranks and nothing left to change.
  void WaitForWorld(int ranks) {
    nlohmann::json status;
    ASSERT_TRUE(Eventually(
        [&] {
          status = cluster_->Status();
          return !status.is_null() && status["state"] == "running" && status["ranks"] == ranks &&
                 status["world_size"] == ranks;
        },
        absl::Seconds(60)))
        << status.dump(2) << cluster_->coordinator().Log();
  }

  // The job ends on its own: the coordinator and every worker in `workers` exit 0.
  void ExpectJobFinishes(std::vector<Process*> workers) {
    EXPECT_EQ(cluster_->coordinator().Wait(absl::Seconds(90)), 0) << cluster_->coordinator().Log();
    for (Process* worker : workers) {
      EXPECT_EQ(worker->Wait(absl::Seconds(20)), 0) << worker->Log();
    }
    EXPECT_NE(cluster_->coordinator().Log().find("training finished ("), std::string::npos);
  }

  // The reference: a new run of the job that restores `checkpoint` on `world` workers and
  // trains to the end with nothing going wrong; its final parameters.
  std::string ReferenceRun(const std::string& checkpoint, int world, int steps) {
    const std::string job = WriteJob("reference", world, world, steps, 0, "reference");
    // On the job's state directory, whose catalog holds `checkpoint`.
    StartCoordinatorOn(state(), job, {"--restore", checkpoint}, 0, "reference-coordinator.log");
    std::vector<std::string> ids;
    for (int i = 0; i < world; ++i) ids.push_back(absl::StrCat("ref", i));
    std::vector<Process> workers = StartWorkers(ids);
    EXPECT_EQ(cluster_->coordinator().Wait(absl::Seconds(90)), 0) << cluster_->coordinator().Log();
    return FileBytes(dir_ + "/reference/final.safetensors");
  }

  // How long after `since` every survivor had given up its collective and so was not hanging.
  // Each must have been inside one when it gave up: its generation ended with a collective's
  // failure ("all-reduce on rank 1 of 4 failed: ..."), not between steps.
  absl::Duration AbortedAfter(absl::Time since, const std::vector<Process*>& survivors) {
    absl::Duration slowest;
    for (Process* survivor : survivors) {
      const std::string log = survivor->Log();
      std::optional<absl::Time> aborted = FirstLineAfter(log, since, "waiting for the next");
      EXPECT_TRUE(aborted.has_value()) << log;
      if (!aborted.has_value()) continue;
      slowest = std::max(slowest, *aborted - since);
      const size_t line_at = log.find("ended for this worker (");
      EXPECT_NE(line_at, std::string::npos) << log;
      if (line_at == std::string::npos) continue;
      const std::string line = log.substr(line_at, log.find('\n', line_at) - line_at);
      EXPECT_TRUE(absl::StrContains(line, " of 4 failed: ")) << "not inside a collective: " << line;
    }
    return slowest;
  }

  bool HasEvent(absl::string_view text) { return cluster_->HasEvent(text); }

  // The reference of a run whose world changed size at given steps: phase i trains on
  // `phases[i].first` workers from where phase i-1 ended (from scratch for the first) up to step
  // `phases[i].second`, through a disk checkpoint at that step; the last phase to the end. Each
  // phase is a run of its own on a state directory of the reference's. Returns the final
  // parameters. Every phase trains at ZeRO stage `zero_stage`.
  std::string ChainReference(const std::vector<std::pair<int, int>>& phases, int zero_stage = 2) {
    const std::string reference_state = dir_ + "/reference-state";
    std::string restore;
    for (size_t i = 0; i < phases.size(); ++i) {
      const auto [world, until] = phases[i];
      const std::string name = absl::StrCat("reference-", i);
      const bool last = i + 1 == phases.size();
      const std::string job = WriteJob(
          name, JobOptions{.world = world, .min = world, .steps = until,
                           .every = last ? 0 : until, .out = "reference",
                           .checkpoints = name + "-checkpoints", .zero_stage = zero_stage});
      std::vector<std::string> extra;
      if (!restore.empty()) extra = {"--restore", restore};
      StartCoordinatorOn(reference_state, job, extra, 0, name + "-coordinator.log");
      std::vector<std::string> ids;
      for (int w = 0; w < world; ++w) ids.push_back(absl::StrCat(name, "-w", w));
      std::vector<Process> workers = StartWorkers(ids);
      EXPECT_EQ(cluster_->coordinator().Wait(absl::Seconds(90)), 0)
          << cluster_->coordinator().Log();
      if (last) break;
      // The one checkpoint of this phase, at its last step.
      const std::string root = absl::StrCat(dir_, "/", name, "-checkpoints/chaos");
      for (const auto& entry : std::filesystem::directory_iterator(root)) {
        restore = entry.path().filename().string();
      }
      EXPECT_TRUE(absl::StartsWith(restore, absl::StrFormat("step-%08d", until))) << restore;
    }
    return FileBytes(dir_ + "/reference/final.safetensors");
  }

  // Waits until the coordinator reports a usable memory snapshot of at least `step`.
  void WaitForSnapshot(int step) {
    nlohmann::json status;
    ASSERT_TRUE(Eventually(
        [&] {
          status = cluster_->Status();
          return !status.is_null() && status["progress"]["last_snapshot_step"].is_number() &&
                 status["progress"]["last_snapshot_step"].get<int>() >= step;
        },
        absl::Seconds(60)))
        << status.dump(2) << cluster_->coordinator().Log();
  }

  // The worker holding rank `rank` now, by index into `ids`.
  int HolderOf(int rank, const std::vector<std::string>& ids) {
    const nlohmann::json status = cluster_->Status();
    for (const nlohmann::json& worker : status["workers"]) {
      if (worker["rank"] == rank) {
        return static_cast<int>(std::find(ids.begin(), ids.end(), worker["id"]) - ids.begin());
      }
    }
    return -1;
  }

  // The details of the run's events of kind `kind`, oldest first.
  std::vector<std::string> EventsOf(absl::string_view kind) {
    std::vector<std::string> found;
    for (const nlohmann::json& event : cluster_->Events()) {
      if (event["kind"] == std::string(kind)) {
        found.push_back(event["detail"].get<std::string>());
      }
    }
    return found;
  }

  // The step of the memory snapshot a restored event names ("restored memory snapshot
  // step-00000040-g1 (step 40) ..."), or -1.
  static int RestoredStep(const std::string& detail) {
    const size_t at = detail.find("(step ");
    int step = -1;
    if (at != std::string::npos) std::sscanf(detail.c_str() + at, "(step %d)", &step);
    return step;
  }

  std::string state() const { return dir_ + "/state"; }

  // (a) and (b): worker `victim` of 4 is lost to `signal` mid-training (a crash or a hang). The
  // survivors must leave their collective within a few leases, re-form at 3 after the grace
  // period, restore the latest checkpoint, and end with exactly the parameters of a 4->3 restore
  // of that checkpoint. Returns how long the slowest survivor took to abort.
  // `worker_flags` go to the job's workers, not to the reference's.
  absl::Duration LoseAWorkerAndExpectTheSameParametersOnThree(
      int victim, int signal, const std::vector<std::string>& worker_flags = {}) {
    constexpr int kSteps = 300;
    StartCoordinator(WriteJob("job", 4, 3, kSteps, 10, "out"));
    std::vector<Process> workers = StartWorkers({"w0", "w1", "w2", "w3"}, worker_flags);
    WaitForCheckpoints(2);
    const absl::Time lost = absl::Now();
    workers[victim].Signal(signal);
    if (signal == SIGKILL) {
      EXPECT_EQ(workers[victim].Wait(absl::Seconds(5)), 128 + SIGKILL);
    }
    std::vector<Process*> survivors;
    for (int i = 0; i < 4; ++i) {
      if (i != victim) survivors.push_back(&workers[i]);
    }
    ExpectJobFinishes(survivors);

    const absl::Duration aborted = AbortedAfter(lost, survivors);
    // Declared dead within a lease, then the abort is immediate; the bound leaves room for a
    // loaded machine (the benchmark bench-recovery measures the time itself).
    EXPECT_LT(aborted, 5 * kLease);
    EXPECT_TRUE(HasEvent("dead: no heartbeat"));
    EXPECT_TRUE(HasEvent("re-formed from 4 to 3 workers"));

    const std::vector<std::string> restores = Restores(survivors[0]->Log());
    EXPECT_EQ(restores.size(), 1u) << survivors[0]->Log();
    if (restores.size() == 1) {
      EXPECT_EQ(FileBytes(dir_ + "/out/final.safetensors"), ReferenceRun(restores[0], 3, kSteps))
          << "the re-formed run must equal a 4->3 restore of the same checkpoint";
    }
    return aborted;
  }

  // 1 of 4 workers training at ZeRO stage `zero_stage` is killed mid-training, with no disk
  // checkpoints at all: the world re-forms at 3 from the snapshot the survivors (and the victim's
  // buddy) hold in memory, reads nothing from disk, and ends with the parameters of a run at the
  // same stage that went 4 -> 3 at that step through a checkpoint.
  void KillAWorkerAndRecoverFromMemory(int zero_stage) {
    constexpr int kSteps = 600;
    StartCoordinator(WriteJob("job", JobOptions{.world = 4, .min = 3, .steps = kSteps,
                                                .snapshot_every = 10, .replicas = 1,
                                                .zero_stage = zero_stage}));
    const std::vector<std::string> ids = {"w0", "w1", "w2", "w3"};
    std::vector<Process> workers = StartWorkers(ids, {}, kSlowSteps);
    WaitForSnapshot(40);
    const int victim = HolderOf(2, ids);
    ASSERT_GE(victim, 0);
    workers[victim].Signal(SIGKILL);
    ASSERT_EQ(workers[victim].Wait(absl::Seconds(5)), 128 + SIGKILL);
    std::vector<Process*> survivors;
    for (int i = 0; i < 4; ++i) {
      if (i != victim) survivors.push_back(&workers[i]);
    }
    ExpectJobFinishes(survivors);
    EXPECT_TRUE(HasEvent("re-formed from 4 to 3 workers"));
    // Every restore was from memory (the first from 4 ranks' snapshot), and nothing is on disk.
    const std::vector<std::string> restored = EventsOf("restored");
    ASSERT_FALSE(restored.empty());
    for (const std::string& detail : restored) {
      EXPECT_TRUE(absl::StrContains(detail, "from memory")) << detail;
    }
    EXPECT_FALSE(std::filesystem::exists(dir_ + "/checkpoints/chaos"))
        << "no checkpoint was ever written, so none was read";
    int bytes_from_peers = 0;
    for (Process* survivor : survivors) {
      bytes_from_peers += absl::StrContains(survivor->Log(), " from peers") ? 1 : 0;
    }
    EXPECT_EQ(bytes_from_peers, 3) << "each survivor says what it read from its peers";
    const int step = RestoredStep(restored.back());
    ASSERT_GE(step, 40) << restored.back();
    EXPECT_EQ(FileBytes(dir_ + "/out/final.safetensors"),
              ChainReference({{4, step}, {3, kSteps}}, zero_stage))
        << "the re-formed run must equal a 4->3 restore at step " << step << " at ZeRO stage "
        << zero_stage;
  }

  std::string dir_;
  absl::Duration lease_ = kLease;  // the coordinator's --lease
  std::optional<LocalCluster> cluster_;
};

TEST_F(ChaosTest, AKilledWorkerAbortsTheSurvivorsPromptlyAndTheJobFinishesOnThree) {
  // A crash closes the peers' connections: the survivors give up their collective at once.
  const absl::Duration aborted = LoseAWorkerAndExpectTheSameParametersOnThree(2, SIGKILL);
  std::cout << "SIGKILL: survivors aborted " << absl::FormatDuration(aborted) << " after the kill\n";
}

TEST_F(ChaosTest, OverTcpAKilledWorkerAbortsTheSurvivorsAndTheBitsEqualSharedMemorys) {
  // The job's workers on loopback TCP, the reference's on shared memory: both transports add
  // the ranks' gradients in the same order, so the parameters are the same bits.
  const absl::Duration aborted =
      LoseAWorkerAndExpectTheSameParametersOnThree(1, SIGKILL, {"--transport", "tcp"});
  std::cout << "SIGKILL over TCP: survivors aborted " << absl::FormatDuration(aborted) << "\n";
}

TEST_F(ChaosTest, AHangingWorkerIsDeclaredDeadAndTheSurvivorsDoNotHang) {
  // SIGSTOP: its connections stay open, so only its missing heartbeats tell; the survivors sit
  // in a collective until the coordinator ends the generation.
  const absl::Duration aborted = LoseAWorkerAndExpectTheSameParametersOnThree(1, SIGSTOP);
  std::cout << "SIGSTOP: survivors aborted " << absl::FormatDuration(aborted)
            << " after the hang began\n";
}

TEST_F(ChaosTest, AReplacementIsFoldedInAtTheNextCheckpointAndTheWorldGrowsBackToFour) {
  StartCoordinator(WriteJob("job", 4, 3, 600, 10, "out"));
  // Slowed: on a fast machine 3 ranks finished the job before the replacement could join.
  std::vector<Process> workers = StartWorkers({"w0", "w1", "w2", "w3"}, {}, kSlowSteps);
  WaitForCheckpoints(2);
  workers[3].Signal(SIGKILL);
  ASSERT_EQ(workers[3].Wait(absl::Seconds(5)), 128 + SIGKILL);
  WaitForWorld(3);
  Process replacement = cluster_->StartWorker("w9", {}, kSlowSteps);
  WaitForWorld(4);
  ExpectJobFinishes({&workers[0], &workers[1], &workers[2], &replacement});
  EXPECT_TRUE(HasEvent("re-formed from 4 to 3 workers"));
  EXPECT_TRUE(HasEvent("standby: "));
  EXPECT_TRUE(HasEvent("re-formed from 3 to 4 workers: 1 standby folded in"));
  // Growing loses no step: training paused right after the checkpoint it then restored.
  EXPECT_NE(workers[0].Log().find("training paused after step"), std::string::npos);
  EXPECT_NE(replacement.Log().find("restoring from checkpoint"), std::string::npos)
      << replacement.Log();
}

// A worker hung just before it restores (a stalled pod) is declared dead; the world re-forms
// without it, an operator restores the newest checkpoint, and retention removes the one the
// stalled worker was about to read (no longer the restore point). Resumed, it finds that
// checkpoint gone before its heartbeat has told it the generation is over: the end of that
// generation, not of the worker, which joins again and is folded in (simulation seed 159852).
TEST_F(ChaosTest, AWorkerResumedAfterItsGenerationEndedJoinsAgainInsteadOfFailing) {
  StartCoordinator(WriteJob("first", 2, 1, 1000000, 5, "out", /*keep=*/1));
  {
    std::vector<Process> workers = StartWorkers({"w0", "w1"});
    WaitForCheckpoints(1);
    ASSERT_EQ(cluster_->Shardctl({"stop"}, absl::Seconds(60)).exit_code, 0);
    for (Process& worker : workers) ASSERT_EQ(worker.Wait(absl::Seconds(20)), 0) << worker.Log();
    ASSERT_EQ(cluster_->coordinator().Wait(absl::Seconds(20)), 0);
  }
  StartCoordinator(WriteJob("second", 2, 1, 1000000, 5, "out", /*keep=*/1), {"--restore", "latest"},
                   0, "second-coordinator.log");
  Process w0 = cluster_->StartWorker("w0-again");
  Process w1 = cluster_->StartWorker("w1-again", {}, {"SHARD_STALL=before-restore"});
  std::string restoring;
  ASSERT_TRUE(Eventually(
      [&] {
        const std::string log = w1.Log();
        const size_t at = log.find("restoring from checkpoint ");
        if (at == std::string::npos) return false;
        restoring = log.substr(at + 26, log.find(' ', at + 26) - at - 26);
        return true;
      },
      absl::Seconds(60)))
      << w1.Log();
  WaitForWorld(1);
  ASSERT_TRUE(Eventually([&] { return cluster_->Checkpoints().size() >= 2; }, absl::Seconds(60)));
  const CommandResult restored =
      cluster_->Shardctl({"checkpoint", "restore", "latest"}, absl::Seconds(60));
  ASSERT_EQ(restored.exit_code, 0) << restored.output;
  // Training went on without it, and retention removed the checkpoint it was restoring.
  std::vector<nlohmann::json> kept;
  ASSERT_TRUE(Eventually(
      [&] {
        kept = cluster_->Checkpoints();
        return !kept.empty() &&
               std::none_of(kept.begin(), kept.end(),
                            [&](const nlohmann::json& c) { return c["id"] == restoring; });
      },
      absl::Seconds(60)))
      << restoring << " " << nlohmann::json(kept).dump();
  w1.Signal(SIGCONT);
  WaitForWorld(2);
  ASSERT_EQ(cluster_->Shardctl({"stop"}, absl::Seconds(60)).exit_code, 0);
  EXPECT_EQ(cluster_->coordinator().Wait(absl::Seconds(30)), 0) << cluster_->coordinator().Log();
  EXPECT_EQ(w0.Wait(absl::Seconds(20)), 0) << w0.Log();
  EXPECT_EQ(w1.Wait(absl::Seconds(20)), 0) << w1.Log();
  // It read no manifest where its restore point had been, and waited for the next generation
  // (whether its heartbeat or its question whether generation 2 was still its own told it first).
  const std::string log = w1.Log();
  const size_t ended = log.find("generation 2 ended");
  ASSERT_NE(ended, std::string::npos) << log;
  EXPECT_NE(log.find("no manifest.json", ended), std::string::npos) << log;
  EXPECT_TRUE(HasEvent("re-formed from 1 to 2 workers: 1 standby folded in"));
}

TEST_F(ChaosTest, ResizingFourToTwoToThreeLosesNoStep) {
  constexpr int kSteps = 600;
  StartCoordinator(WriteJob("job", 4, 2, kSteps, 100, "out"));
  std::vector<Process> workers = StartWorkers({"w0", "w1", "w2", "w3"}, {}, kSlowSteps);
  // Whichever worker holds rank 0 logs the steps.
  ASSERT_TRUE(Eventually(
      [&] {
        return std::any_of(workers.begin(), workers.end(), [](Process& worker) {
          return worker.Log().find(" step 24/") != std::string::npos;
        });
      },
      absl::Seconds(60)));

  CommandResult shrink = cluster_->Shardctl({"resize", "--world-size", "2"}, absl::Seconds(60));
  ASSERT_EQ(shrink.exit_code, 0) << shrink.output << cluster_->coordinator().Log();
  EXPECT_NE(shrink.output.find("2/2 ranks held (target 2"), std::string::npos) << shrink.output;
  Process joiner = cluster_->StartWorker("w9", {}, kSlowSteps);
  ASSERT_TRUE(Eventually(
      [&] {
        nlohmann::json status = cluster_->Status();
        return !status.is_null() && status["standby"] == 1;
      },
      absl::Seconds(30)));
  CommandResult grow = cluster_->Shardctl({"resize", "--world-size", "3"}, absl::Seconds(60));
  ASSERT_EQ(grow.exit_code, 0) << grow.output << cluster_->coordinator().Log();

  std::vector<Process*> all = {&joiner};
  for (Process& worker : workers) all.push_back(&worker);
  ExpectJobFinishes(all);  // the two resized out left cleanly too
  EXPECT_TRUE(HasEvent("re-formed from 4 to 2 workers: resize to 2"));
  EXPECT_TRUE(HasEvent("re-formed from 2 to 3 workers: 1 standby folded in"));

  // No lost step: each pause was at a checkpoint that the next generation restored, and those
  // are the only restores.
  std::set<std::string> paused_at;
  std::string stayer_log;
  for (Process& worker : workers) {
    if (worker.Log().find("training finished") != std::string::npos) stayer_log = worker.Log();
  }
  ASSERT_FALSE(stayer_log.empty());
  for (absl::string_view line : absl::StrSplit(stayer_log, '\n')) {
    int step = 0;
    const size_t at = line.find("training paused after step ");
    if (at != absl::string_view::npos &&
        std::sscanf(std::string(line.substr(at)).c_str(), "training paused after step %d", &step) == 1) {
      paused_at.insert(absl::StrFormat("step-%08d", step));
    }
  }
  const std::vector<std::string> restores = Restores(stayer_log);
  ASSERT_EQ(restores.size(), 2u) << stayer_log;
  ASSERT_EQ(paused_at.size(), 2u) << stayer_log;
  for (const std::string& restored : restores) {
    EXPECT_TRUE(paused_at.count(restored.substr(0, 13))) << restored << "\n" << stayer_log;
  }
  EXPECT_EQ(FileBytes(dir_ + "/out/final.safetensors"), ReferenceRun(restores[1], 3, kSteps));
}

TEST_F(ChaosTest, AKilledAndRestartedCoordinatorKeepsItsCatalogAndTheJobContinues) {
  constexpr int kSteps = 400;
  // Workers train through the outage only while it is shorter than a lease (after a lease of
  // silence they stop, since a coordinator that is only cut off from them counts them dead):
  // a lease that outlasts the restart on a loaded machine.
  lease_ = absl::Seconds(8);
  const std::string job = WriteJob("job", 3, 3, kSteps, 10, "out");
  const int port = FreePort();
  StartCoordinator(job, {}, port);
  std::vector<Process> workers =
      StartWorkers({"w0", "w1", "w2"}, {"--coordinator-timeout", "60s"});
  WaitForCheckpoints(2);
  const std::vector<nlohmann::json> before = cluster_->Checkpoints();
  const absl::Time killed = absl::Now();
  cluster_->coordinator().Signal(SIGKILL);
  ASSERT_EQ(cluster_->coordinator().Wait(absl::Seconds(5)), 128 + SIGKILL);
  // The restart must find workers that noticed the loss and are retrying.
  ASSERT_TRUE(Eventually(
      [&] {
        return std::all_of(workers.begin(), workers.end(), [&](const Process& worker) {
          return FirstLineAfter(worker.Log(), killed, "coordinator silent for").has_value();
        });
      },
      10 * absl::Seconds(1)));

  // Started again with the same command line, on the same port and state directory.
  StartCoordinator(job, {}, port, "coordinator-restarted.log");
  EXPECT_NE(cluster_->coordinator().Log().find("generation kept"), std::string::npos)
      << "an intact, connected world keeps its generation: " << cluster_->coordinator().Log();
  CommandResult list = cluster_->Shardctl({"checkpoint", "list", "--json"});
  ASSERT_EQ(list.exit_code, 0) << list.output;
  std::set<std::string> listed;
  for (const nlohmann::json& checkpoint : nlohmann::json::parse(list.output)) {
    listed.insert(checkpoint["id"].get<std::string>());
  }
  for (const nlohmann::json& checkpoint : before) {
    EXPECT_TRUE(listed.count(checkpoint["id"])) << checkpoint["id"] << "\n" << list.output;
  }

  ExpectJobFinishes({&workers[0], &workers[1], &workers[2]});
  // The workers never stopped training: no restore, and the result equals an undisturbed run.
  EXPECT_TRUE(Restores(workers[0].Log()).empty()) << workers[0].Log();
  const std::string chaos = FileBytes(dir_ + "/out/final.safetensors");
  const std::string reference_job = WriteJob("reference", 3, 3, kSteps, 0, "reference");
  // The finished job's state directory starts a new world for it.
  StartCoordinatorOn(state(), reference_job, {}, 0, "reference-coordinator.log");
  std::vector<Process> reference = StartWorkers({"r0", "r1", "r2"});
  EXPECT_EQ(cluster_->coordinator().Wait(absl::Seconds(90)), 0) << cluster_->coordinator().Log();
  EXPECT_EQ(chaos, FileBytes(dir_ + "/reference/final.safetensors"));
}


// --- Recovery and resizes from memory (docs/recovery.md) -----------------------------------------

// KillAWorkerAndRecoverFromMemory at ZeRO stage 2, and at stage 3, where a rank's snapshot holds
// only its span of the parameters too.
TEST_F(ChaosTest, AKilledWorkerIsRecoveredFromMemoryWithNoCheckpointOnDisk) {
  KillAWorkerAndRecoverFromMemory(2);
}

TEST_F(ChaosTest, AKilledStage3WorkerIsRecoveredFromMemoryWithNoCheckpointOnDisk) {
  KillAWorkerAndRecoverFromMemory(3);
}

// A worker and the buddy that keeps its replica lost together: no snapshot holds every range
// any more, so the world restores the latest disk checkpoint and says so.
TEST_F(ChaosTest, AWorkerAndItsBuddyLostTogetherFallBackToDiskAndSaySo) {
  constexpr int kSteps = 600;
  StartCoordinator(WriteJob("job", JobOptions{.world = 4, .min = 2, .steps = kSteps, .every = 20,
                                              .snapshot_every = 5, .replicas = 1}));
  const std::vector<std::string> ids = {"w0", "w1", "w2", "w3"};
  std::vector<Process> workers = StartWorkers(ids);
  WaitForCheckpoints(2);
  WaitForSnapshot(45);
  // On one host the buddy of rank 1 is rank 2.
  const int first = HolderOf(1, ids);
  const int buddy = HolderOf(2, ids);
  ASSERT_GE(first, 0);
  ASSERT_GE(buddy, 0);
  workers[first].Signal(SIGKILL);
  workers[buddy].Signal(SIGKILL);
  std::vector<Process*> survivors;
  for (int i = 0; i < 4; ++i) {
    if (i != first && i != buddy) survivors.push_back(&workers[i]);
  }
  ExpectJobFinishes(survivors);
  EXPECT_TRUE(HasEvent("re-formed from 4 to 2 workers"));
  EXPECT_TRUE(HasEvent("from disk: no memory snapshot holds every range")) << "announced";
  const std::vector<std::string> restores = Restores(survivors[0]->Log());
  ASSERT_EQ(restores.size(), 1u) << survivors[0]->Log();
  EXPECT_EQ(FileBytes(dir_ + "/out/final.safetensors"), ReferenceRun(restores[0], 2, kSteps));
}

// An operator shrinks a world of 4 to 3, grows it back to 4 with a new worker, and shrinks it to
// 2, with no disk checkpoints: each reshape pauses at a memory snapshot, the workers resized out
// stay until the new world has read their state, and the newcomer reads its ranges from peers.
TEST_F(ChaosTest, ResizingFourToThreeToFourToTwoMovesTheStateInMemory) {
  constexpr int kSteps = 1200;
  StartCoordinator(WriteJob("job", JobOptions{.world = 4, .min = 2, .steps = kSteps,
                                              .snapshot_every = 10, .replicas = 1}));
  std::vector<Process> workers = StartWorkers({"w0", "w1", "w2", "w3"}, {}, kSlowSteps);
  WaitForSnapshot(30);
  CommandResult shrink = cluster_->Shardctl({"resize", "--world-size", "3"}, absl::Seconds(60));
  ASSERT_EQ(shrink.exit_code, 0) << shrink.output << cluster_->coordinator().Log();
  WaitForWorld(3);
  Process newcomer = cluster_->StartWorker("w9", {}, kSlowSteps);
  ASSERT_TRUE(Eventually(
      [&] {
        nlohmann::json status = cluster_->Status();
        return !status.is_null() && status["standby"] == 1;
      },
      absl::Seconds(30)));
  CommandResult grow = cluster_->Shardctl({"resize", "--world-size", "4"}, absl::Seconds(60));
  ASSERT_EQ(grow.exit_code, 0) << grow.output << cluster_->coordinator().Log();
  WaitForWorld(4);
  CommandResult to_two = cluster_->Shardctl({"resize", "--world-size", "2"}, absl::Seconds(60));
  ASSERT_EQ(to_two.exit_code, 0) << to_two.output << cluster_->coordinator().Log();
  std::vector<Process*> all = {&newcomer};
  for (Process& worker : workers) all.push_back(&worker);
  ExpectJobFinishes(all);  // those resized out left cleanly, once they were no longer needed
  EXPECT_TRUE(HasEvent("re-formed from 4 to 3 workers: resize to 3"));
  EXPECT_TRUE(HasEvent("re-formed from 3 to 4 workers: 1 standby folded in"));
  EXPECT_TRUE(HasEvent("re-formed from 4 to 2 workers: resize to 2"));
  EXPECT_FALSE(std::filesystem::exists(dir_ + "/checkpoints/chaos")) << "nothing went to disk";
  // Each reshape restored the memory snapshot it paused at: no step lost, none from disk.
  std::vector<int> steps;
  for (const std::string& detail : EventsOf("restored")) {
    EXPECT_TRUE(absl::StrContains(detail, "from memory")) << detail;
    EXPECT_TRUE(absl::StrContains(detail, "; 0 steps lost")) << detail;
    steps.push_back(RestoredStep(detail));
  }
  ASSERT_EQ(steps.size(), 3u) << absl::StrJoin(EventsOf("restored"), "\n");
  EXPECT_NE(newcomer.Log().find("from peers"), std::string::npos) << newcomer.Log();
  EXPECT_EQ(FileBytes(dir_ + "/out/final.safetensors"),
            ChainReference({{4, steps[0]}, {3, steps[1]}, {4, steps[2]}, {2, kSteps}}));
}

// A worker killed half-way through sending its snapshot shard to its buddy: the buddy keeps
// nothing of it, that snapshot is never offered, and the world restores the one before.
TEST_F(ChaosTest, ASnapshotTornByAKillMidTransferIsNeverUsed) {
  constexpr int kSteps = 600;
  StartCoordinator(WriteJob("job", JobOptions{.world = 4, .min = 3, .steps = kSteps,
                                              .snapshot_every = 10, .replicas = 1}));
  // Slowed so that each snapshot's replication usually ends before the next is due: the
  // snapshots are those of steps 10, 20, 30. One still being replicated when the next is due
  // puts that one off to a later step, never past the next multiple of 10 (a loaded machine
  // took the second at step 23): the second is in [20, 30), the third in [30, 40).
  std::vector<Process> workers = StartWorkers({"w0", "w1", "w2"}, {}, kSlowSteps);
  // Its third push (of the third snapshot) dies half-way.
  workers.push_back(cluster_->StartWorker(
      "w3", {}, {"SHARD_FAULT=snapshot-push-midway", "SHARD_FAULT_SKIP=2", kSlowSteps[0]}));
  EXPECT_EQ(workers[3].Wait(absl::Seconds(60)), 128 + SIGKILL) << workers[3].Log();
  ExpectJobFinishes({&workers[0], &workers[1], &workers[2]});
  const std::vector<std::string> restored = EventsOf("restored");
  ASSERT_FALSE(restored.empty());
  const int step = RestoredStep(restored.front());
  EXPECT_GE(step, 20) << restored.front() << "\nnot the second snapshot";
  EXPECT_LT(step, 30) << restored.front() << "\nthe third snapshot lacks the torn shard";
  for (const std::string& detail : restored) {
    EXPECT_FALSE(absl::StrContains(detail, "snapshot step-0000003")) << detail;
  }
  EXPECT_EQ(FileBytes(dir_ + "/out/final.safetensors"), ChainReference({{4, step}, {3, kSteps}}));
}

// A worker whose training thread hangs (SHARD_STALL_TRAINING: outside any collective, its
// heartbeats going on) holds its peers up in their collective: the progress lease names it,
// evicts it like a dead worker, the hung process exits, and the world re-forms without it from
// memory.
TEST_F(ChaosTest, AStuckRankIsNamedEvictedAndTheWorldGoesOnWithoutIt) {
  constexpr int kSteps = 600;
  StartCoordinator(WriteJob("job", JobOptions{.world = 4, .min = 3, .steps = kSteps,
                                              .snapshot_every = 10, .replicas = 1}),
                   {"--progress-lease-floor", "2s"});
  // Slowed, so that the snapshot of step 80 is replicated before the boundary of step 89
  // posts whether one is in flight: the snapshot of step 90 is taken on time.
  std::vector<Process> workers = StartWorkers({"w0", "w1", "w3"}, {}, kSlowSteps);
  workers.push_back(
      cluster_->StartWorker("w2", {}, {"SHARD_STALL_TRAINING=100", kSlowSteps[0]}));
  ASSERT_TRUE(Eventually([&] { return HasEvent("stuck: "); }, absl::Seconds(60)))
      << cluster_->coordinator().Log();
  const std::vector<std::string> stuck = EventsOf("stuck");
  ASSERT_EQ(stuck.size(), 1u);
  EXPECT_TRUE(absl::StrContains(stuck[0], "(worker w2) has not finished step 100 for ")) << stuck[0];
  EXPECT_TRUE(absl::StrContains(stuck[0], "median step ")) << stuck[0];
  EXPECT_TRUE(absl::StrContains(stuck[0], "3 of 4 ranks wait for it")) << stuck[0];
  EXPECT_TRUE(absl::StrContains(stuck[0], "; evicted")) << stuck[0];
  // Its training thread never returns: the process exits on its own.
  EXPECT_EQ(workers[3].Wait(absl::Seconds(30)), 1) << workers[3].Log();
  EXPECT_NE(workers[3].Log().find("was evicted"), std::string::npos) << workers[3].Log();
  ExpectJobFinishes({&workers[0], &workers[1], &workers[2]});
  EXPECT_TRUE(HasEvent("re-formed from 4 to 3 workers"));
  const std::vector<std::string> restored = EventsOf("restored");
  ASSERT_EQ(restored.size(), 1u);
  EXPECT_TRUE(absl::StrContains(restored[0], "from memory")) << restored[0];
  const int step = RestoredStep(restored[0]);
  EXPECT_EQ(step, 90) << restored[0];
  EXPECT_EQ(FileBytes(dir_ + "/out/final.safetensors"), ChainReference({{4, step}, {3, kSteps}}));
}
}  // namespace
}  // namespace shard::testing

