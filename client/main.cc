// shardctl: the admin client of a Shard job.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <iostream>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/admin_client.h"
#include "client/checkpoint_commands.h"
#include "client/elastic_commands.h"
#include "client/plan_view.h"
#include "client/status_view.h"
#include "common/cli.h"
#include "common/files.h"
#include "common/manifest.h"
#include "common/mlp_data.h"
#include "common/plan.h"
#include "common/status_macros.h"
#include "common/tensor_compare.h"
#include "nlohmann/json.hpp"
#include "proto/plan_convert.h"
#include "proto/control_convert.h"

namespace {

int Fail(const absl::Status& status) {
  std::cerr << "shardctl: " << status.message() << "\n";
  return 1;
}

// `shardctl compare`: 0 when every tensor is within `max_abs_diff`, 1 when one is not, 2 when
// the files cannot be compared.
int RunCompare(const std::string& a, const std::string& b, double max_abs_diff, bool json) {
  absl::StatusOr<std::vector<shard::TensorDifference>> differences =
      shard::CompareSafetensorsFiles(a, b);
  if (!differences.ok()) {
    std::cerr << "shardctl: " << differences.status().message() << "\n";
    return 2;
  }
  bool within = true;
  double worst = 0;
  nlohmann::json out = nlohmann::json::array();
  for (const shard::TensorDifference& d : *differences) {
    within &= d.max_abs_diff <= max_abs_diff;
    worst = std::max(worst, d.max_abs_diff);
    out.push_back({{"name", d.name}, {"numel", d.numel}, {"differing", d.differing},
                   {"max_abs_diff", d.max_abs_diff}, {"worst_element", d.worst_element},
                   {"max_magnitude", d.max_magnitude}});
  }
  if (json) {
    std::cout << nlohmann::json{{"tensors", out}, {"max_abs_diff", worst}, {"within", within}}
                     .dump(2)
              << "\n";
  } else {
    std::printf("%-28s %12s %12s %14s %12s %12s\n", "tensor", "elements", "differing",
                "max |a-b|", "at element", "max |a|");
    for (const shard::TensorDifference& d : *differences) {
      std::printf("%-28s %12lld %12lld %14.6g %12lld %12.6g\n", d.name.c_str(),
                  static_cast<long long>(d.numel), static_cast<long long>(d.differing),
                  d.max_abs_diff, static_cast<long long>(d.worst_element), d.max_magnitude);
    }
    std::printf("largest difference %.6g: %s the accepted %.6g\n", worst,
                within ? "within" : "EXCEEDS", max_abs_diff);
  }
  return within ? 0 : 1;
}

// Waits for the stop to finish: the job reaches "finished" (or "failed") or the coordinator exits.
int WaitForStop(shard::AdminClient& admin, absl::Duration timeout) {
  const absl::Time give_up = absl::Now() + timeout;
  int last_live = -1;
  while (absl::Now() < give_up) {
    absl::StatusOr<shard::v1::GetStatusResponse> status = admin.GetStatus();
    // A coordinator that finished the stop exits, cancelling calls in flight.
    if (!status.ok() &&
        (absl::IsUnavailable(status.status()) || absl::IsCancelled(status.status()))) {
      std::cout << "coordinator has exited; job stopped\n";
      return 0;
    }
    if (!status.ok()) return Fail(status.status());
    if (shard::Ended(shard::FromProto(status->world().state()))) {
      std::cout << "job stopped\n";
      return 0;
    }
    if (status->world().world_size() != last_live) {
      last_live = status->world().world_size();
      std::cout << "stopping: " << last_live << " worker(s) still live\n" << std::flush;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  return Fail(absl::DeadlineExceededError(
      absl::StrCat("the job did not stop within ", absl::FormatDuration(timeout),
                   "; run 'shardctl status' to see which workers are still live")));
}

// `shardctl status --watch`: the status every `interval` until the job stops or the coordinator
// exits; redrawn in place on a terminal, else a block (or with --json a line) per refresh.
int WatchStatus(shard::AdminClient& admin, absl::Duration interval, bool json) {
  const bool terminal = ::isatty(STDOUT_FILENO) != 0;
  bool answered = false;
  while (true) {
    absl::StatusOr<shard::v1::GetStatusResponse> status = admin.GetStatus();
    if (!status.ok()) {
      if (answered &&
          (absl::IsUnavailable(status.status()) || absl::IsCancelled(status.status()))) {
        std::cerr << "the coordinator has exited\n";
        return 0;
      }
      return Fail(status.status());
    }
    answered = true;
    if (json) {
      std::cout << shard::StatusToJson(*status).dump() << "\n";
    } else {
      // Home and clear the screen, so the status stays in one place.
      std::cout << (terminal ? "\x1b[H\x1b[2J" : "") << shard::StatusTable(*status)
                << (terminal ? "" : "\n");
    }
    std::cout << std::flush;
    if (shard::Ended(shard::FromProto(status->world().state()))) return 0;
    std::this_thread::sleep_for(absl::ToChronoNanoseconds(interval));
  }
}

// Waits until the world is formed and every member passed its self-check (and, with
// `initialized`, every worker applied the rebuilt plan).
int WaitForReady(shard::AdminClient& admin, absl::Duration timeout, bool initialized) {
  const absl::Time give_up = absl::Now() + timeout;
  std::string last_progress;
  while (true) {
    absl::StatusOr<shard::v1::GetStatusResponse> status = admin.GetStatus();
    if (!status.ok()) return Fail(status.status());
    int ready = 0;
    for (const shard::v1::WorkerStatus& worker : status->workers()) {
      if (worker.state() == shard::v1::WORKER_STATE_READY) ++ready;
      if (worker.state() == shard::v1::WORKER_STATE_FAILED) {
        return Fail(absl::FailedPreconditionError(
            absl::StrCat("worker ", worker.id(), " failed its self-check: ",
                         worker.self_check().detail())));
      }
    }
    const int expected = status->world().ranks();
    bool planned = true;
    if (initialized) {
      absl::StatusOr<shard::v1::GetStatsResponse> stats = admin.GetStats();
      if (!stats.ok()) return Fail(stats.status());
      planned = stats->status() == shard::v1::OVERLAP_STATUS_INITIALIZED;
    }
    if (status->world().state() == shard::v1::JOB_STATE_RUNNING && ready == expected && planned) {
      std::cout << "ready: " << ready << "/" << expected << " workers at generation "
                << status->world().generation() << "\n";
      return 0;
    }
    if (shard::Stops(shard::FromProto(status->world().state()))) {
      return Fail(absl::FailedPreconditionError("the job is stopping"));
    }
    const std::string progress =
        absl::StrCat("waiting: ", status->world().world_size(), "/", expected, " joined, ", ready,
                     " ready (generation ", status->world().generation(), ")",
                     planned ? "" : ", plan not yet initialized");
    if (progress != last_progress) std::cout << progress << "\n" << std::flush;
    last_progress = progress;
    if (absl::Now() >= give_up) {
      return Fail(absl::DeadlineExceededError(absl::StrCat(
          "the world was not ready within ", absl::FormatDuration(timeout), " (", progress,
          "); run 'shardctl status' to see who is missing")));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

// `shardctl plan --manifest FILE ...`: the plan computed here, with the coordinator's code.
absl::StatusOr<shard::v1::PlanSummary> OfflinePlan(const std::string& manifest_file,
                                                   const shard::PlanOptions& options) {
  SHARD_ASSIGN_OR_RETURN(const std::string text, shard::ReadFile(manifest_file));
  absl::StatusOr<shard::Manifest> manifest = shard::ParseManifestJson(text);
  if (!manifest.ok()) {
    return absl::Status(manifest.status().code(),
                        absl::StrCat(manifest_file, ": ", manifest.status().message()));
  }
  SHARD_ASSIGN_OR_RETURN(const shard::Plan plan, shard::MakePlan(*manifest, options));
  return shard::ToPlanSummary(plan, *manifest, /*version=*/0, /*generation=*/0);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"shardctl: the admin client of a Shard job (status, workers, events, wait, stop, "
      "resize, drain, plan, stats, checkpoint) and its tools (data generate).", "shardctl"};
  app.require_subcommand(1);
  std::string coordinator = "127.0.0.1:7460";
  std::string timeout = "10s";
  app.add_option("--coordinator", coordinator, "host:port of shard-coordinator")
      ->envname("SHARD_COORDINATOR")
      ->capture_default_str();
  app.add_option("--timeout", timeout, "deadline of each call to the coordinator")
      ->capture_default_str()
      ->check(shard::DurationValidator());

  bool json = false;
  bool watch = false;
  std::string watch_interval = "1s";
  CLI::App* status_cmd = app.add_subcommand(
      "status",
      "the job's state, its training (step, loss, steps/s, ETA, last checkpoint, "
      "overlap), the transition in progress, and its workers");
  status_cmd->add_flag("--json", json, "print JSON for scripts");
  status_cmd->add_flag("--watch", watch,
                       "refresh until the job stops or the coordinator exits: in place on a "
                       "terminal, else a block per refresh (with --json, one object per line)");
  status_cmd->add_option("--interval", watch_interval, "how often --watch refreshes")
      ->capture_default_str()
      ->check(shard::DurationValidator());
  CLI::App* workers_cmd = app.add_subcommand("workers", "the workers table");
  workers_cmd->add_flag("--json", json, "print the workers as a JSON array");
  std::string reason = "shardctl stop";
  bool no_wait = false;
  std::string wait_timeout = "120s";
  CLI::App* stop_cmd = app.add_subcommand(
      "stop", "ask every worker to leave and the coordinator to finish, and wait for it");
  stop_cmd->add_option("--reason", reason, "recorded in the job's history")->capture_default_str();
  stop_cmd->add_flag("--no-wait", no_wait, "return once the stop is accepted");
  stop_cmd->add_option("--wait-timeout", wait_timeout, "give up waiting after this long")
      ->capture_default_str()
      ->check(shard::DurationValidator());

  std::string ready_timeout = "120s";
  CLI::App* wait_cmd = app.add_subcommand(
      "wait", "wait until the world is formed and every worker passed its self-check");
  wait_cmd->add_option("--wait-timeout", ready_timeout, "give up after this long")
      ->capture_default_str()
      ->check(shard::DurationValidator());
  bool wait_initialized = false;
  wait_cmd->add_flag("--initialized", wait_initialized,
                     "also wait until every worker applied the rebuilt plan (overlap status "
                     "INITIALIZED)");

  std::string manifest_file;
  int plan_world_size = 0;
  std::string plan_mode = "range";
  double bucket_cap_mb = 25;
  double first_bucket_cap_mb = 1;
  int min_buckets = 4;
  CLI::App* plan_cmd = app.add_subcommand(
      "plan",
      "the current plan of the running job, or with --manifest a plan computed here by the "
      "coordinator's own code: buckets, per-rank ownership, imbalance");
  plan_cmd->add_option("--manifest", manifest_file, "plan this manifest offline (JSON file)")
      ->check(CLI::ExistingFile);
  plan_cmd->add_option("--world-size", plan_world_size, "ranks to plan for (with --manifest)")
      ->check(CLI::Range(1, 1 << 20));
  plan_cmd->add_option("--mode", plan_mode, "range or param (with --manifest)")
      ->capture_default_str()
      ->check(CLI::IsMember({"range", "param"}));
  plan_cmd->add_option("--bucket-cap-mb", bucket_cap_mb, "bucket cap in MiB (with --manifest)")
      ->capture_default_str()
      ->check(shard::MebibytesValidator());
  plan_cmd->add_option("--first-bucket-cap-mb", first_bucket_cap_mb,
                       "first bucket's cap in MiB (with --manifest)")
      ->capture_default_str()
      ->check(shard::MebibytesValidator());
  plan_cmd->add_option("--min-buckets", min_buckets,
                       "later buckets hold at most 1/N of the model's bytes, never less than "
                       "the first bucket's cap; 1: the caps alone (with --manifest)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1024));
  plan_cmd->add_flag("--json", json, "print JSON for scripts");
  CLI::App* stats_cmd = app.add_subcommand(
      "stats", "overlap status (bucket rebuild), plan acknowledgements and step statistics");
  stats_cmd->add_flag("--json", json, "print JSON for scripts");

  CLI::App* data_cmd = app.add_subcommand("data", "training data tools");
  CLI::App* generate_cmd = data_cmd->add_subcommand(
      "generate",
      "write an MLP data file (safetensors: x F32 [N, in], y I64 [N]) whose labels come from a "
      "seeded random teacher MLP of the given widths, so that a student can learn them");
  data_cmd->require_subcommand(1);
  std::string widths_text;
  int64_t samples = 0;
  uint64_t data_seed = 0;
  std::string data_out;
  generate_cmd->add_option("--widths", widths_text, "layer widths, e.g. 512,1024,64")->required();
  generate_cmd->add_option("--samples", samples, "rows to generate")
      ->required()
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 32));
  generate_cmd->add_option("--seed", data_seed, "generator seed")->capture_default_str();
  generate_cmd->add_option("--out", data_out, "output file")->required();

  CLI::App* compare_cmd = app.add_subcommand(
      "compare",
      "compare two safetensors files with the same tensors element by element (e.g. a GPU "
      "run's final.safetensors with a CPU run's): per tensor the largest absolute difference, "
      "where it is, and the tensor's largest magnitude. Exits 0 when every difference is within "
      "--max-abs-diff, 1 when one is not, 2 when the files cannot be compared");
  std::string compare_a, compare_b;
  double max_abs_diff = 0;
  compare_cmd->add_option("a", compare_a, "first file")->required()->check(CLI::ExistingFile);
  compare_cmd->add_option("b", compare_b, "second file")->required()->check(CLI::ExistingFile);
  compare_cmd->add_option("--max-abs-diff", max_abs_diff,
                          "largest absolute difference accepted (0: bitwise equal values)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  compare_cmd->add_flag("--json", json, "print JSON for scripts");

  shard::CheckpointCommands checkpoint_commands;
  shard::AddCheckpointCommands(app, &checkpoint_commands);
  shard::ElasticCommands elastic_commands;
  shard::AddElasticCommands(app, &elastic_commands);

  shard::ClientSecurityFiles security_files;
  shard::AddClientSecurityFlags(app, &security_files, "--admin-token-file",
                                "file holding the admin token, if the coordinator requires one "
                                "(one line); needed to save, restore, delete, stop, resize, "
                                "drain");
  if (std::optional<int> exit_code = shard::ParseCommandLine(
          app, argc, argv, shard::FlagSources::kCommandLineAndEnvironment)) {
    return *exit_code;
  }
  absl::StatusOr<shard::ClientSecurity> security = shard::LoadClientSecurity(security_files);
  if (!security.ok()) {
    std::fprintf(stderr, "shardctl: %s\n", std::string(security.status().message()).c_str());
    return 2;
  }
  std::unique_ptr<shard::AdminClient> admin_client;
  auto admin_on_demand = [&]() -> shard::AdminClient& {
    if (admin_client == nullptr) {
      admin_client = std::make_unique<shard::AdminClient>(
          coordinator, shard::ParsedDuration(timeout), *security);
    }
    return *admin_client;
  };
  if (shard::CheckpointCommandParsed(checkpoint_commands)) {
    return shard::RunCheckpointCommand(checkpoint_commands, admin_on_demand);
  }
  if (generate_cmd->parsed()) {
    std::vector<int64_t> widths;
    for (absl::string_view part : absl::StrSplit(widths_text, ',')) {
      int64_t width = 0;
      if (!absl::SimpleAtoi(part, &width) || width < 1) {
        std::cerr << "shardctl: --widths must be positive integers separated by commas, got '"
                  << widths_text << "'\n";
        return 2;
      }
      widths.push_back(width);
    }
    if (widths.size() < 2) {
      std::cerr << "shardctl: --widths needs at least an input and an output width\n";
      return 2;
    }
    if (absl::Status generated = shard::GenerateMlpData(widths, samples, data_seed, data_out);
        !generated.ok()) {
      return Fail(generated);
    }
    std::cout << "wrote " << samples << " samples (" << widths.front() << " features, "
              << widths.back() << " classes) to " << data_out << "\n";
    return 0;
  }
  if (compare_cmd->parsed()) return RunCompare(compare_a, compare_b, max_abs_diff, json);
  if (plan_cmd->parsed() && !manifest_file.empty()) {
    if (plan_world_size < 1) {
      std::cerr << "shardctl: plan --manifest needs --world-size\n";
      return 2;
    }
    shard::PlanOptions options;
    options.world_size = plan_world_size;
    options.mode = *shard::ParseShardMode(plan_mode);
    options.bucket_cap_bytes = shard::MebibytesToBytes(bucket_cap_mb);
    options.first_bucket_cap_bytes = shard::MebibytesToBytes(first_bucket_cap_mb);
    options.min_buckets = min_buckets;
    absl::StatusOr<shard::v1::PlanSummary> plan = OfflinePlan(manifest_file, options);
    if (!plan.ok()) return Fail(plan.status());
    std::cout << (json ? shard::PlanToJson(*plan).dump(2) + "\n" : shard::PlanTable(*plan));
    return 0;
  }
  shard::AdminClient& admin = admin_on_demand();
  if (shard::ElasticCommandParsed(elastic_commands)) {
    return shard::RunElasticCommand(elastic_commands, admin);
  }
  if (plan_cmd->parsed()) {
    absl::StatusOr<shard::v1::PlanSummary> plan = admin.GetPlan();
    if (!plan.ok()) return Fail(plan.status());
    std::cout << (json ? shard::PlanToJson(*plan).dump(2) + "\n" : shard::PlanTable(*plan));
    return 0;
  }
  if (stats_cmd->parsed()) {
    absl::StatusOr<shard::v1::GetStatsResponse> stats = admin.GetStats();
    if (!stats.ok()) return Fail(stats.status());
    std::cout << (json ? shard::StatsToJson(*stats).dump(2) + "\n" : shard::StatsTable(*stats));
    return 0;
  }

  if (status_cmd->parsed() && watch) {
    return WatchStatus(admin, shard::ParsedDuration(watch_interval), json);
  }
  if (status_cmd->parsed() || workers_cmd->parsed()) {
    absl::StatusOr<shard::v1::GetStatusResponse> status = admin.GetStatus();
    if (!status.ok()) return Fail(status.status());
    if (json) {
      nlohmann::json out = shard::StatusToJson(*status);
      std::cout << (status_cmd->parsed() ? out : out["workers"]).dump(2) << "\n";
    } else {
      std::cout << (status_cmd->parsed() ? shard::StatusTable(*status)
                                         : shard::WorkersTable(*status));
    }
    return 0;
  }
  if (wait_cmd->parsed()) {
    return WaitForReady(admin, shard::ParsedDuration(ready_timeout), wait_initialized);
  }
  if (stop_cmd->parsed()) {
    absl::StatusOr<shard::v1::StopResponse> stopped = admin.Stop(reason);
    if (!stopped.ok()) return Fail(stopped.status());
    std::cout << "stop accepted for job at generation " << stopped->world().generation() << " ("
              << stopped->world().world_size() << " worker(s) live)\n";
    if (no_wait) return 0;
    return WaitForStop(admin, shard::ParsedDuration(wait_timeout));
  }
  return 2;
}
