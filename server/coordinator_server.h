// Wires the coordinator together: loads the state directory (taking back a live job after a
// restart), creates the managers, serves the gRPC services and runs housekeeping (lease expiry,
// rendezvous wait timeouts, elastic re-formations).
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "grpcpp/server.h"
#include "server/checkpoint_manager.h"
#include "server/coordinator_service.h"
#include "server/elastic_manager.h"
#include "server/kv_store_manager.h"
#include "server/plan_manager.h"
#include "server/store/state_store.h"
#include "server/world_manager.h"

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
  // How often leases and rendezvous waits are checked.
  absl::Duration housekeeping_interval = absl::Milliseconds(50);
};

class CoordinatorServer {
 public:
  static absl::StatusOr<std::unique_ptr<CoordinatorServer>> Start(const CoordinatorOptions& options);
  ~CoordinatorServer();

  // The port actually bound (useful with port 0).
  int port() const { return port_; }
  std::string address() const;

  // Starts a graceful stop, as `shardctl stop` does (e.g. on SIGTERM).
  void RequestStop(const std::string& reason);
  // Blocks until the job is stopped or `timeout` passes; true if stopped.
  bool WaitUntilStopped(absl::Duration timeout);
  // Stops serving. Idempotent.
  void Shutdown();

  WorldManager& world() { return *world_; }

 private:
  CoordinatorServer() = default;
  void Housekeeping();

  std::string host_;
  int port_ = 0;
  std::unique_ptr<StateStore> store_;
  std::unique_ptr<WorldManager> world_;
  std::unique_ptr<KvStoreManager> kv_;
  std::unique_ptr<PlanManager> plan_;
  std::unique_ptr<CheckpointManager> checkpoints_;  // with a job only
  std::unique_ptr<ElasticManager> elastic_;
  std::unique_ptr<CoordinatorServiceImpl> coordinator_service_;
  std::unique_ptr<RendezvousServiceImpl> rendezvous_service_;
  std::unique_ptr<AdminServiceImpl> admin_service_;
  std::unique_ptr<grpc::Server> server_;
  absl::Duration housekeeping_interval_;
  absl::Mutex mu_;
  bool shutting_down_ ABSL_GUARDED_BY(mu_) = false;
  bool wake_ ABSL_GUARDED_BY(mu_) = false;
  absl::Notification stopped_;
  std::thread housekeeping_;
};

}  // namespace shard
