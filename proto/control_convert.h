// Conversions between the control plane's value types (common/control_types.h) and their
// shard.v1 messages: the one place they are written, used by the coordinator's services, the
// worker's agent and shardctl. Each message that travels both ways converts back to the same
// value (tests/unit/control_convert_test.cc).
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "common/control_types.h"
#include "shard/v1/coordinator.pb.h"
#include "shard/v1/state.pb.h"

namespace shard {

v1::JobState ToProto(JobState state);
JobState FromProto(v1::JobState state);  // UNSPECIFIED reads as forming
v1::StopKind ToProto(StopKind kind);
StopKind FromProto(v1::StopKind kind);
v1::WorkerState ToProto(WorkerState state);
WorkerState FromProto(v1::WorkerState state);
v1::SelfCheckState ToProto(SelfCheckState state);
SelfCheckState FromProto(v1::SelfCheckState state);
v1::OverlapStatus ToProto(OverlapStatus status);
OverlapStatus FromProto(v1::OverlapStatus status);

// `job` names the rendezvous scope of the world's generation.
v1::WorldView ToProto(const World& world, const std::string& job);
World FromProto(const v1::WorldView& view);

v1::TrainingStart ToProto(const TrainingStartPoint& start);
TrainingStartPoint FromProto(const v1::TrainingStart& start);

v1::StepStats ToProto(const StepReport& report);
StepReport FromProto(const v1::StepStats& stats);

v1::ShardRecord ToProto(const ShardRecord& record);
ShardRecord FromProto(const v1::ShardRecord& record);

// Checked as the peers' description is (common/snapshot.h): InvalidArgument naming the field.
v1::SnapshotShard ToProto(const SnapshotShard& shard);
absl::StatusOr<SnapshotShard> FromProto(const v1::SnapshotShard& shard);

v1::SnapshotHolder ToProto(const SnapshotHolder& holder);
SnapshotHolder FromProto(const v1::SnapshotHolder& holder);

v1::ReportSnapshotRequest ToProto(const SnapshotReport& report);
absl::StatusOr<SnapshotReport> FromProto(const v1::ReportSnapshotRequest& request);

v1::ReportRestoreRequest ToProto(const RestoreReport& report);
RestoreReport FromProto(const v1::ReportRestoreRequest& request);

// The rank is not on the wire: the coordinator takes it from the membership.
v1::ReportCheckpointShardRequest ToProto(const ShardReport& report);
ShardReport FromProto(const v1::ReportCheckpointShardRequest& request);

v1::JoinRequest ToProto(const JoinParams& params);
absl::StatusOr<JoinParams> FromProto(const v1::JoinRequest& request);

v1::PeerProbe ToProto(const PeerProbe& probe);
PeerProbe FromProto(const v1::PeerProbe& probe);

v1::ReportSelfCheckRequest ToProto(const SelfCheckReport& report);
SelfCheckReport FromProto(const v1::ReportSelfCheckRequest& request);

v1::HeartbeatRequest ToProto(const HeartbeatParams& params);
HeartbeatParams FromProto(const v1::HeartbeatRequest& request);

v1::LeaveRequest ToProto(const LeaveParams& params);
LeaveParams FromProto(const v1::LeaveRequest& request);

// `job` names the rendezvous scope of the world's generation. The job spec a join reply may
// carry is not a domain value: the service sets it, the worker reads it from the message.
v1::JoinResponse ToProto(const JoinReply& reply, const std::string& job);
JoinReply FromProto(const v1::JoinResponse& response);
// The orders ride on a heartbeat reply and belong to the generation of its world.
v1::HeartbeatResponse ToProto(const HeartbeatReply& reply, const std::string& job);
HeartbeatReply FromProto(const v1::HeartbeatResponse& response);

v1::GetSaveProgressResponse ToProto(const SaveProgress& progress);
SaveProgress FromProto(const v1::GetSaveProgressResponse& response);

v1::SelfCheck ToProto(const SelfCheckRecord& check);
SelfCheckRecord FromProto(const v1::SelfCheck& check);

v1::WorkerStatus ToProto(const WorkerSnapshot& worker);
WorkerSnapshot FromProto(const v1::WorkerStatus& status);

// Durations travel as whole milliseconds.
v1::TrainingProgress ToProto(const TrainingProgress& progress);
TrainingProgress FromProto(const v1::TrainingProgress& progress);

// The history as shardctl shows it ("joined", "dead", ...).
v1::Event ToApiEvent(const v1::MembershipEvent& event);

// A committed checkpoint as the catalog keeps it, for listings.
v1::CheckpointInfo ToCheckpointInfo(const v1::CheckpointRecord& record);

}  // namespace shard
