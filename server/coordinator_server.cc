#include "server/coordinator_server.h"

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "google/protobuf/util/message_differencer.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"
#include "proto/job_convert.h"
#include "server/access_guard.h"
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

// The hosts whose connections never leave the machine.
bool IsLoopback(absl::string_view host) {
  return host == "127.0.0.1" || host == "localhost" || host == "[::1]";
}

// The main port's credentials, with an AccessGuard on them when tokens are required. gRPC runs
// an AuthMetadataProcessor only on secure credentials; for plaintext, LOCAL_TCP credentials
// take one and still serve plaintext clients (their handshake sends nothing), but they accept
// connections to loopback addresses only. Tokens sent in the clear beyond loopback would be
// readable on the network anyway, so that combination is refused.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MainPortCredentials(
    const CoordinatorOptions& options, absl::string_view host, RpcMetrics* metrics) {
  SHARD_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ServerCredentials> credentials,
                         LoadServerCredentials(options.tls));
  if (options.job_token.empty() && options.admin_token.empty()) return credentials;
  if (options.tls.cert.empty()) {
    if (!IsLoopback(host)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tokens without TLS are accepted only on a loopback --listen (127.0.0.1, localhost, "
          "[::1]), not '", options.listen_address,
          "', where they would cross the network in the clear: add --tls-cert and --tls-key"));
    }
    credentials = grpc::experimental::LocalServerCredentials(LOCAL_TCP);
  }
  SHARD_ASSIGN_OR_RETURN(AccessTable table, AccessTableOf(*v1::Access_descriptor()->file()));
  credentials->SetAuthMetadataProcessor(std::make_shared<AccessGuard>(
      std::move(table), options.job_token, options.admin_token, metrics));
  return credentials;
}

absl::Status CannotListen(const std::string& address, absl::string_view flag) {
  return absl::UnavailableError(absl::StrCat("cannot listen on '", address,
                                             "': the address is malformed or the port is in use; "
                                             "pass another ", flag));
}

}  // namespace

absl::StatusOr<std::unique_ptr<CoordinatorServer>> CoordinatorServer::Start(
    const CoordinatorOptions& given) {
  auto server = std::unique_ptr<CoordinatorServer>(new CoordinatorServer());
  const absl::Time now = absl::Now();
  // Flags that cannot work together fail before the state directory is touched.
  const size_t colon = given.listen_address.rfind(':');
  const std::string host = given.listen_address.substr(0, colon);
  server->rpc_metrics_ = std::make_unique<RpcMetrics>(ServedMethods());
  SHARD_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ServerCredentials> credentials,
                         MainPortCredentials(given, host, server->rpc_metrics_.get()));
  if (given.state_dir.empty()) {
    server->store_ = std::make_unique<InMemoryStateStore>();
  } else {
    SHARD_ASSIGN_OR_RETURN(server->store_, DirectoryStateStore::Open(given.state_dir));
  }
  CoreOptions core_options;
  core_options.world = given.world;
  core_options.plan = given.plan;
  core_options.job = given.job;
  core_options.restore = given.restore;
  core_options.progress = given.progress;
  SHARD_ASSIGN_OR_RETURN(std::unique_ptr<CoordinatorCore> core,
                         CoordinatorCore::Create(std::move(core_options), server->store_.get(),
                                                 &server->checkpoint_storage_, now));
  server->core_ = std::move(core);
  const CoordinatorOptions& options = given;
  CoordinatorCore* core_ptr = server->core_.get();
  const CoreOptions& settled = core_ptr->options();
  std::optional<v1::JobSpec> job_spec;
  if (settled.job.has_value()) job_spec = ToProto(*settled.job);

  const Clock clock = [] { return absl::Now(); };
  CoordinatorServer* self = server.get();
  server->join_limiter_ = std::make_unique<RateLimiter>(
      options.max_joins_per_second, 2.0 * core_ptr->world().options().expected_world_size + 64);
  server->coordinator_service_ = std::make_unique<CoordinatorServiceImpl>(
      core_ptr, job_spec, clock, server->join_limiter_.get());
  server->rendezvous_service_ = std::make_unique<RendezvousServiceImpl>(core_ptr, clock);
  server->admin_service_ = std::make_unique<AdminServiceImpl>(
      core_ptr, clock, now,
      [self] {
        absl::MutexLock lock(&self->mu_);
        self->wake_ = true;
      });

  // Health (grpc.health.v1, SERVING once the state is loaded, which it is by now) and
  // reflection on the main port; health alone on the plaintext --health-listen port.
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(options.listen_address, credentials, &server->port_);
  builder.SetMaxReceiveMessageSize(options.max_message_bytes);
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
    CoordinatorMetricsSources sources;
    sources.world = &core_ptr->world();
    sources.plan = &core_ptr->plan();
    sources.checkpoints = core_ptr->checkpoints();
    sources.snapshots = core_ptr->snapshots();
    sources.rpc = server->rpc_metrics_.get();
    sources.started = now;
    SHARD_ASSIGN_OR_RETURN(server->metrics_http_,
                           MetricsHttpServer::Start(options.metrics_listen, [sources] {
                             return RenderCoordinatorMetrics(sources, absl::Now());
                           }));
  }
  server->SetServing(true);
  if (options.tls.cert.empty() && !IsLoopback(host)) {
    spdlog::warn("*** listening on {} WITHOUT TLS: anyone who can reach this address can read "
                 "the job's traffic, join the job and change it. Give --tls-cert/--tls-key (and "
                 "--tls-client-ca) on a shared network ***",
                 options.listen_address);
  }
  server->host_ = host;
  server->housekeeping_interval_ = options.housekeeping_interval;
  server->housekeeping_ = std::thread([self] { self->Housekeeping(); });
  const World started = core_ptr->world().world();
  spdlog::info("coordinator for job '{}' listening on {} ({} {} workers, at least {} to re-form, "
               "lease {}, re-form grace {}, generation {}, state {})",
               settled.world.job, server->address(),
               core_ptr->recovered() ? "took back a world of" : "expecting",
               started.expected_world_size, started.min_world_size,
               absl::FormatDuration(settled.world.lease),
               absl::FormatDuration(settled.world.reform_grace), started.generation,
               options.state_dir.empty() ? std::string("in memory") : options.state_dir);
  if (server->health_server_ != nullptr) {
    spdlog::info("health (grpc.health.v1, plaintext) on port {}", server->health_port_);
  }
  return server;
}

CoordinatorServer::~CoordinatorServer() { Shutdown(); }

std::string CoordinatorServer::address() const { return absl::StrCat(host_, ":", port_); }

void CoordinatorServer::RequestStop(const std::string& reason) {
  // The path `shardctl stop` takes: durable before anyone is told.
  core_->Stop(reason, absl::Now(), [](const World&) {});
  absl::MutexLock lock(&mu_);
  wake_ = true;
}

JobState CoordinatorServer::job_state() const { return core_->world().world().state; }

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
    if (core_->Housekeep(absl::Now())) {
      absl::MutexLock lock(&mu_);
      wake_ = true;  // answers still wait: the next pass at once
    }
    if (const JobState state = core_->world().world().state;
        Ended(state) && !stopped_.HasBeenNotified()) {
      spdlog::info("job '{}' {}: every worker has left", core_->world().options().job,
                   JobStateName(state));
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
  core_->Close(absl::UnavailableError("the coordinator is shutting down"));
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
