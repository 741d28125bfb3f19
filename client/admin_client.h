// shardctl's side of the coordinator's Admin service. Every call has a deadline.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "shard/v1/coordinator.grpc.pb.h"

namespace shard {

class AdminClient {
 public:
  AdminClient(std::string address, absl::Duration rpc_timeout);

  absl::StatusOr<v1::GetStatusResponse> GetStatus();
  absl::StatusOr<v1::StopResponse> Stop(const std::string& reason);
  absl::StatusOr<v1::PlanSummary> GetPlan();
  absl::StatusOr<v1::GetStatsResponse> GetStats();
  absl::StatusOr<v1::SaveCheckpointResponse> SaveCheckpoint();
  absl::StatusOr<v1::GetSaveProgressResponse> GetSaveProgress(int64_t request);
  absl::StatusOr<v1::ListCheckpointsResponse> ListCheckpoints();
  absl::StatusOr<v1::CheckpointInfo> GetCheckpoint(const std::string& id);
  absl::Status DeleteCheckpoint(const std::string& id);
  absl::StatusOr<v1::RestoreCheckpointResponse> RestoreCheckpoint(const std::string& id);

 private:
  // One call with the deadline; unreachable coordinators get an error that says so and what
  // to check.
  template <typename Response, typename Rpc>
  absl::StatusOr<Response> Call(Rpc rpc, absl::string_view what);

  std::string address_;
  absl::Duration rpc_timeout_;
  std::unique_ptr<v1::Admin::Stub> stub_;
};

}  // namespace shard
