#include "worker/coordinator_client.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"

namespace shard {

RendezvousClient::RendezvousClient(std::shared_ptr<v1::Rendezvous::Stub> stub,
                                   v1::RendezvousScope scope, std::string address,
                                   absl::Duration rpc_timeout)
    : stub_(std::move(stub)),
      scope_(std::move(scope)),
      address_(std::move(address)),
      rpc_timeout_(rpc_timeout) {}

template <typename Request, typename Response>
absl::StatusOr<Response> RendezvousClient::Call(
    UnaryMethod<v1::Rendezvous::Stub, Request, Response> method,
    const std::type_identity_t<Request>& request, absl::Duration timeout, absl::string_view what) {
  grpc::ClientContext context;
  {
    absl::MutexLock lock(&mu_);
    if (cancelled_) return absl::CancelledError(absl::StrCat(what, ": the worker is stopping"));
    in_flight_ = &context;
  }
  absl::StatusOr<Response> response = UnaryCall(context, *stub_, method, request, timeout, what);
  absl::MutexLock lock(&mu_);
  in_flight_ = nullptr;
  return response;
}

absl::Status RendezvousClient::Set(const std::string& key, const std::string& value) {
  v1::KvSetRequest request;
  *request.mutable_scope() = scope_;
  request.set_key(key);
  request.set_value(value);
  return Call(&v1::Rendezvous::Stub::Set, request, rpc_timeout_,
              absl::StrCat("rendezvous set '", key, "' at ", address_))
      .status();
}

absl::StatusOr<std::string> RendezvousClient::Get(const std::string& key) {
  v1::KvGetRequest request;
  *request.mutable_scope() = scope_;
  request.set_key(key);
  SHARD_ASSIGN_OR_RETURN(v1::KvGetResponse response,
                         Call(&v1::Rendezvous::Stub::Get, request, rpc_timeout_,
                              absl::StrCat("rendezvous get '", key, "' at ", address_)));
  return std::move(*response.mutable_value());
}

absl::Status RendezvousClient::Wait(const std::vector<std::string>& keys,
                                    absl::Duration timeout) {
  v1::KvWaitRequest request;
  *request.mutable_scope() = scope_;
  for (const std::string& key : keys) request.add_keys(key);
  request.set_timeout_ms(std::max<int64_t>(1, absl::ToInt64Milliseconds(timeout)));
  // The server answers when the wait times out; the deadline leaves room for that answer.
  return Call(&v1::Rendezvous::Stub::Wait, request, timeout + rpc_timeout_,
              absl::StrCat("rendezvous wait at ", address_))
      .status();
}

void RendezvousClient::Cancel() {
  absl::MutexLock lock(&mu_);
  cancelled_ = true;
  if (in_flight_ != nullptr) in_flight_->TryCancel();
}

namespace {

// gRPC backs off reconnecting for up to two minutes; a restarted coordinator must hear from
// its workers within their lease, so keep retrying the connection every few hundred ms. The
// channel has its own subchannels, so that a channel made afresh (ReplaceFailedChannel)
// connects afresh instead of sharing a failed one's state.
grpc::ChannelArguments ReconnectQuickly() {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 500);
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  return args;
}

}  // namespace

CoordinatorClient::CoordinatorClient(std::string address, absl::Duration rpc_timeout,
                                     const ClientSecurity& security)
    : address_(std::move(address)),
      rpc_timeout_(rpc_timeout),
      security_(security),
      stubs_(MakeStubs()) {}

std::shared_ptr<const CoordinatorClient::Stubs> CoordinatorClient::MakeStubs() const {
  auto stubs = std::make_shared<Stubs>();
  stubs->channel = CreateSecureChannel(address_, security_, ReconnectQuickly());
  stubs->coordinator = v1::Coordinator::NewStub(stubs->channel);
  stubs->rendezvous = v1::Rendezvous::NewStub(stubs->channel);
  return stubs;
}

std::shared_ptr<const CoordinatorClient::Stubs> CoordinatorClient::stubs() const {
  absl::MutexLock lock(&mu_);
  return stubs_;
}

void CoordinatorClient::ReplaceFailedChannel(const std::shared_ptr<const Stubs>& failed) {
  // gRPC 1.51's pick_first, once its connection failed, can leave a channel failing calls for
  // seconds after the coordinator is back (a restarted coordinator then declares its workers
  // dead); a new channel connects at once. At most one replacement per backoff period.
  if (failed->channel->GetState(/*try_to_connect=*/true) != GRPC_CHANNEL_TRANSIENT_FAILURE) {
    return;
  }
  absl::MutexLock lock(&mu_);
  if (stubs_ != failed || absl::Now() - replaced_at_ < absl::Milliseconds(200)) return;
  stubs_ = MakeStubs();
  replaced_at_ = absl::Now();
}

template <typename Request, typename Response>
absl::StatusOr<Response> CoordinatorClient::Call(
    UnaryMethod<v1::Coordinator::Stub, Request, Response> method,
    const std::type_identity_t<Request>& request, absl::Duration timeout, absl::string_view what) {
  const std::shared_ptr<const Stubs> stubs = this->stubs();
  grpc::ClientContext context;
  absl::StatusOr<Response> response = UnaryCall(context, *stubs->coordinator, method, request,
                                                timeout, absl::StrCat(what, " ", address_));
  if (absl::IsUnavailable(response.status())) ReplaceFailedChannel(stubs);
  return response;
}

absl::StatusOr<v1::JoinResponse> CoordinatorClient::Join(const v1::JoinRequest& request) {
  return Call(&v1::Coordinator::Stub::Join, request, rpc_timeout_, "join at");
}

absl::StatusOr<v1::HeartbeatResponse> CoordinatorClient::Heartbeat(
    const v1::HeartbeatRequest& request) {
  return Call(&v1::Coordinator::Stub::Heartbeat, request, rpc_timeout_, "heartbeat to");
}

absl::Status CoordinatorClient::ReportSelfCheck(const v1::ReportSelfCheckRequest& request) {
  return Call(&v1::Coordinator::Stub::ReportSelfCheck, request, rpc_timeout_,
              "self-check report to")
      .status();
}

absl::Status CoordinatorClient::Leave(const v1::LeaveRequest& request) {
  return Call(&v1::Coordinator::Stub::Leave, request, rpc_timeout_, "leave at").status();
}

absl::StatusOr<v1::PlanResponse> CoordinatorClient::RegisterManifest(
    const v1::RegisterManifestRequest& request) {
  return Call(&v1::Coordinator::Stub::RegisterManifest, request, rpc_timeout_,
              "manifest registration at");
}

absl::StatusOr<v1::PlanResponse> CoordinatorClient::AckPlan(const v1::AckPlanRequest& request) {
  return Call(&v1::Coordinator::Stub::AckPlan, request, rpc_timeout_, "plan acknowledgement at");
}

absl::StatusOr<v1::PlanResponse> CoordinatorClient::ReportGradientOrder(
    const v1::ReportGradientOrderRequest& request) {
  return Call(&v1::Coordinator::Stub::ReportGradientOrder, request,
              absl::Milliseconds(request.wait_ms()) + rpc_timeout_, "gradient order report at");
}

absl::Status CoordinatorClient::ReportStepStats(const v1::ReportStepStatsRequest& request) {
  return Call(&v1::Coordinator::Stub::ReportStepStats, request, rpc_timeout_,
              "step statistics report at")
      .status();
}

absl::Status CoordinatorClient::ReportTrainingDone(const v1::ReportTrainingDoneRequest& request) {
  return Call(&v1::Coordinator::Stub::ReportTrainingDone, request, rpc_timeout_,
              "training report at")
      .status();
}

absl::Status CoordinatorClient::ReportCheckpointShard(
    const v1::ReportCheckpointShardRequest& request) {
  return Call(&v1::Coordinator::Stub::ReportCheckpointShard, request, rpc_timeout_,
              "checkpoint report at")
      .status();
}

absl::Status CoordinatorClient::ReportSnapshot(const v1::ReportSnapshotRequest& request) {
  return Call(&v1::Coordinator::Stub::ReportSnapshot, request, rpc_timeout_, "snapshot report at")
      .status();
}

absl::StatusOr<v1::RestoreSnapshot> CoordinatorClient::GetRestoreSnapshot(
    const v1::GetRestoreSnapshotRequest& request) {
  return Call(&v1::Coordinator::Stub::GetRestoreSnapshot, request, rpc_timeout_,
              "restore point request at");
}

absl::Status CoordinatorClient::ReportRestore(const v1::ReportRestoreRequest& request) {
  return Call(&v1::Coordinator::Stub::ReportRestore, request, rpc_timeout_, "restore report at")
      .status();
}

std::unique_ptr<RendezvousClient> CoordinatorClient::RendezvousStore(
    const v1::RendezvousScope& scope) {
  return std::make_unique<RendezvousClient>(stubs()->rendezvous, scope, address_, rpc_timeout_);
}

}  // namespace shard
