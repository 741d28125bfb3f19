// shard-worker: one data-parallel rank of a Shard job.
#include <signal.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/cli.h"
#include "common/files.h"
#include "common/logging.h"
#include "common/manifest.h"
#include "common/mlp.h"
#include "common/names.h"
#include "common/signal_watcher.h"
#include "shard/config.h"
#include "spdlog/spdlog.h"
#include "worker/agent.h"
#include "worker/data_path.h"
#if SHARD_HAVE_CUDA
#include "worker/gpu/gpu_data_path.h"
#endif

namespace {

std::string DefaultWorkerId() {
  char host[256] = {};
  if (gethostname(host, sizeof(host) - 1) != 0) std::snprintf(host, sizeof(host), "worker");
  return absl::StrCat(host, "-", getpid());
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "shard-worker: one data-parallel rank of a Shard job. Joins the coordinator, receives its "
      "rank, connects the data path to its peers (Gloo over TCP on CPU, NCCL on a GPU), "
      "self-checks it with "
      "collectives of known result, trains the coordinator's job, and keeps its lease alive "
      "until the job stops.",
      "shard-worker"};
  shard::WorkerOptions options;
  std::string coordinator = "127.0.0.1:7460";
  std::string coordinator_timeout = "60s";
  std::string collective_timeout = "60s";
  std::string log_level = "info";
  int rank = -1;
  options.worker_id = DefaultWorkerId();
  app.add_option("--coordinator", coordinator, "host:port of shard-coordinator")
      ->capture_default_str();
  app.add_option("--id", options.worker_id,
                 "unique worker id ([A-Za-z0-9._-]); a restarted process with the same id "
                 "keeps its rank")
      ->capture_default_str();
  app.add_option("--host", options.host,
                 "address this worker's peers reach its data path at (it listens there)")
      ->capture_default_str();
  app.add_option("--device", options.device,
                 "cpu (or cpu:N), or cuda:N: the GPU this rank trains on (one rank per GPU "
                 "with NCCL)")
      ->capture_default_str();
  std::string backend = "auto";
  app.add_option("--backend", backend,
                 "collectives: auto (NCCL on a GPU, Gloo on CPU), nccl, or gloo (on a GPU: "
                 "staged through pinned host memory, so several ranks may share one GPU)")
      ->capture_default_str();
  std::string transport = "auto";
  app.add_option("--transport", transport,
                 "how ranks exchange host memory (Gloo's, or the GPU staging's): auto (shared "
                 "memory when every rank of the generation is on this host, TCP otherwise), "
                 "tcp, or shm (every rank must be on this host). Snapshot replicas for a buddy "
                 "on this host go through shared memory, except with tcp")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "tcp", "shm"}));
  app.add_option("--rank", rank, "ask for this rank (default: the coordinator assigns one)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--snapshot-port", options.snapshot_port,
                 "port on --host where peers read the in-memory snapshots this worker holds "
                 "(its own shard and its buddies'); 0: any free port")
      ->capture_default_str()
      ->check(CLI::Range(0, 65535));
  app.add_option("--coordinator-timeout", coordinator_timeout,
                 "give up after the coordinator has been unreachable this long")
      ->capture_default_str()
      ->check(shard::DurationValidator());
  app.add_option("--collective-timeout", collective_timeout,
                 "a rendezvous or collective waiting longer than this for a peer fails (once "
                 "steps are measured, the timeout is 20 x the p99 step time, at least "
                 "--collective-timeout-floor and at most this)")
      ->capture_default_str()
      ->check(shard::DurationValidator());
  std::string collective_timeout_floor = "30s";
  app.add_option("--collective-timeout-floor", collective_timeout_floor,
                 "the least a collective waits for a peer, however fast the steps (keep it above "
                 "the coordinator's --progress-lease-floor, so that a stuck peer is named first)")
      ->capture_default_str()
      ->check(shard::DurationValidator());
  std::string link_timeout = "10s";
  app.add_option("--link-timeout", link_timeout,
                 "a data-path connection whose sent data stays unacknowledged this long, or that "
                 "falls silent this long and misses its keepalives, fails: a partitioned link is "
                 "found in about this time (a stopped or hung peer's kernel still answers, so "
                 "only the network trips it); 0s leaves the kernel's defaults")
      ->capture_default_str()
      ->check(shard::DurationValidator());
  std::string connect_probe_timeout = "5s";
  app.add_option("--connect-probe-timeout", connect_probe_timeout,
                 "the most a connect probe to a peer may take (every rank probes every peer "
                 "before its data path connects; the deadline is 50 x the slowest connect "
                 "measured, at least 1s and at most this)")
      ->capture_default_str()
      ->check(shard::DurationValidator());
  app.add_option("--self-check-elements", options.self_check_elements,
                 "f32 elements in the self-check all-reduce")
      ->capture_default_str()
      ->check(CLI::Range(size_t{1}, size_t{1} << 28));
  int compute_threads = 1;
  app.add_option("--compute-threads", compute_threads,
                 "threads for the model's matrix products (OpenBLAS); keep workers x threads "
                 "within the machine's cores")
      ->capture_default_str()
      ->check(CLI::Range(1, 256));
  std::string manifest_file;
  app.add_option("--manifest", manifest_file,
                 "parameter manifest (JSON) to register and plan for, "
                 "{\"params\": [{\"name\": ..., \"shape\": [...], \"dtype\": \"f32\"}]}")
      ->check(CLI::ExistingFile);
  app.add_option("--log-level", log_level, "trace, debug, info, warn or error")
      ->capture_default_str();
  shard::ClientSecurityFiles security_files;
  shard::AddClientSecurityFlags(app, &security_files, "--job-token-file",
                                "file holding the job's token, if the coordinator requires one "
                                "(one line)");
  if (std::optional<int> exit_code = shard::ParseCommandLine(
          app, argc, argv, shard::FlagSources::kCommandLineAndEnvironment)) {
    return *exit_code;
  }
  absl::StatusOr<shard::ClientSecurity> security = shard::LoadClientSecurity(security_files);
  if (!security.ok()) {
    std::fprintf(stderr, "shard-worker: %s\n", std::string(security.status().message()).c_str());
    return 2;
  }
  if (absl::Status valid = shard::ValidateName("worker id (--id)", options.worker_id); !valid.ok()) {
    std::fprintf(stderr, "shard-worker: %s\n", std::string(valid.message()).c_str());
    return 2;
  }
  int gpu = -1;
  absl::StatusOr<std::string> resolved = shard::ResolveBackend(options.device, backend, &gpu);
  if (!resolved.ok()) {
    std::fprintf(stderr, "shard-worker: %s\n", std::string(resolved.status().message()).c_str());
    return 2;
  }
#if !SHARD_HAVE_CUDA
  if (gpu >= 0) {
    std::fprintf(stderr,
                 "shard-worker: --device %s needs a build with CUDA and NCCL; this one was built "
                 "without (SHARD_WITH_CUDA=OFF or no CUDA toolkit found). Use --device cpu.\n",
                 options.device.c_str());
    return 2;
  }
#endif
  if (absl::Status logging =
          shard::ConfigureLogging(log_level, absl::StrCat("worker=", options.worker_id));
      !logging.ok()) {
    std::fprintf(stderr, "shard-worker: %s\n", std::string(logging.message()).c_str());
    return 2;
  }
  if (rank >= 0) options.rank = rank;
  shard::SetComputeThreads(compute_threads);
  if (!manifest_file.empty()) {
    absl::StatusOr<std::string> text = shard::ReadFile(manifest_file);
    absl::StatusOr<shard::Manifest> manifest =
        text.ok() ? shard::ParseManifestJson(*text) : absl::StatusOr<shard::Manifest>(text.status());
    if (!manifest.ok()) {
      std::fprintf(stderr, "shard-worker: --manifest %s: %s\n", manifest_file.c_str(),
                   std::string(manifest.status().message()).c_str());
      return 2;
    }
    options.manifest = std::move(*manifest);
  }
  options.coordinator_timeout = shard::ParsedDuration(coordinator_timeout);
  options.snapshot_same_host = *shard::ParseHostTransport(transport) != shard::HostTransport::kTcp;
  options.collective_timeout = shard::ParsedDuration(collective_timeout);
  options.collective_timeout_floor = shard::ParsedDuration(collective_timeout_floor);
  options.connect_probe_timeout = shard::ParsedDuration(connect_probe_timeout);
  const shard::HostPathOptions host_path{.host = options.host,
                                         .timeout = options.collective_timeout,
                                         .link_timeout = shard::ParsedDuration(link_timeout),
                                         .transport = *shard::ParseHostTransport(transport)};
  absl::StatusOr<std::unique_ptr<shard::DataPath>> data_path = shard::CpuDataPath(host_path);
#if SHARD_HAVE_CUDA
  if (gpu >= 0) data_path = shard::GpuDataPath(gpu, *resolved, host_path);
#endif
  if (!data_path.ok()) {
    spdlog::error("{}", data_path.status().message());
    return 1;
  }

  // Signals stop the agent, once it exists (a signal before that is remembered).
  absl::Mutex agent_mu;
  shard::WorkerAgent* running_agent = nullptr;
  std::string early_stop;
  shard::SignalWatcher signals([&](int signal, int /*count*/) {
    spdlog::info("received {}: leaving the job", strsignal(signal));
    const std::string reason = absl::StrCat("worker received ", strsignal(signal));
    absl::MutexLock lock(&agent_mu);
    if (running_agent == nullptr) {
      early_stop = reason;
      return;
    }
    running_agent->RequestStop(reason);
  });
  shard::WorkerAgent agent(
      options,
      std::make_unique<shard::CoordinatorClient>(coordinator, absl::Seconds(10), *security),
      std::move(*data_path));
  {
    absl::MutexLock lock(&agent_mu);
    running_agent = &agent;
    if (!early_stop.empty()) agent.RequestStop(early_stop);
  }
  const absl::Status result = agent.Run();
  {
    absl::MutexLock lock(&agent_mu);
    running_agent = nullptr;
  }
  if (!result.ok()) {
    spdlog::error("{}", result.message());
    return 1;
  }
  return 0;
}
