#include "worker/coordinator_client.h"

#include "absl/strings/str_cat.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/support/channel_arguments.h"
#include "grpcpp/security/credentials.h"
#include "proto/grpc_status.h"

namespace shard {
namespace {

// One unary call: `rpc(context, response)` issues it on a context with the deadline.
template <typename Response, typename Rpc>
absl::StatusOr<Response> UnaryCall(grpc::ClientContext* context, Rpc rpc, absl::Duration timeout,
                                   absl::string_view what) {
  context->set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  Response response;
  absl::Status status = FromGrpcStatus(rpc(context, &response), what);
  if (!status.ok()) return status;
  return response;
}

}  // namespace

RendezvousClient::RendezvousClient(std::shared_ptr<v1::Rendezvous::Stub> stub,
                                   v1::RendezvousScope scope, std::string address,
                                   absl::Duration rpc_timeout)
    : stub_(std::move(stub)),
      scope_(std::move(scope)),
      address_(std::move(address)),
      rpc_timeout_(rpc_timeout) {}

template <typename Response, typename Rpc>
absl::StatusOr<Response> RendezvousClient::Call(Rpc rpc, absl::Duration timeout,
                                                absl::string_view what) {
  grpc::ClientContext context;
  {
    absl::MutexLock lock(&mu_);
    if (cancelled_) return absl::CancelledError(absl::StrCat(what, ": the worker is stopping"));
    in_flight_ = &context;
  }
  absl::StatusOr<Response> response = UnaryCall<Response>(&context, rpc, timeout, what);
  absl::MutexLock lock(&mu_);
  in_flight_ = nullptr;
  return response;
}

absl::Status RendezvousClient::Set(const std::string& key, const std::string& value) {
  v1::KvSetRequest request;
  *request.mutable_scope() = scope_;
  request.set_key(key);
  request.set_value(value);
  return Call<v1::KvSetResponse>(
             [&](auto* context, auto* response) { return stub_->Set(context, request, response); },
             rpc_timeout_, absl::StrCat("rendezvous set '", key, "' at ", address_))
      .status();
}

absl::StatusOr<std::string> RendezvousClient::Get(const std::string& key) {
  v1::KvGetRequest request;
  *request.mutable_scope() = scope_;
  request.set_key(key);
  absl::StatusOr<v1::KvGetResponse> response = Call<v1::KvGetResponse>(
      [&](auto* context, auto* response) { return stub_->Get(context, request, response); },
      rpc_timeout_, absl::StrCat("rendezvous get '", key, "' at ", address_));
  if (!response.ok()) return response.status();
  return std::move(*response->mutable_value());
}

absl::Status RendezvousClient::Wait(const std::vector<std::string>& keys,
                                    absl::Duration timeout) {
  v1::KvWaitRequest request;
  *request.mutable_scope() = scope_;
  for (const std::string& key : keys) request.add_keys(key);
  request.set_timeout_ms(std::max<int64_t>(1, absl::ToInt64Milliseconds(timeout)));
  // The server answers when the wait times out; the deadline leaves room for that answer.
  return Call<v1::KvWaitResponse>(
             [&](auto* context, auto* response) { return stub_->Wait(context, request, response); },
             timeout + rpc_timeout_, absl::StrCat("rendezvous wait at ", address_))
      .status();
}

void RendezvousClient::Cancel() {
  absl::MutexLock lock(&mu_);
  cancelled_ = true;
  if (in_flight_ != nullptr) in_flight_->TryCancel();
}

namespace {

// gRPC backs off reconnecting for up to two minutes; a restarted coordinator must hear from
// its workers within their lease, so keep retrying the connection every few hundred ms.
grpc::ChannelArguments ReconnectQuickly() {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 500);
  return args;
}

}  // namespace

CoordinatorClient::CoordinatorClient(std::string address, absl::Duration rpc_timeout,
                                     const ClientSecurity& security)
    : address_(std::move(address)),
      rpc_timeout_(rpc_timeout),
      channel_(CreateSecureChannel(address_, security, ReconnectQuickly())),
      coordinator_(v1::Coordinator::NewStub(channel_)),
      rendezvous_(v1::Rendezvous::NewStub(channel_)) {}

absl::StatusOr<v1::JoinResponse> CoordinatorClient::Join(const v1::JoinRequest& request) {
  grpc::ClientContext context;
  return UnaryCall<v1::JoinResponse>(
      &context,
      [&](auto* context, auto* response) { return coordinator_->Join(context, request, response); },
      rpc_timeout_, absl::StrCat("join at ", address_));
}

absl::StatusOr<v1::HeartbeatResponse> CoordinatorClient::Heartbeat(
    const v1::HeartbeatRequest& request) {
  grpc::ClientContext context;
  return UnaryCall<v1::HeartbeatResponse>(
      &context,
      [&](auto* context, auto* response) {
        return coordinator_->Heartbeat(context, request, response);
      },
      rpc_timeout_, absl::StrCat("heartbeat to ", address_));
}

absl::Status CoordinatorClient::ReportSelfCheck(const v1::ReportSelfCheckRequest& request) {
  grpc::ClientContext context;
  return UnaryCall<v1::ReportSelfCheckResponse>(
             &context,
             [&](auto* context, auto* response) {
               return coordinator_->ReportSelfCheck(context, request, response);
             },
             rpc_timeout_, absl::StrCat("self-check report to ", address_))
      .status();
}

absl::Status CoordinatorClient::Leave(const v1::LeaveRequest& request) {
  grpc::ClientContext context;
  return UnaryCall<v1::LeaveResponse>(
             &context,
             [&](auto* context, auto* response) {
               return coordinator_->Leave(context, request, response);
             },
             rpc_timeout_, absl::StrCat("leave at ", address_))
      .status();
}

absl::StatusOr<v1::PlanResponse> CoordinatorClient::RegisterManifest(
    const v1::RegisterManifestRequest& request) {
  grpc::ClientContext context;
  return UnaryCall<v1::PlanResponse>(
      &context,
      [&](auto* context, auto* response) {
        return coordinator_->RegisterManifest(context, request, response);
      },
      rpc_timeout_, absl::StrCat("manifest registration at ", address_));
}

absl::StatusOr<v1::PlanResponse> CoordinatorClient::AckPlan(const v1::AckPlanRequest& request) {
  grpc::ClientContext context;
  return UnaryCall<v1::PlanResponse>(
      &context,
      [&](auto* context, auto* response) {
        return coordinator_->AckPlan(context, request, response);
      },
      rpc_timeout_, absl::StrCat("plan acknowledgement at ", address_));
}

absl::StatusOr<v1::PlanResponse> CoordinatorClient::ReportGradientOrder(
    const v1::ReportGradientOrderRequest& request) {
  grpc::ClientContext context;
  return UnaryCall<v1::PlanResponse>(
      &context,
      [&](auto* context, auto* response) {
        return coordinator_->ReportGradientOrder(context, request, response);
      },
      absl::Milliseconds(request.wait_ms()) + rpc_timeout_,
      absl::StrCat("gradient order report at ", address_));
}

absl::Status CoordinatorClient::ReportStepStats(const v1::ReportStepStatsRequest& request) {
  grpc::ClientContext context;
  return UnaryCall<v1::ReportStepStatsResponse>(
             &context,
             [&](auto* context, auto* response) {
               return coordinator_->ReportStepStats(context, request, response);
             },
             rpc_timeout_, absl::StrCat("step statistics report at ", address_))
      .status();
}

absl::Status CoordinatorClient::ReportTrainingDone(const v1::ReportTrainingDoneRequest& request) {
  grpc::ClientContext context;
  return UnaryCall<v1::ReportTrainingDoneResponse>(
             &context,
             [&](auto* context, auto* response) {
               return coordinator_->ReportTrainingDone(context, request, response);
             },
             rpc_timeout_, absl::StrCat("training report at ", address_))
      .status();
}

absl::Status CoordinatorClient::ReportCheckpointShard(
    const v1::ReportCheckpointShardRequest& request) {
  grpc::ClientContext context;
  return UnaryCall<v1::ReportCheckpointShardResponse>(
             &context,
             [&](auto* context, auto* response) {
               return coordinator_->ReportCheckpointShard(context, request, response);
             },
             rpc_timeout_, absl::StrCat("checkpoint report at ", address_))
      .status();
}

std::unique_ptr<RendezvousClient> CoordinatorClient::RendezvousStore(
    const v1::RendezvousScope& scope) {
  return std::make_unique<RendezvousClient>(rendezvous_, scope, address_, rpc_timeout_);
}

}  // namespace shard
