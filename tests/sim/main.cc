// shard-control-plane-sim: runs the control plane's deterministic simulation (simulation.h) for
// many seeds within a time budget, or replays one seed with a trace. Exit status 1 if any seed
// broke an invariant or the liveness property; the seed and how to replay it are printed.
#include <cstdio>
#include <string>

#include "CLI/CLI.hpp"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/cli.h"
#include "spdlog/spdlog.h"
#include "tests/sim/simulation.h"

int main(int argc, char** argv) {
  CLI::App app{"Deterministic simulation of the Shard coordinator under random faults"};
  uint64_t first_seed = 1;
  int64_t seeds = 1'000'000;
  std::string budget = "60s";
  std::optional<uint64_t> replay;
  bool verbose = false;
  app.add_option("--first-seed", first_seed, "the first seed of the run")->capture_default_str();
  app.add_option("--seeds", seeds, "at most this many seeds (first-seed, first-seed + 1, ...)")
      ->capture_default_str();
  app.add_option("--time-budget", budget,
                 "stop starting new seeds after this much wall time (e.g. 60s)")
      ->capture_default_str()
      ->check(shard::DurationValidator());
  app.add_option("--seed", replay, "replay this one seed with a trace of every event");
  app.add_flag("--verbose", verbose, "with --seed: also the coordinator's own log");
  CLI11_PARSE(app, argc, argv);
  spdlog::set_level(verbose ? spdlog::level::info : spdlog::level::off);

  if (replay.has_value()) {
    const shard::sim::SimulationResult result =
        shard::sim::RunSimulation({.seed = *replay, .verbose = true});
    std::printf("seed %llu: %s after %lld events, %s simulated\n",
                static_cast<unsigned long long>(*replay), result.passed ? "PASS" : "FAIL",
                static_cast<long long>(result.events),
                absl::FormatDuration(result.simulated).c_str());
    if (!result.passed) std::printf("%s\n", result.failure.c_str());
    return result.passed ? 0 : 1;
  }

  const absl::Duration limit = shard::ParsedDuration(budget);
  const absl::Time started = absl::Now();
  int64_t run = 0;
  int64_t failed = 0;
  int64_t events = 0;
  int64_t finished = 0;
  int64_t stopped = 0;
  int64_t kills = 0, stops = 0, stalls = 0, crashes = 0, admin = 0, checkpoints = 0;
  int64_t partitions = 0;
  int64_t memory_restores = 0, disk_restores = 0, memory_failures = 0;
  absl::Duration simulated;
  for (uint64_t seed = first_seed; run < seeds && absl::Now() - started < limit; ++seed, ++run) {
    const shard::sim::SimulationResult result = shard::sim::RunSimulation({.seed = seed});
    events += result.events;
    simulated += result.simulated;
    finished += result.finished ? 1 : 0;
    stopped += result.stopped_by_operator && !result.finished ? 1 : 0;
    kills += result.worker_kills;
    stops += result.worker_stops;
    stalls += result.training_stalls;
    partitions += result.partitions;
    crashes += result.coordinator_crashes;
    admin += result.admin_calls;
    checkpoints += result.checkpoints;
    memory_restores += result.memory_restores;
    disk_restores += result.disk_restores;
    memory_failures += result.memory_restore_failures;
    if (!result.passed) {
      ++failed;
      std::printf("FAIL seed %llu: %s\nreplay: shard-control-plane-sim --seed %llu\n\n",
                  static_cast<unsigned long long>(seed), result.failure.c_str(),
                  static_cast<unsigned long long>(seed));
      if (failed >= 3) break;
    }
  }
  const double seconds = absl::ToDoubleSeconds(absl::Now() - started);
  std::printf(
      "%lld seeds (%llu..%llu) in %.1f s: %.1f seeds/s, %lld events, %.0f s simulated\n"
      "faults: %lld worker kills, %lld stops, %lld hung training threads, %lld partitions, "
      "%lld coordinator crashes, %lld operator calls; "
      "%lld checkpoints committed\n"
      "restores: %lld from memory, %lld from disk; %lld reads of a memory snapshot failed (the "
      "next generation restored from elsewhere)\n"
      "outcome: %lld trained to the end, %lld stopped by an operator, %lld failed\n",
      static_cast<long long>(run), static_cast<unsigned long long>(first_seed),
      static_cast<unsigned long long>(first_seed + run - 1), seconds, run / seconds,
      static_cast<long long>(events), absl::ToDoubleSeconds(simulated),
      static_cast<long long>(kills), static_cast<long long>(stops), static_cast<long long>(stalls),
      static_cast<long long>(partitions), static_cast<long long>(crashes), static_cast<long long>(admin),
      static_cast<long long>(checkpoints), static_cast<long long>(memory_restores),
      static_cast<long long>(disk_restores), static_cast<long long>(memory_failures),
      static_cast<long long>(finished),
      static_cast<long long>(stopped), static_cast<long long>(failed));
  return failed == 0 ? 0 : 1;
}
