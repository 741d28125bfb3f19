#include "server/metrics.h"

#include <netdb.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <map>
#include <optional>
#include <thread>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/status_macros.h"
#include "httplib.h"
#include "prometheus/text_serializer.h"
#include "server/checkpoint_manager.h"
#include "server/snapshot_manager.h"
#include "server/plan_manager.h"
#include "server/world_manager.h"
#include "spdlog/spdlog.h"

namespace shard {

// --- RPC metrics ---------------------------------------------------------------------------------

namespace {

// Unary calls take well under a millisecond to tens of milliseconds (a checkpoint commit); long
// polls (heartbeat watches, rendezvous waits, event watches) wait up to their wait_ms.
const prometheus::Histogram::BucketBoundaries& DurationBuckets() {
  static const auto* const kBuckets = new prometheus::Histogram::BucketBoundaries{
      0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300};
  return *kBuckets;
}

}  // namespace

RpcMetrics::RpcMetrics(const std::vector<std::string>& served)
    : requests_(prometheus::BuildCounter()
                    .Name("shard_rpc_requests_total")
                    .Help("RPCs the coordinator answered, by method and status code.")
                    .Register(registry_)),
      durations_(prometheus::BuildHistogram()
                     .Name("shard_rpc_duration_seconds")
                     .Help("Time from an RPC's arrival to its status being sent, by method (long "
                           "polls included).")
                     .Register(registry_)),
      in_flight_(prometheus::BuildGauge()
                     .Name("shard_rpc_in_flight")
                     .Help("RPCs being served now (long polls included), by method.")
                     .Register(registry_)),
      other_(AddMethod("other")) {
  for (const std::string& method : served) served_.try_emplace(method, AddMethod(method));
}

RpcMetrics::MethodSeries RpcMetrics::AddMethod(const std::string& method) {
  MethodSeries series;
  for (int code = 0; code < kStatusCodes; ++code) {
    // gRPC's codes are absl's, number for number (proto/grpc_status.h relies on it too).
    const std::string name = absl::StatusCodeToString(static_cast<absl::StatusCode>(code));
    series.requests[code] = &requests_.Add({{"method", method}, {"code", name}});
  }
  series.duration = &durations_.Add({{"method", method}}, DurationBuckets());
  series.in_flight = &in_flight_.Add({{"method", method}});
  return series;
}

const RpcMetrics::MethodSeries& RpcMetrics::SeriesOf(absl::string_view full_method) const {
  absl::ConsumePrefix(&full_method, "/");
  auto found = served_.find(full_method);
  return found != served_.end() ? found->second : other_;
}

void RpcMetrics::Begin(absl::string_view full_method) {
  SeriesOf(full_method).in_flight->Increment();
}

void RpcMetrics::End(absl::string_view full_method, grpc::StatusCode code,
                     absl::Duration elapsed) {
  const MethodSeries& series = SeriesOf(full_method);
  // A code outside gRPC's range (a handler may construct any number) is counted as UNKNOWN, so
  // the series stay the ones the constructor made.
  const int index = code >= 0 && code < kStatusCodes ? code : grpc::StatusCode::UNKNOWN;
  series.requests[index]->Increment();
  series.duration->Observe(absl::ToDoubleSeconds(elapsed));
  series.in_flight->Decrement();
}

std::vector<std::string> MethodNames(const google::protobuf::ServiceDescriptor& service) {
  std::vector<std::string> names;
  for (int i = 0; i < service.method_count(); ++i) {
    names.push_back(absl::StrCat(service.full_name(), "/", service.method(i)->name()));
  }
  return names;
}

namespace {

// One per call: the clock starts when the request's metadata arrives and stops when the status
// is about to be sent. A call that ends without sending one (the client went away) is counted
// as CANCELLED when gRPC destroys the interceptor with the call.
class RpcMetricsInterceptor final : public grpc::experimental::Interceptor {
 public:
  RpcMetricsInterceptor(RpcMetrics* metrics, std::string method)
      : metrics_(metrics), method_(std::move(method)), start_(absl::Now()) {}

  ~RpcMetricsInterceptor() override {
    if (begun_ && !ended_) {
      metrics_->End(method_, grpc::StatusCode::CANCELLED, absl::Now() - start_);
    }
  }

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    using grpc::experimental::InterceptionHookPoints;
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::POST_RECV_INITIAL_METADATA) &&
        !begun_) {
      begun_ = true;
      start_ = absl::Now();
      metrics_->Begin(method_);
    }
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_STATUS) && !ended_) {
      if (!begun_) {  // the clock started when the call was created
        begun_ = true;
        metrics_->Begin(method_);
      }
      ended_ = true;
      metrics_->End(method_, methods->GetSendStatus().error_code(), absl::Now() - start_);
    }
    methods->Proceed();
  }

 private:
  RpcMetrics* const metrics_;
  const std::string method_;
  absl::Time start_;
  // A call's hook points run one after another, never at once.
  bool begun_ = false;
  bool ended_ = false;
};

class RpcMetricsInterceptorFactory final
    : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit RpcMetricsInterceptorFactory(RpcMetrics* metrics) : metrics_(metrics) {}

  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    const char* method = info->method();
    return new RpcMetricsInterceptor(metrics_, method != nullptr ? method : "");
  }

 private:
  RpcMetrics* const metrics_;
};

}  // namespace

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
MakeRpcMetricsInterceptorFactory(RpcMetrics* metrics) {
  return std::make_unique<RpcMetricsInterceptorFactory>(metrics);
}


// --- The coordinator's exposition ----------------------------------------------------------------

namespace {

// What a scrape reads of the managers. ReadManagers() is the only code here that calls them, so
// a change of their API is met in one place; the rest turns these values into gauges.
struct ManagerReadings {
  struct Checkpoints {
    std::vector<v1::CheckpointRecord> records;  // the catalog, oldest first
    int64_t start_step = 0;                     // where this generation's training started
    bool training_started = false;
    bool save_pending = false;
    SaveHealth health;  // failed and skipped saves
  };
  std::optional<StatusSnapshot> world;
  std::optional<PlanStats> plan;
  std::optional<Checkpoints> checkpoints;
  std::optional<SnapshotSummary> snapshots;
  std::optional<CheckpointManager::Restores> restores;
};

ManagerReadings ReadManagers(const CoordinatorMetricsSources& sources, absl::Time now) {
  ManagerReadings readings;
  if (sources.world != nullptr) readings.world = sources.world->Status(now);
  if (sources.plan != nullptr) readings.plan = sources.plan->Stats();
  if (sources.checkpoints != nullptr) {
    const CheckpointManager& checkpoints = *sources.checkpoints;
    readings.checkpoints = ManagerReadings::Checkpoints{
        checkpoints.List(), checkpoints.start().step, checkpoints.training_started(),
        checkpoints.pending_request() != 0, checkpoints.health()};
    readings.restores = checkpoints.restores();
  }
  if (sources.snapshots != nullptr && sources.world != nullptr) {
    readings.snapshots = sources.snapshots->Summary(sources.world->LiveNow(), now);
  }
  return readings;
}

using GaugeFamily = prometheus::Family<prometheus::Gauge>;

GaugeFamily& AddGaugeFamily(const std::string& name, const std::string& help,
                            prometheus::Registry& registry) {
  return prometheus::BuildGauge().Name(name).Help(help).Register(registry);
}

// A gauge without labels.
void SetGauge(const std::string& name, const std::string& help, double value,
              prometheus::Registry& registry) {
  AddGaugeFamily(name, help, registry).Add({}).Set(value);
}

double Seconds(absl::Duration duration) { return absl::ToDoubleSeconds(duration); }

bool IsLive(WorkerState state) {
  return state != WorkerState::kLeft && state != WorkerState::kDead;
}

void AddWorldMetrics(const StatusSnapshot& status, prometheus::Registry& registry) {
  const World& w = status.world;

  GaugeFamily& job_state = AddGaugeFamily(
      "shard_job_state",
      "1 for the job's current phase (forming, running, reshaping, stopping, finished, failed).",
      registry);
  for (JobState state : kAllJobStates) {
    job_state.Add({{"state", std::string(JobStateName(state))}}).Set(state == w.state ? 1 : 0);
  }
  SetGauge("shard_generation", "The world's generation (bumped on every rank change).",
           static_cast<double>(w.generation), registry);
  SetGauge("shard_world_size", "Live workers holding a rank.", w.world_size, registry);
  SetGauge("shard_world_ranks", "Ranks of the current generation's world.", w.ranks, registry);
  SetGauge("shard_world_target_size", "The world size the job aims for.", w.expected_world_size,
           registry);
  SetGauge("shard_world_min_size", "The fewest workers the world re-forms with.",
           w.min_world_size, registry);
  SetGauge("shard_worker_lease_seconds",
           "A worker is declared dead after this long without a heartbeat.",
           Seconds(status.lease), registry);

  std::map<WorkerState, int> counts;
  for (WorkerState state :
       {WorkerState::kJoining, WorkerState::kReady, WorkerState::kFailed, WorkerState::kStandby,
        WorkerState::kLeaving, WorkerState::kLeft, WorkerState::kDead}) {
    counts[state] = 0;
  }
  for (const WorkerSnapshot& worker : status.workers) ++counts[worker.state];
  GaugeFamily& workers = AddGaugeFamily(
      "shard_workers",
      "Workers by state; departed ones (left, dead) among the most recent that status keeps.",
      registry);
  for (const auto& [state, count] : counts) {
    workers.Add({{"state", std::string(WorkerStateName(state))}}).Set(count);
  }

  GaugeFamily& up = AddGaugeFamily(
      "shard_worker_up", "1 while the worker is live (heartbeating), 0 once it left or died.",
      registry);
  GaugeFamily& heartbeat = AddGaugeFamily(
      "shard_worker_last_heartbeat_seconds", "Seconds since the worker's last heartbeat.",
      registry);
  GaugeFamily& isolated = AddGaugeFamily(
      "shard_worker_isolated",
      "1 while the worker waits as a standby because peers could not connect to it (status and "
      "the isolated event name the links), 0 otherwise.",
      registry);
  int isolated_count = 0;
  for (const WorkerSnapshot& worker : status.workers) {
    const std::string rank = worker.rank >= 0 ? absl::StrCat(worker.rank) : "";
    up.Add({{"worker", worker.id}, {"rank", rank}}).Set(IsLive(worker.state) ? 1 : 0);
    heartbeat.Add({{"worker", worker.id}}).Set(Seconds(worker.since_heartbeat));
    const bool is_isolated = IsLive(worker.state) && !worker.unreachable.empty();
    isolated.Add({{"worker", worker.id}}).Set(is_isolated ? 1 : 0);
    isolated_count += is_isolated ? 1 : 0;
  }
  SetGauge("shard_workers_isolated",
           "Live workers kept out of the world because peers could not connect to them.",
           isolated_count, registry);
}

void AddPlanMetrics(const PlanStats& stats, prometheus::Registry& registry) {
  SetGauge("shard_plan_version", "Version of the current sharding plan (0: none yet).",
           static_cast<double>(stats.plan_version), registry);
  SetGauge("shard_plan_pending_acks", "Ranks that have not applied the current plan.",
           static_cast<double>(stats.pending_acks.size()), registry);
  GaugeFamily& overlap_status = AddGaugeFamily(
      "shard_overlap_status",
      "1 for the gradient-bucket state (UNINITIALIZED, DDP_HAS_REBUILT_BUCKETS, INITIALIZED).",
      registry);
  for (OverlapStatus status :
       {OverlapStatus::kUninitialized, OverlapStatus::kRebuilt, OverlapStatus::kInitialized}) {
    overlap_status.Add({{"status", std::string(OverlapStatusName(status))}})
        .Set(status == stats.status ? 1 : 0);
  }

  // The lowest rank's latest report stands for the step (rank 0 in a running world); the step
  // counter is the furthest any rank reported.
  const StepReport* latest = nullptr;
  int64_t step = 0;
  for (const PlanStats::Rank& rank : stats.ranks) {
    if (!rank.last.has_value()) continue;
    if (latest == nullptr) latest = &*rank.last;
    step = std::max(step, rank.last->step);
  }
  SetGauge("shard_training_step", "The latest training step a worker reported.",
           static_cast<double>(step), registry);
  if (latest == nullptr) return;  // no step yet: nothing to say about one

  SetGauge("shard_step_duration_seconds",
           "Duration of the latest reported step (the lowest rank's).", latest->step_ms / 1000,
           registry);
  SetGauge("shard_training_loss", "Loss of the latest reported step (the lowest rank's).",
           latest->loss, registry);
  int64_t reduced = 0;
  for (int64_t bytes : latest->bucket_bytes) reduced += bytes;
  SetGauge("shard_step_reduced_bytes",
           "Gradient bytes all-reduced per step (sum of the latest step's buckets).",
           static_cast<double>(reduced), registry);
  SetGauge("shard_step_duration_mean_seconds",
           "Mean step duration over the recent reports of every rank.", stats.mean_step_ms / 1000,
           registry);
  SetGauge("shard_backward_duration_mean_seconds",
           "Mean backward compute per step over the recent reports.",
           stats.mean_backward_ms / 1000, registry);
  SetGauge("shard_communication_duration_mean_seconds",
           "Mean time per step that gradient collectives were in flight.",
           stats.mean_communication_ms / 1000, registry);
  SetGauge("shard_hidden_communication_duration_mean_seconds",
           "Mean communication time per step that overlapped backward compute.",
           stats.mean_hidden_ms / 1000, registry);
  SetGauge("shard_overlap_hidden_ratio",
           "Fraction of communication time hidden behind backward compute (0..1).",
           stats.overlap_fraction, registry);
  GaugeFamily& held = AddGaugeFamily(
      "shard_rank_model_state_bytes",
      "Model state a rank holds by the engine's accounting: parameters, gradients, optimizer "
      "state and (ZeRO-3) its gathered buckets.",
      registry);
  GaugeFamily& gathered = AddGaugeFamily(
      "shard_rank_gathered_units",
      "ZeRO-3: the most buckets a rank held gathered at once in its latest step (at most "
      "prefetch + 1 unless the model holds more).",
      registry);
  GaugeFamily& gather_wait = AddGaugeFamily(
      "shard_rank_gather_wait_seconds",
      "Time a rank's latest forward and backward waited for parameter gathers (ZeRO-3, "
      "overlapParamGather).",
      registry);
  for (const PlanStats::Rank& rank : stats.ranks) {
    if (!rank.last.has_value()) continue;
    const std::map<std::string, std::string> labels = {{"rank", std::to_string(rank.rank)}};
    held.Add(labels).Set(static_cast<double>(rank.last->held_bytes));
    gathered.Add(labels).Set(rank.last->gathered_units);
    gather_wait.Add(labels).Set(rank.last->gather_wait_ms / 1000);
  }
}

void AddCheckpointMetrics(const ManagerReadings::Checkpoints& checkpoints,
                          prometheus::Registry& registry) {
  SetGauge("shard_training_started", "1 once a worker reported a training step.",
           checkpoints.training_started ? 1 : 0, registry);
  SetGauge("shard_training_start_step",
           "The step this generation's training started from (a restored checkpoint's).",
           static_cast<double>(checkpoints.start_step), registry);
  SetGauge("shard_checkpoint_save_pending", "1 while a save request awaits its commit.",
           checkpoints.save_pending ? 1 : 0, registry);
  SetGauge("shard_checkpoints_committed",
           "Committed checkpoints in the catalog (after keep-last-K retention).",
           static_cast<double>(checkpoints.records.size()), registry);
  prometheus::BuildCounter()
      .Name("shard_checkpoint_failures_total")
      .Help("Saves that failed (a full disk, EIO) since the coordinator started.")
      .Register(registry)
      .Add({})
      .Increment(static_cast<double>(checkpoints.health.failures_total));
  prometheus::BuildCounter()
      .Name("shard_checkpoints_skipped_total")
      .Help("Periodic saves skipped while the previous one was still being written.")
      .Register(registry)
      .Add({})
      .Increment(static_cast<double>(checkpoints.health.skipped_total));
  SetGauge("shard_checkpoint_failures_since_commit",
           "Saves that failed since the newest checkpoint committed (0: saves work).",
           static_cast<double>(checkpoints.health.failures), registry);
  if (checkpoints.records.empty()) return;

  const v1::CheckpointRecord& last = checkpoints.records.back();
  SetGauge("shard_checkpoint_last_step", "Training step of the newest checkpoint.",
           static_cast<double>(last.step()), registry);
  SetGauge("shard_checkpoint_last_commit_timestamp_seconds",
           "When the newest checkpoint committed, in seconds since the Unix epoch.",
           static_cast<double>(last.committed_unix_ms()) / 1000, registry);
  SetGauge("shard_checkpoint_save_duration_seconds",
           "Newest checkpoint: the slowest rank's time to write its shard.",
           last.max_write_ms() / 1000, registry);
  SetGauge("shard_checkpoint_pause_seconds",
           "Newest checkpoint: the longest training stall it caused on a rank.",
           last.max_pause_ms() / 1000, registry);
  SetGauge("shard_checkpoint_bytes", "Newest checkpoint: bytes written, all shards.",
           static_cast<double>(last.bytes()), registry);
}

}  // namespace

void AddRecoveryMetrics(const std::optional<SnapshotSummary>& snapshots,
                        const CheckpointManager::Restores& restores, absl::Time now,
                        prometheus::Registry& registry) {
  prometheus::Family<prometheus::Counter>& total =
      prometheus::BuildCounter()
          .Name("shard_restores_total")
          .Help("Restores every rank of a generation completed, by where the state came from.")
          .Register(registry);
  total.Add({{"source", "memory"}}).Increment(static_cast<double>(restores.from_memory));
  total.Add({{"source", "disk"}}).Increment(static_cast<double>(restores.from_disk));
  if (restores.last.has_value()) {
    SetGauge("shard_restore_last_duration_seconds",
             "The last restore: the slowest rank's time to read its state.",
             Seconds(restores.last->slowest), registry);
    SetGauge("shard_restore_last_steps_lost",
             "The last restore: steps trained before it that were trained again.",
             static_cast<double>(restores.last->steps_lost), registry);
    SetGauge("shard_restore_last_from_memory", "1 if the last restore read workers' memory.",
             restores.last->start.in_memory ? 1 : 0, registry);
  }
  if (!snapshots.has_value() || snapshots->usable_id.empty()) return;
  SetGauge("shard_snapshot_last_step",
           "Step of the newest in-memory snapshot every shard of which a live worker holds.",
           static_cast<double>(snapshots->usable_step), registry);
  if (snapshots->usable_since.has_value()) {
    SetGauge("shard_snapshot_age_seconds", "Since that snapshot became usable.",
             Seconds(now - *snapshots->usable_since), registry);
  }
  SetGauge("shard_snapshot_copies", "Live copies of that snapshot's least-held shard.",
           snapshots->usable_copies, registry);
  SetGauge("shard_snapshot_replica_lag_steps",
           "Steps between the newest snapshot taken and the newest fully replicated one.",
           static_cast<double>(snapshots->replica_lag_steps), registry);
  SetGauge("shard_snapshot_replica_lag_seconds",
           "How long the newest snapshot taken has waited for its replicas (0 once it has them).",
           snapshots->replica_lag.has_value() ? Seconds(*snapshots->replica_lag) : 0, registry);
}

std::string RenderCoordinatorMetrics(const CoordinatorMetricsSources& sources, absl::Time now) {
  const ManagerReadings readings = ReadManagers(sources, now);
  // A registry per scrape: the series are those of this moment (a departed worker's disappear
  // with it), and gauges need no updating between scrapes.
  prometheus::Registry registry;
  SetGauge("shard_coordinator_start_time_seconds",
           "When the coordinator started, in seconds since the Unix epoch.",
           Seconds(sources.started - absl::UnixEpoch()), registry);
  SetGauge("shard_coordinator_uptime_seconds", "Seconds since the coordinator started.",
           Seconds(now - sources.started), registry);
  if (readings.world.has_value()) AddWorldMetrics(*readings.world, registry);
  if (readings.plan.has_value()) AddPlanMetrics(*readings.plan, registry);
  if (readings.checkpoints.has_value()) AddCheckpointMetrics(*readings.checkpoints, registry);
  if (readings.restores.has_value()) {
    AddRecoveryMetrics(readings.snapshots, *readings.restores, now, registry);
  }

  std::vector<prometheus::MetricFamily> families = registry.Collect();
  if (sources.rpc != nullptr) {
    std::vector<prometheus::MetricFamily> rpc = sources.rpc->Collect();
    families.insert(families.end(), std::make_move_iterator(rpc.begin()),
                    std::make_move_iterator(rpc.end()));
  }
  // prometheus-cpp keeps a family's series in a hash map; sorted, the page lists them in the
  // same order on every scrape (and states, workers and methods alphabetically) for a reader.
  for (prometheus::MetricFamily& family : families) {
    std::sort(family.metric.begin(), family.metric.end(),
              [](const prometheus::ClientMetric& a, const prometheus::ClientMetric& b) {
                return a.label < b.label;
              });
  }
  return prometheus::TextSerializer().Serialize(families);
}

// --- The HTTP endpoint ---------------------------------------------------------------------------

namespace {

constexpr int kServingThreads = 2;

// Splits "host:port" / "[v6]:port".
absl::Status ParseListen(const std::string& listen, std::string* host, int* port) {
  absl::string_view rest = listen;
  const std::string usage =
      absl::StrCat("bad metrics address '", listen,
                   "': want HOST:PORT, e.g. 127.0.0.1:9460 (0.0.0.0 for every interface, port 0 "
                   "for a free one)");
  if (absl::ConsumePrefix(&rest, "[")) {
    const size_t close = rest.find("]:");
    if (close == absl::string_view::npos) return absl::InvalidArgumentError(usage);
    *host = std::string(rest.substr(0, close));
    rest.remove_prefix(close + 2);
  } else {
    const size_t colon = rest.rfind(':');
    if (colon == absl::string_view::npos) return absl::InvalidArgumentError(usage);
    *host = std::string(rest.substr(0, colon));
    if (host->find(':') != std::string::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat(usage, "; an IPv6 address goes in brackets: [::1]:9460"));
    }
    rest.remove_prefix(colon + 1);
  }
  if (host->empty()) return absl::InvalidArgumentError(usage);
  if (rest.empty() || rest.size() > 5 ||
      !std::all_of(rest.begin(), rest.end(),
                   [](char c) { return absl::ascii_isdigit(static_cast<unsigned char>(c)); }) ||
      !absl::SimpleAtoi(rest, port) || *port > 65535) {
    return absl::InvalidArgumentError(usage);
  }
  return absl::OkStatus();
}

absl::Status CheckResolves(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* result = nullptr;
  const int rc = ::getaddrinfo(host.c_str(), "0", &hints, &result);
  if (rc != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot resolve metrics host '", host, "': ", ::gai_strerror(rc)));
  }
  ::freeaddrinfo(result);
  return absl::OkStatus();
}

}  // namespace

struct MetricsHttpServer::Impl {
  httplib::Server server;
  std::thread thread;
  std::atomic<bool> exited{false};
};

MetricsHttpServer::MetricsHttpServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const std::string& listen, std::function<std::string()> render) {
  std::string host;
  int port = 0;
  SHARD_RETURN_IF_ERROR(ParseListen(listen, &host, &port));
  SHARD_RETURN_IF_ERROR(CheckResolves(host));

  auto impl = std::make_unique<Impl>();
  httplib::Server& server = impl->server;
  server.new_task_queue = [] { return new httplib::ThreadPool(kServingThreads); };
  // httplib's default sets SO_REUSEPORT, which would let a second server share the port and
  // split the scrapes; SO_REUSEADDR alone still reports a port in use.
  server.set_socket_options([](socket_t sock) {
    int yes = 1;
    ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  server.set_payload_max_length(4096);  // a scrape has no body
  server.set_read_timeout(5, 0);
  server.set_write_timeout(5, 0);
  server.set_keep_alive_timeout(5);
  server.Get("/metrics", [render = std::move(render)](const httplib::Request&,
                                                       httplib::Response& response) {
    response.set_content(render(), std::string(kContentType));
  });
  server.set_error_handler([](const httplib::Request&, httplib::Response& response) {
    if (response.status == 404) {
      response.set_content("not found: the metrics are at /metrics\n", "text/plain; charset=utf-8");
    }
  });

  errno = 0;
  int bound = port;
  if (port == 0) {
    bound = server.bind_to_any_port(host);
  } else if (!server.bind_to_port(host, port)) {
    bound = -1;
  }
  if (bound < 0) {
    const int error = errno;
    const std::string what = absl::StrCat("cannot listen for metrics on ", listen);
    if (error == 0) return absl::UnavailableError(what);
    return absl::ErrnoToStatus(error, what);
  }

  Impl* raw = impl.get();
  impl->thread = std::thread([raw] {
    raw->server.listen_after_bind();
    raw->exited = true;
  });
  // stop() is a no-op until the accept loop runs, so wait for it before handing the server out
  // (its destructor stops it).
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!raw->server.is_running() && !raw->exited &&
         std::chrono::steady_clock::now() < give_up) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (!raw->server.is_running()) {
    raw->server.stop();
    if (raw->exited) {
      raw->thread.join();
    } else {
      // The accept loop never started in 10 s (never seen): leave the thread its server.
      raw->thread.detach();
      (void)impl.release();
    }
    return absl::InternalError(absl::StrCat("the metrics server on ", listen, " did not start"));
  }

  std::unique_ptr<MetricsHttpServer> result(new MetricsHttpServer(std::move(impl)));
  result->host_ = host;
  result->port_ = bound;
  spdlog::info("serving metrics at http://{}/metrics", result->address());
  return result;
}

MetricsHttpServer::~MetricsHttpServer() {
  impl_->server.stop();
  if (impl_->thread.joinable()) impl_->thread.join();
}

std::string MetricsHttpServer::address() const {
  return host_.find(':') != std::string::npos ? absl::StrCat("[", host_, "]:", port_)
                                              : absl::StrCat(host_, ":", port_);
}

}  // namespace shard
