#include "server/coordinator_service.h"

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "proto/grpc_status.h"
#include "proto/plan_convert.h"

namespace shard {
namespace {

grpc::ServerUnaryReactor* Reply(grpc::CallbackServerContext* context, const absl::Status& status) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

// The reply refusing a call `guard` does not let through, or nullptr.
grpc::ServerUnaryReactor* Refuse(const AccessGuard& guard, grpc::CallbackServerContext* context,
                                 Access access) {
  absl::Status allowed = guard.Check(*context, access);
  return allowed.ok() ? nullptr : Reply(context, allowed);
}

v1::JobState ToProto(JobState state) {
  switch (state) {
    case JobState::kForming: return v1::JOB_STATE_FORMING;
    case JobState::kRunning: return v1::JOB_STATE_RUNNING;
    case JobState::kStopping: return v1::JOB_STATE_STOPPING;
    case JobState::kStopped: return v1::JOB_STATE_STOPPED;
  }
  return v1::JOB_STATE_UNSPECIFIED;
}

v1::WorkerState ToProto(WorkerState state) {
  switch (state) {
    case WorkerState::kJoining: return v1::WORKER_STATE_JOINING;
    case WorkerState::kReady: return v1::WORKER_STATE_READY;
    case WorkerState::kFailed: return v1::WORKER_STATE_FAILED;
    case WorkerState::kLeft: return v1::WORKER_STATE_LEFT;
    case WorkerState::kDead: return v1::WORKER_STATE_DEAD;
    case WorkerState::kStandby: return v1::WORKER_STATE_STANDBY;
    case WorkerState::kLeaving: return v1::WORKER_STATE_LEAVING;
  }
  return v1::WORKER_STATE_UNSPECIFIED;
}

v1::SelfCheckState ToProto(SelfCheckState state) {
  switch (state) {
    case SelfCheckState::kPending: return v1::SELF_CHECK_STATE_PENDING;
    case SelfCheckState::kPassed: return v1::SELF_CHECK_STATE_PASSED;
    case SelfCheckState::kFailed: return v1::SELF_CHECK_STATE_FAILED;
  }
  return v1::SELF_CHECK_STATE_UNSPECIFIED;
}

void FillWorld(const std::string& job, const World& world, v1::WorldView* view) {
  view->set_state(ToProto(world.state));
  view->set_generation(world.generation);
  view->set_world_size(world.world_size);
  view->set_expected_world_size(world.expected_world_size);
  view->mutable_scope()->set_job(job);
  view->mutable_scope()->set_generation(world.generation);
  view->set_ranks(world.ranks);
  view->set_min_world_size(world.min_world_size);
  view->set_standby(world.standby);
  view->set_transition(world.transition);
}

std::string EventKind(v1::MembershipEventKind kind) {
  std::string name = v1::MembershipEventKind_Name(kind);
  constexpr absl::string_view kPrefix = "MEMBERSHIP_EVENT_KIND_";
  if (absl::StartsWith(name, kPrefix)) name = name.substr(kPrefix.size());
  return absl::AsciiStrToLower(name);
}

KvScope FromProto(const v1::RendezvousScope& scope) { return KvScope{scope.job(), scope.generation()}; }

JobState FromProto(v1::JobState state) {
  switch (state) {
    case v1::JOB_STATE_RUNNING: return JobState::kRunning;
    case v1::JOB_STATE_STOPPING: return JobState::kStopping;
    case v1::JOB_STATE_STOPPED: return JobState::kStopped;
    default: return JobState::kForming;
  }
}

v1::OverlapStatus ToProto(OverlapStatus status) {
  switch (status) {
    case OverlapStatus::kUninitialized: return v1::OVERLAP_STATUS_UNINITIALIZED;
    case OverlapStatus::kRebuilt: return v1::OVERLAP_STATUS_DDP_HAS_REBUILT_BUCKETS;
    case OverlapStatus::kInitialized: return v1::OVERLAP_STATUS_INITIALIZED;
  }
  return v1::OVERLAP_STATUS_UNSPECIFIED;
}

void FillPlan(const PlanView& view, v1::PlanResponse* response) {
  *response->mutable_plan() = ToPlanSpec(*view.plan, view.version, view.generation);
  response->set_status(ToProto(view.status));
}

v1::StepStats ToProto(const StepReport& report) {
  v1::StepStats out;
  out.set_step(report.step);
  out.set_step_ms(report.step_ms);
  out.set_backward_ms(report.backward_ms);
  out.set_communication_ms(report.communication_ms);
  out.set_hidden_ms(report.hidden_ms);
  for (int64_t bytes : report.bucket_bytes) out.add_bucket_bytes(bytes);
  out.set_loss(report.loss);
  return out;
}

void FillStart(const TrainingStartPoint& start, v1::TrainingStart* out) {
  out->set_checkpoint_id(start.checkpoint_id);
  out->set_checkpoint_dir(start.dir);
  out->set_step(start.step);
}

void FillCheckpoint(const v1::CheckpointRecord& record, v1::CheckpointInfo* out) {
  out->set_id(record.id());
  out->set_step(record.step());
  out->set_world_size(record.world_size());
  out->set_dir(record.dir());
  out->set_bytes(record.bytes());
  out->set_committed_unix_ms(record.committed_unix_ms());
  out->set_max_pause_ms(record.max_pause_ms());
  out->set_max_write_ms(record.max_write_ms());
}

}  // namespace

grpc::ServerUnaryReactor* CoordinatorServiceImpl::Join(grpc::CallbackServerContext* context,
                                                       const v1::JoinRequest* request,
                                                       v1::JoinResponse* response) {
  if (auto* refused = Refuse(*guard_, context, Access::kWorker)) return refused;
  if (!join_limiter_->Allow(clock_())) {
    return Reply(context, absl::UnavailableError(
                              "too many joins at once; the coordinator bounds their rate "
                              "(--max-joins-per-second): retry shortly"));
  }
  JoinParams params;
  params.worker_id = request->worker_id();
  params.host = request->host();
  params.device = request->device();
  params.capabilities.assign(request->capabilities().begin(), request->capabilities().end());
  params.incarnation = request->incarnation();
  if (request->has_requested_rank()) params.requested_rank = request->requested_rank();
  absl::StatusOr<JoinOutcome> outcome = world_->Join(params, clock_());
  if (outcome.ok()) {
    const WorldOptions& options = world_->options();
    response->set_rank(outcome->rank);
    response->set_job(options.job);
    response->set_generation(outcome->world.generation);
    response->set_lease_ms(absl::ToInt64Milliseconds(options.lease));
    response->set_heartbeat_interval_ms(
        std::max<int64_t>(1, absl::ToInt64Milliseconds(options.lease / 4)));
    FillWorld(options.job, outcome->world, response->mutable_world());
    if (job_.has_value()) *response->mutable_job_spec() = *job_;
    if (checkpoints_ != nullptr) FillStart(checkpoints_->start(), response->mutable_start());
  }
  return Reply(context, outcome.status());
}

grpc::ServerUnaryReactor* CoordinatorServiceImpl::Heartbeat(grpc::CallbackServerContext* context,
                                                            const v1::HeartbeatRequest* request,
                                                            v1::HeartbeatResponse* response) {
  if (auto* refused = Refuse(*guard_, context, Access::kWorker)) return refused;
  // Answered when the world changes or the wait runs out; the manager calls back once.
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  HeartbeatParams params;
  params.worker_id = request->worker_id();
  params.incarnation = request->incarnation();
  params.known_generation = request->known_generation();
  params.known_state = FromProto(request->known_state());
  params.wait = absl::Milliseconds(std::max<int64_t>(0, request->wait_ms()));
  const std::string job = world_->options().job;
  CheckpointManager* checkpoints = checkpoints_;
  world_->WatchHeartbeat(
      params, clock_(),
      [reactor, response, job, checkpoints](absl::StatusOr<HeartbeatOutcome> outcome) {
        if (outcome.ok()) {
          FillWorld(job, outcome->world, response->mutable_world());
          response->set_rank(outcome->rank);
          response->mutable_order()->set_kind(outcome->stop ? v1::ORDER_KIND_STOP
                                                            : v1::ORDER_KIND_CONTINUE);
          response->mutable_order()->set_reason(outcome->stop_reason);
          if (checkpoints != nullptr) {
            response->set_checkpoint_request(checkpoints->pending_request());
            response->set_pause_request(checkpoints->pause_request());
            FillStart(checkpoints->start(), response->mutable_start());
          }
        }
        reactor->Finish(ToGrpcStatus(outcome.status()));
      });
  return reactor;
}

grpc::ServerUnaryReactor* CoordinatorServiceImpl::ReportSelfCheck(
    grpc::CallbackServerContext* context, const v1::ReportSelfCheckRequest* request,
    v1::ReportSelfCheckResponse* /*response*/) {
  if (auto* refused = Refuse(*guard_, context, Access::kWorker)) return refused;
  return Reply(context, world_->ReportSelfCheck(request->worker_id(), request->incarnation(),
                                                request->generation(), request->passed(),
                                                request->detail(), clock_()));
}

grpc::ServerUnaryReactor* CoordinatorServiceImpl::Leave(grpc::CallbackServerContext* context,
                                                        const v1::LeaveRequest* request,
                                                        v1::LeaveResponse* /*response*/) {
  if (auto* refused = Refuse(*guard_, context, Access::kWorker)) return refused;
  return Reply(context, world_->Leave(request->worker_id(), request->incarnation(),
                                      request->reason(), clock_()));
}

grpc::ServerUnaryReactor* CoordinatorServiceImpl::RegisterManifest(
    grpc::CallbackServerContext* context, const v1::RegisterManifestRequest* request,
    v1::PlanResponse* response) {
  if (auto* refused = Refuse(*guard_, context, Access::kWorker)) return refused;
  absl::StatusOr<MemberRef> member = world_->Member(request->worker_id(), request->incarnation());
  if (!member.ok()) return Reply(context, member.status());
  absl::StatusOr<Manifest> manifest = FromProto(request->manifest());
  if (!manifest.ok()) return Reply(context, manifest.status());
  absl::StatusOr<PlanView> view = plan_->RegisterManifest(*member, *manifest);
  if (view.ok()) FillPlan(*view, response);
  return Reply(context, view.status());
}

grpc::ServerUnaryReactor* CoordinatorServiceImpl::AckPlan(grpc::CallbackServerContext* context,
                                                          const v1::AckPlanRequest* request,
                                                          v1::PlanResponse* response) {
  if (auto* refused = Refuse(*guard_, context, Access::kWorker)) return refused;
  absl::StatusOr<MemberRef> member = world_->Member(request->worker_id(), request->incarnation());
  if (!member.ok()) return Reply(context, member.status());
  absl::StatusOr<PlanView> view = plan_->AckPlan(*member, request->version(), request->hash());
  if (view.ok()) FillPlan(*view, response);
  return Reply(context, view.status());
}

grpc::ServerUnaryReactor* CoordinatorServiceImpl::ReportGradientOrder(
    grpc::CallbackServerContext* context, const v1::ReportGradientOrderRequest* request,
    v1::PlanResponse* response) {
  if (auto* refused = Refuse(*guard_, context, Access::kWorker)) return refused;
  absl::StatusOr<MemberRef> member = world_->Member(request->worker_id(), request->incarnation());
  if (!member.ok()) return Reply(context, member.status());
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  plan_->ReportGradientOrder(
      *member, request->plan_version(), {request->order().begin(), request->order().end()},
      absl::Milliseconds(std::max<int64_t>(0, request->wait_ms())), clock_(),
      [reactor, response](absl::StatusOr<PlanView> view) {
        if (view.ok()) FillPlan(*view, response);
        reactor->Finish(ToGrpcStatus(view.status()));
      });
  return reactor;
}

grpc::ServerUnaryReactor* CoordinatorServiceImpl::ReportStepStats(
    grpc::CallbackServerContext* context, const v1::ReportStepStatsRequest* request,
    v1::ReportStepStatsResponse* /*response*/) {
  if (auto* refused = Refuse(*guard_, context, Access::kWorker)) return refused;
  absl::StatusOr<MemberRef> member = world_->Member(request->worker_id(), request->incarnation());
  if (!member.ok()) return Reply(context, member.status());
  const v1::StepStats& stats = request->stats();
  StepReport report;
  report.step = stats.step();
  report.step_ms = stats.step_ms();
  report.backward_ms = stats.backward_ms();
  report.communication_ms = stats.communication_ms();
  report.hidden_ms = stats.hidden_ms();
  report.bucket_bytes.assign(stats.bucket_bytes().begin(), stats.bucket_bytes().end());
  report.loss = stats.loss();
  if (checkpoints_ != nullptr) checkpoints_->NoteTrainingStarted();
  return Reply(context, plan_->ReportStepStats(*member, std::move(report)));
}

grpc::ServerUnaryReactor* CoordinatorServiceImpl::ReportCheckpointShard(
    grpc::CallbackServerContext* context, const v1::ReportCheckpointShardRequest* request,
    v1::ReportCheckpointShardResponse* response) {
  if (auto* refused = Refuse(*guard_, context, Access::kWorker)) return refused;
  if (checkpoints_ == nullptr) {
    return Reply(context, absl::FailedPreconditionError("this coordinator runs no job"));
  }
  absl::StatusOr<MemberRef> member = world_->Member(request->worker_id(), request->incarnation());
  if (!member.ok()) return Reply(context, member.status());
  std::optional<PlanView> plan = plan_->Current();
  if (!plan.has_value()) {
    return Reply(context, absl::FailedPreconditionError("no plan in this generation"));
  }
  ShardReport report;
  report.worker_id = request->worker_id();
  report.rank = member->rank;
  report.id = request->checkpoint_id();
  report.step = request->step();
  report.request = request->request();
  report.plan_version = request->plan_version();
  report.plan_hash = request->plan_hash();
  report.record = ShardRecord{request->shard().file(), member->rank, request->shard().bytes(),
                              request->shard().xxh3(),
                              {request->shard().block_xxh3().begin(),
                               request->shard().block_xxh3().end()}};
  report.pause_ms = request->pause_ms();
  report.write_ms = request->write_ms();
  report.error = request->error();
  report.counters = TrainingCounters{request->optimizer_step(), request->loss_scale(),
                                     request->loss_scale_growth_tracker()};
  absl::StatusOr<bool> committed = checkpoints_->ReportShard(report, *plan);
  if (committed.ok()) response->set_committed(*committed);
  return Reply(context, committed.status());
}

grpc::ServerUnaryReactor* CoordinatorServiceImpl::ReportTrainingDone(
    grpc::CallbackServerContext* context, const v1::ReportTrainingDoneRequest* request,
    v1::ReportTrainingDoneResponse* /*response*/) {
  if (auto* refused = Refuse(*guard_, context, Access::kWorker)) return refused;
  std::string summary = absl::StrCat(request->steps(), " steps, final loss ", request->final_loss());
  if (!request->output_path().empty()) absl::StrAppend(&summary, ", parameters in ", request->output_path());
  return Reply(context, world_->ReportTrainingDone(request->worker_id(), request->incarnation(),
                                                   summary, clock_()));
}

grpc::ServerUnaryReactor* RendezvousServiceImpl::Set(grpc::CallbackServerContext* context,
                                                     const v1::KvSetRequest* request,
                                                     v1::KvSetResponse* /*response*/) {
  if (auto* refused = Refuse(*guard_, context, Access::kWorker)) return refused;
  return Reply(context, kv_->Set(FromProto(request->scope()), request->key(), request->value()));
}

grpc::ServerUnaryReactor* RendezvousServiceImpl::Get(grpc::CallbackServerContext* context,
                                                     const v1::KvGetRequest* request,
                                                     v1::KvGetResponse* response) {
  if (auto* refused = Refuse(*guard_, context, Access::kWorker)) return refused;
  absl::StatusOr<std::string> value = kv_->Get(FromProto(request->scope()), request->key());
  if (value.ok()) response->set_value(std::move(*value));
  return Reply(context, value.status());
}

grpc::ServerUnaryReactor* RendezvousServiceImpl::Wait(grpc::CallbackServerContext* context,
                                                      const v1::KvWaitRequest* request,
                                                      v1::KvWaitResponse* /*response*/) {
  if (auto* refused = Refuse(*guard_, context, Access::kWorker)) return refused;
  // The reply is sent when the keys arrive, the wait times out or the generation ends; the
  // manager calls back exactly once.
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  std::vector<std::string> keys(request->keys().begin(), request->keys().end());
  kv_->Wait(FromProto(request->scope()), std::move(keys),
            absl::Milliseconds(request->timeout_ms()), clock_(),
            [reactor](absl::Status status) { reactor->Finish(ToGrpcStatus(status)); });
  return reactor;
}

grpc::ServerUnaryReactor* AdminServiceImpl::GetStatus(grpc::CallbackServerContext* context,
                                                      const v1::GetStatusRequest* /*request*/,
                                                      v1::GetStatusResponse* response) {
  if (auto* refused = Refuse(*guard_, context, Access::kRead)) return refused;
  const absl::Time now = clock_();
  StatusSnapshot snapshot = world_->Status(now);
  if (std::string transition = elastic_->transition(); !transition.empty()) {
    snapshot.world.transition = std::move(transition);
  }
  response->set_job(snapshot.job);
  FillWorld(snapshot.job, snapshot.world, response->mutable_world());
  response->set_lease_ms(absl::ToInt64Milliseconds(snapshot.lease));
  response->set_uptime_ms(absl::ToInt64Milliseconds(now - started_));
  for (const WorkerSnapshot& worker : snapshot.workers) {
    v1::WorkerStatus* out = response->add_workers();
    out->set_id(worker.id);
    out->set_rank(worker.rank);
    out->set_host(worker.host);
    out->set_device(worker.device);
    for (const std::string& capability : worker.capabilities) out->add_capabilities(capability);
    out->set_state(ToProto(worker.state));
    out->set_last_heartbeat_ms_ago(absl::ToInt64Milliseconds(worker.since_heartbeat));
    out->mutable_self_check()->set_state(ToProto(worker.self_check.state));
    out->mutable_self_check()->set_generation(worker.self_check.generation);
    out->mutable_self_check()->set_detail(worker.self_check.detail);
    out->set_joined_generation(worker.joined_generation);
  }
  return Reply(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* AdminServiceImpl::GetPlan(grpc::CallbackServerContext* context,
                                                    const v1::GetPlanRequest* /*request*/,
                                                    v1::PlanSummary* response) {
  if (auto* refused = Refuse(*guard_, context, Access::kRead)) return refused;
  std::optional<PlanView> view = plan_->Current();
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
  if (auto* refused = Refuse(*guard_, context, Access::kRead)) return refused;
  const PlanStats stats = plan_->Stats();
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

absl::Status AdminServiceImpl::NeedCheckpoints() const {
  if (checkpoints_ != nullptr) return absl::OkStatus();
  return absl::FailedPreconditionError(
      "this coordinator runs no training job (started without --job), so it has no checkpoints");
}

grpc::ServerUnaryReactor* AdminServiceImpl::SaveCheckpoint(
    grpc::CallbackServerContext* context, const v1::SaveCheckpointRequest* /*request*/,
    v1::SaveCheckpointResponse* response) {
  if (auto* refused = Refuse(*guard_, context, Access::kAdmin)) return refused;
  if (absl::Status need = NeedCheckpoints(); !need.ok()) return Reply(context, need);
  if (world_->world().state != JobState::kRunning) {
    return Reply(context, absl::FailedPreconditionError(
                              "the world is not running; a checkpoint is saved by its workers"));
  }
  absl::StatusOr<int64_t> request = checkpoints_->RequestSave();
  if (request.ok()) {
    response->set_request(*request);
    world_->WakeWatches();  // workers learn of the request at once
  }
  return Reply(context, request.status());
}

grpc::ServerUnaryReactor* AdminServiceImpl::GetSaveProgress(
    grpc::CallbackServerContext* context, const v1::GetSaveProgressRequest* request,
    v1::GetSaveProgressResponse* response) {
  if (auto* refused = Refuse(*guard_, context, Access::kRead)) return refused;
  if (absl::Status need = NeedCheckpoints(); !need.ok()) return Reply(context, need);
  const SaveProgress progress = checkpoints_->Progress(request->request());
  response->set_shards_done(progress.shards_done);
  response->set_world_size(progress.world_size);
  response->set_bytes_done(progress.bytes_done);
  response->set_checkpoint_id(progress.committed_id);
  response->set_error(progress.error);
  return Reply(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* AdminServiceImpl::ListCheckpoints(
    grpc::CallbackServerContext* context, const v1::ListCheckpointsRequest* /*request*/,
    v1::ListCheckpointsResponse* response) {
  if (auto* refused = Refuse(*guard_, context, Access::kRead)) return refused;
  if (absl::Status need = NeedCheckpoints(); !need.ok()) return Reply(context, need);
  for (const v1::CheckpointRecord& record : checkpoints_->List()) {
    FillCheckpoint(record, response->add_checkpoints());
  }
  response->set_root(checkpoints_->root());
  return Reply(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* AdminServiceImpl::GetCheckpoint(grpc::CallbackServerContext* context,
                                                          const v1::GetCheckpointRequest* request,
                                                          v1::CheckpointInfo* response) {
  if (auto* refused = Refuse(*guard_, context, Access::kRead)) return refused;
  if (absl::Status need = NeedCheckpoints(); !need.ok()) return Reply(context, need);
  absl::StatusOr<v1::CheckpointRecord> record = checkpoints_->Find(request->id());
  if (!record.ok()) return Reply(context, record.status());
  FillCheckpoint(*record, response);
  absl::StatusOr<CheckpointManifest> manifest = ReadCheckpointManifest(record->dir());
  if (!manifest.ok()) return Reply(context, manifest.status());
  response->set_tensors(static_cast<int32_t>(manifest->tensors.size()));
  response->set_zero_stage(manifest->zero_stage);
  response->set_optimizer(std::string(OptimizerKindName(manifest->optimizer.kind)));
  for (const ShardRecord& shard : manifest->shards) {
    v1::ShardRecord* out = response->add_shards();
    out->set_file(shard.file);
    out->set_rank(shard.rank);
    out->set_bytes(shard.bytes);
    out->set_xxh3(shard.xxh3);
  }
  return Reply(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* AdminServiceImpl::DeleteCheckpoint(
    grpc::CallbackServerContext* context, const v1::DeleteCheckpointRequest* request,
    v1::DeleteCheckpointResponse* /*response*/) {
  if (auto* refused = Refuse(*guard_, context, Access::kAdmin)) return refused;
  if (absl::Status need = NeedCheckpoints(); !need.ok()) return Reply(context, need);
  return Reply(context, checkpoints_->Delete(request->id()));
}

grpc::ServerUnaryReactor* AdminServiceImpl::RestoreCheckpoint(
    grpc::CallbackServerContext* context, const v1::RestoreCheckpointRequest* request,
    v1::RestoreCheckpointResponse* response) {
  if (auto* refused = Refuse(*guard_, context, Access::kAdmin)) return refused;
  if (absl::Status need = NeedCheckpoints(); !need.ok()) return Reply(context, need);
  absl::StatusOr<v1::CheckpointRecord> record = checkpoints_->Find(request->id());
  if (!record.ok()) return Reply(context, record.status());
  absl::StatusOr<CheckpointManifest> manifest = ReadCheckpointManifest(record->dir());
  if (!manifest.ok()) return Reply(context, manifest.status());
  absl::StatusOr<TrainingStartPoint> start = checkpoints_->SetRestorePoint(record->id());
  if (!start.ok()) return Reply(context, start.status());
  plan_->SeedRebuiltOrder(manifest->plan.gradient_order);
  const World world = world_->Reform(absl::StrCat("restore from checkpoint ", record->id()),
                                     clock_());
  FillStart(*start, response->mutable_start());
  response->set_generation(world.generation);
  return Reply(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* AdminServiceImpl::Stop(grpc::CallbackServerContext* context,
                                                 const v1::StopRequest* request,
                                                 v1::StopResponse* response) {
  if (auto* refused = Refuse(*guard_, context, Access::kAdmin)) return refused;
  const World world = world_->RequestStop(
      request->reason().empty() ? "shardctl stop" : request->reason(), clock_());
  FillWorld(world_->options().job, world, response->mutable_world());
  on_change_();
  return Reply(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* AdminServiceImpl::Resize(grpc::CallbackServerContext* context,
                                                   const v1::ResizeRequest* request,
                                                   v1::ResizeResponse* response) {
  if (auto* refused = Refuse(*guard_, context, Access::kAdmin)) return refused;
  const absl::Status set = world_->SetTarget(request->world_size(), clock_());
  if (set.ok()) {
    on_change_();
    FillWorld(world_->options().job, world_->Status(clock_()).world, response->mutable_world());
  }
  return Reply(context, set);
}

grpc::ServerUnaryReactor* AdminServiceImpl::Drain(grpc::CallbackServerContext* context,
                                                  const v1::DrainRequest* request,
                                                  v1::DrainResponse* response) {
  if (auto* refused = Refuse(*guard_, context, Access::kAdmin)) return refused;
  const absl::Status drained = world_->Drain(request->worker_id(), clock_());
  if (drained.ok()) {
    on_change_();
    FillWorld(world_->options().job, world_->Status(clock_()).world, response->mutable_world());
  }
  return Reply(context, drained);
}

grpc::ServerUnaryReactor* AdminServiceImpl::ListEvents(grpc::CallbackServerContext* context,
                                                       const v1::ListEventsRequest* request,
                                                       v1::ListEventsResponse* response) {
  if (auto* refused = Refuse(*guard_, context, Access::kRead)) return refused;
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  auto answer = [reactor, response](std::vector<v1::MembershipEvent> events) {
    for (const v1::MembershipEvent& event : events) {
      v1::Event* out = response->add_events();
      out->set_sequence(event.sequence());
      out->set_unix_ms(event.unix_ms());
      out->set_generation(event.generation());
      out->set_kind(EventKind(event.kind()));
      out->set_worker_id(event.worker_id());
      out->set_rank(event.rank());
      out->set_detail(event.detail());
    }
    reactor->Finish(grpc::Status::OK);
  };
  if (request->wait_ms() <= 0) {
    answer(world_->Events(request->after_sequence()));
  } else {
    // Held until an event is recorded; capped so that a client learns of a dead coordinator.
    const absl::Duration wait = std::min(absl::Milliseconds(request->wait_ms()), absl::Minutes(1));
    world_->WatchEvents(request->after_sequence(), clock_() + wait, std::move(answer));
  }
  return reactor;
}

}  // namespace shard
