// Thin gRPC handlers: convert the request (proto/control_convert.h), call CoordinatorCore,
// convert its answer and reply exactly once. Every rule lives in the core's managers; who may
// call them is checked before they run, by the AccessGuard on the server's credentials.
#pragma once

#include <functional>
#include <optional>

#include "common/rate_limiter.h"
#include "server/coordinator_core.h"
#include "shard/v1/coordinator.grpc.pb.h"

namespace shard {

using Clock = std::function<absl::Time()>;

class CoordinatorServiceImpl final : public v1::Coordinator::CallbackService {
 public:
  // `job_spec`: the training job handed to every joining worker, if any.
  CoordinatorServiceImpl(CoordinatorCore* core, std::optional<v1::JobSpec> job_spec, Clock clock,
                         RateLimiter* join_limiter)
      : join_limiter_(join_limiter),
        core_(core),
        job_spec_(std::move(job_spec)),
        clock_(std::move(clock)) {}

  grpc::ServerUnaryReactor* Join(grpc::CallbackServerContext* context,
                                 const v1::JoinRequest* request,
                                 v1::JoinResponse* response) override;
  grpc::ServerUnaryReactor* Heartbeat(grpc::CallbackServerContext* context,
                                      const v1::HeartbeatRequest* request,
                                      v1::HeartbeatResponse* response) override;
  grpc::ServerUnaryReactor* ReportSelfCheck(grpc::CallbackServerContext* context,
                                            const v1::ReportSelfCheckRequest* request,
                                            v1::ReportSelfCheckResponse* response) override;
  grpc::ServerUnaryReactor* Leave(grpc::CallbackServerContext* context,
                                  const v1::LeaveRequest* request,
                                  v1::LeaveResponse* response) override;
  grpc::ServerUnaryReactor* RegisterManifest(grpc::CallbackServerContext* context,
                                             const v1::RegisterManifestRequest* request,
                                             v1::PlanResponse* response) override;
  grpc::ServerUnaryReactor* AckPlan(grpc::CallbackServerContext* context,
                                    const v1::AckPlanRequest* request,
                                    v1::PlanResponse* response) override;
  grpc::ServerUnaryReactor* ReportGradientOrder(grpc::CallbackServerContext* context,
                                                const v1::ReportGradientOrderRequest* request,
                                                v1::PlanResponse* response) override;
  grpc::ServerUnaryReactor* ReportStepStats(grpc::CallbackServerContext* context,
                                            const v1::ReportStepStatsRequest* request,
                                            v1::ReportStepStatsResponse* response) override;
  grpc::ServerUnaryReactor* ReportTrainingDone(grpc::CallbackServerContext* context,
                                               const v1::ReportTrainingDoneRequest* request,
                                               v1::ReportTrainingDoneResponse* response) override;
  grpc::ServerUnaryReactor* ReportCheckpointShard(
      grpc::CallbackServerContext* context, const v1::ReportCheckpointShardRequest* request,
      v1::ReportCheckpointShardResponse* response) override;
  grpc::ServerUnaryReactor* ReportSnapshot(grpc::CallbackServerContext* context,
                                           const v1::ReportSnapshotRequest* request,
                                           v1::ReportSnapshotResponse* response) override;
  grpc::ServerUnaryReactor* GetRestoreSnapshot(grpc::CallbackServerContext* context,
                                               const v1::GetRestoreSnapshotRequest* request,
                                               v1::RestoreSnapshot* response) override;
  grpc::ServerUnaryReactor* ReportRestore(grpc::CallbackServerContext* context,
                                          const v1::ReportRestoreRequest* request,
                                          v1::ReportRestoreResponse* response) override;

 private:
  RateLimiter* join_limiter_;  // joins persist state: bounded
  CoordinatorCore* core_;
  std::optional<v1::JobSpec> job_spec_;
  Clock clock_;
};

class RendezvousServiceImpl final : public v1::Rendezvous::CallbackService {
 public:
  RendezvousServiceImpl(CoordinatorCore* core, Clock clock) : core_(core), clock_(clock) {}

  grpc::ServerUnaryReactor* Set(grpc::CallbackServerContext* context,
                                const v1::KvSetRequest* request,
                                v1::KvSetResponse* response) override;
  grpc::ServerUnaryReactor* Get(grpc::CallbackServerContext* context,
                                const v1::KvGetRequest* request,
                                v1::KvGetResponse* response) override;
  grpc::ServerUnaryReactor* Wait(grpc::CallbackServerContext* context,
                                 const v1::KvWaitRequest* request,
                                 v1::KvWaitResponse* response) override;

 private:
  CoordinatorCore* core_;
  Clock clock_;
};

class AdminServiceImpl final : public v1::Admin::CallbackService {
 public:
  // `on_change` runs after a stop, resize or drain was accepted (the server uses it to wake its
  // housekeeping, which carries the change out).
  AdminServiceImpl(CoordinatorCore* core, Clock clock, absl::Time started,
                   std::function<void()> on_change)
      : core_(core),
        clock_(std::move(clock)),
        started_(started),
        on_change_(std::move(on_change)) {}

  grpc::ServerUnaryReactor* GetStatus(grpc::CallbackServerContext* context,
                                      const v1::GetStatusRequest* request,
                                      v1::GetStatusResponse* response) override;
  grpc::ServerUnaryReactor* Stop(grpc::CallbackServerContext* context,
                                 const v1::StopRequest* request,
                                 v1::StopResponse* response) override;
  grpc::ServerUnaryReactor* GetPlan(grpc::CallbackServerContext* context,
                                    const v1::GetPlanRequest* request,
                                    v1::PlanSummary* response) override;
  grpc::ServerUnaryReactor* GetStats(grpc::CallbackServerContext* context,
                                     const v1::GetStatsRequest* request,
                                     v1::GetStatsResponse* response) override;
  grpc::ServerUnaryReactor* SaveCheckpoint(grpc::CallbackServerContext* context,
                                           const v1::SaveCheckpointRequest* request,
                                           v1::SaveCheckpointResponse* response) override;
  grpc::ServerUnaryReactor* GetSaveProgress(grpc::CallbackServerContext* context,
                                            const v1::GetSaveProgressRequest* request,
                                            v1::GetSaveProgressResponse* response) override;
  grpc::ServerUnaryReactor* ListCheckpoints(grpc::CallbackServerContext* context,
                                            const v1::ListCheckpointsRequest* request,
                                            v1::ListCheckpointsResponse* response) override;
  grpc::ServerUnaryReactor* GetCheckpoint(grpc::CallbackServerContext* context,
                                          const v1::GetCheckpointRequest* request,
                                          v1::CheckpointInfo* response) override;
  grpc::ServerUnaryReactor* DeleteCheckpoint(grpc::CallbackServerContext* context,
                                             const v1::DeleteCheckpointRequest* request,
                                             v1::DeleteCheckpointResponse* response) override;
  grpc::ServerUnaryReactor* RestoreCheckpoint(grpc::CallbackServerContext* context,
                                              const v1::RestoreCheckpointRequest* request,
                                              v1::RestoreCheckpointResponse* response) override;
  grpc::ServerUnaryReactor* Resize(grpc::CallbackServerContext* context,
                                   const v1::ResizeRequest* request,
                                   v1::ResizeResponse* response) override;
  grpc::ServerUnaryReactor* Drain(grpc::CallbackServerContext* context,
                                  const v1::DrainRequest* request,
                                  v1::DrainResponse* response) override;
  grpc::ServerUnaryReactor* ListEvents(grpc::CallbackServerContext* context,
                                       const v1::ListEventsRequest* request,
                                       v1::ListEventsResponse* response) override;

 private:
  CoordinatorCore* core_;
  Clock clock_;
  absl::Time started_;
  std::function<void()> on_change_;
};

}  // namespace shard
