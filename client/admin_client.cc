#include "client/admin_client.h"

#include "absl/strings/str_cat.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "proto/grpc_status.h"

namespace shard {

AdminClient::AdminClient(std::string address, absl::Duration rpc_timeout)
    : address_(std::move(address)),
      rpc_timeout_(rpc_timeout),
      stub_(v1::Admin::NewStub(grpc::CreateChannel(address_, grpc::InsecureChannelCredentials()))) {}

absl::Status AdminClient::Explain(const absl::Status& status) const {
  if (absl::IsUnavailable(status) || absl::IsDeadlineExceeded(status)) {
    return absl::Status(status.code(),
                        absl::StrCat("cannot reach the coordinator at ", address_, " (",
                                     status.message(),
                                     "); is shard-coordinator running there? Check --coordinator"));
  }
  return status;
}

absl::StatusOr<v1::GetStatusResponse> AdminClient::GetStatus() {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + rpc_timeout_));
  v1::GetStatusResponse response;
  absl::Status status =
      FromGrpcStatus(stub_->GetStatus(&context, v1::GetStatusRequest(), &response), "status");
  if (!status.ok()) return Explain(status);
  return response;
}

absl::StatusOr<v1::StopResponse> AdminClient::Stop(const std::string& reason) {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + rpc_timeout_));
  v1::StopRequest request;
  request.set_reason(reason);
  v1::StopResponse response;
  absl::Status status = FromGrpcStatus(stub_->Stop(&context, request, &response), "stop");
  if (!status.ok()) return Explain(status);
  return response;
}

}  // namespace shard
