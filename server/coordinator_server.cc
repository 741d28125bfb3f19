#include "server/coordinator_server.h"

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "grpcpp/server_builder.h"
#include "proto/job_convert.h"
#include "grpcpp/security/server_credentials.h"
#include "common/logging.h"
#include "spdlog/spdlog.h"

namespace shard {

absl::StatusOr<std::unique_ptr<CoordinatorServer>> CoordinatorServer::Start(
    const CoordinatorOptions& options) {
  auto server = std::unique_ptr<CoordinatorServer>(new CoordinatorServer());
  const absl::Time now = absl::Now();
  if (options.state_dir.empty()) {
    server->store_ = std::make_unique<InMemoryStateStore>();
  } else {
    auto store = DirectoryStateStore::Open(options.state_dir);
    if (!store.ok()) return store.status();
    server->store_ = std::move(*store);
  }
  auto world = WorldManager::Create(options.world, server->store_.get(), now);
  if (!world.ok()) return world.status();
  server->world_ = std::move(*world);
  server->kv_ = std::make_unique<KvStoreManager>(options.world.job,
                                                 server->world_->world().generation);
  server->plan_ = std::make_unique<PlanManager>(options.plan);
  server->plan_->OnGeneration(server->world_->world().generation);
  std::optional<v1::JobSpec> job_spec;
  if (options.job.has_value()) {
    const JobConfig& job = *options.job;
    job_spec = ToProto(job);
    CheckpointOptions checkpoint_options;
    checkpoint_options.job = job.name;
    checkpoint_options.root = job.checkpoint_dir;
    checkpoint_options.keep_last = job.checkpoint_keep_last;
    checkpoint_options.zero_stage = job.zero_stage;
    checkpoint_options.optimizer = job.optimizer;
    checkpoint_options.state_names = OptimizerStateNames(job.optimizer);
    auto checkpoints = CheckpointManager::Create(checkpoint_options, server->store_.get());
    if (!checkpoints.ok()) return checkpoints.status();
    server->checkpoints_ = std::move(*checkpoints);
    if (!options.restore.empty()) {
      absl::StatusOr<v1::CheckpointRecord> record = server->checkpoints_->Find(options.restore);
      if (!record.ok()) return record.status();
      absl::StatusOr<CheckpointManifest> manifest = ReadCheckpointManifest(record->dir());
      if (!manifest.ok()) return manifest.status();
      if (absl::Status same = CompareManifests(MlpManifest(job.widths), manifest->model(),
                                               absl::StrCat("checkpoint ", manifest->id));
          !same.ok()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "cannot restore checkpoint ", manifest->id, ": it is of a different model (",
            same.message(), ")"));
      }
      if (manifest->state_names != checkpoint_options.state_names) {
        return absl::FailedPreconditionError(absl::StrCat(
            "cannot restore checkpoint ", manifest->id, ": it holds ",
            OptimizerKindName(manifest->optimizer.kind), " state but the job uses ",
            OptimizerKindName(job.optimizer.kind)));
      }
      if (absl::StatusOr<TrainingStartPoint> start =
              server->checkpoints_->SetRestorePoint(record->id());
          !start.ok()) {
        return start.status();
      }
      server->plan_->SeedRebuiltOrder(manifest->plan.gradient_order);
    }
  } else if (!options.restore.empty()) {
    return absl::InvalidArgumentError("--restore needs --job");
  }
  KvStoreManager* kv = server->kv_.get();
  PlanManager* plan = server->plan_.get();
  CheckpointManager* checkpoint_manager = server->checkpoints_.get();
  server->world_->set_generation_listener([kv, plan, checkpoint_manager](int64_t generation) {
    kv->SetCurrentGeneration(generation);
    plan->OnGeneration(generation);
    if (checkpoint_manager != nullptr) checkpoint_manager->OnGeneration(generation);
  });

  const Clock clock = [] { return absl::Now(); };
  CoordinatorServer* self = server.get();
  server->coordinator_service_ = std::make_unique<CoordinatorServiceImpl>(
      server->world_.get(), plan, checkpoint_manager, job_spec, clock);
  server->rendezvous_service_ = std::make_unique<RendezvousServiceImpl>(kv, clock);
  server->admin_service_ = std::make_unique<AdminServiceImpl>(server->world_.get(), plan, checkpoint_manager, clock, now, [self] {
    absl::MutexLock lock(&self->mu_);
    self->wake_ = true;
  });

  grpc::ServerBuilder builder;
  builder.AddListeningPort(options.listen_address, grpc::InsecureServerCredentials(),
                           &server->port_);
  builder.RegisterService(server->coordinator_service_.get());
  builder.RegisterService(server->rendezvous_service_.get());
  builder.RegisterService(server->admin_service_.get());
  server->server_ = builder.BuildAndStart();
  if (server->server_ == nullptr || server->port_ == 0) {
    return absl::UnavailableError(absl::StrCat(
        "cannot listen on '", options.listen_address,
        "': the address is malformed or the port is in use; pass another --listen"));
  }
  const size_t colon = options.listen_address.rfind(':');
  server->host_ = options.listen_address.substr(0, colon);
  server->housekeeping_interval_ = options.housekeeping_interval;
  server->housekeeping_ = std::thread([self] { self->Housekeeping(); });
  spdlog::info("coordinator for job '{}' listening on {} (expecting {} workers, lease {}, "
               "generation {}, state {})",
               options.world.job, server->address(), options.world.expected_world_size,
               absl::FormatDuration(options.world.lease), server->world_->world().generation,
               options.state_dir.empty() ? std::string("in memory") : options.state_dir);
  return server;
}

CoordinatorServer::~CoordinatorServer() { Shutdown(); }

std::string CoordinatorServer::address() const { return absl::StrCat(host_, ":", port_); }

void CoordinatorServer::RequestStop(const std::string& reason) {
  world_->RequestStop(reason, absl::Now());
  absl::MutexLock lock(&mu_);
  wake_ = true;
}

bool CoordinatorServer::WaitUntilStopped(absl::Duration timeout) {
  return stopped_.WaitForNotificationWithTimeout(timeout);
}

void CoordinatorServer::Housekeeping() {
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      auto woken = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return shutting_down_ || wake_; };
      mu_.AwaitWithTimeout(absl::Condition(&woken), housekeeping_interval_);
      if (shutting_down_) return;
      wake_ = false;
    }
    const absl::Time now = absl::Now();
    world_->ExpireLeases(now);
    world_->ExpireWatches(now);
    plan_->ExpireWaits(now);
    kv_->ExpireWaiters(now);
    if (world_->world().state == JobState::kStopped && !stopped_.HasBeenNotified()) {
      spdlog::info("job '{}' stopped: every worker has left", world_->options().job);
      stopped_.Notify();
    }
  }
}

void CoordinatorServer::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    if (shutting_down_) return;
    shutting_down_ = true;
  }
  if (housekeeping_.joinable()) housekeeping_.join();
  if (server_ == nullptr) return;  // Start() failed before serving
  // Pending long-polls must be answered before the server can drain.
  const absl::Status closing = absl::UnavailableError("the coordinator is shutting down");
  kv_->Close(closing);
  world_->CloseWatches(closing);
  plan_->CloseWaits(closing);
  server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
}

}  // namespace shard
