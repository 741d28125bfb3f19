#include "client/admin_client.h"

#include "absl/strings/str_cat.h"

namespace shard {

AdminClient::AdminClient(std::string address, absl::Duration rpc_timeout,
                         const ClientSecurity& security)
    : address_(std::move(address)),
      rpc_timeout_(rpc_timeout),
      stub_(v1::Admin::NewStub(CreateSecureChannel(address_, security))) {}

template <typename Request, typename Response>
absl::StatusOr<Response> AdminClient::Call(UnaryMethod<v1::Admin::Stub, Request, Response> method,
                                           const std::type_identity_t<Request>& request,
                                           absl::string_view what, absl::Duration extra) {
  grpc::ClientContext context;
  absl::StatusOr<Response> response =
      UnaryCall(context, *stub_, method, request, rpc_timeout_ + extra, what);
  const absl::Status& status = response.status();
  if (absl::IsUnavailable(status) || absl::IsDeadlineExceeded(status)) {
    return absl::Status(status.code(),
                        absl::StrCat("cannot reach the coordinator at ", address_, " (",
                                     status.message(),
                                     "); is shard-coordinator running there? Check --coordinator"));
  }
  return response;
}

absl::StatusOr<v1::GetStatusResponse> AdminClient::GetStatus() {
  return Call(&v1::Admin::Stub::GetStatus, v1::GetStatusRequest(), "status");
}

absl::StatusOr<v1::StopResponse> AdminClient::Stop(const std::string& reason) {
  v1::StopRequest request;
  request.set_reason(reason);
  return Call(&v1::Admin::Stub::Stop, request, "stop");
}

absl::StatusOr<v1::PlanSummary> AdminClient::GetPlan() {
  return Call(&v1::Admin::Stub::GetPlan, v1::GetPlanRequest(), "plan");
}

absl::StatusOr<v1::GetStatsResponse> AdminClient::GetStats() {
  return Call(&v1::Admin::Stub::GetStats, v1::GetStatsRequest(), "stats");
}

absl::StatusOr<v1::SaveCheckpointResponse> AdminClient::SaveCheckpoint() {
  return Call(&v1::Admin::Stub::SaveCheckpoint, v1::SaveCheckpointRequest(), "checkpoint save");
}

absl::StatusOr<v1::GetSaveProgressResponse> AdminClient::GetSaveProgress(int64_t request) {
  v1::GetSaveProgressRequest message;
  message.set_request(request);
  return Call(&v1::Admin::Stub::GetSaveProgress, message, "checkpoint progress");
}

absl::StatusOr<v1::ListCheckpointsResponse> AdminClient::ListCheckpoints() {
  return Call(&v1::Admin::Stub::ListCheckpoints, v1::ListCheckpointsRequest(), "checkpoint list");
}

absl::StatusOr<v1::CheckpointInfo> AdminClient::GetCheckpoint(const std::string& id) {
  v1::GetCheckpointRequest message;
  message.set_id(id);
  return Call(&v1::Admin::Stub::GetCheckpoint, message, "checkpoint lookup");
}

absl::Status AdminClient::DeleteCheckpoint(const std::string& id) {
  v1::DeleteCheckpointRequest message;
  message.set_id(id);
  return Call(&v1::Admin::Stub::DeleteCheckpoint, message, "checkpoint delete").status();
}

absl::StatusOr<v1::RestoreCheckpointResponse> AdminClient::RestoreCheckpoint(
    const std::string& id) {
  v1::RestoreCheckpointRequest message;
  message.set_id(id);
  return Call(&v1::Admin::Stub::RestoreCheckpoint, message, "checkpoint restore");
}

absl::StatusOr<v1::ResizeResponse> AdminClient::Resize(int world_size) {
  v1::ResizeRequest message;
  message.set_world_size(world_size);
  return Call(&v1::Admin::Stub::Resize, message, "resize");
}

absl::StatusOr<v1::DrainResponse> AdminClient::Drain(const std::string& worker_id) {
  v1::DrainRequest message;
  message.set_worker_id(worker_id);
  return Call(&v1::Admin::Stub::Drain, message, "drain");
}

absl::StatusOr<v1::ListEventsResponse> AdminClient::ListEvents(int64_t after,
                                                               absl::Duration wait) {
  v1::ListEventsRequest message;
  message.set_after_sequence(after);
  message.set_wait_ms(absl::ToInt64Milliseconds(wait));
  return Call(&v1::Admin::Stub::ListEvents, message, "events", wait);
}

}  // namespace shard
