// shard-control-plane-sim: runs the control plane's deterministic simulation (simulation.h) for
// the seeds pinned in a file and a range of seeds, or replays one seed with a trace; each under a
// profile (simulation.h's Profile: which scenarios the draws favour). Exit status
// 1 if any seed broke an invariant or the liveness property (the seed and how to replay it are
// printed), or if the time budget ended the run before every seed it was asked for had run; 2 on
// a pinned-seed file it cannot read.
#include <cstdio>
#include <fstream>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "common/cli.h"
#include "spdlog/spdlog.h"
#include "tests/sim/simulation.h"

namespace {

using shard::sim::Profile;

struct SeedUnderProfile {
  uint64_t seed = 0;
  Profile profile = Profile::kMixed;
};

// The seeds of a pinned-seed file (tests/sim/pinned_seeds.txt): one a line, optionally followed by
// the profile it runs under (mixed when none), `#` starts a comment, blank lines are skipped.
// nullopt, with the reason printed, on a file it cannot read or a line that is not a seed.
std::optional<std::vector<SeedUnderProfile>> ReadSeedUnderProfiles(const std::string& path) {
  std::ifstream in(path);
  if (!in) {
    std::fprintf(stderr, "cannot read the pinned seeds %s\n", path.c_str());
    return std::nullopt;
  }
  std::vector<SeedUnderProfile> seeds;
  std::string line;
  for (int number = 1; std::getline(in, line); ++number) {
    const std::string text = line.substr(0, line.find('#'));
    const std::vector<absl::string_view> fields =
        absl::StrSplit(text, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    if (fields.empty()) continue;
    SeedUnderProfile pinned;
    std::optional<Profile> profile =
        fields.size() == 2 ? shard::sim::ParseProfile(fields[1]) : Profile::kMixed;
    if (fields.size() > 2 || !absl::SimpleAtoi(fields[0], &pinned.seed) || !profile.has_value()) {
      std::fprintf(stderr, "%s:%d: not a seed and an optional profile (%s): %s\n", path.c_str(),
                   number, shard::sim::ProfileNames().c_str(), line.c_str());
      return std::nullopt;
    }
    pinned.profile = *profile;
    seeds.push_back(pinned);
  }
  return seeds;
}

// How to replay one seed, for a failure's message.
std::string ReplayCommand(const SeedUnderProfile& seed) {
  return absl::StrFormat("shard-control-plane-sim --seed %d%s", seed.seed,
                         seed.profile == Profile::kMixed
                             ? ""
                             : " --profile " + shard::sim::ProfileName(seed.profile));
}

// What the seeds of a run added up to.
struct Totals {
  int64_t run = 0;
  int64_t failed = 0;
  int64_t events = 0;
  int64_t finished = 0;
  int64_t stopped = 0;
  int64_t kills = 0, stops = 0, stalls = 0, crashes = 0, admin = 0, checkpoints = 0;
  int64_t partitions = 0;
  int64_t memory_restores = 0, disk_restores = 0, memory_failures = 0;
  absl::Duration simulated;

  void Add(const shard::sim::SimulationResult& result) {
    ++run;
    failed += result.passed ? 0 : 1;
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
  }
};

constexpr int64_t kMaxFailures = 3;  // a run stops at its third failing seed

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Deterministic simulation of the Shard coordinator under random faults"};
  uint64_t first_seed = 1;
  int64_t seeds = 0;
  std::string budget = "60s";
  std::string pinned_path;
  std::optional<uint64_t> replay;
  bool verbose = false;
  std::string profile_name = "mixed";
  app.add_option("--first-seed", first_seed, "the first seed of the range")->capture_default_str();
  CLI::Option* seeds_option =
      app.add_option("--seeds", seeds,
                     "run exactly this many seeds of the range (first-seed, first-seed + 1, "
                     "...); the run fails if the time budget ends it sooner. Without it, the "
                     "range runs until the time budget ends it")
          ->check(CLI::Range(int64_t{0}, std::numeric_limits<int64_t>::max()));
  app.add_option("--pinned", pinned_path,
                 "also run the seeds listed in this file (one a line, # comments), before the "
                 "range; with --seeds 0, only those. All of them must run within the budget")
      ->check(CLI::ExistingFile);
  app.add_option("--time-budget", budget,
                 "start no new seed after this much wall time (e.g. 60s, 10m)")
      ->capture_default_str()
      ->check(shard::DurationValidator());
  app.add_option("--seed", replay, "replay this one seed with a trace of every event");
  app.add_option("--profile", profile_name,
                 absl::StrFormat("which scenarios the draws favour, for the range and --seed (a "
                                 "pinned seed names its own): %s. A seed replays only under the "
                                 "profile it ran with",
                                 shard::sim::ProfileNames()))
      ->capture_default_str()
      ->check([](const std::string& name) {
        return shard::sim::ParseProfile(name).has_value()
                   ? std::string()
                   : absl::StrFormat("no profile %s; one of %s", name, shard::sim::ProfileNames());
      });
  app.add_flag("--verbose", verbose, "with --seed: also the coordinator's own log");
  CLI11_PARSE(app, argc, argv);
  spdlog::set_level(verbose ? spdlog::level::info : spdlog::level::off);
  const Profile profile = *shard::sim::ParseProfile(profile_name);

  if (replay.has_value()) {
    const shard::sim::SimulationResult result =
        shard::sim::RunSimulation({.seed = *replay, .profile = profile, .verbose = true});
    std::printf("seed %llu (%s): %s after %lld events, %s simulated\n",
                static_cast<unsigned long long>(*replay), profile_name.c_str(),
                result.passed ? "PASS" : "FAIL",
                static_cast<long long>(result.events),
                absl::FormatDuration(result.simulated).c_str());
    if (!result.passed) std::printf("%s\n", result.failure.c_str());
    return result.passed ? 0 : 1;
  }

  std::vector<SeedUnderProfile> pinned;
  if (!pinned_path.empty()) {
    std::optional<std::vector<SeedUnderProfile>> read = ReadSeedUnderProfiles(pinned_path);
    if (!read.has_value()) return 2;
    pinned = std::move(*read);
  }
  // A count asked for is a promise the budget must not break; without one the budget ends the
  // range (a run to explore new seeds for a while).
  const bool range_counted = seeds_option->count() > 0;
  const absl::Duration limit = shard::ParsedDuration(budget);
  const absl::Time started = absl::Now();
  Totals totals;
  auto must_stop = [&] { return totals.failed >= kMaxFailures || absl::Now() - started >= limit; };
  auto run_seed = [&](const SeedUnderProfile& seed, const char* kind) {
    const shard::sim::SimulationResult result =
        shard::sim::RunSimulation({.seed = seed.seed, .profile = seed.profile});
    totals.Add(result);
    if (!result.passed) {
      std::printf("FAIL %sseed %llu (%s): %s\nreplay: %s\n\n", kind,
                  static_cast<unsigned long long>(seed.seed),
                  shard::sim::ProfileName(seed.profile).c_str(), result.failure.c_str(),
                  ReplayCommand(seed).c_str());
    }
  };

  int64_t pinned_run = 0;
  for (const SeedUnderProfile& seed : pinned) {
    if (must_stop()) break;
    run_seed(seed, "pinned ");
    ++pinned_run;
  }
  int64_t range_run = 0;
  for (uint64_t seed = first_seed; (!range_counted || range_run < seeds) && !must_stop(); ++seed) {
    run_seed({seed, profile}, "");
    ++range_run;
  }

  const double seconds = absl::ToDoubleSeconds(absl::Now() - started);
  std::string which;
  if (!pinned.empty()) {
    which =
        pinned_run == static_cast<int64_t>(pinned.size())
            ? absl::StrFormat("%d pinned from %s", pinned_run, pinned_path)
            : absl::StrFormat("%d of %d pinned from %s", pinned_run, pinned.size(), pinned_path);
  }
  if (range_run > 0) {
    which += absl::StrFormat("%s%d..%d%s", which.empty() ? "" : ", ", first_seed,
                             first_seed + range_run - 1,
                             profile == Profile::kMixed ? "" : " under " + profile_name);
  }
  std::printf(
      "%lld seeds (%s) in %.1f s: %.1f seeds/s, %lld events, %.0f s simulated\n"
      "faults: %lld worker kills, %lld stops, %lld hung training threads, %lld partitions, "
      "%lld coordinator crashes, %lld operator calls; "
      "%lld checkpoints committed\n"
      "restores: %lld from memory, %lld from disk; %lld reads of a memory snapshot failed (the "
      "next generation restored from elsewhere)\n"
      "outcome: %lld trained to the end, %lld stopped by an operator, %lld failed\n",
      static_cast<long long>(totals.run), which.c_str(), seconds,
      seconds > 0 ? totals.run / seconds : 0.0, static_cast<long long>(totals.events),
      absl::ToDoubleSeconds(totals.simulated), static_cast<long long>(totals.kills),
      static_cast<long long>(totals.stops), static_cast<long long>(totals.stalls),
      static_cast<long long>(totals.partitions), static_cast<long long>(totals.crashes),
      static_cast<long long>(totals.admin), static_cast<long long>(totals.checkpoints),
      static_cast<long long>(totals.memory_restores), static_cast<long long>(totals.disk_restores),
      static_cast<long long>(totals.memory_failures), static_cast<long long>(totals.finished),
      static_cast<long long>(totals.stopped), static_cast<long long>(totals.failed));
  if (totals.failed > 0) return 1;
  // Coverage must not depend on the machine's speed: a budget that ran out before every seed
  // asked for had run fails the run rather than passing with fewer.
  const bool cut_short =
      pinned_run < static_cast<int64_t>(pinned.size()) || (range_counted && range_run < seeds);
  if (cut_short) {
    const int64_t asked = static_cast<int64_t>(pinned.size()) + (range_counted ? seeds : 0);
    const int64_t done = pinned_run + (range_counted ? range_run : 0);
    std::printf(
        "FAIL: the time budget (%s) ran out after %lld of the %lld seeds asked for; raise "
        "--time-budget or ask for fewer seeds\n",
        budget.c_str(), static_cast<long long>(done), static_cast<long long>(asked));
    return 1;
  }
  return 0;
}
