// Serves a CoordinatorCore over gRPC: opens the state directory, creates the core (which takes
// back a live job after a restart), serves the services with TLS, tokens, health, reflection
// and metrics, and runs the core's housekeeping on a thread.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/rate_limiter.h"
#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/server.h"
#include "proto/channel_security.h"
#include "server/checkpoint_storage.h"
#include "server/coordinator_core.h"
#include "server/coordinator_service.h"
#include "server/metrics.h"
#include "server/store/state_store.h"

namespace shard {

struct CoordinatorOptions {
  std::string listen_address = "127.0.0.1:7460";
  std::string state_dir;  // empty: keep state in memory only
  // expected_world_size 0: the job's (or, with neither a job nor a size, the live world's kept in
  // the state directory).
  WorldOptions world;
  PlanConfig plan;
  // Handed to every joining worker. Unset: the job kept in the state directory if one is still
  // live there, else a world without training.
  std::optional<JobConfig> job;
  // With a job: restore the training from this checkpoint ("latest" allowed) when it starts.
  std::string restore;
  CoreOptions::ProgressLease progress;  // stuck ranks (CoreOptions)
  // How often leases and rendezvous waits are checked.
  absl::Duration housekeeping_interval = absl::Milliseconds(50);
  // TLS on the gRPC port (mutual with a client CA); none: plaintext.
  ServerSecurityFiles tls;
  // Tokens workers and admin clients must present (see AccessGuard); empty: not required.
  // Without TLS they are accepted only on a loopback listen address.
  std::string job_token;
  std::string admin_token;
  // A plaintext port serving only grpc.health.v1.Health (for kubelet probes); empty: none.
  std::string health_listen;
  // HTTP host:port serving Prometheus text at /metrics (docs/metrics.md); empty: none.
  std::string metrics_listen;
  // Largest request accepted, and how fast workers may join (burst: twice the world, plus 64).
  int max_message_bytes = 4 << 20;
  double max_joins_per_second = 100;
};

class CoordinatorServer {
 public:
  static absl::StatusOr<std::unique_ptr<CoordinatorServer>> Start(const CoordinatorOptions& options);
  ~CoordinatorServer();

  // The port actually bound (useful with port 0), and the health port's (0: none).
  int port() const { return port_; }
  int health_port() const { return health_port_; }
  int metrics_port() const { return metrics_http_ == nullptr ? 0 : metrics_http_->port(); }
  std::string address() const;

  // Starts a graceful stop, as `shardctl stop` does (e.g. on SIGTERM).
  void RequestStop(const std::string& reason);
  // Blocks until the job ended (finished or failed) or `timeout` passes; true if it ended.
  bool WaitUntilStopped(absl::Duration timeout);
  // The job's phase now.
  JobState job_state() const;
  // Stops serving. Idempotent.
  void Shutdown();

  const CoordinatorCore& core() const { return *core_; }

 private:
  CoordinatorServer() = default;
  void Housekeeping();
  // What grpc.health.v1 answers on both ports.
  void SetServing(bool serving);

  std::string host_;
  int port_ = 0;
  std::unique_ptr<StateStore> store_;
  FilesystemCheckpointStorage checkpoint_storage_;
  std::unique_ptr<CoordinatorCore> core_;
  std::unique_ptr<CoordinatorServiceImpl> coordinator_service_;
  std::unique_ptr<RendezvousServiceImpl> rendezvous_service_;
  std::unique_ptr<AdminServiceImpl> admin_service_;
  std::unique_ptr<RpcMetrics> rpc_metrics_;  // outlives server_
  std::unique_ptr<RateLimiter> join_limiter_;
  std::unique_ptr<grpc::Server> server_;
  // --health-listen: grpc.health.v1, and UNIMPLEMENTED for every other method (a server needs
  // a service of its own to run at all; the health service is added to one).
  grpc::CallbackGenericService health_unimplemented_;
  std::unique_ptr<grpc::Server> health_server_;
  int health_port_ = 0;
  std::unique_ptr<MetricsHttpServer> metrics_http_;  // reads the managers: stopped first
  absl::Duration housekeeping_interval_;
  absl::Mutex mu_;
  bool shutting_down_ ABSL_GUARDED_BY(mu_) = false;
  bool wake_ ABSL_GUARDED_BY(mu_) = false;
  absl::Notification stopped_;
  std::thread housekeeping_;
};

}  // namespace shard
