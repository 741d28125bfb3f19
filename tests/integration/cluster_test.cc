// Real processes of shard-coordinator, shard-worker and shardctl on 127.0.0.1: the world forms,
// a worker killed with SIGKILL is declared dead within its lease, bad input fails clearly.
#include "tests/support/cluster.h"

#include <signal.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/checkpoint.h"
#include "common/safetensors.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/support/process.h"

namespace shard::testing {
namespace {

constexpr absl::Duration kLease = absl::Seconds(1);

class ClusterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = MakeTempDir("cluster");
    cluster_.emplace(dir_);
  }

  // Starts the coordinator (with `args`) on a free port; address_ and coordinator_ follow it.
  void StartCoordinatorWith(const std::vector<std::string>& args,
                            const std::string& log_name = "coordinator.log",
                            const std::vector<std::string>& env = {}) {
    const absl::Status started = cluster_->StartCoordinator(args, 0, log_name, env);
    ASSERT_TRUE(started.ok()) << started;
    address_ = cluster_->address();
    coordinator_ = &cluster_->coordinator();
  }
  void StartCoordinator(int world_size, const std::string& state_dir = "") {
    StartCoordinatorWith({"--world-size", absl::StrCat(world_size), "--lease",
                          absl::FormatDuration(kLease), "--state-dir",
                          state_dir.empty() ? absl::StrCat(dir_, "/state") : state_dir});
  }

  Process StartWorker(const std::string& id, const std::vector<std::string>& extra = {}) {
    return cluster_->StartWorker(id, extra);
  }
  nlohmann::json Status() { return cluster_->Status(); }

  static const nlohmann::json* Worker(const nlohmann::json& status, const std::string& id) {
    for (const nlohmann::json& worker : status["workers"]) {
      if (worker["id"] == id) return &worker;
    }
    return nullptr;
  }

  std::string dir_;
  std::optional<LocalCluster> cluster_;
  std::string address_;
  Process* coordinator_ = nullptr;
};

TEST_F(ClusterTest, ThreeWorkersFormAWorldAndAKilledOneIsDeclaredDead) {
  StartCoordinator(3);
  std::vector<Process> workers;
  for (int i = 0; i < 3; ++i) workers.push_back(StartWorker(absl::StrCat("w", i)));

  nlohmann::json status;
  ASSERT_TRUE(Eventually(
      [&] {
        status = Status();
        if (status.is_null() || status["state"] != "running") return false;
        for (const nlohmann::json& worker : status["workers"]) {
          if (worker["state"] != "ready" || worker["self_check"] != "passed") return false;
        }
        return status["workers"].size() == 3;
      },
      absl::Seconds(30)))
      << status.dump(2) << "\n" << coordinator_->Log();
  EXPECT_EQ(status["world_size"], 3);
  EXPECT_EQ(status["expected_world_size"], 3);
  std::vector<int> ranks;
  for (const nlohmann::json& worker : status["workers"]) {
    ranks.push_back(worker["rank"]);
    EXPECT_EQ(worker["host"], "127.0.0.1");
    EXPECT_EQ(worker["device"], "cpu");
    // Workers beat three times a lease; a lease without one would be a missed beat (plus the
    // slack of a loaded machine).
    EXPECT_LT(worker["last_heartbeat_ms_ago"].get<int64_t>(), absl::ToInt64Milliseconds(3 * kLease));
  }
  EXPECT_EQ(ranks, (std::vector<int>{0, 1, 2}));
  const int64_t formed_generation = status["generation"];

  // SIGKILL: no goodbye, only the missing heartbeats tell.
  const absl::Time killed_at = absl::Now();
  workers[1].Signal(SIGKILL);
  ASSERT_EQ(workers[1].Wait(absl::Seconds(5)), 128 + SIGKILL);
  absl::Duration detected_after;
  ASSERT_TRUE(Eventually(
      [&] {
        status = Status();
        const nlohmann::json* dead = status.is_null() ? nullptr : Worker(status, "w1");
        if (dead == nullptr || (*dead)["state"] != "dead") return false;
        detected_after = absl::Now() - killed_at;
        return true;
      },
      10 * kLease))
      << status.dump(2);
  std::cout << "declared dead " << absl::FormatDuration(detected_after) << " after the kill (lease "
            << absl::FormatDuration(kLease) << ")\n";
  EXPECT_GT(status["generation"].get<int64_t>(), formed_generation);
  EXPECT_EQ(status["state"], "forming");
  EXPECT_EQ(status["world_size"], 2);
  EXPECT_EQ((*Worker(status, "w1"))["rank"], -1);

  CommandResult stop = cluster_->Shardctl({"stop"}, absl::Seconds(30));
  EXPECT_EQ(stop.exit_code, 0) << stop.output;
  EXPECT_NE(stop.output.find("stopped"), std::string::npos) << stop.output;
  EXPECT_EQ(coordinator_->Wait(absl::Seconds(15)), 0) << coordinator_->Log();
  for (int i : {0, 2}) {
    EXPECT_EQ(workers[i].Wait(absl::Seconds(15)), 0) << workers[i].Log();
    EXPECT_NE(workers[i].Log().find("left the job"), std::string::npos) << workers[i].Log();
  }
}

TEST_F(ClusterTest, WorkersRegisterAManifestAndReachInitializedWithPlanVersionTwo) {
  const std::string manifest = absl::StrCat(dir_, "/manifest.json");
  std::ofstream(manifest) << R"({"params": [
    {"name": "layers.0.weight", "shape": [512, 256]}, {"name": "layers.0.bias", "shape": [512]},
    {"name": "layers.1.weight", "shape": [64, 512]}, {"name": "layers.1.bias", "shape": [64]}]})";
  StartCoordinator(3);
  std::vector<Process> workers;
  for (int i = 0; i < 3; ++i) {
    workers.push_back(StartWorker(absl::StrCat("w", i), {"--manifest", manifest}));
  }
  nlohmann::json stats;
  ASSERT_TRUE(Eventually(
      [&] {
        CommandResult result = cluster_->Shardctl({"stats", "--json"}, absl::Seconds(10));
        if (result.exit_code != 0) return false;
        stats = nlohmann::json::parse(result.output, nullptr, false);
        return !stats.is_discarded() && stats["status"] == "initialized";
      },
      absl::Seconds(30)))
      << stats.dump(2) << coordinator_->Log();
  EXPECT_EQ(stats["plan_version"], 2);
  EXPECT_TRUE(stats["pending_acks"].empty());
  ASSERT_EQ(stats["ranks"].size(), 3u);
  for (const nlohmann::json& rank : stats["ranks"]) EXPECT_EQ(rank["acked_plan_version"], 2);
  // Every worker computed the plan itself and arrived at the coordinator's hash.
  const std::string hash = stats["plan_hash"];
  for (Process& worker : workers) {
    // Rebuilt after its own report, or already rebuilt when it registered.
    EXPECT_NE(worker.Log().find(absl::StrCat(" plan v2 (hash ", hash)), std::string::npos)
        << worker.Log();
  }
  CommandResult plan = cluster_->Shardctl({"plan", "--json"}, absl::Seconds(10));
  ASSERT_EQ(plan.exit_code, 0) << plan.output;
  nlohmann::json summary = nlohmann::json::parse(plan.output);
  EXPECT_EQ(summary["hash"], hash);
  EXPECT_EQ(summary["world_size"], 3);
  int64_t owned = 0;
  for (const nlohmann::json& rank : summary["ranks"]) owned += rank["owned_numel"].get<int64_t>();
  EXPECT_EQ(owned, 512 * 256 + 512 + 64 * 512 + 64);
  CommandResult stop = cluster_->Shardctl({"stop"}, absl::Seconds(30));
  EXPECT_EQ(stop.exit_code, 0) << stop.output;
}

TEST_F(ClusterTest, OfflinePlanningUsesTheSameCodeAndValidatesInput) {
  const std::string manifest = absl::StrCat(dir_, "/manifest.json");
  std::ofstream(manifest) << R"({"params": [{"name": "w", "shape": [1000, 100]},
                                             {"name": "b", "shape": [1000]}]})";
  CommandResult plan = RunCommand({BinaryPath("shardctl"), "plan", "--manifest", manifest,
                                   "--world-size", "4", "--mode", "param", "--json"},
                                  absl::Seconds(10));
  ASSERT_EQ(plan.exit_code, 0) << plan.output;
  nlohmann::json summary = nlohmann::json::parse(plan.output);
  EXPECT_EQ(summary["mode"], "param");
  EXPECT_EQ(summary["ranks"].size(), 4u);
  EXPECT_DOUBLE_EQ(summary["imbalance"].get<double>(), 100000.0 * 4 / 101000.0);

  std::ofstream(manifest, std::ios::trunc) << R"({"params": [{"name": "w", "shape": [0]}]})";
  CommandResult bad = RunCommand(
      {BinaryPath("shardctl"), "plan", "--manifest", manifest, "--world-size", "4"},
      absl::Seconds(10));
  EXPECT_EQ(bad.exit_code, 1);
  EXPECT_NE(bad.output.find("dimension 0 of size 0"), std::string::npos) << bad.output;
  CommandResult no_world = RunCommand({BinaryPath("shardctl"), "plan", "--manifest", manifest},
                                      absl::Seconds(10));
  EXPECT_EQ(no_world.exit_code, 2) << no_world.output;
}

// A job spec for the small MLP, with its data generated by shardctl.
std::string WriteTrainingJob(const std::string& dir, int world, int64_t global_batch,
                             const std::string& extra = "") {
  CommandResult data = RunCommand({BinaryPath("shardctl"), "data", "generate", "--widths",
                                   "32,64,10", "--samples", "2048", "--seed", "5", "--out",
                                   dir + "/data.safetensors"},
                                  absl::Seconds(30));
  EXPECT_EQ(data.exit_code, 0) << data.output;
  const std::string path = dir + "/job.json";
  std::ofstream(path) << absl::StrCat(R"({"name": "train-test", "worldSize": )", world, R"(,
    "model": {"mlp": {"widths": [32, 64, 10]}}, "data": {"path": "data.safetensors"},
    "optimizer": {"name": "adam", "lr": 0.003}, "globalBatch": )", global_batch, R"(,
    "steps": 40, "zeroStage": 2, "bucketCapMb": 0.004, "outputDir": "out",
    "snapshot": {"everySteps": 0})", extra, "}");
  return path;
}

TEST_F(ClusterTest, ThreeWorkersTrainTheJobAndTheCoordinatorFinishesOnItsOwn) {
  const std::string job = WriteTrainingJob(dir_, 3, 48);
  StartCoordinatorWith({"--job", job, "--lease", "2s", "--state-dir", absl::StrCat(dir_, "/state")});
  std::vector<Process> workers;
  for (int i = 0; i < 3; ++i) workers.push_back(StartWorker(absl::StrCat("t", i)));

  EXPECT_EQ(coordinator_->Wait(absl::Seconds(60)), 0) << coordinator_->Log();
  for (Process& worker : workers) {
    EXPECT_EQ(worker.Wait(absl::Seconds(10)), 0) << worker.Log();
  }
  // The buckets were rebuilt after the first step and every worker applied the new plan.
  EXPECT_NE(coordinator_->Log().find("overlap status INITIALIZED: every worker applied plan v2"),
            std::string::npos)
      << coordinator_->Log();

  // Rank 0 wrote the consolidated parameters with the brief's names and shapes.
  const std::string coordinator_log = coordinator_->Log();
  EXPECT_NE(coordinator_log.find("training finished (40 steps"), std::string::npos)
      << coordinator_log;
  const std::string output = absl::StrCat(dir_, "/out/final.safetensors");
  ASSERT_TRUE(std::filesystem::exists(output));
  std::string all_logs;
  for (Process& worker : workers) all_logs += worker.Log();
  EXPECT_NE(all_logs.find("step 40/40 loss "), std::string::npos) << all_logs;
  // The loss fell: first and last as logged by rank 0.
  const size_t done = all_logs.find("training finished: 40 steps, loss ");
  ASSERT_NE(done, std::string::npos) << all_logs;
  double first = 0, last = 0;
  ASSERT_EQ(std::sscanf(all_logs.c_str() + done, "training finished: 40 steps, loss %lf -> %lf",
                        &first, &last),
            2);
  EXPECT_LT(last, 0.8 * first) << all_logs;
}

// A worker whose error would come back wherever it restarts (here shard-worker started for a job
// whose model a training script brings) fails the job once more workers than
// --max-worker-failures have exited with an error: the coordinator exits 1, and started again
// as it was it has nothing to run and exits 1 again.
TEST_F(ClusterTest, WorkersThatKeepFailingFailTheJobAndTheCoordinatorExitsOne) {
  const std::string job = dir_ + "/job.json";
  std::ofstream(job) << R"({"name": "fails", "worldSize": 2, "model": {"external": {}},
    "optimizer": {"name": "adam", "lr": 0.001}, "globalBatch": 8, "steps": 10,
    "outputDir": "out"})";
  const std::string state = dir_ + "/state";
  StartCoordinatorWith(
      {"--job", job, "--lease", "2s", "--max-worker-failures", "1", "--state-dir", state});
  Process first = StartWorker("f0");
  EXPECT_EQ(first.Wait(absl::Seconds(30)), 1) << first.Log();
  EXPECT_NE(first.Log().find("start the training script"), std::string::npos) << first.Log();
  // One failure is within the limit: the job waits for workers.
  EXPECT_EQ(Status()["state"], "forming") << coordinator_->Log();

  Process again = StartWorker("f0");  // its pod restarted, with the same error
  EXPECT_EQ(again.Wait(absl::Seconds(30)), 1) << again.Log();
  EXPECT_EQ(coordinator_->Wait(absl::Seconds(30)), 1) << coordinator_->Log();
  const std::string log = coordinator_->Log();
  EXPECT_NE(log.find("2 workers exited with an error (more than --max-worker-failures 1)"),
            std::string::npos)
      << log;
  EXPECT_NE(log.find("job 'fails' failed: every worker has left"), std::string::npos) << log;

  CommandResult restarted =
      RunCommand({BinaryPath("shard-coordinator"), "--listen", "127.0.0.1:0", "--job", job,
                  "--state-dir", state},
                 absl::Seconds(30));
  EXPECT_EQ(restarted.exit_code, 1) << restarted.output;
  EXPECT_NE(restarted.output.find("had failed"), std::string::npos) << restarted.output;
}

TEST_F(ClusterTest, ABadJobIsRefusedBeforeAnyWorkerStarts) {
  const std::string job = WriteTrainingJob(dir_, 3, 50);  // 50 does not divide over 3
  CommandResult indivisible = RunCommand(
      {BinaryPath("shard-coordinator"), "--listen", "127.0.0.1:0", "--job", job}, absl::Seconds(10));
  EXPECT_EQ(indivisible.exit_code, 2) << indivisible.output;
  EXPECT_NE(indivisible.output.find("does not divide evenly over 3"), std::string::npos)
      << indivisible.output;

  const std::string good = WriteTrainingJob(dir_, 2, 50);
  std::filesystem::resize_file(dir_ + "/data.safetensors", 1000);  // truncated
  CommandResult truncated = RunCommand(
      {BinaryPath("shard-coordinator"), "--listen", "127.0.0.1:0", "--job", good},
      absl::Seconds(10));
  EXPECT_EQ(truncated.exit_code, 2) << truncated.output;
  EXPECT_NE(truncated.output.find("data.safetensors"), std::string::npos) << truncated.output;
  EXPECT_NE(truncated.output.find("not a valid safetensors file"), std::string::npos)
      << truncated.output;

  const std::string unknown = WriteTrainingJob(dir_, 2, 50, R"(, "learningRate": 1)");
  CommandResult bad_field = RunCommand(
      {BinaryPath("shard-coordinator"), "--listen", "127.0.0.1:0", "--job", unknown},
      absl::Seconds(10));
  EXPECT_EQ(bad_field.exit_code, 2) << bad_field.output;
  EXPECT_NE(bad_field.output.find("learningRate"), std::string::npos) << bad_field.output;
}

// What an operator asks first: shardctl status says the step, loss, rate, ETA, last checkpoint
// and overlap, as text and JSON; --watch refreshes until the job stops.
TEST_F(ClusterTest, StatusSaysTheStepLossRateEtaAndLastCheckpointAndWatchFollowsTheJob) {
  constexpr int64_t kSteps = 1000000;  // longer than the test: it stops the job itself
  std::string text;
  {
    // Every checkpoint kept: the one status names is still listed when the test looks.
    std::ifstream in(WriteTrainingJob(dir_, 2, 24,
                                      R"(, "checkpoint": {"everySteps": 10, "keepLast": 100000})"));
    text.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  text.replace(text.find("\"steps\": 40"), 11, absl::StrCat("\"steps\": ", kSteps));
  std::ofstream(dir_ + "/job.json", std::ios::trunc) << text;
  StartCoordinatorWith({"--job", dir_ + "/job.json", "--state-dir", dir_ + "/state"});
  // Before any step: the step is 0 of the job's, nothing else is known yet.
  nlohmann::json status = Status();
  ASSERT_FALSE(status.is_null());
  EXPECT_EQ(status["progress"]["step"], 0);
  EXPECT_EQ(status["progress"]["steps"], kSteps);
  EXPECT_TRUE(status["progress"]["loss"].is_null()) << status.dump(2);
  EXPECT_TRUE(status["progress"]["eta_ms"].is_null()) << status.dump(2);
  EXPECT_TRUE(status["progress"]["last_checkpoint"].is_null()) << status.dump(2);

  std::vector<Process> workers;
  // A few hundred steps a second, not thousands: checkpoints every 10 steps stay few.
  for (const std::string id : {"p0", "p1"}) {
    workers.push_back(cluster_->StartWorker(id, {}, {"SHARD_SLOW_STEP_MS=5"}));
  }
  auto watched = Process::Start({BinaryPath("shardctl"), "--coordinator", address_, "status",
                                 "--watch", "--json", "--interval", "50ms"},
                                dir_ + "/watch.jsonl");
  ASSERT_TRUE(watched.ok()) << watched.status();
  ASSERT_TRUE(Eventually(
      [&] {
        status = Status();
        return !status.is_null() && status["progress"]["step"] >= 100 &&
               !status["progress"]["last_checkpoint"].is_null() &&
               !status["progress"]["eta_ms"].is_null();
      },
      absl::Seconds(60)))
      << status.dump(2) << coordinator_->Log();
  const nlohmann::json& progress = status["progress"];
  const int64_t step = progress["step"];
  EXPECT_GT(progress["loss"].get<double>(), 0);
  const double rate = progress["steps_per_second"];
  ASSERT_GT(rate, 0);
  // The ETA is the steps left at the rate shown.
  EXPECT_NEAR(progress["eta_ms"].get<double>(), 1000.0 * static_cast<double>(kSteps - step) / rate,
              1 + 1e-3 * progress["eta_ms"].get<double>());
  // The last checkpoint is a committed one, of a step already trained, and was just written.
  const int64_t saved_step = progress["last_checkpoint_step"];
  EXPECT_EQ(saved_step % 10, 0);
  // A checkpoint commits as soon as its shards are in, and the step it was taken at can reach
  // the status a heartbeat later: the trained step shown catches up with it.
  EXPECT_TRUE(Eventually(
      [&] {
        const nlohmann::json now = Status();
        return !now.is_null() && now["progress"]["step"] >= saved_step;
      },
      absl::Seconds(10)))
      << "the step shown never reached the last checkpoint's step " << saved_step;
  EXPECT_GE(progress["last_checkpoint_age_ms"].get<int64_t>(), 0);
  bool listed = false;
  for (const nlohmann::json& checkpoint : cluster_->Checkpoints()) {
    listed |= checkpoint["id"] == progress["last_checkpoint"] && checkpoint["step"] == saved_step;
  }
  EXPECT_TRUE(listed) << progress.dump(2);
  // A fraction (this model's backward is too short to hide much; plan_manager_test checks the
  // arithmetic).
  EXPECT_GE(progress["overlap_fraction"].get<double>(), 0);
  EXPECT_LE(progress["overlap_fraction"].get<double>(), 1);

  const CommandResult shown = cluster_->Shardctl({"status"});
  ASSERT_EQ(shown.exit_code, 0) << shown.output;
  EXPECT_NE(shown.output.find(absl::StrCat("/", kSteps, ", loss ")), std::string::npos)
      << shown.output;
  EXPECT_NE(shown.output.find(" steps/s, ETA "), std::string::npos) << shown.output;
  EXPECT_NE(shown.output.find("last checkpoint: step-"), std::string::npos) << shown.output;

  ASSERT_EQ(cluster_->Shardctl({"stop"}, absl::Seconds(60)).exit_code, 0);
  EXPECT_EQ(watched->Wait(absl::Seconds(30)), 0) << watched->Log();
  // One status per refresh, training moving forward, until the job stopped or its coordinator
  // exited.
  std::vector<nlohmann::json> seen;
  std::istringstream lines(watched->Log());
  for (std::string line; std::getline(lines, line);) {
    nlohmann::json parsed = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!parsed.is_discarded()) seen.push_back(std::move(parsed));
  }
  ASSERT_GE(seen.size(), 3u) << watched->Log();
  for (size_t i = 1; i < seen.size(); ++i) {
    EXPECT_GE(seen[i]["progress"]["step"], seen[i - 1]["progress"]["step"]) << watched->Log();
  }
  EXPECT_GT(seen.back()["progress"]["step"], seen.front()["progress"]["step"]);
  const bool stopped = seen.back()["state"] == "finished";
  EXPECT_TRUE(stopped || watched->Log().find("the coordinator has exited") != std::string::npos)
      << watched->Log();
  for (Process& worker : workers) EXPECT_EQ(worker.Wait(absl::Seconds(20)), 0) << worker.Log();
}

TEST_F(ClusterTest, ACrashAtAnyPointOfASaveLeavesThePreviousCheckpointIntact) {
  const std::string job = WriteTrainingJob(
      dir_, 2, 24, R"(, "checkpoint": {"everySteps": 10, "keepLast": 10})");
  // Train far longer than the test runs; the test kills everything itself.
  std::string text;
  {
    std::ifstream in(job);
    text.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  text.replace(text.find("\"steps\": 40"), 11, "\"steps\": 1000000");
  std::ofstream(job, std::ios::trunc) << text;
  const std::string state = dir_ + "/state";
  int phase = 0;
  // The catalog as the coordinator of the latest phase listed it before its workers started.
  std::vector<nlohmann::json> listed_at_start;
  // Starts the coordinator (restoring the latest checkpoint after the first phase) and 2
  // workers, each with `*_env` in its environment.
  auto start = [&](const std::vector<std::string>& coordinator_env,
                   const std::vector<std::string>& worker_env) {
    ++phase;
    std::vector<std::string> args = {"--job", job, "--state-dir", state, "--lease", "2s"};
    if (phase > 1) {
      args.push_back("--restore");
      args.push_back("latest");
    }
    StartCoordinatorWith(args, absl::StrCat("coordinator", phase, ".log"), coordinator_env);
    listed_at_start = cluster_->Checkpoints();
    std::vector<Process> processes;
    processes.push_back(std::move(*coordinator_));
    for (int i = 0; i < 2; ++i) {
      auto worker = Process::Start(
          {BinaryPath("shard-worker"), "--coordinator", address_, "--id", absl::StrCat("c", i),
           "--coordinator-timeout", "5s"},
          absl::StrCat(dir_, "/worker", i, "-", phase, ".log"), worker_env);
      EXPECT_TRUE(worker.ok());
      processes.push_back(std::move(*worker));
    }
    return processes;
  };
  auto kill_all = [](std::vector<Process>& processes) {
    for (Process& p : processes) {
      p.Signal(SIGKILL);
      p.Wait(absl::Seconds(10));
    }
  };

  // A healthy run until two checkpoints are committed.
  std::vector<Process> processes = start({}, {});
  ASSERT_TRUE(Eventually([&] { return cluster_->Checkpoints().size() >= 2; }, absl::Seconds(60)))
      << processes[0].Log();
  kill_all(processes);
  // A faulty save commits nothing, so each faulty phase starts with the catalog of the one
  // before; `before` is what the healthy phase left.
  std::optional<std::vector<nlohmann::json>> before;

  struct Fault {
    std::string point;
    bool in_coordinator;
  };
  for (const Fault& fault : {Fault{"shard-before-sync", false},
                             Fault{"manifest-before-write", true},
                             Fault{"manifest-before-rename", true}}) {
    SCOPED_TRACE(fault.point);
    const std::vector<std::string> env = {"SHARD_FAULT=" + fault.point};
    processes = start(fault.in_coordinator ? env : std::vector<std::string>{},
                      fault.in_coordinator ? std::vector<std::string>{} : env);
    if (!before.has_value()) before = listed_at_start;
    ASSERT_GE(before->size(), 2u);
    EXPECT_EQ(listed_at_start, *before) << "the previous faulty save changed the catalog";
    // The faulty process kills itself at its first save.
    Process& faulty = fault.in_coordinator ? processes[0] : processes[1];
    ASSERT_EQ(faulty.Wait(absl::Seconds(60)), 128 + SIGKILL) << faulty.Log();
    kill_all(processes);
    // A partial directory was left, and what was there still verifies.
    bool partial = false;
    for (const auto& entry : std::filesystem::directory_iterator(dir_ + "/out/checkpoints/train-test")) {
      partial = partial || !std::filesystem::exists(entry.path() / "manifest.json");
    }
    EXPECT_TRUE(partial);
    for (const nlohmann::json& checkpoint : *before) {
      CommandResult verify = RunCommand({BinaryPath("shardctl"), "checkpoint", "verify", "--path",
                                         checkpoint["dir"].get<std::string>()},
                                        absl::Seconds(30));
      EXPECT_EQ(verify.exit_code, 0) << verify.output;
    }
  }

  // A clean start removes the partial saves, restores the intact latest checkpoint, and goes on
  // committing.
  processes = start({}, {});
  const std::vector<nlohmann::json> intact = listed_at_start;
  EXPECT_EQ(intact, *before) << "the last faulty save changed the catalog";
  ASSERT_TRUE(Eventually([&] { return cluster_->Checkpoints().size() > intact.size(); },
                         absl::Seconds(60)))
      << processes[0].Log();
  EXPECT_NE(processes[1].Log().find("restoring from checkpoint " +
                                    intact.back()["id"].get<std::string>()),
            std::string::npos)
      << processes[1].Log();
  EXPECT_NE(processes[0].Log().find("a checkpoint that never committed"), std::string::npos)
      << processes[0].Log();
  kill_all(processes);
}

TEST_F(ClusterTest, ExportingACheckpointLargerThanItsBufferKeepsMemoryBounded) {
  // A 256 MiB checkpoint (two ranks, one 64M-element parameter, no optimizer state) written
  // directly in the format; the export buffer is 4 MiB.
  const Manifest model{{ParamSpec{"big", {8192, 8192}, DataType::kFloat32, true}}};
  PlanOptions options;
  options.world_size = 2;
  auto plan = MakePlan(model, options);
  ASSERT_TRUE(plan.ok());
  const std::string dir = CheckpointDirectory(dir_ + "/checkpoints", "job", "step-00000001");
  std::vector<ShardRecord> records;
  std::vector<float> chunk(1 << 20, 0.5f);
  for (int rank = 0; rank < 2; ++rank) {
    const ShardLayout layout = MakeShardLayout(model, *plan, rank, 0);
    auto writer = ShardWriter::Create(dir, rank, 2);
    ASSERT_TRUE(writer.ok());
    for (uint64_t written = 0; written < layout.bytes;) {
      const uint64_t bytes = std::min<uint64_t>(chunk.size() * 4, layout.bytes - written);
      ASSERT_TRUE((*writer)->Append(chunk.data(), bytes).ok());
      written += bytes;
    }
    records.push_back(*(*writer)->Finish());
  }
  OptimizerConfig sgd;
  sgd.kind = OptimizerKind::kSgd;
  auto manifest = MakeCheckpointManifest("job", "step-00000001", 1, 2, model, *plan, sgd, {},
                                         records);
  ASSERT_TRUE(manifest.ok()) << manifest.status();
  ASSERT_TRUE(CommitCheckpoint(dir, *manifest).ok());

  CommandResult exported = RunCommand(
      {BinaryPath("shardctl"), "checkpoint", "export", "--path", dir, "--out",
       dir_ + "/export.safetensors", "--buffer-mb", "4"},
      absl::Seconds(120));
  ASSERT_EQ(exported.exit_code, 0) << exported.output;
  auto file = SafetensorsReader::Open(dir_ + "/export.safetensors");
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_TRUE((*file)->Expect("big", DataType::kFloat32, {8192, 8192}).ok());
  // The 4 MiB buffer, one verified 4 MiB block, and the program itself: far below the 256 MiB
  // a whole-model exporter would hold.
  EXPECT_LT(exported.max_rss_kb, 64 * 1024) << "peak RSS " << exported.max_rss_kb << " KiB";
  std::cout << "export of 256 MiB with a 4 MiB buffer: peak RSS " << exported.max_rss_kb / 1024
            << " MiB\n";
}

TEST_F(ClusterTest, SigtermMakesAWorkerLeaveCleanly) {
  StartCoordinator(1);
  Process worker = StartWorker("solo");
  nlohmann::json status;
  ASSERT_TRUE(Eventually(
      [&] {
        status = Status();
        return !status.is_null() && status["state"] == "running" &&
               status["workers"][0]["state"] == "ready";
      },
      absl::Seconds(20)))
      << status.dump(2);
  worker.Signal(SIGTERM);
  EXPECT_EQ(worker.Wait(absl::Seconds(10)), 0) << worker.Log();
  status = Status();
  ASSERT_FALSE(status.is_null());
  EXPECT_EQ((*Worker(status, "solo"))["state"], "left");
  coordinator_->Signal(SIGTERM);
  EXPECT_EQ(coordinator_->Wait(absl::Seconds(10)), 0) << coordinator_->Log();
}

TEST_F(ClusterTest, ATakenRankWaitsForItsHolderAndAnExtraWorkerStandsBy) {
  StartCoordinatorWith({"--world-size", "2", "--lease", absl::FormatDuration(kLease),
                        "--state-dir", absl::StrCat(dir_, "/state"), "--max-standbys", "1"});
  Process w0 = StartWorker("w0", {"--rank", "0"});
  ASSERT_TRUE(Eventually([&] {
    nlohmann::json status = Status();
    return !status.is_null() && status["world_size"] == 1;
  }, absl::Seconds(20)));

  // A worker asking for a held rank waits for it (a replacement started before its
  // predecessor's death is detected) instead of exiting.
  Process successor = StartWorker("successor", {"--rank", "0"});
  ASSERT_TRUE(Eventually(
      [&] { return successor.Log().find("rank 0 is held by live worker 'w0'") != std::string::npos; },
      absl::Seconds(20)))
      << successor.Log();
  EXPECT_FALSE(successor.Exited()) << successor.Log();
  w0.Signal(SIGKILL);
  ASSERT_EQ(w0.Wait(absl::Seconds(5)), 128 + SIGKILL);
  nlohmann::json status;
  ASSERT_TRUE(Eventually(
      [&] {
        status = Status();
        const nlohmann::json* taken = status.is_null() ? nullptr : Worker(status, "successor");
        return taken != nullptr && (*taken)["rank"] == 0;
      },
      10 * kLease))
      << status.dump(2) << successor.Log();

  // A full world keeps an extra worker as a standby, and tells one more than --max-standbys to
  // come back later; neither exits.
  Process w1 = StartWorker("w1");
  ASSERT_TRUE(Eventually([&] {
    status = Status();
    return !status.is_null() && status["state"] == "running";
  }, absl::Seconds(20))) << status.dump(2);
  Process extra = StartWorker("extra");
  ASSERT_TRUE(Eventually(
      [&] {
        status = Status();
        const nlohmann::json* standby = status.is_null() ? nullptr : Worker(status, "extra");
        return standby != nullptr && (*standby)["state"] == "standby" && status["standby"] == 1;
      },
      absl::Seconds(20)))
      << status.dump(2) << extra.Log();
  EXPECT_EQ((*Worker(status, "extra"))["rank"], -1);
  Process surplus = StartWorker("surplus");
  ASSERT_TRUE(Eventually(
      [&] { return surplus.Log().find("the world is full") != std::string::npos; },
      absl::Seconds(20)))
      << surplus.Log();
  EXPECT_NE(surplus.Log().find("--max-standbys"), std::string::npos) << surplus.Log();
  EXPECT_FALSE(extra.Exited()) << extra.Log();
  EXPECT_FALSE(surplus.Exited()) << surplus.Log();
}

TEST_F(ClusterTest, UnreachableCoordinatorIsAClearErrorNotAHang) {
  // Nothing listens on port 1.
  CommandResult shardctl = RunCommand(
      {BinaryPath("shardctl"), "--coordinator", "127.0.0.1:1", "--timeout", "2s", "status"},
      absl::Seconds(20));
  EXPECT_EQ(shardctl.exit_code, 1) << shardctl.output;
  EXPECT_NE(shardctl.output.find("cannot reach the coordinator at 127.0.0.1:1"), std::string::npos)
      << shardctl.output;

  CommandResult worker = RunCommand({BinaryPath("shard-worker"), "--coordinator", "127.0.0.1:1",
                                     "--id", "lonely", "--coordinator-timeout", "2s"},
                                    absl::Seconds(30));
  EXPECT_EQ(worker.exit_code, 1) << worker.output;
  EXPECT_NE(worker.output.find("cannot reach the coordinator at 127.0.0.1:1"), std::string::npos)
      << worker.output;
  EXPECT_LT(worker.elapsed, absl::Seconds(15));
}

TEST_F(ClusterTest, UnknownFlagsAndBadValuesAreUsageErrors) {
  struct Case {
    std::vector<std::string> argv;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {{BinaryPath("shard-coordinator"), "--world-size", "2", "--bogus"}, "--bogus"},
      {{BinaryPath("shard-coordinator")}, "--job FILE or --world-size N"},
      {{BinaryPath("shard-coordinator"), "--world-size", "2", "--lease", "soon"}, "soon"},
      {{BinaryPath("shard-coordinator"), "--world-size", "0"}, "--world-size"},
      {{BinaryPath("shard-worker"), "--bogus"}, "--bogus"},
      {{BinaryPath("shard-worker"), "--id", "a/b"}, "worker id"},
      {{BinaryPath("shard-worker"), "--device", "tpu:0"}, "tpu:0"},
      {{BinaryPath("shardctl"), "status", "--bogus"}, "--bogus"},
      {{BinaryPath("shardctl")}, "subcommand"},
  };
  for (const Case& c : cases) {
    CommandResult result = RunCommand(c.argv, absl::Seconds(10));
    EXPECT_EQ(result.exit_code, 2) << c.argv.back() << ": " << result.output;
    EXPECT_NE(result.output.find(c.expected), std::string::npos)
        << "expected '" << c.expected << "' in: " << result.output;
  }
  CommandResult help = RunCommand({BinaryPath("shardctl"), "--help"}, absl::Seconds(10));
  EXPECT_EQ(help.exit_code, 0);
  EXPECT_NE(help.output.find("status"), std::string::npos);
}

TEST_F(ClusterTest, ASecondCoordinatorCannotShareTheStateDirectory) {
  const std::string state = absl::StrCat(dir_, "/shared-state");
  StartCoordinator(1, state);
  CommandResult second = RunCommand({BinaryPath("shard-coordinator"), "--listen", "127.0.0.1:0",
                                     "--world-size", "1", "--state-dir", state},
                                    absl::Seconds(10));
  EXPECT_EQ(second.exit_code, 1) << second.output;
  EXPECT_NE(second.output.find("in use by another shard-coordinator"), std::string::npos)
      << second.output;
}

}  // namespace
}  // namespace shard::testing
