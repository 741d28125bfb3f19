// shard-bench-recovery: how long a lost worker stops a job. Real shard-coordinator and
// shard-worker processes on 127.0.0.1 train the medium MLP (512,1024,1024,64) with a checkpoint
// every --every steps; once two checkpoints are committed one worker is killed (SIGKILL: a
// crash) or stopped (SIGSTOP: a hang). Measured from the signal, from the processes' own log
// lines (millisecond timestamps):
//   detect   the coordinator declares the worker dead          (reference: the lease)
//   abort    the last survivor is out of its collective and waiting for the next generation
//   re-form  the coordinator forms the smaller world             (detect + the reform grace)
//   resume   the re-formed world has restored the latest checkpoint and finished a step
// and, as the same run's reference for the last part, a cold start of the same job: from the
// workers' "training job" line (world formed, plan applied) to their first step.
#include <signal.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/cli.h"
#include "tests/support/cluster.h"
#include "tests/support/process.h"

namespace shard {
namespace {

using testing::Eventually;
using testing::FirstLineAfter;
using testing::LocalCluster;
using testing::Process;

struct Flags {
  int workers = 4;
  int trials = 3;
  int every = 20;
  std::string lease = "1s";
  std::string grace = "1s";
  std::string signal = "kill";
  std::string widths = "512,1024,1024,64";
};

struct Trial {
  double detect_ms = 0;
  double abort_ms = 0;
  double reform_ms = 0;
  double resume_ms = 0;     // signal -> first step after the restore
  double restart_ms = 0;    // re-formed -> first step after the restore
  double cold_start_ms = 0;  // first run: "training job" -> first step
};

double Milliseconds(absl::Duration d) { return absl::ToDoubleMilliseconds(d); }

// The latest time `text` appears at or after `since` in any of `logs` (the slowest process).
std::optional<absl::Time> Slowest(const std::vector<std::string>& logs, absl::Time since,
                                  const std::string& text) {
  std::optional<absl::Time> slowest;
  for (const std::string& log : logs) {
    std::optional<absl::Time> at = FirstLineAfter(log, since, text);
    if (!at.has_value()) return std::nullopt;
    if (!slowest.has_value() || *at > *slowest) slowest = at;
  }
  return slowest;
}

// The earliest time `text` appears at or after `since` in any of `logs` (rank 0 logs once).
std::optional<absl::Time> Earliest(const std::vector<std::string>& logs, absl::Time since,
                                   const std::string& text) {
  std::optional<absl::Time> earliest;
  for (const std::string& log : logs) {
    std::optional<absl::Time> at = FirstLineAfter(log, since, text);
    if (at.has_value() && (!earliest.has_value() || *at < *earliest)) earliest = at;
  }
  return earliest;
}

absl::StatusOr<Trial> RunTrial(const Flags& flags, int index) {
  const std::string dir = testing::MakeTempDir(absl::StrCat("bench-recovery-", index));
  testing::CommandResult data = testing::RunCommand(
      {testing::BinaryPath("shardctl"), "data", "generate", "--widths", flags.widths,
       "--samples", "16384", "--seed", "1", "--out", dir + "/data.safetensors"},
      absl::Seconds(60));
  if (data.exit_code != 0) return absl::InternalError("data generate failed: " + data.output);
  // 64 samples per worker at either size.
  const int batch = 64 * flags.workers * (flags.workers - 1) /
                    std::gcd(flags.workers, flags.workers - 1);
  std::ofstream(dir + "/job.json") << absl::StrCat(
      R"({"name": "recovery", "worldSize": )", flags.workers, R"(, "minWorldSize": )",
      flags.workers - 1, R"(, "model": {"mlp": {"widths": [)", flags.widths,
      R"(]}}, "data": {"path": "data.safetensors"}, "seed": 42,
      "optimizer": {"name": "adam", "lr": 0.001}, "globalBatch": )", batch,
      R"(, "steps": 1000000, "zeroStage": 2, "bucketCapMb": 4,
      "checkpoint": {"everySteps": )", flags.every, R"(, "keepLast": 2}, "outputDir": "out"})");

  LocalCluster cluster(dir);
  absl::Status started = cluster.StartCoordinator(
      {"--job", dir + "/job.json", "--state-dir", dir + "/state", "--lease", flags.lease,
       "--reform-grace", flags.grace});
  if (!started.ok()) return started;
  std::vector<Process> workers;
  for (int i = 0; i < flags.workers; ++i) {
    workers.push_back(cluster.StartWorker(absl::StrCat("w", i), {"--compute-threads", "1"}));
  }
  auto stop_all = [&] {
    cluster.Shardctl({"stop", "--no-wait"}, absl::Seconds(10));
    for (Process& worker : workers) worker.Signal(SIGKILL);
    cluster.coordinator().Signal(SIGKILL);
  };
  if (!Eventually([&] { return cluster.Checkpoints().size() >= 2; },
                  absl::Seconds(180))) {
    stop_all();
    return absl::DeadlineExceededError("no two checkpoints within 180 s; logs in " + dir);
  }
  std::vector<std::string> first_logs;
  for (Process& worker : workers) first_logs.push_back(worker.Log());
  const std::optional<absl::Time> training = Earliest(first_logs, absl::InfinitePast(),
                                                      "training job '");
  const std::optional<absl::Time> first_step =
      Earliest(first_logs, absl::InfinitePast(), "first step of this run done");

  const absl::Time signaled = absl::Now();
  Process& victim = workers.back();
  victim.Signal(flags.signal == "kill" ? SIGKILL : SIGSTOP);
  std::vector<Process*> survivors;
  for (int i = 0; i + 1 < flags.workers; ++i) survivors.push_back(&workers[i]);
  auto survivor_logs = [&] {
    std::vector<std::string> logs;
    for (Process* survivor : survivors) logs.push_back(survivor->Log());
    return logs;
  };
  const bool resumed = Eventually(
      [&] {
        return Earliest(survivor_logs(), signaled, "first step of this run done").has_value();
      },
      absl::Seconds(120));
  const std::string coordinator_log = cluster.coordinator().Log();
  const std::vector<std::string> logs = survivor_logs();
  if (flags.signal == "stop") victim.Signal(SIGKILL);
  stop_all();
  if (!resumed) return absl::DeadlineExceededError("the job did not resume; logs in " + dir);

  const std::optional<absl::Time> dead = FirstLineAfter(coordinator_log, signaled, "declared dead");
  const std::optional<absl::Time> aborted = Slowest(logs, signaled, "waiting for the next");
  const std::optional<absl::Time> reformed =
      FirstLineAfter(coordinator_log, signaled, "re-forming with");
  const std::optional<absl::Time> resumed_at =
      Earliest(logs, signaled, "first step of this run done");
  if (!dead || !aborted || !reformed || !resumed_at || !training || !first_step) {
    return absl::InternalError("a log line the benchmark reads is missing; logs in " + dir);
  }
  std::filesystem::remove_all(dir);
  return Trial{Milliseconds(*dead - signaled),     Milliseconds(*aborted - signaled),
               Milliseconds(*reformed - signaled), Milliseconds(*resumed_at - signaled),
               Milliseconds(*resumed_at - *reformed), Milliseconds(*first_step - *training)};
}

double Median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

int Main(int argc, char** argv) {
  CLI::App app{
      "shard-bench-recovery: time from losing one of N CPU workers (SIGKILL or SIGSTOP) to "
      "the job training again on N-1, from real coordinator and worker processes on 127.0.0.1 "
      "training the medium MLP: detect (vs the lease), abort of the survivors, re-form (detect "
      "+ grace), resume (restore of the latest checkpoint + one step, vs a cold start of the "
      "same job in the same run). Prints every trial and the medians.",
      "shard-bench-recovery"};
  Flags flags;
  app.add_option("--workers", flags.workers, "workers at the start (one is lost)")
      ->capture_default_str()
      ->check(CLI::Range(2, 16));
  app.add_option("--trials", flags.trials, "independent runs")->capture_default_str()
      ->check(CLI::Range(1, 100));
  app.add_option("--every", flags.every, "checkpoint every this many steps")
      ->capture_default_str()
      ->check(CLI::Range(1, 100000));
  app.add_option("--lease", flags.lease, "coordinator --lease")->capture_default_str()
      ->check(DurationValidator());
  app.add_option("--grace", flags.grace, "coordinator --reform-grace")->capture_default_str()
      ->check(DurationValidator());
  app.add_option("--signal", flags.signal, "kill (a crash) or stop (a hang)")
      ->capture_default_str()
      ->check(CLI::IsMember({"kill", "stop"}));
  app.add_option("--widths", flags.widths, "MLP widths")->capture_default_str();
  if (std::optional<int> exit_code = ParseCommandLine(app, argc, argv)) return *exit_code;

  std::printf("%d CPU workers, MLP %s, SIG%s one after two checkpoints (every %d steps), lease "
              "%s, reform grace %s; times in ms from the signal\n",
              flags.workers, flags.widths.c_str(), flags.signal == "kill" ? "KILL" : "STOP",
              flags.every, flags.lease.c_str(), flags.grace.c_str());
  std::printf("%-6s %8s %8s %8s %8s | %14s %14s\n", "trial", "detect", "abort", "re-form",
              "resume", "re-form->step", "cold start");
  std::vector<Trial> trials;
  for (int i = 0; i < flags.trials; ++i) {
    absl::StatusOr<Trial> trial = RunTrial(flags, i);
    if (!trial.ok()) {
      std::fprintf(stderr, "trial %d: %s\n", i, std::string(trial.status().message()).c_str());
      return 1;
    }
    std::printf("%-6d %8.0f %8.0f %8.0f %8.0f | %14.0f %14.0f\n", i, trial->detect_ms,
                trial->abort_ms, trial->reform_ms, trial->resume_ms, trial->restart_ms,
                trial->cold_start_ms);
    std::fflush(stdout);
    trials.push_back(*trial);
  }
  auto median = [&](double Trial::*field) {
    std::vector<double> values;
    for (const Trial& trial : trials) values.push_back(trial.*field);
    return Median(values);
  };
  const double lease_ms = Milliseconds(ParsedDuration(flags.lease));
  const double grace_ms = Milliseconds(ParsedDuration(flags.grace));
  std::printf("%-6s %8.0f %8.0f %8.0f %8.0f | %14.0f %14.0f\n", "median",
              median(&Trial::detect_ms), median(&Trial::abort_ms), median(&Trial::reform_ms),
              median(&Trial::resume_ms), median(&Trial::restart_ms),
              median(&Trial::cold_start_ms));
  std::printf("detect = %.2fx the lease; re-form - detect - grace = %.0f ms; restart after "
              "re-form = %.2fx a cold start of the same job\n",
              median(&Trial::detect_ms) / lease_ms,
              median(&Trial::reform_ms) - median(&Trial::detect_ms) - grace_ms,
              median(&Trial::restart_ms) / median(&Trial::cold_start_ms));
  return 0;
}

}  // namespace
}  // namespace shard

int main(int argc, char** argv) { return shard::Main(argc, argv); }
