#include "server/coordinator_service.h"

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "proto/control_convert.h"
#include "proto/grpc_status.h"
#include "proto/plan_convert.h"

namespace shard {
namespace {

grpc::ServerUnaryReactor* Reply(grpc::CallbackServerContext* context, const absl::Status& status) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

// A reactor finished later, when the core answers.
struct Pending {
  grpc::ServerUnaryReactor* reactor;
  void Finish(const absl::Status& status) const { reactor->Finish(ToGrpcStatus(status)); }
};

Pending Later(grpc::CallbackServerContext* context) { return Pending{context->DefaultReactor()}; }

void FillPlan(const PlanView& view, v1::PlanResponse* response) {
  *response->mutable_plan() = ToPlanSpec(*view.plan, view.version, view.generation);
  response->set_status(ToProto(view.status));
}

}  // namespace

grpc::ServerUnaryReactor* CoordinatorServiceImpl::Join(grpc::CallbackServerContext* context,
                                                       const v1::JoinRequest* request,
                                                       v1::JoinResponse* response) {
  if (!join_limiter_->Allow(clock_())) {
    return Reply(context, absl::UnavailableError(
                              "too many joins at once; the coordinator bounds their rate "
                              "(--max-joins-per-second): retry shortly"));
  }
  absl::StatusOr<JoinParams> params = FromProto(*request);
  if (!params.ok()) return Reply(context, params.status());
  const Pending pending = Later(context);
  const std::string job = core_->world().options().job;
  core_->Join(*std::move(params), clock_(),
              [pending, response, job, this](absl::StatusOr<JoinReply> reply) {
                if (reply.ok()) {
                  *response = ToProto(*reply, job);
                  if (job_spec_.has_value()) *response->mutable_job_spec() = *job_spec_;
                }
                pending.Finish(reply.status());
              });
  return pending.reactor;
}

grpc::ServerUnaryReactor* CoordinatorServiceImpl::Heartbeat(grpc::CallbackServerContext* context,
                                                            const v1::HeartbeatRequest* request,
                                                            v1::HeartbeatResponse* response) {
  // Answered when the world changes or the wait runs out; the core calls back once.
  const Pending pending = Later(context);
  const std::string job = core_->world().options().job;
  core_->Heartbeat(FromProto(*request), clock_(),
                   [pending, response, job](absl::StatusOr<HeartbeatReply> reply) {
                     if (reply.ok()) *response = ToProto(*reply, job);
                     pending.Finish(reply.status());
                   });
  return pending.reactor;
}

grpc::ServerUnaryReactor* CoordinatorServiceImpl::ReportSelfCheck(
    grpc::CallbackServerContext* context, const v1::ReportSelfCheckRequest* request,
    v1::ReportSelfCheckResponse* /*response*/) {
  const Pending pending = Later(context);
  core_->ReportSelfCheck(FromProto(*request), clock_(),
                         [pending](absl::Status status) { pending.Finish(status); });
  return pending.reactor;
}

grpc::ServerUnaryReactor* CoordinatorServiceImpl::Leave(grpc::CallbackServerContext* context,
                                                        const v1::LeaveRequest* request,
                                                        v1::LeaveResponse* /*response*/) {
  const Pending pending = Later(context);
  core_->Leave(FromProto(*request), clock_(),
               [pending](absl::Status status) { pending.Finish(status); });
  return pending.reactor;
}

grpc::ServerUnaryReactor* CoordinatorServiceImpl::RegisterManifest(
    grpc::CallbackServerContext* context, const v1::RegisterManifestRequest* request,
    v1::PlanResponse* response) {
  absl::StatusOr<Manifest> manifest = FromProto(request->manifest());
  if (!manifest.ok()) return Reply(context, manifest.status());
  absl::StatusOr<PlanView> view =
      core_->RegisterManifest(request->worker_id(), request->incarnation(), *manifest);
  if (view.ok()) FillPlan(*view, response);
  return Reply(context, view.status());
}

grpc::ServerUnaryReactor* CoordinatorServiceImpl::AckPlan(grpc::CallbackServerContext* context,
                                                          const v1::AckPlanRequest* request,
                                                          v1::PlanResponse* response) {
  absl::StatusOr<PlanView> view = core_->AckPlan(request->worker_id(), request->incarnation(),
                                                 request->version(), request->hash());
  if (view.ok()) FillPlan(*view, response);
  return Reply(context, view.status());
}

grpc::ServerUnaryReactor* CoordinatorServiceImpl::ReportGradientOrder(
    grpc::CallbackServerContext* context, const v1::ReportGradientOrderRequest* request,
    v1::PlanResponse* response) {
  const Pending pending = Later(context);
  core_->ReportGradientOrder(
      request->worker_id(), request->incarnation(), request->plan_version(),
      {request->order().begin(), request->order().end()},
      absl::Milliseconds(std::max<int64_t>(0, request->wait_ms())), clock_(),
      [pending, response](absl::StatusOr<PlanView> view) {
        if (view.ok()) FillPlan(*view, response);
        pending.Finish(view.status());
      });
  return pending.reactor;
}

grpc::ServerUnaryReactor* CoordinatorServiceImpl::ReportStepStats(
    grpc::CallbackServerContext* context, const v1::ReportStepStatsRequest* request,
    v1::ReportStepStatsResponse* /*response*/) {
  return Reply(context, core_->ReportStepStats(request->worker_id(), request->incarnation(),
                                               request->generation(), FromProto(request->stats()),
                                               clock_()));
}

grpc::ServerUnaryReactor* CoordinatorServiceImpl::ReportCheckpointShard(
    grpc::CallbackServerContext* context, const v1::ReportCheckpointShardRequest* request,
    v1::ReportCheckpointShardResponse* response) {
  absl::StatusOr<bool> committed = core_->ReportCheckpointShard(FromProto(*request), clock_());
  if (committed.ok()) response->set_committed(*committed);
  return Reply(context, committed.status());
}

grpc::ServerUnaryReactor* CoordinatorServiceImpl::ReportSnapshot(
    grpc::CallbackServerContext* context, const v1::ReportSnapshotRequest* request,
    v1::ReportSnapshotResponse* /*response*/) {
  absl::StatusOr<SnapshotReport> report = FromProto(*request);
  if (!report.ok()) return Reply(context, report.status());
  return Reply(context, core_->ReportSnapshot(*report, clock_()));
}

grpc::ServerUnaryReactor* CoordinatorServiceImpl::GetRestoreSnapshot(
    grpc::CallbackServerContext* context, const v1::GetRestoreSnapshotRequest* request,
    v1::RestoreSnapshot* response) {
  absl::StatusOr<RestoreSnapshotView> view = core_->GetRestoreSnapshot(
      request->worker_id(), request->incarnation(), request->generation());
  if (view.ok()) {
    response->set_id(view->id);
    response->set_manifest_json(view->manifest_json);
    for (const std::vector<SnapshotHolder>& holders : view->holders) {
      v1::RestoreSnapshot::Shard* shard = response->add_shards();
      for (const SnapshotHolder& holder : holders) *shard->add_holders() = ToProto(holder);
    }
  }
  return Reply(context, view.status());
}

grpc::ServerUnaryReactor* CoordinatorServiceImpl::ReportRestore(
    grpc::CallbackServerContext* context, const v1::ReportRestoreRequest* request,
    v1::ReportRestoreResponse* /*response*/) {
  return Reply(context, core_->ReportRestore(FromProto(*request), clock_()));
}

grpc::ServerUnaryReactor* CoordinatorServiceImpl::ReportTrainingDone(
    grpc::CallbackServerContext* context, const v1::ReportTrainingDoneRequest* request,
    v1::ReportTrainingDoneResponse* /*response*/) {
  std::string summary = absl::StrCat(request->steps(), " steps, final loss ", request->final_loss());
  if (!request->output_path().empty()) absl::StrAppend(&summary, ", parameters in ", request->output_path());
  const Pending pending = Later(context);
  core_->ReportTrainingDone(request->worker_id(), request->incarnation(), summary, clock_(),
                            [pending](absl::Status status) { pending.Finish(status); });
  return pending.reactor;
}

grpc::ServerUnaryReactor* RendezvousServiceImpl::Set(grpc::CallbackServerContext* context,
                                                     const v1::KvSetRequest* request,
                                                     v1::KvSetResponse* /*response*/) {
  return Reply(context, core_->KvSet(KvScope{request->scope().job(), request->scope().generation()},
                                     request->key(), request->value()));
}

grpc::ServerUnaryReactor* RendezvousServiceImpl::Get(grpc::CallbackServerContext* context,
                                                     const v1::KvGetRequest* request,
                                                     v1::KvGetResponse* response) {
  absl::StatusOr<std::string> value =
      core_->KvGet(KvScope{request->scope().job(), request->scope().generation()}, request->key());
  if (value.ok()) response->set_value(std::move(*value));
  return Reply(context, value.status());
}

grpc::ServerUnaryReactor* RendezvousServiceImpl::Wait(grpc::CallbackServerContext* context,
                                                      const v1::KvWaitRequest* request,
                                                      v1::KvWaitResponse* /*response*/) {
  // The reply is sent when the keys arrive, the wait times out or the generation ends; the
  // manager calls back exactly once.
  const Pending pending = Later(context);
  std::vector<std::string> keys(request->keys().begin(), request->keys().end());
  core_->KvWait(KvScope{request->scope().job(), request->scope().generation()}, std::move(keys),
                absl::Milliseconds(request->timeout_ms()), clock_(),
                [pending](absl::Status status) { pending.Finish(status); });
  return pending.reactor;
}

grpc::ServerUnaryReactor* AdminServiceImpl::GetStatus(grpc::CallbackServerContext* context,
                                                      const v1::GetStatusRequest* /*request*/,
                                                      v1::GetStatusResponse* response) {
  const absl::Time now = clock_();
  const StatusSnapshot snapshot = core_->Status(now);
  response->set_job(snapshot.job);
  *response->mutable_world() = ToProto(snapshot.world, snapshot.job);
  response->set_lease_ms(absl::ToInt64Milliseconds(snapshot.lease));
  response->set_uptime_ms(absl::ToInt64Milliseconds(now - started_));
  for (const WorkerSnapshot& worker : snapshot.workers) *response->add_workers() = ToProto(worker);
  *response->mutable_progress() = ToProto(core_->Progress(now));
  return Reply(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* AdminServiceImpl::GetPlan(grpc::CallbackServerContext* context,
                                                    const v1::GetPlanRequest* /*request*/,
                                                    v1::PlanSummary* response) {
  std::optional<PlanView> view = core_->plan().Current();
  if (!view.has_value()) {
    return Reply(context, absl::NotFoundError("no plan yet: no worker has registered a manifest "
                                              "in the current generation"));
  }
  *response = ToPlanSummary(*view->plan, *view->manifest, view->version, view->generation);
  return Reply(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* AdminServiceImpl::GetStats(grpc::CallbackServerContext* context,
                                                     const v1::GetStatsRequest* /*request*/,
                                                     v1::GetStatsResponse* response) {
  const PlanStats stats = core_->plan().Stats();
  response->set_status(ToProto(stats.status));
  response->set_plan_version(stats.plan_version);
  response->set_plan_hash(stats.plan_hash);
  for (int rank : stats.pending_acks) response->add_pending_acks(rank);
  for (const OrderDisagreement& d : stats.disagreements) {
    v1::OrderDisagreement* out = response->add_disagreements();
    out->set_rank(d.rank);
    out->set_position(d.position);
    out->set_expected(d.expected);
    out->set_reported(d.reported);
  }
  response->set_steps_reported(stats.steps_reported);
  response->set_mean_step_ms(stats.mean_step_ms);
  response->set_mean_backward_ms(stats.mean_backward_ms);
  response->set_mean_communication_ms(stats.mean_communication_ms);
  response->set_mean_hidden_ms(stats.mean_hidden_ms);
  response->set_overlap_fraction(stats.overlap_fraction);
  for (int64_t bytes : stats.bucket_bytes) response->add_bucket_bytes(bytes);
  for (const PlanStats::Rank& rank : stats.ranks) {
    v1::RankStats* out = response->add_ranks();
    out->set_rank(rank.rank);
    out->set_worker_id(rank.worker_id);
    out->set_acked_plan_version(rank.acked_version);
    if (rank.last.has_value()) *out->mutable_last() = ToProto(*rank.last);
  }
  return Reply(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* AdminServiceImpl::SaveCheckpoint(
    grpc::CallbackServerContext* context, const v1::SaveCheckpointRequest* /*request*/,
    v1::SaveCheckpointResponse* response) {
  absl::StatusOr<int64_t> request = core_->SaveCheckpoint();
  if (request.ok()) response->set_request(*request);
  return Reply(context, request.status());
}

grpc::ServerUnaryReactor* AdminServiceImpl::GetSaveProgress(
    grpc::CallbackServerContext* context, const v1::GetSaveProgressRequest* request,
    v1::GetSaveProgressResponse* response) {
  absl::StatusOr<const CheckpointManager*> checkpoints = core_->Checkpoints();
  if (!checkpoints.ok()) return Reply(context, checkpoints.status());
  *response = ToProto((*checkpoints)->Progress(request->request()));
  return Reply(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* AdminServiceImpl::ListCheckpoints(
    grpc::CallbackServerContext* context, const v1::ListCheckpointsRequest* /*request*/,
    v1::ListCheckpointsResponse* response) {
  absl::StatusOr<const CheckpointManager*> checkpoints = core_->Checkpoints();
  if (!checkpoints.ok()) return Reply(context, checkpoints.status());
  for (const v1::CheckpointRecord& record : (*checkpoints)->List()) {
    *response->add_checkpoints() = ToCheckpointInfo(record);
  }
  response->set_root((*checkpoints)->root());
  return Reply(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* AdminServiceImpl::GetCheckpoint(grpc::CallbackServerContext* context,
                                                          const v1::GetCheckpointRequest* request,
                                                          v1::CheckpointInfo* response) {
  absl::StatusOr<const CheckpointManager*> checkpoints = core_->Checkpoints();
  if (!checkpoints.ok()) return Reply(context, checkpoints.status());
  absl::StatusOr<v1::CheckpointRecord> record = (*checkpoints)->Find(request->id());
  if (!record.ok()) return Reply(context, record.status());
  *response = ToCheckpointInfo(*record);
  absl::StatusOr<CheckpointManifest> manifest = (*checkpoints)->ReadManifest(*record);
  if (!manifest.ok()) return Reply(context, manifest.status());
  response->set_tensors(static_cast<int32_t>(manifest->tensors.size()));
  response->set_zero_stage(manifest->zero_stage);
  // A script's own optimizer by its class ("torch.optim.adamw.AdamW").
  response->set_optimizer(manifest->optimizer.kind == OptimizerKind::kTorch
                              ? manifest->optimizer.torch_class
                              : std::string(OptimizerKindName(manifest->optimizer.kind)));
  for (const ShardRecord& shard : manifest->shards) *response->add_shards() = ToProto(shard);
  return Reply(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* AdminServiceImpl::DeleteCheckpoint(
    grpc::CallbackServerContext* context, const v1::DeleteCheckpointRequest* request,
    v1::DeleteCheckpointResponse* /*response*/) {
  return Reply(context, core_->DeleteCheckpoint(request->id()));
}

grpc::ServerUnaryReactor* AdminServiceImpl::RestoreCheckpoint(
    grpc::CallbackServerContext* context, const v1::RestoreCheckpointRequest* request,
    v1::RestoreCheckpointResponse* response) {
  const Pending pending = Later(context);
  core_->RestoreCheckpoint(
      request->id(), clock_(),
      [pending, response](absl::StatusOr<std::pair<TrainingStartPoint, World>> restored) {
        if (restored.ok()) {
          *response->mutable_start() = ToProto(restored->first);
          response->set_generation(restored->second.generation);
        }
        pending.Finish(restored.status());
      });
  return pending.reactor;
}

grpc::ServerUnaryReactor* AdminServiceImpl::Stop(grpc::CallbackServerContext* context,
                                                 const v1::StopRequest* request,
                                                 v1::StopResponse* response) {
  const Pending pending = Later(context);
  const std::string job = core_->world().options().job;
  core_->Stop(request->reason().empty() ? "shardctl stop" : request->reason(), clock_(),
              [pending, response, job](World world) {
                *response->mutable_world() = ToProto(world, job);
                pending.Finish(absl::OkStatus());
              });
  on_change_();
  return pending.reactor;
}

grpc::ServerUnaryReactor* AdminServiceImpl::Resize(grpc::CallbackServerContext* context,
                                                   const v1::ResizeRequest* request,
                                                   v1::ResizeResponse* response) {
  const Pending pending = Later(context);
  const std::string job = core_->world().options().job;
  core_->Resize(request->world_size(), clock_(),
                [this, pending, response, job](absl::StatusOr<World> world) {
                  if (world.ok()) {
                    *response->mutable_world() = ToProto(*world, job);
                    on_change_();
                  }
                  pending.Finish(world.status());
                });
  return pending.reactor;
}

grpc::ServerUnaryReactor* AdminServiceImpl::Drain(grpc::CallbackServerContext* context,
                                                  const v1::DrainRequest* request,
                                                  v1::DrainResponse* response) {
  const Pending pending = Later(context);
  const std::string job = core_->world().options().job;
  core_->Drain(request->worker_id(), clock_(),
               [this, pending, response, job](absl::StatusOr<World> world) {
                 if (world.ok()) {
                   *response->mutable_world() = ToProto(*world, job);
                   on_change_();
                 }
                 pending.Finish(world.status());
               });
  return pending.reactor;
}

grpc::ServerUnaryReactor* AdminServiceImpl::ListEvents(grpc::CallbackServerContext* context,
                                                       const v1::ListEventsRequest* request,
                                                       v1::ListEventsResponse* response) {
  const Pending pending = Later(context);
  // Held until an event is recorded; capped so that a client learns of a dead coordinator.
  const absl::Duration wait =
      std::min(absl::Milliseconds(std::max<int64_t>(0, request->wait_ms())), absl::Minutes(1));
  core_->ListEvents(request->after_sequence(), wait, clock_(),
                    [pending, response](absl::StatusOr<std::vector<v1::MembershipEvent>> events) {
                      if (!events.ok()) return pending.Finish(events.status());
                      for (const v1::MembershipEvent& event : *events) {
                        *response->add_events() = ToApiEvent(event);
                      }
                      pending.Finish(absl::OkStatus());
                    });
  return pending.reactor;
}

}  // namespace shard
