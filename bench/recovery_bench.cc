// shard-bench-recovery: how long a lost worker stops a job, and how many steps it costs, when
// the new world restores from memory (peers' snapshots) and when it restores from disk, in the
// same run. Real shard-coordinator and shard-worker processes on 127.0.0.1 train an MLP (the
// medium one, 512,1024,1024,64: about 20 MB of job state with Adam; --widths for larger ones).
// From memory: a snapshot every --snapshot-every steps with one replica, no disk checkpoints.
// From disk: a checkpoint every --every steps, no snapshots. Once the job passes step --kill-at
// one worker is killed (SIGKILL: a crash) or stopped (SIGSTOP: a hang). Measured from the
// signal, from the processes' own log lines (millisecond timestamps):
//   detect   the coordinator declares the worker dead          (reference: the lease)
//   abort    the last survivor is out of its collective and waiting for the next generation
//   re-form  the coordinator forms the smaller world             (detect + the reform grace)
//   resume   the re-formed world has restored and finished a step: training again
// and from the coordinator's "restored" event: the restore itself (slowest rank) and the steps
// lost (the furthest step reached before the death minus the step restored). As the same run's
// reference, a cold start of the same job: from the workers' "training job" line (world formed,
// plan applied) to their first step.
#include <signal.h>

#include <cstdio>
#include <fstream>
#include <map>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bench/harness.h"
#include "common/cli.h"
#include "nlohmann/json.hpp"
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
  int snapshot_every = 10;
  int kill_at = 55;
  int samples = 16384;
  std::vector<std::string> sources = {"memory", "disk"};
  std::string lease = "1s";
  std::string grace = "1s";
  std::string signal = "kill";
  std::string widths = "512,1024,1024,64";
};

struct Trial {
  double detect_ms = 0;
  double abort_ms = 0;
  double reform_ms = 0;
  double resume_ms = 0;      // signal -> first step after the restore
  double restart_ms = 0;     // re-formed -> first step after the restore
  double restore_ms = 0;     // the restore itself, slowest rank (the restored event)
  double steps_lost = 0;     // the restored event's
  double cold_start_ms = 0;  // first run: "training job" -> first step
  std::string restored;      // what was restored: "memory snapshot ..." or "checkpoint ..."
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

// The job state of an MLP of `widths` in bytes: f32 parameters and Adam's two states.
double StateBytes(const std::string& widths) {
  std::vector<int64_t> w;
  for (absl::string_view text : absl::StrSplit(widths, ',')) {
    int64_t value = 0;
    if (absl::SimpleAtoi(text, &value)) w.push_back(value);
  }
  double params = 0;
  for (size_t i = 0; i + 1 < w.size(); ++i) params += static_cast<double>(w[i] + 1) * w[i + 1];
  return params * 4 * 3;
}

// Fills the restore's facts of `trial` from the coordinator's "restored" event, e.g. "generation
// 3 restored memory snapshot step-50-g2 (step 50) on 3 ranks in 41 ms (slowest rank), from
// memory (... bytes from peers); 7 steps lost".
absl::Status ReadRestoredEvent(LocalCluster& cluster, Trial* trial) {
  for (const nlohmann::json& event : cluster.Events()) {
    const std::string detail = event.value("detail", "");
    if (event.value("kind", "") != "restored" || detail.find(" steps lost") == std::string::npos) {
      continue;
    }
    const size_t what = detail.find(" restored ");
    const size_t in = detail.find(" ranks in ");
    const size_t lost = detail.rfind("; ");
    int64_t steps_lost = 0;
    double restore_ms = 0;
    if (what == std::string::npos || in == std::string::npos || lost == std::string::npos ||
        !absl::SimpleAtod(detail.substr(in + 10, detail.find(' ', in + 10) - in - 10),
                          &restore_ms) ||
        !absl::SimpleAtoi(detail.substr(lost + 2, detail.find(' ', lost + 2) - lost - 2),
                          &steps_lost)) {
      return absl::InternalError("cannot read the restored event '" + detail + "'");
    }
    trial->restored = detail.substr(what + 10, detail.find(" (step") - what - 10);
    trial->restore_ms = restore_ms;
    trial->steps_lost = static_cast<double>(steps_lost);
  }
  if (trial->restored.empty()) return absl::InternalError("no restored event after the loss");
  return absl::OkStatus();
}

absl::StatusOr<Trial> RunTrial(const Flags& flags, const std::string& source, int index) {
  const bool memory = source == "memory";
  const std::string dir =
      testing::MakeTempDir(absl::StrCat("bench-recovery-", source, "-", index));
  testing::CommandResult data = testing::RunCommand(
      {testing::BinaryPath("shardctl"), "data", "generate", "--widths", flags.widths,
       "--samples", absl::StrCat(flags.samples), "--seed", "1", "--out", dir + "/data.safetensors"},
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
      "checkpoint": {"everySteps": )", memory ? 0 : flags.every,
      R"(, "keepLast": 2}, "snapshot": {"everySteps": )", memory ? flags.snapshot_every : 0,
      R"(, "replicas": 1}, "outputDir": "out"})");

  LocalCluster cluster(dir);
  absl::Status started = cluster.StartCoordinator(
      {"--job", dir + "/job.json", "--state-dir", dir + "/state", "--lease", flags.lease,
       "--reform-grace", flags.grace});
  if (!started.ok()) return started;
  cluster.FollowEvents();
  std::vector<Process> workers;
  for (int i = 0; i < flags.workers; ++i) {
    workers.push_back(cluster.StartWorker(absl::StrCat("w", i), {"--compute-threads", "1"}));
  }
  auto stop_all = [&] {
    cluster.Shardctl({"stop", "--no-wait"}, absl::Seconds(10));
    for (Process& worker : workers) worker.Signal(SIGKILL);
    cluster.coordinator().Signal(SIGKILL);
    // Gone, so that the event follower has printed everything (ReadRestoredEvent).
    cluster.coordinator().Wait(absl::Seconds(10));
  };
  // Past --kill-at, with what it restores from in place (from disk: at least one checkpoint).
  if (!Eventually(
          [&] {
            const nlohmann::json status = cluster.Status();
            return !status.is_null() && status["progress"]["step"].get<int>() >= flags.kill_at &&
                   (memory || !cluster.Checkpoints().empty());
          },
          absl::Seconds(600))) {
    stop_all();
    return absl::DeadlineExceededError(absl::StrCat("the job did not reach step ", flags.kill_at,
                                                    " within 600 s; logs in ", dir));
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
  Trial trial{.detect_ms = Milliseconds(*dead - signaled),
              .abort_ms = Milliseconds(*aborted - signaled),
              .reform_ms = Milliseconds(*reformed - signaled),
              .resume_ms = Milliseconds(*resumed_at - signaled),
              .restart_ms = Milliseconds(*resumed_at - *reformed),
              .cold_start_ms = Milliseconds(*first_step - *training),
              .restored = ""};
  if (absl::Status read = ReadRestoredEvent(cluster, &trial); !read.ok()) {
    return absl::InternalError(absl::StrCat(read.message(), "; logs in ", dir));
  }
  if (memory != absl::StartsWith(trial.restored, "memory snapshot")) {
    return absl::InternalError(absl::StrCat("the ", source, " run restored ", trial.restored,
                                            "; logs in ", dir));
  }
  std::filesystem::remove_all(dir);
  return trial;
}

// Every trial's `field`, in trial order.
std::vector<double> Samples(const std::vector<Trial>& trials, double Trial::*field) {
  std::vector<double> values;
  for (const Trial& trial : trials) values.push_back(trial.*field);
  return values;
}

int Main(int argc, char** argv) {
  CLI::App app{
      "shard-bench-recovery: time from losing one of N CPU workers (SIGKILL or SIGSTOP) to "
      "the job training again on N-1, and the steps the loss cost, restoring from memory (peers' "
      "snapshots) and from disk (the latest checkpoint) in the same run, from real coordinator "
      "and worker processes on 127.0.0.1 training an MLP: detect (vs the lease), abort of the "
      "survivors, re-form (detect + grace), resume (restore + one step), the restore itself and "
      "the steps lost, beside a cold start of the same job. Prints the medians over the trials "
      "(every trial's figures in the JSON).",
      "shard-bench-recovery"};
  Flags flags;
  bench::Output output;
  app.add_option("--workers", flags.workers, "workers at the start (one is lost)")
      ->capture_default_str()
      ->check(CLI::Range(2, 16));
  app.add_option("--trials", flags.trials, "independent runs of each source")
      ->capture_default_str()
      ->check(CLI::Range(1, 100));
  app.add_option("--sources", flags.sources, "what the new world restores from, each measured")
      ->capture_default_str()
      ->delimiter(',')
      ->check(CLI::IsMember({"memory", "disk"}));
  app.add_option("--every", flags.every, "from disk: a checkpoint every this many steps")
      ->capture_default_str()
      ->check(CLI::Range(1, 100000));
  app.add_option("--snapshot-every", flags.snapshot_every,
                 "from memory: a snapshot every this many steps (one replica)")
      ->capture_default_str()
      ->check(CLI::Range(1, 100000));
  app.add_option("--kill-at", flags.kill_at, "the worker is lost once the job passes this step")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000000));
  app.add_option("--lease", flags.lease, "coordinator --lease")->capture_default_str()
      ->check(DurationValidator());
  app.add_option("--grace", flags.grace, "coordinator --reform-grace")->capture_default_str()
      ->check(DurationValidator());
  app.add_option("--signal", flags.signal, "kill (a crash) or stop (a hang)")
      ->capture_default_str()
      ->check(CLI::IsMember({"kill", "stop"}));
  app.add_option("--widths", flags.widths,
                 "MLP widths (4096,8192,8192,64: about 1.2 GB of job state)")
      ->capture_default_str();
  app.add_option("--samples", flags.samples, "samples in the generated data set")
      ->capture_default_str()
      ->check(CLI::Range(256, 1 << 20));
  bench::AddOutputOptions(app, &output);
  if (std::optional<int> exit_code = ParseCommandLine(app, argc, argv)) return *exit_code;

  bench::Report report("shard-bench-recovery", output);
  report.Note(absl::StrFormat(
      "%d CPU workers, MLP %s (%.1f MB of job state), SIG%s one past step %d; from memory: a "
      "snapshot every %d steps, 1 replica, no checkpoints; from disk: a checkpoint every %d "
      "steps, no snapshots; lease %s, reform grace %s",
      flags.workers, flags.widths, StateBytes(flags.widths) / 1e6,
      flags.signal == "kill" ? "KILL" : "STOP", flags.kill_at, flags.snapshot_every, flags.every,
      flags.lease, flags.grace));
  report.Note("ms from the signal: detect (declared dead), abort (the last survivor waits for the "
              "next generation), re_form, resume (training again); restore: the restore itself "
              "(slowest rank); restart: re-formed -> first step; cold_start: the first run's "
              "world formed -> first step");
  std::map<std::string, std::vector<Trial>> trials;
  for (int i = 0; i < flags.trials; ++i) {
    for (const std::string& source : flags.sources) {
      absl::StatusOr<Trial> trial = RunTrial(flags, source, i);
      if (!trial.ok()) {
        std::fprintf(stderr, "%s trial %d: %s\n", source.c_str(), i,
                     std::string(trial.status().message()).c_str());
        return 1;
      }
      // A trial takes a while: say how far the run is (the records come once all are done).
      std::fprintf(stderr, "shard-bench-recovery: %s trial %d of %d: training again %.0f ms "
                   "after the signal\n", source.c_str(), i + 1, flags.trials, trial->resume_ms);
      trials[source].push_back(*trial);
    }
  }
  const double lease_ms = Milliseconds(ParsedDuration(flags.lease));
  const double grace_ms = Milliseconds(ParsedDuration(flags.grace));
  auto record = [&](const std::string& source, const std::string& op, double Trial::*field) {
    return bench::Record({.op = op, .impl = source, .ranks = flags.workers},
                         bench::Summarize(Samples(trials[source], field)));
  };
  for (const std::string& source : flags.sources) {
    // Memory against disk, where the run measured both (0: not compared).
    auto disk_ms = [&](const std::string& op, double Trial::*field) {
      return source == "memory" && trials.count("disk") > 0 ? record("disk", op, field).time_ms()
                                                              : 0.0;
    };
    bench::Record detect = record(source, "detect", &Trial::detect_ms);
    report.Add(detect.Compare("time_ms", "lease " + flags.lease, lease_ms));
    report.Add(record(source, "abort", &Trial::abort_ms));
    bench::Record reform = record(source, "re_form", &Trial::reform_ms);
    report.Add(reform.Extra("after_detect_and_grace_ms",
                            reform.time_ms() - detect.time_ms() - grace_ms));
    report.Add(record(source, "resume", &Trial::resume_ms)
                   .Compare("time_ms", "disk", disk_ms("resume", &Trial::resume_ms)));
    std::vector<std::string> restored;
    for (const Trial& trial : trials[source]) {
      restored.push_back(absl::StrCat(trial.restored, ", ", trial.steps_lost, " steps lost"));
    }
    // Summarize's median is any samples' median, steps as well as milliseconds.
    const double steps_lost =
        bench::Summarize(Samples(trials[source], &Trial::steps_lost)).median_ms;
    report.Add(record(source, "restore", &Trial::restore_ms)
                   .Extra("steps_lost", steps_lost)
                   .Compare("time_ms", "disk", disk_ms("restore", &Trial::restore_ms))
                   .Note(absl::StrJoin(restored, "; ")));
    const bench::Record cold = record(source, "cold_start", &Trial::cold_start_ms);
    report.Add(record(source, "restart", &Trial::restart_ms)
                   .Compare("time_ms", "cold_start", cold.time_ms()));
    report.Add(cold);
  }
  return report.Finish() ? 0 : 1;
}

}  // namespace
}  // namespace shard

int main(int argc, char** argv) { return shard::Main(argc, argv); }
