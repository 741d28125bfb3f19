#include "client/admin_client.h"

#include "absl/strings/str_cat.h"
#include "proto/grpc_status.h"

namespace shard {

AdminClient::AdminClient(std::string address, absl::Duration rpc_timeout,
                         const ClientSecurity& security)
    : address_(std::move(address)),
      rpc_timeout_(rpc_timeout),
      stub_(v1::Admin::NewStub(CreateSecureChannel(address_, security))) {}

template <typename Response, typename Rpc>
absl::StatusOr<Response> AdminClient::Call(Rpc rpc, absl::string_view what, absl::Duration extra) {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + rpc_timeout_ + extra));
  Response response;
  absl::Status status = FromGrpcStatus(rpc(&context, &response), what);
  if (absl::IsUnavailable(status) || absl::IsDeadlineExceeded(status)) {
    return absl::Status(status.code(),
                        absl::StrCat("cannot reach the coordinator at ", address_, " (",
                                     status.message(),
                                     "); is shard-coordinator running there? Check --coordinator"));
  }
  if (!status.ok()) return status;
  return response;
}

absl::StatusOr<v1::GetStatusResponse> AdminClient::GetStatus() {
  return Call<v1::GetStatusResponse>(
      [&](auto* context, auto* response) {
        return stub_->GetStatus(context, v1::GetStatusRequest(), response);
      },
      "status");
}

absl::StatusOr<v1::StopResponse> AdminClient::Stop(const std::string& reason) {
  v1::StopRequest request;
  request.set_reason(reason);
  return Call<v1::StopResponse>(
      [&](auto* context, auto* response) { return stub_->Stop(context, request, response); },
      "stop");
}

absl::StatusOr<v1::PlanSummary> AdminClient::GetPlan() {
  return Call<v1::PlanSummary>(
      [&](auto* context, auto* response) {
        return stub_->GetPlan(context, v1::GetPlanRequest(), response);
      },
      "plan");
}

absl::StatusOr<v1::GetStatsResponse> AdminClient::GetStats() {
  return Call<v1::GetStatsResponse>(
      [&](auto* context, auto* response) {
        return stub_->GetStats(context, v1::GetStatsRequest(), response);
      },
      "stats");
}

}  // namespace shard

namespace shard {

absl::StatusOr<v1::SaveCheckpointResponse> AdminClient::SaveCheckpoint() {
  return Call<v1::SaveCheckpointResponse>(
      [&](auto* context, auto* response) {
        return stub_->SaveCheckpoint(context, v1::SaveCheckpointRequest(), response);
      },
      "checkpoint save");
}

absl::StatusOr<v1::GetSaveProgressResponse> AdminClient::GetSaveProgress(int64_t request) {
  v1::GetSaveProgressRequest message;
  message.set_request(request);
  return Call<v1::GetSaveProgressResponse>(
      [&](auto* context, auto* response) {
        return stub_->GetSaveProgress(context, message, response);
      },
      "checkpoint progress");
}

absl::StatusOr<v1::ListCheckpointsResponse> AdminClient::ListCheckpoints() {
  return Call<v1::ListCheckpointsResponse>(
      [&](auto* context, auto* response) {
        return stub_->ListCheckpoints(context, v1::ListCheckpointsRequest(), response);
      },
      "checkpoint list");
}

absl::StatusOr<v1::CheckpointInfo> AdminClient::GetCheckpoint(const std::string& id) {
  v1::GetCheckpointRequest message;
  message.set_id(id);
  return Call<v1::CheckpointInfo>(
      [&](auto* context, auto* response) {
        return stub_->GetCheckpoint(context, message, response);
      },
      "checkpoint lookup");
}

absl::Status AdminClient::DeleteCheckpoint(const std::string& id) {
  v1::DeleteCheckpointRequest message;
  message.set_id(id);
  return Call<v1::DeleteCheckpointResponse>(
             [&](auto* context, auto* response) {
               return stub_->DeleteCheckpoint(context, message, response);
             },
             "checkpoint delete")
      .status();
}

absl::StatusOr<v1::RestoreCheckpointResponse> AdminClient::RestoreCheckpoint(
    const std::string& id) {
  v1::RestoreCheckpointRequest message;
  message.set_id(id);
  return Call<v1::RestoreCheckpointResponse>(
      [&](auto* context, auto* response) {
        return stub_->RestoreCheckpoint(context, message, response);
      },
      "checkpoint restore");
}

absl::StatusOr<v1::ResizeResponse> AdminClient::Resize(int world_size) {
  v1::ResizeRequest message;
  message.set_world_size(world_size);
  return Call<v1::ResizeResponse>(
      [&](auto* context, auto* response) { return stub_->Resize(context, message, response); },
      "resize");
}

absl::StatusOr<v1::DrainResponse> AdminClient::Drain(const std::string& worker_id) {
  v1::DrainRequest message;
  message.set_worker_id(worker_id);
  return Call<v1::DrainResponse>(
      [&](auto* context, auto* response) { return stub_->Drain(context, message, response); },
      "drain");
}

absl::StatusOr<v1::ListEventsResponse> AdminClient::ListEvents(int64_t after,
                                                               absl::Duration wait) {
  v1::ListEventsRequest message;
  message.set_after_sequence(after);
  message.set_wait_ms(absl::ToInt64Milliseconds(wait));
  return Call<v1::ListEventsResponse>(
      [&](auto* context, auto* response) { return stub_->ListEvents(context, message, response); },
      "events", wait);
}

}  // namespace shard
