#include "server/metrics.h"

#include <netdb.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "httplib.h"
#include "server/checkpoint_manager.h"
#include "server/plan_manager.h"
#include "server/world_manager.h"
#include "spdlog/spdlog.h"

namespace shard {
namespace {

// A misuse of the registry by this program's own code (see the header): stop, as a CHECK would.
[[noreturn]] void Fatal(const std::string& message) {
  std::fprintf(stderr, "metrics: %s\n", message.c_str());
  std::fflush(stderr);
  std::abort();
}

// Prometheus names: a letter or '_' (or ':' in metric names), then those or digits.
bool ValidName(absl::string_view name, bool colon_allowed) {
  if (name.empty()) return false;
  for (size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    const bool ok = absl::ascii_isalpha(static_cast<unsigned char>(c)) || c == '_' ||
                    (colon_allowed && c == ':') ||
                    (i > 0 && absl::ascii_isdigit(static_cast<unsigned char>(c)));
    if (!ok) return false;
  }
  return true;
}

bool ValidMetricName(absl::string_view name) { return ValidName(name, /*colon_allowed=*/true); }

// Label names starting "__" are reserved for Prometheus itself.
bool ValidLabelName(absl::string_view name) {
  return ValidName(name, /*colon_allowed=*/false) && !absl::StartsWith(name, "__");
}

// Backslash and newline escaped, and the double quote where `quote_escaped`.
std::string Escape(absl::string_view text, bool quote_escaped) {
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '"' && quote_escaped) {
      out += "\\\"";
    } else {
      out += c;
    }
  }
  return out;
}

}  // namespace

// --- The text exposition format ------------------------------------------------------------------

std::string EscapeLabelValue(absl::string_view value) {
  return Escape(value, /*quote_escaped=*/true);
}

std::string EscapeHelp(absl::string_view help) { return Escape(help, /*quote_escaped=*/false); }

std::string FormatMetricValue(double value) {
  if (std::isnan(value)) return "NaN";
  if (std::isinf(value)) return value > 0 ? "+Inf" : "-Inf";
  // Integers (counts, bytes, steps) exactly and without an exponent, up to where doubles stop
  // being exact; -0 as 0.
  if (value == std::floor(value) && std::fabs(value) < 9007199254740992.0) {
    return absl::StrCat(static_cast<int64_t>(value));
  }
  char buffer[64];
  const std::to_chars_result result = std::to_chars(buffer, buffer + sizeof(buffer), value);
  return std::string(buffer, result.ptr);
}

MetricFamily::MetricFamily(std::string name, std::string help,
                           std::vector<std::string> label_names)
    : name_(std::move(name)), help_(std::move(help)), label_names_(std::move(label_names)) {
  if (!ValidMetricName(name_)) Fatal(absl::StrCat("invalid metric name '", name_, "'"));
  for (const std::string& label : label_names_) {
    if (!ValidLabelName(label)) {
      Fatal(absl::StrCat("invalid label name '", label, "' of metric ", name_));
    }
    if (std::count(label_names_.begin(), label_names_.end(), label) > 1) {
      Fatal(absl::StrCat("label '", label, "' repeated in metric ", name_));
    }
  }
}

void MetricFamily::CheckArity(const LabelValues& values) const {
  if (values.size() != label_names_.size()) {
    Fatal(absl::StrCat("metric ", name_, " has ", label_names_.size(), " labels (",
                       absl::StrJoin(label_names_, ","), "); a sample gave ", values.size()));
  }
}

std::string MetricFamily::LabelText(const LabelValues& values, absl::string_view extra) const {
  if (values.empty() && extra.empty()) return "";
  std::string out = "{";
  for (size_t i = 0; i < values.size(); ++i) {
    if (i > 0) out += ',';
    absl::StrAppend(&out, label_names_[i], "=\"", EscapeLabelValue(values[i]), "\"");
  }
  if (!extra.empty()) absl::StrAppend(&out, values.empty() ? "" : ",", extra);
  out += '}';
  return out;
}

void MetricFamily::RenderHeader(absl::string_view type, std::string* out) const {
  absl::StrAppend(out, "# HELP ", name_, " ", EscapeHelp(help_), "\n", "# TYPE ", name_, " ", type,
                  "\n");
}

ValueFamily::ValueFamily(std::string name, std::string help,
                         std::vector<std::string> label_names, absl::string_view type)
    : MetricFamily(std::move(name), std::move(help), std::move(label_names)), type_(type) {
  if (label_names_.empty()) values_[{}] = 0;
}

void ValueFamily::AddToValue(const LabelValues& labels, double delta) {
  CheckArity(labels);
  absl::MutexLock lock(&mu_);
  values_[labels] += delta;
}

double ValueFamily::Value(const LabelValues& labels) const {
  absl::ReaderMutexLock lock(&mu_);
  auto it = values_.find(labels);
  return it == values_.end() ? 0 : it->second;
}

void ValueFamily::Render(std::string* out) const {
  RenderHeader(type_, out);
  absl::ReaderMutexLock lock(&mu_);
  for (const auto& [labels, value] : values_) {
    absl::StrAppend(out, name_, LabelText(labels), " ", FormatMetricValue(value), "\n");
  }
}

CounterFamily::CounterFamily(std::string name, std::string help,
                             std::vector<std::string> label_names)
    : ValueFamily(std::move(name), std::move(help), std::move(label_names), "counter") {
  if (!absl::EndsWith(name_, "_total")) {
    Fatal(absl::StrCat("counter ", name_, " must be named *_total"));
  }
}

void CounterFamily::Increment(const LabelValues& labels, double amount) {
  if (!(amount >= 0)) return;
  AddToValue(labels, amount);
}

GaugeFamily::GaugeFamily(std::string name, std::string help, std::vector<std::string> label_names)
    : ValueFamily(std::move(name), std::move(help), std::move(label_names), "gauge") {}

void GaugeFamily::Set(const LabelValues& labels, double value) {
  CheckArity(labels);
  absl::MutexLock lock(&mu_);
  values_[labels] = value;
}

HistogramFamily::HistogramFamily(std::string name, std::string help,
                                 std::vector<std::string> label_names,
                                 std::vector<double> upper_bounds)
    : MetricFamily(std::move(name), std::move(help), std::move(label_names)),
      upper_bounds_(std::move(upper_bounds)) {
  if (std::find(label_names_.begin(), label_names_.end(), "le") != label_names_.end()) {
    Fatal(absl::StrCat("histogram ", name_, " may not have a label named 'le'"));
  }
  for (size_t i = 0; i < upper_bounds_.size(); ++i) {
    if (!std::isfinite(upper_bounds_[i]) || (i > 0 && upper_bounds_[i] <= upper_bounds_[i - 1])) {
      Fatal(absl::StrCat("histogram ", name_, ": bucket bounds must be finite and increasing"));
    }
  }
  if (label_names_.empty()) {
    absl::MutexLock lock(&mu_);
    SeriesLocked({});
  }
}

HistogramFamily::Series& HistogramFamily::SeriesLocked(const LabelValues& labels) {
  Series& series = series_[labels];
  if (series.buckets.empty()) series.buckets.assign(upper_bounds_.size() + 1, 0);
  return series;
}

void HistogramFamily::Observe(const LabelValues& labels, double value) {
  CheckArity(labels);
  if (std::isnan(value)) return;
  // The first bound >= value ("le"); past the last one, the +Inf bucket.
  const size_t bucket =
      std::lower_bound(upper_bounds_.begin(), upper_bounds_.end(), value) - upper_bounds_.begin();
  absl::MutexLock lock(&mu_);
  Series& series = SeriesLocked(labels);
  ++series.buckets[bucket];
  series.sum += value;
  ++series.count;
}

uint64_t HistogramFamily::Count(const LabelValues& labels) const {
  absl::ReaderMutexLock lock(&mu_);
  auto it = series_.find(labels);
  return it == series_.end() ? 0 : it->second.count;
}

void HistogramFamily::Render(std::string* out) const {
  RenderHeader("histogram", out);
  absl::ReaderMutexLock lock(&mu_);
  for (const auto& [labels, series] : series_) {
    uint64_t cumulative = 0;
    for (size_t i = 0; i < series.buckets.size(); ++i) {
      cumulative += series.buckets[i];
      const std::string le =
          i < upper_bounds_.size() ? FormatMetricValue(upper_bounds_[i]) : std::string("+Inf");
      absl::StrAppend(out, name_, "_bucket", LabelText(labels, absl::StrCat("le=\"", le, "\"")),
                      " ", cumulative, "\n");
    }
    absl::StrAppend(out, name_, "_sum", LabelText(labels), " ", FormatMetricValue(series.sum),
                    "\n");
    absl::StrAppend(out, name_, "_count", LabelText(labels), " ", series.count, "\n");
  }
}

void MetricsRegistry::CheckNewName(const std::string& name) const {
  for (const auto& family : families_) {
    if (family->name() == name) Fatal(absl::StrCat("metric ", name, " registered twice"));
  }
}

CounterFamily& MetricsRegistry::AddCounter(std::string name, std::string help,
                                           std::vector<std::string> label_names) {
  absl::MutexLock lock(&mu_);
  CheckNewName(name);
  auto family = std::make_unique<CounterFamily>(std::move(name), std::move(help),
                                                std::move(label_names));
  CounterFamily& ref = *family;
  families_.push_back(std::move(family));
  return ref;
}

GaugeFamily& MetricsRegistry::AddGauge(std::string name, std::string help,
                                       std::vector<std::string> label_names) {
  absl::MutexLock lock(&mu_);
  CheckNewName(name);
  auto family =
      std::make_unique<GaugeFamily>(std::move(name), std::move(help), std::move(label_names));
  GaugeFamily& ref = *family;
  families_.push_back(std::move(family));
  return ref;
}

HistogramFamily& MetricsRegistry::AddHistogram(std::string name, std::string help,
                                               std::vector<std::string> label_names,
                                               std::vector<double> upper_bounds) {
  absl::MutexLock lock(&mu_);
  CheckNewName(name);
  auto family = std::make_unique<HistogramFamily>(std::move(name), std::move(help),
                                                  std::move(label_names), std::move(upper_bounds));
  HistogramFamily& ref = *family;
  families_.push_back(std::move(family));
  return ref;
}

void MetricsRegistry::RenderTo(std::string* out) const {
  absl::ReaderMutexLock lock(&mu_);
  for (const auto& family : families_) family->Render(out);
}

std::string MetricsRegistry::Render() const {
  std::string out;
  RenderTo(&out);
  return out;
}

// --- RPC metrics ---------------------------------------------------------------------------------

const std::vector<double>& RpcMetrics::DurationBuckets() {
  // Unary calls take well under a millisecond to tens of milliseconds (a checkpoint commit);
  // long polls (heartbeat watches, rendezvous waits, event watches) wait up to their wait_ms.
  static const auto* const kBuckets = new std::vector<double>{
      0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300};
  return *kBuckets;
}

namespace {

std::string CodeName(grpc::StatusCode code) {
  // gRPC's codes are absl's, number for number (proto/grpc_status.h relies on it too).
  return absl::StatusCodeToString(static_cast<absl::StatusCode>(code));
}

}  // namespace

RpcMetrics::RpcMetrics(const std::vector<std::string>& served)
    : requests_(&registry_.AddCounter("shard_rpc_requests_total",
                                      "RPCs the coordinator answered, by method and status code.",
                                      {"method", "code"})),
      durations_(&registry_.AddHistogram(
          "shard_rpc_duration_seconds",
          "Time from an RPC's arrival to its status being sent, by method (long polls included).",
          {"method"}, DurationBuckets())),
      in_flight_(&registry_.AddGauge("shard_rpc_in_flight",
                                     "RPCs being served now (long polls included), by method.",
                                     {"method"})),
      served_(served.begin(), served.end()) {}

const std::string& RpcMetrics::MethodLabel(absl::string_view full_method) const {
  static const std::string* const kOther = new std::string("other");
  absl::ConsumePrefix(&full_method, "/");
  auto found = served_.find(full_method);
  return found != served_.end() ? *found : *kOther;
}

void RpcMetrics::Begin(absl::string_view full_method) {
  in_flight_->Add({MethodLabel(full_method)}, 1);
}

void RpcMetrics::End(absl::string_view full_method, grpc::StatusCode code,
                     absl::Duration elapsed) {
  const std::string& method = MethodLabel(full_method);
  requests_->Increment({method, CodeName(code)});
  durations_->Observe({method}, absl::ToDoubleSeconds(elapsed));
  in_flight_->Add({method}, -1);
}

double RpcMetrics::Requests(absl::string_view full_method, grpc::StatusCode code) const {
  return requests_->Value({MethodLabel(full_method), CodeName(code)});
}

uint64_t RpcMetrics::Observations(absl::string_view full_method) const {
  return durations_->Count({MethodLabel(full_method)});
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

double Seconds(absl::Duration duration) { return absl::ToDoubleSeconds(duration); }

bool IsLive(WorkerState state) {
  return state != WorkerState::kLeft && state != WorkerState::kDead;
}

void AddWorldMetrics(const WorldManager& world, const CoordinatorMetricsSources& sources,
                     absl::Time now, MetricsRegistry& registry) {
  const StatusSnapshot status = world.Status(now);
  const World& w = status.world;

  registry.AddGauge("shard_coordinator_start_time_seconds",
                    "When the coordinator started, in seconds since the Unix epoch.")
      .Set(Seconds(sources.started - absl::UnixEpoch()));
  registry.AddGauge("shard_coordinator_uptime_seconds", "Seconds since the coordinator started.")
      .Set(Seconds(now - sources.started));

  GaugeFamily& job_state = registry.AddGauge(
      "shard_job_state", "1 for the job's current state (forming, running, stopping, stopped).",
      {"state"});
  for (JobState state :
       {JobState::kForming, JobState::kRunning, JobState::kStopping, JobState::kStopped}) {
    job_state.Set({std::string(JobStateName(state))}, state == w.state ? 1 : 0);
  }
  registry.AddGauge("shard_generation", "The world's generation (bumped on every rank change).")
      .Set(static_cast<double>(w.generation));
  registry.AddGauge("shard_world_size", "Live workers holding a rank.").Set(w.world_size);
  registry.AddGauge("shard_world_ranks", "Ranks of the current generation's world.").Set(w.ranks);
  registry.AddGauge("shard_world_target_size", "The world size the job aims for.")
      .Set(w.expected_world_size);
  registry.AddGauge("shard_world_min_size", "The fewest workers the world re-forms with.")
      .Set(w.min_world_size);
  registry.AddGauge("shard_worker_lease_seconds",
                    "A worker is declared dead after this long without a heartbeat.")
      .Set(Seconds(status.lease));

  GaugeFamily& workers = registry.AddGauge(
      "shard_workers",
      "Workers by state; departed ones (left, dead) among the most recent that status keeps.",
      {"state"});
  std::map<WorkerState, int> counts;
  for (WorkerState state :
       {WorkerState::kJoining, WorkerState::kReady, WorkerState::kFailed, WorkerState::kStandby,
        WorkerState::kLeaving, WorkerState::kLeft, WorkerState::kDead}) {
    counts[state] = 0;
  }
  for (const WorkerSnapshot& worker : status.workers) ++counts[worker.state];
  for (const auto& [state, count] : counts) {
    workers.Set({std::string(WorkerStateName(state))}, count);
  }

  GaugeFamily& up = registry.AddGauge(
      "shard_worker_up", "1 while the worker is live (heartbeating), 0 once it left or died.",
      {"worker", "rank"});
  GaugeFamily& heartbeat = registry.AddGauge(
      "shard_worker_last_heartbeat_seconds", "Seconds since the worker's last heartbeat.",
      {"worker"});
  for (const WorkerSnapshot& worker : status.workers) {
    const std::string rank = worker.rank >= 0 ? absl::StrCat(worker.rank) : "";
    up.Set({worker.id, rank}, IsLive(worker.state) ? 1 : 0);
    heartbeat.Set({worker.id}, Seconds(worker.since_heartbeat));
  }
}

void AddPlanMetrics(const PlanManager& plans, MetricsRegistry& registry) {
  const PlanStats stats = plans.Stats();

  registry.AddGauge("shard_plan_version", "Version of the current sharding plan (0: none yet).")
      .Set(static_cast<double>(stats.plan_version));
  registry.AddGauge("shard_plan_pending_acks", "Ranks that have not applied the current plan.")
      .Set(static_cast<double>(stats.pending_acks.size()));
  GaugeFamily& overlap_status = registry.AddGauge(
      "shard_overlap_status",
      "1 for the gradient-bucket state (UNINITIALIZED, DDP_HAS_REBUILT_BUCKETS, INITIALIZED).",
      {"status"});
  for (OverlapStatus status :
       {OverlapStatus::kUninitialized, OverlapStatus::kRebuilt, OverlapStatus::kInitialized}) {
    overlap_status.Set({std::string(OverlapStatusName(status))}, status == stats.status ? 1 : 0);
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
  registry.AddGauge("shard_training_step", "The latest training step a worker reported.")
      .Set(static_cast<double>(step));
  if (latest == nullptr) return;  // no step yet: nothing to say about one

  registry.AddGauge("shard_step_duration_seconds",
                    "Duration of the latest reported step (the lowest rank's).")
      .Set(latest->step_ms / 1000);
  registry.AddGauge("shard_training_loss", "Loss of the latest reported step (the lowest rank's).")
      .Set(latest->loss);
  int64_t reduced = 0;
  for (int64_t bytes : latest->bucket_bytes) reduced += bytes;
  registry.AddGauge("shard_step_reduced_bytes",
                    "Gradient bytes all-reduced per step (sum of the latest step's buckets).")
      .Set(static_cast<double>(reduced));
  registry.AddGauge("shard_step_duration_mean_seconds",
                    "Mean step duration over the recent reports of every rank.")
      .Set(stats.mean_step_ms / 1000);
  registry.AddGauge("shard_backward_duration_mean_seconds",
                    "Mean backward compute per step over the recent reports.")
      .Set(stats.mean_backward_ms / 1000);
  registry.AddGauge("shard_communication_duration_mean_seconds",
                    "Mean time per step that gradient collectives were in flight.")
      .Set(stats.mean_communication_ms / 1000);
  registry.AddGauge("shard_hidden_communication_duration_mean_seconds",
                    "Mean communication time per step that overlapped backward compute.")
      .Set(stats.mean_hidden_ms / 1000);
  registry.AddGauge("shard_overlap_hidden_ratio",
                    "Fraction of communication time hidden behind backward compute (0..1).")
      .Set(stats.overlap_fraction);
}

void AddCheckpointMetrics(const CheckpointManager& checkpoints, MetricsRegistry& registry) {
  const std::vector<v1::CheckpointRecord> records = checkpoints.List();
  const TrainingStartPoint start = checkpoints.start();

  registry.AddGauge("shard_training_started", "1 once a worker reported a training step.")
      .Set(checkpoints.training_started() ? 1 : 0);
  registry.AddGauge("shard_training_start_step",
                    "The step this generation's training started from (a restored checkpoint's).")
      .Set(static_cast<double>(start.step));
  registry.AddGauge("shard_checkpoint_save_pending", "1 while a save request awaits its commit.")
      .Set(checkpoints.pending_request() != 0 ? 1 : 0);
  registry.AddGauge("shard_checkpoints_committed",
                    "Committed checkpoints in the catalog (after keep-last-K retention).")
      .Set(static_cast<double>(records.size()));
  if (records.empty()) return;

  const v1::CheckpointRecord& last = records.back();
  registry.AddGauge("shard_checkpoint_last_step", "Training step of the newest checkpoint.")
      .Set(static_cast<double>(last.step()));
  registry.AddGauge("shard_checkpoint_last_commit_timestamp_seconds",
                    "When the newest checkpoint committed, in seconds since the Unix epoch.")
      .Set(static_cast<double>(last.committed_unix_ms()) / 1000);
  registry.AddGauge("shard_checkpoint_save_duration_seconds",
                    "Newest checkpoint: the slowest rank's time to write its shard.")
      .Set(last.max_write_ms() / 1000);
  registry.AddGauge("shard_checkpoint_pause_seconds",
                    "Newest checkpoint: the longest training stall it caused on a rank.")
      .Set(last.max_pause_ms() / 1000);
  registry.AddGauge("shard_checkpoint_bytes", "Newest checkpoint: bytes written, all shards.")
      .Set(static_cast<double>(last.bytes()));
}

}  // namespace

std::string RenderCoordinatorMetrics(const CoordinatorMetricsSources& sources, absl::Time now) {
  MetricsRegistry registry;
  if (sources.world != nullptr) AddWorldMetrics(*sources.world, sources, now, registry);
  if (sources.plan != nullptr) AddPlanMetrics(*sources.plan, registry);
  if (sources.checkpoints != nullptr) AddCheckpointMetrics(*sources.checkpoints, registry);
  std::string out = registry.Render();
  if (sources.rpc != nullptr) sources.rpc->RenderTo(&out);
  return out;
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
  if (absl::Status parsed = ParseListen(listen, &host, &port); !parsed.ok()) return parsed;
  if (absl::Status resolved = CheckResolves(host); !resolved.ok()) return resolved;

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
