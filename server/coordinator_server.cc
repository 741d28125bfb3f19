#include "server/coordinator_server.h"

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "google/protobuf/util/message_differencer.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"
#include "proto/job_convert.h"
#include "spdlog/spdlog.h"

namespace shard {

namespace {

// Health only (the plaintext health port): no builder plugins, so not reflection's either, which
// registers itself with every ServerBuilder made after InitProtoReflectionServerBuilderPlugin().
class WithoutPlugins final : public grpc::ServerBuilderOption {
 public:
  void UpdateArguments(grpc::ChannelArguments*) override {}
  void UpdatePlugins(std::vector<std::unique_ptr<grpc::ServerBuilderPlugin>>* plugins) override {
    plugins->clear();
  }
};

// What the main port serves: our services, health and reflection.
std::vector<std::string> ServedMethods() {
  std::vector<std::string> served = {
      "grpc.health.v1.Health/Check", "grpc.health.v1.Health/Watch",
      "grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"};
  for (const char* service :
       {v1::Coordinator::service_full_name(), v1::Rendezvous::service_full_name(),
        v1::Admin::service_full_name()}) {
    const google::protobuf::ServiceDescriptor* descriptor =
        google::protobuf::DescriptorPool::generated_pool()->FindServiceByName(service);
    for (std::string& name : MethodNames(*descriptor)) served.push_back(std::move(name));
  }
  return served;
}

absl::Status CannotListen(const std::string& address, absl::string_view flag) {
  return absl::UnavailableError(absl::StrCat("cannot listen on '", address,
                                             "': the address is malformed or the port is in use; "
                                             "pass another ", flag));
}

constexpr char kJobRecord[] = "job";

// The world's options as the job spec sets them.
void ApplyJob(const JobConfig& job, CoordinatorOptions* options) {
  options->world.job = job.name;
  options->world.expected_world_size = job.world_size;
  options->world.min_world_size = job.min_world_size;
  const int64_t global_batch = job.global_batch;
  options->world.check_size = [global_batch](int world_size) {
    if (global_batch % world_size == 0) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat(
        "the job's global batch ", global_batch, " does not divide over ", world_size,
        " workers"));
  };
  options->plan.mode = job.shard_mode;
  options->plan.bucket_cap_bytes = job.bucket_cap_bytes;
  options->plan.first_bucket_cap_bytes = job.first_bucket_cap_bytes;
}

// Decides between taking back a live job kept in the state directory (a restart after a crash)
// and starting a new world, and settles the job and world options accordingly.
absl::StatusOr<bool> SettleJob(StateStore* store, CoordinatorOptions* options) {
  absl::StatusOr<bool> live = WorldManager::HasLiveWorld(store);
  if (!live.ok()) return live.status();
  v1::JobSpec stored;
  absl::StatusOr<bool> has_job = store->Load(kJobRecord, &stored);
  if (!has_job.ok()) return has_job.status();
  const bool recover = *live && options->restore.empty() &&
                       (*has_job || !options->job.has_value());
  if (recover && *has_job) {
    if (options->job.has_value() &&
        !google::protobuf::util::MessageDifferencer::Equals(ToProto(*options->job), stored)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the state directory holds job '", stored.name(), "', still live (its workers may be "
          "running), with another job spec; start without --job (or with the same file) to take "
          "it back, pass --restore to start a new run from a checkpoint, or use another "
          "--state-dir"));
    }
    absl::StatusOr<JobConfig> job = JobConfigFromProto(stored, "");
    if (!job.ok()) return job.status();
    options->job = std::move(*job);
  }
  if (options->job.has_value()) {
    ApplyJob(*options->job, options);
    if (!recover) {
      if (absl::Status saved = store->Save(kJobRecord, ToProto(*options->job)); !saved.ok()) {
        return saved;
      }
    }
  } else if (options->world.expected_world_size < 1) {
    return absl::InvalidArgumentError(
        "no job to run: give --job FILE or --world-size N (the state directory holds no live "
        "job to take back)");
  }
  options->world.recover = recover;
  return recover;
}

}  // namespace

absl::StatusOr<std::unique_ptr<CoordinatorServer>> CoordinatorServer::Start(
    const CoordinatorOptions& given) {
  auto server = std::unique_ptr<CoordinatorServer>(new CoordinatorServer());
  const absl::Time now = absl::Now();
  if (given.state_dir.empty()) {
    server->store_ = std::make_unique<InMemoryStateStore>();
  } else {
    auto store = DirectoryStateStore::Open(given.state_dir);
    if (!store.ok()) return store.status();
    server->store_ = std::move(*store);
  }
  CoordinatorOptions options = given;
  absl::StatusOr<bool> recover = SettleJob(server->store_.get(), &options);
  if (!recover.ok()) return recover.status();
  auto world = WorldManager::Create(options.world, server->store_.get(), now);
  if (!world.ok()) return world.status();
  server->world_ = std::move(*world);
  const int64_t generation = server->world_->world().generation;
  server->kv_ = std::make_unique<KvStoreManager>(options.world.job, generation);
  server->plan_ = std::make_unique<PlanManager>(options.plan, server->store_.get());
  server->plan_->OnGeneration(generation);
  if (server->world_->recovered()) {
    if (absl::Status plan = server->plan_->Recover(generation); !plan.ok()) return plan;
  }
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
    checkpoint_options.recover = server->world_->recovered();
    auto checkpoints = CheckpointManager::Create(checkpoint_options, server->store_.get());
    if (!checkpoints.ok()) return checkpoints.status();
    server->checkpoints_ = std::move(*checkpoints);
    if (server->world_->recovered() && !server->world_->kept_generation()) {
      // A world that reconnects at a new generation restarts from the latest checkpoint.
      server->checkpoints_->OnGeneration(generation);
    }
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
  server->elastic_ =
      std::make_unique<ElasticManager>(server->world_.get(), server->checkpoints_.get());
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
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials =
      LoadServerCredentials(options.tls);
  if (!credentials.ok()) return credentials.status();
  server->guard_ = std::make_unique<AccessGuard>(options.job_token, options.admin_token);
  server->join_limiter_ = std::make_unique<RateLimiter>(
      options.max_joins_per_second, 2.0 * server->world_->options().expected_world_size + 64);
  server->coordinator_service_ = std::make_unique<CoordinatorServiceImpl>(
      server->world_.get(), plan, checkpoint_manager, job_spec, clock, server->guard_.get(),
      server->join_limiter_.get());
  server->rendezvous_service_ =
      std::make_unique<RendezvousServiceImpl>(kv, clock, server->guard_.get());
  server->admin_service_ = std::make_unique<AdminServiceImpl>(
      server->world_.get(), plan, checkpoint_manager, server->elastic_.get(), clock, now,
      [self] {
        absl::MutexLock lock(&self->mu_);
        self->wake_ = true;
      },
      server->guard_.get());

  // Health (grpc.health.v1, SERVING once the state is loaded, which it is by now) and
  // reflection on the main port; health alone on the plaintext --health-listen port.
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(options.listen_address, *credentials, &server->port_);
  builder.SetMaxReceiveMessageSize(options.max_message_bytes);
  server->rpc_metrics_ = std::make_unique<RpcMetrics>(ServedMethods());
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
  interceptors.push_back(MakeRpcMetricsInterceptorFactory(server->rpc_metrics_.get()));
  builder.experimental().SetInterceptorCreators(std::move(interceptors));
  builder.RegisterService(server->coordinator_service_.get());
  builder.RegisterService(server->rendezvous_service_.get());
  builder.RegisterService(server->admin_service_.get());
  server->server_ = builder.BuildAndStart();
  if (server->server_ == nullptr || server->port_ == 0) {
    return CannotListen(options.listen_address, "--listen");
  }
  if (!options.health_listen.empty()) {
    grpc::ServerBuilder health;
    health.SetOption(std::make_unique<WithoutPlugins>());
    health.RegisterCallbackGenericService(&server->health_unimplemented_);
    health.AddListeningPort(options.health_listen, grpc::InsecureServerCredentials(),
                            &server->health_port_);
    health.SetMaxReceiveMessageSize(4096);
    server->health_server_ = health.BuildAndStart();
    if (server->health_server_ == nullptr || server->health_port_ == 0) {
      return CannotListen(options.health_listen, "--health-listen");
    }
  }
  if (!options.metrics_listen.empty()) {
    const CoordinatorMetricsSources sources{server->world_.get(), plan, checkpoint_manager,
                                            server->rpc_metrics_.get(), now};
    absl::StatusOr<std::unique_ptr<MetricsHttpServer>> http = MetricsHttpServer::Start(
        options.metrics_listen,
        [sources] { return RenderCoordinatorMetrics(sources, absl::Now()); });
    if (!http.ok()) return http.status();
    server->metrics_http_ = std::move(*http);
  }
  server->SetServing(true);
  const size_t colon = options.listen_address.rfind(':');
  const std::string host = options.listen_address.substr(0, colon);
  if (options.tls.cert.empty() && host != "127.0.0.1" && host != "localhost" && host != "[::1]") {
    spdlog::warn("*** listening on {} WITHOUT TLS: anyone who can reach this address can read "
                 "the job's traffic{}. Give --tls-cert/--tls-key (and --tls-client-ca) on a "
                 "shared network ***",
                 options.listen_address,
                 options.job_token.empty() ? ", join the job and change it" : " and its tokens");
  }
  server->host_ = host;
  server->housekeeping_interval_ = options.housekeeping_interval;
  server->housekeeping_ = std::thread([self] { self->Housekeeping(); });
  const World started = server->world_->world();
  spdlog::info("coordinator for job '{}' listening on {} ({} {} workers, at least {} to re-form, "
               "lease {}, re-form grace {}, generation {}, state {})",
               options.world.job, server->address(),
               server->world_->recovered() ? "took back a world of" : "expecting",
               started.expected_world_size, started.min_world_size,
               absl::FormatDuration(options.world.lease),
               absl::FormatDuration(options.world.reform_grace), started.generation,
               options.state_dir.empty() ? std::string("in memory") : options.state_dir);
  if (server->health_server_ != nullptr) {
    spdlog::info("health (grpc.health.v1, plaintext) on port {}", server->health_port_);
  }
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
    if (elastic_->Reconcile(now)) world_->WakeWatches();
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
  metrics_http_.reset();
  if (server_ == nullptr) return;  // Start() failed before serving
  SetServing(false);
  // Pending long-polls must be answered before the server can drain.
  const absl::Status closing = absl::UnavailableError("the coordinator is shutting down");
  kv_->Close(closing);
  world_->CloseWatches(closing);
  plan_->CloseWaits(closing);
  server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  if (health_server_ != nullptr) health_server_->Shutdown();
}

void CoordinatorServer::SetServing(bool serving) {
  for (grpc::Server* server : {server_.get(), health_server_.get()}) {
    if (server != nullptr && server->GetHealthCheckService() != nullptr) {
      server->GetHealthCheckService()->SetServingStatus(serving);
    }
  }
}

}  // namespace shard
