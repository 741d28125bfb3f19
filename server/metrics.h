// The coordinator's Prometheus metrics (docs/metrics.md): RPC counts and latencies fed by a gRPC
// server interceptor, the job's gauges computed at scrape time from the managers' snapshots, both
// kept in prometheus-cpp registries and written by its text serializer (exposition format 0.0.4),
// and the HTTP endpoint that serves them (cpp-httplib; only GET /metrics).
//
// prometheus-cpp throws on a malformed metric or label name, or on histogram bounds out of order;
// ours are all constants of this program, so that would be a programming error. Label values
// (worker ids) may be anything: the serializer escapes them. It writes HELP texts as they are
// (prometheus-cpp 1.0.1 does not escape them), so ours hold no backslash or newline.
//
// Thread-safe: the RPC series may be updated from any thread while another renders.
#pragma once

#include <array>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "google/protobuf/descriptor.h"
#include "grpcpp/support/server_interceptor.h"
#include "grpcpp/support/status.h"
#include "prometheus/counter.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/metric_family.h"
#include "prometheus/registry.h"

namespace shard {

class CheckpointManager;
class PlanManager;
class SnapshotManager;
class WorldManager;

// --- RPC metrics ---------------------------------------------------------------------------------

// Counts and latencies of the RPCs the coordinator serves, per method and status code:
//   shard_rpc_requests_total{method,code}    counter
//   shard_rpc_duration_seconds{method}       histogram (from the request's arrival to the status)
//   shard_rpc_in_flight{method}              gauge
// `method` is "shard.v1.Admin/GetStatus", one of the methods the server serves; a client may
// name any method (answered UNIMPLEMENTED, and still counted), which is counted as
// method="other", so no client can grow the series or crowd out the real names.
//
// Every series (each method, "other" included, with every status code) is created by the
// constructor, so a call only looks its method up in a map that never changes and updates
// prometheus-cpp's metrics (atomic counters and gauges; the histogram takes its own mutex): no
// lock of ours and no Family::Add per call. It also means a series reads 0 before its first call
// instead of being absent, so rate() sees the first error.
class RpcMetrics {
 public:
  // `served`: "pkg.Service/Method" names, e.g. from MethodNames().
  explicit RpcMetrics(const std::vector<std::string>& served);
  RpcMetrics(const RpcMetrics&) = delete;
  RpcMetrics& operator=(const RpcMetrics&) = delete;

  // An RPC of `full_method` ("/pkg.Service/Method") arrived / ended with `code` after `elapsed`.
  void Begin(absl::string_view full_method);
  void End(absl::string_view full_method, grpc::StatusCode code, absl::Duration elapsed);

  // The current values, for the serializer.
  std::vector<prometheus::MetricFamily> Collect() const { return registry_.Collect(); }

 private:
  // gRPC's status codes are 0 (OK) .. 16 (UNAUTHENTICATED).
  static constexpr int kStatusCodes = 17;

  // One method's series; they live as long as registry_.
  struct MethodSeries {
    std::array<prometheus::Counter*, kStatusCodes> requests{};  // indexed by status code
    prometheus::Histogram* duration = nullptr;
    prometheus::Gauge* in_flight = nullptr;
  };

  MethodSeries AddMethod(const std::string& method);
  const MethodSeries& SeriesOf(absl::string_view full_method) const;

  prometheus::Registry registry_;
  prometheus::Family<prometheus::Counter>& requests_;
  prometheus::Family<prometheus::Histogram>& durations_;
  prometheus::Family<prometheus::Gauge>& in_flight_;
  // Filled by the constructor and never changed after: read without a lock.
  absl::flat_hash_map<std::string, MethodSeries> served_;
  MethodSeries other_;
};

// "pkg.Service/Method" for every method of `service`.
std::vector<std::string> MethodNames(const google::protobuf::ServiceDescriptor& service);

// An interceptor factory for grpc::ServerBuilder::experimental().SetInterceptorCreators() that
// feeds `metrics` (which must outlive the server). Works with callback and sync services.
std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
MakeRpcMetricsInterceptorFactory(RpcMetrics* metrics);

// --- The coordinator's exposition ----------------------------------------------------------------

struct CoordinatorMetricsSources {
  const WorldManager* world = nullptr;             // null: no world metrics (tests)
  const PlanManager* plan = nullptr;               // null: no plan metrics
  const CheckpointManager* checkpoints = nullptr;  // null: no training job
  const SnapshotManager* snapshots = nullptr;      // null: no training job (needs `world`)
  const RpcMetrics* rpc = nullptr;                 // null: no RPC metrics
  absl::Time started;                              // when the coordinator started
};

// The whole /metrics page: the coordinator's start time and uptime, the world, training and
// checkpoint gauges read now from the managers' snapshots, then the RPC metrics. Each family's
// series are sorted by their labels. Safe to call from any thread.
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
