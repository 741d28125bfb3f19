#include "proto/control_convert.h"

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "common/status_macros.h"
#include "proto/plan_convert.h"

namespace shard {

v1::JobState ToProto(JobState state) {
  switch (state) {
    case JobState::kForming: return v1::JOB_STATE_FORMING;
    case JobState::kRunning: return v1::JOB_STATE_RUNNING;
    case JobState::kReshaping: return v1::JOB_STATE_RESHAPING;
    case JobState::kStopping: return v1::JOB_STATE_STOPPING;
    case JobState::kFinished: return v1::JOB_STATE_FINISHED;
    case JobState::kFailed: return v1::JOB_STATE_FAILED;
  }
  return v1::JOB_STATE_UNSPECIFIED;
}

JobState FromProto(v1::JobState state) {
  switch (state) {
    case v1::JOB_STATE_RUNNING: return JobState::kRunning;
    case v1::JOB_STATE_RESHAPING: return JobState::kReshaping;
    case v1::JOB_STATE_STOPPING: return JobState::kStopping;
    case v1::JOB_STATE_FINISHED: return JobState::kFinished;
    case v1::JOB_STATE_FAILED: return JobState::kFailed;
    default: return JobState::kForming;
  }
}

v1::StopKind ToProto(StopKind kind) {
  switch (kind) {
    case StopKind::kNone: return v1::STOP_KIND_UNSPECIFIED;
    case StopKind::kOperator: return v1::STOP_KIND_OPERATOR;
    case StopKind::kTrained: return v1::STOP_KIND_TRAINED;
    case StopKind::kFailed: return v1::STOP_KIND_FAILED;
  }
  return v1::STOP_KIND_UNSPECIFIED;
}

StopKind FromProto(v1::StopKind kind) {
  switch (kind) {
    case v1::STOP_KIND_OPERATOR: return StopKind::kOperator;
    case v1::STOP_KIND_TRAINED: return StopKind::kTrained;
    case v1::STOP_KIND_FAILED: return StopKind::kFailed;
    default: return StopKind::kNone;
  }
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

WorkerState FromProto(v1::WorkerState state) {
  switch (state) {
    case v1::WORKER_STATE_READY: return WorkerState::kReady;
    case v1::WORKER_STATE_FAILED: return WorkerState::kFailed;
    case v1::WORKER_STATE_LEFT: return WorkerState::kLeft;
    case v1::WORKER_STATE_DEAD: return WorkerState::kDead;
    case v1::WORKER_STATE_STANDBY: return WorkerState::kStandby;
    case v1::WORKER_STATE_LEAVING: return WorkerState::kLeaving;
    default: return WorkerState::kJoining;
  }
}

v1::SelfCheckState ToProto(SelfCheckState state) {
  switch (state) {
    case SelfCheckState::kPending: return v1::SELF_CHECK_STATE_PENDING;
    case SelfCheckState::kPassed: return v1::SELF_CHECK_STATE_PASSED;
    case SelfCheckState::kFailed: return v1::SELF_CHECK_STATE_FAILED;
  }
  return v1::SELF_CHECK_STATE_UNSPECIFIED;
}

SelfCheckState FromProto(v1::SelfCheckState state) {
  switch (state) {
    case v1::SELF_CHECK_STATE_PASSED: return SelfCheckState::kPassed;
    case v1::SELF_CHECK_STATE_FAILED: return SelfCheckState::kFailed;
    default: return SelfCheckState::kPending;
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

OverlapStatus FromProto(v1::OverlapStatus status) {
  switch (status) {
    case v1::OVERLAP_STATUS_DDP_HAS_REBUILT_BUCKETS: return OverlapStatus::kRebuilt;
    case v1::OVERLAP_STATUS_INITIALIZED: return OverlapStatus::kInitialized;
    default: return OverlapStatus::kUninitialized;
  }
}

v1::WorldView ToProto(const World& world, const std::string& job) {
  v1::WorldView view;
  view.set_state(ToProto(world.state));
  view.set_generation(world.generation);
  view.set_world_size(world.world_size);
  view.set_expected_world_size(world.expected_world_size);
  view.mutable_scope()->set_job(job);
  view.mutable_scope()->set_generation(world.generation);
  view.set_ranks(world.ranks);
  view.set_min_world_size(world.min_world_size);
  view.set_standby(world.standby);
  view.set_transition(world.transition);
  return view;
}

World FromProto(const v1::WorldView& view) {
  World world;
  world.state = FromProto(view.state());
  world.generation = view.generation();
  world.world_size = view.world_size();
  world.expected_world_size = view.expected_world_size();
  world.ranks = view.ranks();
  world.min_world_size = view.min_world_size();
  world.standby = view.standby();
  world.transition = view.transition();
  return world;
}

v1::TrainingStart ToProto(const TrainingStartPoint& start) {
  v1::TrainingStart out;
  out.set_checkpoint_id(start.checkpoint_id);
  out.set_checkpoint_dir(start.dir);
  out.set_step(start.step);
  out.set_in_memory(start.in_memory);
  return out;
}

TrainingStartPoint FromProto(const v1::TrainingStart& start) {
  return TrainingStartPoint{start.checkpoint_id(), start.checkpoint_dir(), start.step(),
                            start.in_memory()};
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
  out.set_held_bytes(report.held_bytes);
  out.set_gathered_units(report.gathered_units);
  out.set_gather_wait_ms(report.gather_wait_ms);
  return out;
}

StepReport FromProto(const v1::StepStats& stats) {
  StepReport report;
  report.step = stats.step();
  report.step_ms = stats.step_ms();
  report.backward_ms = stats.backward_ms();
  report.communication_ms = stats.communication_ms();
  report.hidden_ms = stats.hidden_ms();
  report.bucket_bytes.assign(stats.bucket_bytes().begin(), stats.bucket_bytes().end());
  report.loss = stats.loss();
  report.held_bytes = stats.held_bytes();
  report.gathered_units = stats.gathered_units();
  report.gather_wait_ms = stats.gather_wait_ms();
  return report;
}

v1::ShardRecord ToProto(const ShardRecord& record) {
  v1::ShardRecord out;
  out.set_file(record.file);
  out.set_rank(record.rank);
  out.set_bytes(record.bytes);
  out.set_xxh3(record.xxh3);
  for (const std::string& block : record.block_xxh3) out.add_block_xxh3(block);
  for (const ShardExtra& extra : record.extras) {
    v1::ShardExtra* e = out.add_extras();
    e->set_param(extra.param);
    e->set_offset(extra.offset);
    e->set_bytes(extra.bytes);
  }
  return out;
}

ShardRecord FromProto(const v1::ShardRecord& record) {
  ShardRecord out{record.file(), record.rank(), record.bytes(), record.xxh3(),
                  {record.block_xxh3().begin(), record.block_xxh3().end()}, {}};
  for (const v1::ShardExtra& e : record.extras()) {
    out.extras.push_back(ShardExtra{e.param(), e.offset(), e.bytes()});
  }
  return out;
}

v1::OptimizerStateKind ToProto(const OptimizerStateKind& state) {
  v1::OptimizerStateKind out;
  out.set_torch_class(state.torch_class);
  for (const std::string& name : state.names) out.add_names(name);
  return out;
}

OptimizerStateKind FromProto(const v1::OptimizerStateKind& state) {
  return OptimizerStateKind{state.torch_class(), {state.names().begin(), state.names().end()}};
}

v1::SnapshotShard ToProto(const SnapshotShard& shard) {
  v1::SnapshotShard out;
  out.set_id(shard.id);
  out.set_generation(shard.generation);
  out.set_step(shard.step);
  out.set_rank(shard.rank);
  v1::PlanSpec* plan = out.mutable_plan();
  plan->set_world_size(shard.plan.world_size);
  plan->set_mode(ToProto(shard.plan.mode));
  plan->set_bucket_cap_bytes(shard.plan.bucket_cap_bytes);
  plan->set_first_bucket_cap_bytes(shard.plan.first_bucket_cap_bytes);
  plan->set_min_buckets(shard.plan.min_buckets);
  plan->set_alignment_bytes(shard.plan.alignment_bytes);
  for (int param : shard.plan.gradient_order) plan->add_gradient_order(param);
  plan->set_hash(shard.plan_hash);
  out.set_optimizer_step(shard.counters.optimizer_step);
  out.set_loss_scale(shard.counters.loss_scale);
  out.set_loss_scale_growth_tracker(shard.counters.loss_scale_growth_tracker);
  *out.mutable_record() = ToProto(shard.record);
  out.set_request(shard.request);
  *out.mutable_state() = ToProto(shard.state);
  return out;
}

absl::StatusOr<SnapshotShard> FromProto(const v1::SnapshotShard& shard) {
  SnapshotShard out;
  out.id = shard.id();
  out.generation = shard.generation();
  out.step = shard.step();
  out.rank = shard.rank();
  SHARD_ASSIGN_OR_RETURN(out.plan, PlanOptionsFromSpec(shard.plan()));
  out.plan_hash = shard.plan().hash();
  out.counters = TrainingCounters{shard.optimizer_step(), shard.loss_scale(),
                                  shard.loss_scale_growth_tracker()};
  out.record = FromProto(shard.record());
  out.record.rank = out.rank;
  out.request = shard.request();
  out.state = FromProto(shard.state());
  SHARD_RETURN_IF_ERROR(ValidateSnapshotShard(out));
  return out;
}

v1::SnapshotHolder ToProto(const SnapshotHolder& holder) {
  v1::SnapshotHolder out;
  out.set_worker_id(holder.worker_id);
  out.set_incarnation(holder.incarnation);
  out.set_address(holder.address);
  return out;
}

SnapshotHolder FromProto(const v1::SnapshotHolder& holder) {
  return SnapshotHolder{holder.worker_id(), holder.incarnation(), holder.address()};
}

v1::ReportSnapshotRequest ToProto(const SnapshotReport& report) {
  v1::ReportSnapshotRequest out;
  out.set_worker_id(report.worker_id);
  out.set_incarnation(report.incarnation);
  for (const SnapshotShard& shard : report.held) *out.add_held() = ToProto(shard);
  for (const std::string& id : report.dropped) out.add_dropped(id);
  out.set_failed_id(report.failed_id);
  out.set_error(report.error);
  out.set_snapshot_address(report.snapshot_address);
  return out;
}

absl::StatusOr<SnapshotReport> FromProto(const v1::ReportSnapshotRequest& request) {
  SnapshotReport report;
  report.worker_id = request.worker_id();
  report.incarnation = request.incarnation();
  for (const v1::SnapshotShard& shard : request.held()) {
    SHARD_ASSIGN_OR_RETURN(SnapshotShard held, FromProto(shard));
    report.held.push_back(std::move(held));
  }
  report.dropped.assign(request.dropped().begin(), request.dropped().end());
  report.failed_id = request.failed_id();
  report.error = request.error();
  report.snapshot_address = request.snapshot_address();
  return report;
}

v1::ReportRestoreRequest ToProto(const RestoreReport& report) {
  v1::ReportRestoreRequest out;
  out.set_worker_id(report.worker_id);
  out.set_incarnation(report.incarnation);
  out.set_generation(report.generation);
  out.set_checkpoint_id(report.checkpoint_id);
  out.set_in_memory(report.in_memory);
  out.set_duration_ms(absl::ToDoubleMilliseconds(report.duration));
  out.set_bytes_from_peers(report.bytes_from_peers);
  out.set_bytes(report.bytes);
  out.set_error(report.error);
  for (const std::string& refused : report.refused) out.add_refused(refused);
  return out;
}

RestoreReport FromProto(const v1::ReportRestoreRequest& request) {
  RestoreReport report;
  report.worker_id = request.worker_id();
  report.incarnation = request.incarnation();
  report.generation = request.generation();
  report.checkpoint_id = request.checkpoint_id();
  report.in_memory = request.in_memory();
  report.duration = absl::Milliseconds(request.duration_ms());
  report.bytes_from_peers = request.bytes_from_peers();
  report.bytes = request.bytes();
  report.error = request.error();
  report.refused.assign(request.refused().begin(), request.refused().end());
  return report;
}

v1::ReportCheckpointShardRequest ToProto(const ShardReport& report) {
  v1::ReportCheckpointShardRequest out;
  out.set_worker_id(report.worker_id);
  out.set_incarnation(report.incarnation);
  out.set_generation(report.generation);
  out.set_checkpoint_id(report.id);
  out.set_step(report.step);
  out.set_request(report.request);
  out.set_plan_version(report.plan_version);
  out.set_plan_hash(report.plan_hash);
  if (report.error.empty()) *out.mutable_shard() = ToProto(report.record);
  out.set_pause_ms(report.pause_ms);
  out.set_write_ms(report.write_ms);
  out.set_error(report.error);
  out.set_skipped(report.skipped);
  out.set_optimizer_step(report.counters.optimizer_step);
  out.set_loss_scale(report.counters.loss_scale);
  out.set_loss_scale_growth_tracker(report.counters.loss_scale_growth_tracker);
  *out.mutable_state() = ToProto(report.state);
  return out;
}

ShardReport FromProto(const v1::ReportCheckpointShardRequest& request) {
  ShardReport report;
  report.worker_id = request.worker_id();
  report.incarnation = request.incarnation();
  report.generation = request.generation();
  report.id = request.checkpoint_id();
  report.step = request.step();
  report.request = request.request();
  report.plan_version = request.plan_version();
  report.plan_hash = request.plan_hash();
  report.record = FromProto(request.shard());
  report.rank = report.record.rank;
  report.pause_ms = request.pause_ms();
  report.write_ms = request.write_ms();
  report.error = request.error();
  report.skipped = request.skipped();
  report.counters = TrainingCounters{request.optimizer_step(), request.loss_scale(),
                                     request.loss_scale_growth_tracker()};
  report.state = FromProto(request.state());
  return report;
}

v1::JoinRequest ToProto(const JoinParams& params) {
  v1::JoinRequest out;
  out.set_worker_id(params.worker_id);
  out.set_host(params.host);
  out.set_device(params.device);
  for (const std::string& capability : params.capabilities) out.add_capabilities(capability);
  out.set_incarnation(params.incarnation);
  if (params.requested_rank.has_value()) out.set_requested_rank(*params.requested_rank);
  out.set_snapshot_address(params.snapshot_address);
  for (const SnapshotShard& shard : params.holdings) *out.add_holdings() = ToProto(shard);
  return out;
}

absl::StatusOr<JoinParams> FromProto(const v1::JoinRequest& request) {
  JoinParams params;
  params.worker_id = request.worker_id();
  params.host = request.host();
  params.device = request.device();
  params.capabilities.assign(request.capabilities().begin(), request.capabilities().end());
  params.incarnation = request.incarnation();
  if (request.has_requested_rank()) params.requested_rank = request.requested_rank();
  params.snapshot_address = request.snapshot_address();
  for (const v1::SnapshotShard& shard : request.holdings()) {
    SHARD_ASSIGN_OR_RETURN(SnapshotShard held, FromProto(shard));
    params.holdings.push_back(std::move(held));
  }
  return params;
}

namespace {

v1::LinkFailure ToProto(LinkFailure how) {
  switch (how) {
    case LinkFailure::kConnect: return v1::LINK_FAILURE_CONNECT;
    case LinkFailure::kSend: return v1::LINK_FAILURE_SEND;
    case LinkFailure::kReceive: return v1::LINK_FAILURE_RECEIVE;
  }
  return v1::LINK_FAILURE_UNSPECIFIED;
}

// UNSPECIFIED reads as a failed connect: the one kind that is always a link's fault.
LinkFailure FromProto(v1::LinkFailure how) {
  switch (how) {
    case v1::LINK_FAILURE_SEND: return LinkFailure::kSend;
    case v1::LINK_FAILURE_RECEIVE: return LinkFailure::kReceive;
    default: return LinkFailure::kConnect;
  }
}

}  // namespace

v1::PeerProbe ToProto(const PeerProbe& probe) {
  v1::PeerProbe out;
  out.set_worker_id(probe.worker_id);
  out.set_address(probe.address);
  out.set_reachable(probe.reachable);
  out.set_detail(probe.detail);
  return out;
}

PeerProbe FromProto(const v1::PeerProbe& probe) {
  return PeerProbe{probe.worker_id(), probe.address(), probe.reachable(), probe.detail()};
}

v1::ReportSelfCheckRequest ToProto(const SelfCheckReport& report) {
  v1::ReportSelfCheckRequest out;
  out.set_worker_id(report.worker_id);
  out.set_incarnation(report.incarnation);
  out.set_generation(report.generation);
  out.set_passed(report.passed);
  out.set_detail(report.detail);
  for (const PeerFault& fault : report.unreachable) {
    v1::PeerFault* entry = out.add_unreachable();
    entry->set_peer_rank(fault.peer_rank);
    entry->set_how(ToProto(fault.how));
    entry->set_detail(fault.detail);
  }
  return out;
}

SelfCheckReport FromProto(const v1::ReportSelfCheckRequest& request) {
  SelfCheckReport report;
  report.worker_id = request.worker_id();
  report.incarnation = request.incarnation();
  report.generation = request.generation();
  report.passed = request.passed();
  report.detail = request.detail();
  for (const v1::PeerFault& fault : request.unreachable()) {
    report.unreachable.push_back(PeerFault{fault.peer_rank(), FromProto(fault.how()),
                                           fault.detail()});
  }
  return report;
}

v1::HeartbeatRequest ToProto(const HeartbeatParams& params) {
  v1::HeartbeatRequest out;
  out.set_worker_id(params.worker_id);
  out.set_incarnation(params.incarnation);
  out.set_known_generation(params.known_generation);
  out.set_known_state(ToProto(params.known_state));
  out.set_wait_ms(absl::ToInt64Milliseconds(params.wait));
  out.set_paused_generation(params.paused_generation);
  if (params.activity.generation > 0) {
    v1::TrainingActivity* activity = out.mutable_activity();
    activity->set_generation(params.activity.generation);
    activity->set_step(params.activity.step);
    activity->set_since_step_ms(absl::ToInt64Milliseconds(params.activity.since_step));
    activity->set_waiting_ms(absl::ToInt64Milliseconds(params.activity.waiting));
  }
  for (const PeerProbe& probe : params.probed) *out.add_probed() = ToProto(probe);
  return out;
}

HeartbeatParams FromProto(const v1::HeartbeatRequest& request) {
  HeartbeatParams params;
  params.worker_id = request.worker_id();
  params.incarnation = request.incarnation();
  params.known_generation = request.known_generation();
  params.known_state = FromProto(request.known_state());
  params.wait = absl::Milliseconds(std::max<int64_t>(0, request.wait_ms()));
  params.paused_generation = request.paused_generation();
  if (request.has_activity()) {
    params.activity.generation = request.activity().generation();
    params.activity.step = request.activity().step();
    params.activity.since_step =
        absl::Milliseconds(std::max<int64_t>(0, request.activity().since_step_ms()));
    params.activity.waiting =
        absl::Milliseconds(std::max<int64_t>(0, request.activity().waiting_ms()));
  }
  for (const v1::PeerProbe& probe : request.probed()) params.probed.push_back(FromProto(probe));
  return params;
}

v1::LeaveRequest ToProto(const LeaveParams& params) {
  v1::LeaveRequest request;
  request.set_worker_id(params.worker_id);
  request.set_incarnation(params.incarnation);
  request.set_reason(params.reason);
  request.set_failed(params.failed);
  return request;
}

LeaveParams FromProto(const v1::LeaveRequest& request) {
  return LeaveParams{request.worker_id(), request.incarnation(), request.reason(),
                     request.failed()};
}

v1::JoinResponse ToProto(const JoinReply& reply, const std::string& job) {
  v1::JoinResponse out;
  out.set_rank(reply.outcome.rank);
  out.set_job(job);
  out.set_generation(reply.outcome.world.generation);
  out.set_lease_ms(absl::ToInt64Milliseconds(reply.lease));
  out.set_heartbeat_interval_ms(absl::ToInt64Milliseconds(reply.heartbeat_interval));
  *out.mutable_world() = ToProto(reply.outcome.world, job);
  *out.mutable_start() = ToProto(reply.start);
  return out;
}

JoinReply FromProto(const v1::JoinResponse& response) {
  JoinReply reply;
  reply.outcome.rank = response.rank();
  reply.outcome.world = FromProto(response.world());
  reply.lease = absl::Milliseconds(response.lease_ms());
  reply.heartbeat_interval = absl::Milliseconds(response.heartbeat_interval_ms());
  reply.start = FromProto(response.start());
  return reply;
}

v1::HeartbeatResponse ToProto(const HeartbeatReply& reply, const std::string& job) {
  v1::HeartbeatResponse out;
  *out.mutable_world() = ToProto(reply.outcome.world, job);
  out.set_rank(reply.outcome.rank);
  out.mutable_order()->set_kind(reply.outcome.stop ? v1::ORDER_KIND_STOP
                                                   : v1::ORDER_KIND_CONTINUE);
  out.mutable_order()->set_reason(reply.outcome.stop_reason);
  for (const PeerProbe& probe : reply.outcome.probe) *out.add_probe() = ToProto(probe);
  out.set_checkpoint_request(reply.orders.save_request);
  out.set_pause_request(reply.orders.pause_request);
  out.set_pause_in_memory(reply.orders.pause_in_memory);
  *out.mutable_start() = ToProto(reply.start);
  return out;
}

HeartbeatReply FromProto(const v1::HeartbeatResponse& response) {
  HeartbeatReply reply;
  reply.outcome.world = FromProto(response.world());
  reply.outcome.rank = response.rank();
  reply.outcome.stop = response.order().kind() == v1::ORDER_KIND_STOP;
  reply.outcome.stop_reason = response.order().reason();
  for (const v1::PeerProbe& probe : response.probe()) {
    reply.outcome.probe.push_back(FromProto(probe));
  }
  // The orders belong to the generation of the reply's world.
  reply.orders = StepOrders{response.world().generation(), response.checkpoint_request(),
                            response.pause_request(), response.pause_in_memory()};
  reply.start = FromProto(response.start());
  return reply;
}

v1::GetSaveProgressResponse ToProto(const SaveProgress& progress) {
  v1::GetSaveProgressResponse out;
  out.set_shards_done(progress.shards_done);
  out.set_world_size(progress.world_size);
  out.set_bytes_done(progress.bytes_done);
  out.set_checkpoint_id(progress.committed_id);
  out.set_error(progress.error);
  return out;
}

SaveProgress FromProto(const v1::GetSaveProgressResponse& response) {
  return SaveProgress{response.shards_done(), response.world_size(), response.bytes_done(),
                      response.checkpoint_id(), response.error()};
}

v1::SelfCheck ToProto(const SelfCheckRecord& check) {
  v1::SelfCheck out;
  out.set_state(ToProto(check.state));
  out.set_generation(check.generation);
  out.set_detail(check.detail);
  return out;
}

SelfCheckRecord FromProto(const v1::SelfCheck& check) {
  return SelfCheckRecord{FromProto(check.state()), check.generation(), check.detail()};
}

v1::WorkerStatus ToProto(const WorkerSnapshot& worker) {
  v1::WorkerStatus out;
  out.set_id(worker.id);
  out.set_rank(worker.rank);
  out.set_host(worker.host);
  out.set_device(worker.device);
  for (const std::string& capability : worker.capabilities) out.add_capabilities(capability);
  out.set_state(ToProto(worker.state));
  out.set_last_heartbeat_ms_ago(absl::ToInt64Milliseconds(worker.since_heartbeat));
  *out.mutable_self_check() = ToProto(worker.self_check);
  out.set_joined_generation(worker.joined_generation);
  out.set_unreachable(worker.unreachable);
  return out;
}

WorkerSnapshot FromProto(const v1::WorkerStatus& status) {
  WorkerSnapshot worker;
  worker.id = status.id();
  worker.rank = status.rank();
  worker.host = status.host();
  worker.device = status.device();
  worker.capabilities.assign(status.capabilities().begin(), status.capabilities().end());
  worker.state = FromProto(status.state());
  worker.since_heartbeat = absl::Milliseconds(status.last_heartbeat_ms_ago());
  worker.self_check = FromProto(status.self_check());
  worker.joined_generation = status.joined_generation();
  worker.unreachable = status.unreachable();
  return worker;
}

v1::TrainingProgress ToProto(const TrainingProgress& progress) {
  v1::TrainingProgress out;
  out.set_step(progress.step);
  out.set_steps(progress.steps);
  if (progress.loss.has_value()) out.set_loss(*progress.loss);
  out.set_steps_per_second(progress.steps_per_second);
  if (progress.eta.has_value()) out.set_eta_ms(absl::ToInt64Milliseconds(*progress.eta));
  out.set_last_checkpoint(progress.last_checkpoint);
  out.set_last_checkpoint_step(progress.last_checkpoint_step);
  if (progress.last_checkpoint_age.has_value()) {
    out.set_last_checkpoint_age_ms(absl::ToInt64Milliseconds(*progress.last_checkpoint_age));
  }
  out.set_overlap_fraction(progress.overlap_fraction);
  out.set_last_snapshot(progress.last_snapshot);
  out.set_last_snapshot_step(progress.last_snapshot_step);
  if (progress.last_snapshot_age.has_value()) {
    out.set_last_snapshot_age_ms(absl::ToInt64Milliseconds(*progress.last_snapshot_age));
  }
  out.set_last_snapshot_copies(progress.last_snapshot_copies);
  out.set_replica_lag_steps(progress.replica_lag_steps);
  if (progress.replica_lag.has_value()) {
    out.set_replica_lag_ms(absl::ToInt64Milliseconds(*progress.replica_lag));
  }
  out.set_checkpoint_failures(progress.checkpoint_failures);
  out.set_last_checkpoint_failure(progress.last_checkpoint_failure);
  if (progress.last_checkpoint_failure_age.has_value()) {
    out.set_last_checkpoint_failure_age_ms(
        absl::ToInt64Milliseconds(*progress.last_checkpoint_failure_age));
  }
  out.set_checkpoints_skipped(progress.checkpoints_skipped);
  out.set_last_checkpoint_skip(progress.last_checkpoint_skip);
  return out;
}

TrainingProgress FromProto(const v1::TrainingProgress& progress) {
  TrainingProgress out;
  out.step = progress.step();
  out.steps = progress.steps();
  if (progress.has_loss()) out.loss = progress.loss();
  out.steps_per_second = progress.steps_per_second();
  if (progress.has_eta_ms()) out.eta = absl::Milliseconds(progress.eta_ms());
  out.last_checkpoint = progress.last_checkpoint();
  out.last_checkpoint_step = progress.last_checkpoint_step();
  if (progress.has_last_checkpoint_age_ms()) {
    out.last_checkpoint_age = absl::Milliseconds(progress.last_checkpoint_age_ms());
  }
  out.overlap_fraction = progress.overlap_fraction();
  out.last_snapshot = progress.last_snapshot();
  out.last_snapshot_step = progress.last_snapshot_step();
  if (progress.has_last_snapshot_age_ms()) {
    out.last_snapshot_age = absl::Milliseconds(progress.last_snapshot_age_ms());
  }
  out.last_snapshot_copies = progress.last_snapshot_copies();
  out.replica_lag_steps = progress.replica_lag_steps();
  if (progress.has_replica_lag_ms()) out.replica_lag = absl::Milliseconds(progress.replica_lag_ms());
  out.checkpoint_failures = progress.checkpoint_failures();
  out.last_checkpoint_failure = progress.last_checkpoint_failure();
  if (progress.has_last_checkpoint_failure_age_ms()) {
    out.last_checkpoint_failure_age = absl::Milliseconds(progress.last_checkpoint_failure_age_ms());
  }
  out.checkpoints_skipped = progress.checkpoints_skipped();
  out.last_checkpoint_skip = progress.last_checkpoint_skip();
  return out;
}

v1::Event ToApiEvent(const v1::MembershipEvent& event) {
  v1::Event out;
  out.set_sequence(event.sequence());
  out.set_unix_ms(event.unix_ms());
  out.set_generation(event.generation());
  std::string kind = v1::MembershipEventKind_Name(event.kind());
  constexpr absl::string_view kPrefix = "MEMBERSHIP_EVENT_KIND_";
  if (absl::StartsWith(kind, kPrefix)) kind = kind.substr(kPrefix.size());
  out.set_kind(absl::AsciiStrToLower(kind));
  out.set_worker_id(event.worker_id());
  out.set_rank(event.rank());
  out.set_detail(event.detail());
  return out;
}

v1::CheckpointInfo ToCheckpointInfo(const v1::CheckpointRecord& record) {
  v1::CheckpointInfo out;
  out.set_id(record.id());
  out.set_step(record.step());
  out.set_world_size(record.world_size());
  out.set_dir(record.dir());
  out.set_bytes(record.bytes());
  out.set_committed_unix_ms(record.committed_unix_ms());
  out.set_max_pause_ms(record.max_pause_ms());
  out.set_max_write_ms(record.max_write_ms());
  return out;
}

}  // namespace shard
