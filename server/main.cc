// shard-coordinator: the control plane of one Shard job.
#include <csignal>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "common/cli.h"
#include "common/files.h"
#include "common/logging.h"
#include "common/signal_watcher.h"
#include "proto/channel_security.h"
#include "proto/job_convert.h"
#include "server/coordinator_server.h"
#include "spdlog/spdlog.h"

int main(int argc, char** argv) {
  CLI::App app{
      "shard-coordinator: the control plane of one Shard job. Forms the world from joining "
      "shard-worker processes (ranks, generations), serves their rendezvous store, watches their "
      "heartbeat leases, re-forms the world after failures and resizes, orders checkpoints and "
      "answers shardctl. Restarted on the same --state-dir after a crash, it takes the live job "
      "back (with the same --job file, or without --job).",
      "shard-coordinator"};
  shard::CoordinatorOptions options;
  std::string lease = "10s";
  std::string port_file;
  std::string log_level = "info";
  options.state_dir = "shard-state";
  app.add_option("--listen", options.listen_address,
                 "host:port to serve gRPC on; port 0 picks a free port (see --port-file)")
      ->capture_default_str();
  std::string job_file;
  std::string restore;
  app.add_option("--job", job_file,
                 "training job spec (JSON, protobuf mapping of shard.v1.JobSpec); sets the job "
                 "name, world size and planning, and is handed to every worker. Without it (and "
                 "without a live job in --state-dir to take back) the workers only form a world "
                 "and self-check their data path")
      ->check(CLI::ExistingFile);
  app.add_option("--restore", restore,
                 "with --job: continue training from this committed checkpoint of the job (an id "
                 "from 'shardctl checkpoint list', or 'latest'), on whatever world size the job "
                 "now has");
  CLI::Option* world_size = app.add_option("--world-size", options.world.expected_world_size,
                                           "number of workers that form the world (default: the "
                                           "job's world_size)")
                                ->check(CLI::Range(1, 1 << 20));
  CLI::Option* job_name =
      app.add_option("--job-name", options.world.job,
                     "name of the job ([A-Za-z0-9._-]; default: the job spec's name)")
          ->capture_default_str();
  app.add_option("--lease", lease,
                 "a worker silent for longer than this is declared dead (workers heartbeat "
                 "every quarter lease)")
      ->capture_default_str()
      ->check(shard::DurationValidator());
  app.add_option("--state-dir", options.state_dir,
                 "directory for the coordinator's durable state (job spec, generation, members "
                 "and history, plan, checkpoint catalog); created if missing, locked while "
                 "running")
      ->capture_default_str();
  std::string progress_floor = "30s";
  std::string progress_ceiling = "30m";
  std::string stuck_policy = "evict";
  app.add_option("--progress-lease-floor", progress_floor,
                 "a rank that finishes no step for max(this, --progress-lease-factor x the p99 "
                 "step time) while its peers wait on it in a collective is stuck (a hung kernel, "
                 "a deadlocked data loader, a stalled disk); keep it above the longest restore "
                 "and first step. 0s: never look")
      ->capture_default_str()
      ->check(shard::DurationValidator());
  app.add_option("--progress-lease-factor", options.progress.factor,
                 "the progress lease in multiples of the p99 step time (at least the floor)")
      ->capture_default_str()
      ->check(CLI::Range(1.0, 1e6));
  app.add_option("--progress-lease-ceiling", progress_ceiling,
                 "the progress lease never exceeds this")
      ->capture_default_str()
      ->check(shard::DurationValidator());
  app.add_option("--stuck-policy", stuck_policy,
                 "what to do with a stuck rank: evict (as a dead worker: its peers abort and the "
                 "world re-forms; the hung process exits) or warn (an event and a log line only)")
      ->capture_default_str()
      ->check(CLI::IsMember({"evict", "warn"}));
  std::string reform_grace = "30s";
  app.add_option("--reform-grace", reform_grace,
                 "after a worker holding a rank is lost: how long to wait for a replacement "
                 "before re-forming with the survivors (if at least the job's min_world_size "
                 "remain)")
      ->capture_default_str()
      ->check(shard::DurationValidator());
  app.add_option("--max-standbys", options.world.max_standbys,
                 "workers that find every rank held wait as standbys, up to this many (0: the "
                 "job's world size); a standby takes the rank of a worker that dies and is "
                 "folded in at a checkpoint while the world is below its target. Workers beyond "
                 "them are told to retry")
      ->capture_default_str()
      ->check(CLI::Range(0, 1 << 20));
  app.add_option("--max-worker-failures", options.world.max_worker_failures,
                 "the job fails (every worker is told to leave, and the coordinator exits 1) "
                 "once more than this many workers have exited with an error over its life: an "
                 "error that comes back wherever a worker restarts must not be retried forever. "
                 "A worker killed or declared dead does not count. Negative: never")
      ->capture_default_str();
  std::string shard_mode = "range";
  double bucket_cap_mb = 25;
  double first_bucket_cap_mb = 1;
  int min_buckets = 4;
  app.add_option("--shard-mode", shard_mode,
                 "optimizer-state sharding: range (equal contiguous shards of every bucket) or "
                 "param (whole parameters balanced over ranks)")
      ->capture_default_str()
      ->check(CLI::IsMember({"range", "param"}));
  app.add_option("--bucket-cap-mb", bucket_cap_mb, "gradient bucket cap in MiB")
      ->capture_default_str()
      ->check(shard::MebibytesValidator());
  app.add_option("--first-bucket-cap-mb", first_bucket_cap_mb,
                 "cap of the first bucket in MiB (small, so communication starts early)")
      ->capture_default_str()
      ->check(shard::MebibytesValidator());
  app.add_option("--min-buckets", min_buckets,
                 "buckets after the first hold at most this fraction (1/N) of the model's bytes, "
                 "never less than the first bucket's cap, so a small model still reduces during "
                 "backward; 1: the caps alone decide")
      ->capture_default_str()
      ->check(CLI::Range(1, 1024));
  app.add_option("--port-file", port_file,
                 "write the bound port to this file once serving (for --listen host:0)");
  app.add_option("--health-listen", options.health_listen,
                 "host:port of a plaintext gRPC port serving only grpc.health.v1.Health "
                 "(SERVING once the state directory is loaded), for probes that cannot do TLS "
                 "such as kubelet's; the main port serves health and reflection too");
  app.add_option("--metrics-listen", options.metrics_listen,
                 "host:port to serve Prometheus metrics on, at /metrics (see docs/metrics.md)");
  app.add_option("--tls-cert", options.tls.cert, "PEM certificate of the coordinator: serve TLS")
      ->check(CLI::ExistingFile);
  app.add_option("--tls-key", options.tls.key, "PEM private key of --tls-cert")
      ->check(CLI::ExistingFile);
  app.add_option("--tls-client-ca", options.tls.client_ca,
                 "PEM CA: mutual TLS, every worker and shardctl must present a certificate it "
                 "signed")
      ->check(CLI::ExistingFile);
  std::string job_token_file;
  std::string admin_token_file;
  app.add_option("--job-token-file", job_token_file,
                 "file holding the token workers must present to join and report (one line); needs "
                 "--admin-token-file too, and TLS (--tls-cert, --tls-key) unless --listen is a "
                 "loopback address: tokens never cross a network in clear text")
      ->check(CLI::ExistingFile);
  app.add_option("--admin-token-file", admin_token_file,
                 "file holding the token shardctl must present for calls that change the job "
                 "(save, restore, delete, stop, resize, drain); read-only calls take either token")
      ->check(CLI::ExistingFile);
  app.add_option("--max-joins-per-second", options.max_joins_per_second,
                 "joins accepted per second beyond a burst of twice the world size (a join "
                 "persists state); more are told to retry")
      ->capture_default_str()
      ->check(CLI::Range(1.0, 1e6));
  app.add_option("--log-level", log_level, "trace, debug, info, warn or error")
      ->capture_default_str();
  if (std::optional<int> exit_code = shard::ParseCommandLine(
          app, argc, argv, shard::FlagSources::kCommandLineAndEnvironment)) {
    return *exit_code;
  }
  for (auto [file, token] : {std::pair{&job_token_file, &options.job_token},
                             std::pair{&admin_token_file, &options.admin_token}}) {
    if (file->empty()) continue;
    absl::StatusOr<std::string> read = shard::ReadTokenFile(*file);
    if (!read.ok()) {
      std::fprintf(stderr, "shard-coordinator: %s\n", std::string(read.status().message()).c_str());
      return 2;
    }
    *token = std::move(*read);
  }
  if (!options.job_token.empty() && options.admin_token.empty()) {
    std::fprintf(stderr, "shard-coordinator: --job-token-file without --admin-token-file would "
                         "leave stop, resize, drain, restore and delete open to anyone who can "
                         "reach the port; give an admin token too\n");
    return 2;
  }
  if (!options.job_token.empty() && options.job_token == options.admin_token) {
    std::fprintf(stderr, "shard-coordinator: the job and admin tokens must differ (a worker "
                         "must not be able to change the job)\n");
    return 2;
  }
  if (absl::Status logging = shard::ConfigureLogging(log_level, "coordinator"); !logging.ok()) {
    std::fprintf(stderr, "shard-coordinator: %s\n", std::string(logging.message()).c_str());
    return 2;
  }
  options.world.lease = shard::ParsedDuration(lease);
  options.world.reform_grace = shard::ParsedDuration(reform_grace);
  options.progress.floor = shard::ParsedDuration(progress_floor);
  options.progress.ceiling = shard::ParsedDuration(progress_ceiling);
  options.progress.evict_stuck = stuck_policy == "evict";
  options.world.expected_world_size = world_size->count() > 0 ? options.world.expected_world_size : 0;
  if (!job_file.empty()) {
    absl::StatusOr<shard::JobConfig> job = shard::LoadJobFile(job_file);
    if (!job.ok()) {
      std::fprintf(stderr, "shard-coordinator: %s\n", std::string(job.status().message()).c_str());
      return 2;
    }
    if (world_size->count() > 0 && options.world.expected_world_size != job->world_size) {
      std::fprintf(stderr,
                   "shard-coordinator: --world-size %d disagrees with the job's world_size %d\n",
                   options.world.expected_world_size, job->world_size);
      return 2;
    }
    if (job_name->count() > 0 && options.world.job != job->name) {
      std::fprintf(stderr, "shard-coordinator: --job-name %s disagrees with the job's name %s\n",
                   options.world.job.c_str(), job->name.c_str());
      return 2;
    }
    options.job = *job;
    options.restore = restore;
    for (const char* flag :
         {"--shard-mode", "--bucket-cap-mb", "--first-bucket-cap-mb", "--min-buckets"}) {
      if (app.count(flag) > 0) {
        std::fprintf(stderr, "shard-coordinator: %s comes from the job spec when --job is given\n",
                     flag);
        return 2;
      }
    }
  } else {
    options.plan.mode = *shard::ParseShardMode(shard_mode);
    options.plan.bucket_cap_bytes = shard::MebibytesToBytes(bucket_cap_mb);
    options.plan.first_bucket_cap_bytes = shard::MebibytesToBytes(first_bucket_cap_mb);
    options.plan.min_buckets = min_buckets;
  }


  // Signals stop the job through the server, once it exists.
  std::unique_ptr<shard::CoordinatorServer> server;
  absl::Mutex server_mu;
  shard::SignalWatcher signals([&](int signal, int count) {
    absl::MutexLock lock(&server_mu);
    if (count > 1 || server == nullptr) {
      spdlog::warn("received {}: exiting without waiting for workers", strsignal(signal));
      std::_Exit(1);
    }
    spdlog::info("received {}: stopping the job (again to exit at once)", strsignal(signal));
    server->RequestStop(absl::StrCat("coordinator received ", strsignal(signal)));
  });

  auto started = shard::CoordinatorServer::Start(options);
  if (!started.ok()) {
    spdlog::error("cannot start: {}", started.status().message());
    // Options that cannot work are usage errors; anything else is operational.
    return absl::IsInvalidArgument(started.status()) ? 2 : 1;
  }
  {
    absl::MutexLock lock(&server_mu);
    server = std::move(*started);
  }
  if (!port_file.empty()) {
    if (absl::Status written =
            shard::WriteFileAtomically(port_file, absl::StrCat(server->port(), "\n"));
        !written.ok()) {
      spdlog::error("{}", written.message());
      return 1;
    }
  }
  server->WaitUntilStopped(absl::InfiniteDuration());
  const bool failed = server->job_state() == shard::JobState::kFailed;
  server->Shutdown();
  spdlog::info("coordinator exiting{}", failed ? ": the job failed" : "");
  return failed ? 1 : 0;
}
