// shardctl's side of the coordinator's Admin service. Every call has a deadline.
#pragma once

#include <memory>
#include <string>
#include <type_traits>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "proto/channel_security.h"
#include "proto/unary_call.h"
#include "shard/v1/coordinator.grpc.pb.h"

namespace shard {

class AdminClient {
 public:
  // `security`: TLS and the admin token, if the coordinator requires them.
  AdminClient(std::string address, absl::Duration rpc_timeout,
              const ClientSecurity& security = {});

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
  absl::StatusOr<v1::ResizeResponse> Resize(int world_size);
  absl::StatusOr<v1::DrainResponse> Drain(const std::string& worker_id);
  // Events after `after`; with `wait` > 0 the coordinator holds the reply until there is one
  // (the call's deadline is `wait` plus the usual timeout).
  absl::StatusOr<v1::ListEventsResponse> ListEvents(int64_t after, absl::Duration wait);

 private:
  // One call with the deadline; unreachable coordinators get an error that says so and what
  // to check.
  template <typename Request, typename Response>
  absl::StatusOr<Response> Call(UnaryMethod<v1::Admin::Stub, Request, Response> method,
                                const std::type_identity_t<Request>& request,
                                absl::string_view what,
                                absl::Duration extra = absl::ZeroDuration());

  std::string address_;
  absl::Duration rpc_timeout_;
  std::unique_ptr<v1::Admin::Stub> stub_;
};

}  // namespace shard
