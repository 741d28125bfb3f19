// The coordinator's Prometheus metrics (docs/metrics.md): a small registry that writes the text
// exposition format 0.0.4, RPC counts and latencies fed by a gRPC server interceptor, the job's
// gauges computed at scrape time from the managers' snapshots, and the HTTP endpoint that
// serves them (cpp-httplib; only GET /metrics).
//
// Metric and label names are constants of this program, so a malformed one, a name registered
// twice or a sample with the wrong number of label values is a programming error: it aborts
// with a message, as a failed CHECK would (tests catch it). Label values may be anything; they
// are escaped.
//
// Thread-safe: families may be updated from any thread while another renders.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "google/protobuf/descriptor.h"
#include "grpcpp/support/server_interceptor.h"
#include "grpcpp/support/status.h"

namespace shard {

class CheckpointManager;
class PlanManager;
class WorldManager;

// --- The text exposition format ------------------------------------------------------------------

// A label value as it goes between the quotes: backslash, double quote and newline escaped.
std::string EscapeLabelValue(absl::string_view value);
// HELP text: backslash and newline escaped.
std::string EscapeHelp(absl::string_view help);
// A sample value or bucket bound: integers without a fraction ("3"), others in the shortest
// form that reads back exactly ("0.25", "1e-05"), and "+Inf", "-Inf", "NaN".
std::string FormatMetricValue(double value);

// A series' label values, in the order of its family's label names.
using LabelValues = std::vector<std::string>;

// One metric family: a name, a help text, label names, and its series.
class MetricFamily {
 public:
  virtual ~MetricFamily() = default;
  MetricFamily(const MetricFamily&) = delete;
  MetricFamily& operator=(const MetricFamily&) = delete;

  const std::string& name() const { return name_; }
  // Appends "# HELP", "# TYPE" and the samples, series sorted by label values.
  virtual void Render(std::string* out) const = 0;

 protected:
  MetricFamily(std::string name, std::string help, std::vector<std::string> label_names);
  // Aborts unless `values` has one value per label name.
  void CheckArity(const LabelValues& values) const;
  // `{a="x",b="y"}` for `values`, with `extra` (e.g. le="0.5") last; "" for no labels.
  std::string LabelText(const LabelValues& values, absl::string_view extra = {}) const;
  void RenderHeader(absl::string_view type, std::string* out) const;

  const std::string name_;
  const std::string help_;
  const std::vector<std::string> label_names_;
};

// Counters and gauges: one value per series. Without labels it reads 0 until changed.
class ValueFamily : public MetricFamily {
 public:
  double Value(const LabelValues& labels = {}) const;
  void Render(std::string* out) const override;

 protected:
  // `type`: "counter" or "gauge", as rendered.
  ValueFamily(std::string name, std::string help, std::vector<std::string> label_names,
              absl::string_view type);
  void AddToValue(const LabelValues& labels, double delta);

  mutable absl::Mutex mu_;
  std::map<LabelValues, double> values_ ABSL_GUARDED_BY(mu_);

 private:
  const absl::string_view type_;
};

// A value that only goes up. Its name ends in "_total".
class CounterFamily : public ValueFamily {
 public:
  CounterFamily(std::string name, std::string help, std::vector<std::string> label_names);
  // Negative and NaN amounts are ignored (a counter never goes down).
  void Increment(const LabelValues& labels = {}, double amount = 1);
};

// A value that goes up and down.
class GaugeFamily : public ValueFamily {
 public:
  GaugeFamily(std::string name, std::string help, std::vector<std::string> label_names);
  void Set(const LabelValues& labels, double value);
  void Set(double value) { Set({}, value); }
  void Add(const LabelValues& labels, double delta) { AddToValue(labels, delta); }
};

// Observations counted into buckets by upper bound (rendered cumulative, with "+Inf"), with
// their sum and count. The label names must not include "le".
class HistogramFamily : public MetricFamily {
 public:
  // `upper_bounds`: finite and strictly increasing; "+Inf" is implied.
  HistogramFamily(std::string name, std::string help, std::vector<std::string> label_names,
                  std::vector<double> upper_bounds);
  void Observe(const LabelValues& labels, double value);
  void Observe(double value) { Observe({}, value); }
  // Observations so far for `labels` (0 if none).
  uint64_t Count(const LabelValues& labels = {}) const;
  const std::vector<double>& upper_bounds() const { return upper_bounds_; }
  void Render(std::string* out) const override;

 private:
  struct Series {
    std::vector<uint64_t> buckets;  // per bound, not cumulative; the last one is +Inf
    double sum = 0;
    uint64_t count = 0;
  };
  Series& SeriesLocked(const LabelValues& labels) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::vector<double> upper_bounds_;
  mutable absl::Mutex mu_;
  std::map<LabelValues, Series> series_ ABSL_GUARDED_BY(mu_);
};

// The families of one exposition, rendered in the order they were added.
class MetricsRegistry {
 public:
  MetricsRegistry() = default;
  MetricsRegistry(const MetricsRegistry&) = delete;
  MetricsRegistry& operator=(const MetricsRegistry&) = delete;

  // The returned families live as long as the registry. Names must be valid Prometheus names
  // and unique in the registry; label names valid and not reserved ("__*").
  CounterFamily& AddCounter(std::string name, std::string help,
                            std::vector<std::string> label_names = {});
  GaugeFamily& AddGauge(std::string name, std::string help,
                        std::vector<std::string> label_names = {});
  HistogramFamily& AddHistogram(std::string name, std::string help,
                                std::vector<std::string> label_names,
                                std::vector<double> upper_bounds);

  void RenderTo(std::string* out) const;
  std::string Render() const;

 private:
  void CheckNewName(const std::string& name) const ABSL_SHARED_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  std::vector<std::unique_ptr<MetricFamily>> families_ ABSL_GUARDED_BY(mu_);
};

// --- RPC metrics ---------------------------------------------------------------------------------

// Counts and latencies of the RPCs the coordinator serves, per method and status code:
//   shard_rpc_requests_total{method,code}    counter
//   shard_rpc_duration_seconds{method}       histogram (from the request's arrival to the status)
//   shard_rpc_in_flight{method}              gauge
// `method` is "shard.v1.Admin/GetStatus", one of the methods the server serves; a client may
// name any method (answered UNIMPLEMENTED, and still counted), which is counted as
// method="other", so no client can grow the series or crowd out the real names.
class RpcMetrics {
 public:
  static const std::vector<double>& DurationBuckets();

  // `served`: "pkg.Service/Method" names, e.g. from MethodNames().
  explicit RpcMetrics(const std::vector<std::string>& served);
  // An RPC of `full_method` ("/pkg.Service/Method") arrived / ended with `code` after `elapsed`.
  void Begin(absl::string_view full_method);
  void End(absl::string_view full_method, grpc::StatusCode code, absl::Duration elapsed);

  double Requests(absl::string_view full_method, grpc::StatusCode code) const;
  uint64_t Observations(absl::string_view full_method) const;
  void RenderTo(std::string* out) const { registry_.RenderTo(out); }

 private:
  const std::string& MethodLabel(absl::string_view full_method) const;

  MetricsRegistry registry_;
  CounterFamily* requests_;
  HistogramFamily* durations_;
  GaugeFamily* in_flight_;
  const absl::flat_hash_set<std::string> served_;  // immutable: read without a lock
};

// "pkg.Service/Method" for every method of `service`.
std::vector<std::string> MethodNames(const google::protobuf::ServiceDescriptor& service);

// An interceptor factory for grpc::ServerBuilder::experimental().SetInterceptorCreators() that
// feeds `metrics` (which must outlive the server). Works with callback and sync services.
std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
MakeRpcMetricsInterceptorFactory(RpcMetrics* metrics);

// --- The coordinator's exposition ----------------------------------------------------------------

struct CoordinatorMetricsSources {
  const WorldManager* world = nullptr;             // required
  const PlanManager* plan = nullptr;               // null: no plan metrics
  const CheckpointManager* checkpoints = nullptr;  // null: no training job
  const RpcMetrics* rpc = nullptr;                 // null: no RPC metrics
  absl::Time started;                              // when the coordinator started
};

// The whole /metrics page: the world, training and checkpoint gauges read now from the managers'
// snapshots, then the RPC metrics. Safe to call from any thread.
std::string RenderCoordinatorMetrics(const CoordinatorMetricsSources& sources, absl::Time now);

// --- The HTTP endpoint ---------------------------------------------------------------------------

// Serves GET /metrics (Content-Type "text/plain; version=0.0.4; charset=utf-8") with the text
// `render` returns; every other path is 404. Two serving threads; `render` may run on both at
// once.
class MetricsHttpServer {
 public:
  static constexpr absl::string_view kContentType = "text/plain; version=0.0.4; charset=utf-8";

  // Binds exactly `listen` ("host:port" or "[v6-host]:port"; port 0 picks a free one) and
  // serves until destroyed. InvalidArgument for a malformed or unresolvable address; else the
  // bind's errno as a status (FailedPrecondition "...: Address already in use", PermissionDenied
  // for a privileged port, ...).
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(
      const std::string& listen, std::function<std::string()> render);
  // Stops serving and joins the threads.
  ~MetricsHttpServer();
  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  int port() const { return port_; }
  // "host:port" as bound (the port resolved), for logs and clients.
  std::string address() const;

 private:
  struct Impl;
  explicit MetricsHttpServer(std::unique_ptr<Impl> impl);

  std::unique_ptr<Impl> impl_;
  std::string host_;
  int port_ = 0;
};

}  // namespace shard
