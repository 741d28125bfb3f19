// The wire conversions of the control plane's value types: every value that travels both ways
// comes back equal, every enum value maps to a distinct wire value and back, and what a newer
// peer might send (an unknown enum value) reads as the safe default.
#include "proto/control_convert.h"

#include <set>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shard {
namespace {

TEST(ControlConvertTest, EveryEnumValueRoundTripsToADistinctWireValue) {
  std::set<int> job_states;
  for (JobState state : kAllJobStates) {
    EXPECT_EQ(FromProto(ToProto(state)), state) << JobStateName(state);
    EXPECT_TRUE(job_states.insert(ToProto(state)).second);
  }
  std::set<int> stop_kinds;
  for (StopKind kind : {StopKind::kNone, StopKind::kOperator, StopKind::kTrained,
                        StopKind::kFailed}) {
    EXPECT_EQ(FromProto(ToProto(kind)), kind) << static_cast<int>(kind);
    EXPECT_TRUE(stop_kinds.insert(ToProto(kind)).second);
  }
  std::set<int> worker_states;
  for (WorkerState state : {WorkerState::kJoining, WorkerState::kReady, WorkerState::kFailed,
                            WorkerState::kLeft, WorkerState::kDead, WorkerState::kStandby,
                            WorkerState::kLeaving}) {
    EXPECT_EQ(FromProto(ToProto(state)), state) << WorkerStateName(state);
    EXPECT_TRUE(worker_states.insert(ToProto(state)).second);
  }
  for (SelfCheckState state :
       {SelfCheckState::kPending, SelfCheckState::kPassed, SelfCheckState::kFailed}) {
    EXPECT_EQ(FromProto(ToProto(state)), state) << SelfCheckStateName(state);
  }
  for (OverlapStatus status :
       {OverlapStatus::kUninitialized, OverlapStatus::kRebuilt, OverlapStatus::kInitialized}) {
    EXPECT_EQ(FromProto(ToProto(status)), status) << OverlapStatusName(status);
  }
  // Unset or unknown values read as the state that asks nothing of anyone.
  EXPECT_EQ(FromProto(v1::JOB_STATE_UNSPECIFIED), JobState::kForming);
  EXPECT_EQ(FromProto(static_cast<v1::JobState>(99)), JobState::kForming);
  EXPECT_EQ(FromProto(v1::WORKER_STATE_UNSPECIFIED), WorkerState::kJoining);
}

TEST(ControlConvertTest, WorldAndTrainingStartRoundTrip) {
  World world;
  world.state = JobState::kRunning;
  world.generation = 42;
  world.world_size = 3;
  world.expected_world_size = 4;
  world.ranks = 3;
  world.min_world_size = 2;
  world.standby = 1;
  world.transition = "re-forming from 3 to 4 workers";
  const v1::WorldView view = ToProto(world, "job7");
  EXPECT_EQ(view.scope().job(), "job7");
  EXPECT_EQ(view.scope().generation(), 42) << "the rendezvous scope is the world's generation";
  EXPECT_EQ(FromProto(view), world);

  const TrainingStartPoint start{"step-00000120-g9", "/ckpt/job7/step-00000120-g9", 120};
  EXPECT_EQ(FromProto(ToProto(start)), start);
  const TrainingStartPoint memory{"step-00000130-g10", "", 130, /*in_memory=*/true};
  EXPECT_EQ(FromProto(ToProto(memory)), memory);
}

// A snapshot shard as a worker holds it: rank 1 of 2, two 4 MiB blocks and a short one.
SnapshotShard HeldShard() {
  SnapshotShard shard;
  shard.id = "step-00000040-g3";
  shard.generation = 3;
  shard.step = 40;
  shard.rank = 1;
  shard.plan.world_size = 2;
  shard.plan.mode = ShardMode::kParam;
  shard.plan.bucket_cap_bytes = 4096;
  shard.plan.first_bucket_cap_bytes = 1024;
  shard.plan.min_buckets = 3;
  shard.plan.alignment_bytes = 64;
  shard.plan.gradient_order = {3, 2, 1, 0};
  shard.plan_hash = "0123456789abcdef";
  shard.counters = TrainingCounters{38, 512.0f, 7};
  shard.record = ShardRecord{"shard-00001-of-00002.bin", 1, (8 << 20) + 12, "00ff",
                             {"01", "02", "03"}, {{-1, 8 << 20, 4}, {3, (8 << 20) + 4, 8}}};
  shard.request = 6;
  shard.state = OptimizerStateKind{"torch.optim.adamw.AdamW", {"exp_avg", "exp_avg_sq"}};
  return shard;
}

TEST(ControlConvertTest, SnapshotShardsReportsAndRestoresRoundTrip) {
  const SnapshotShard shard = HeldShard();
  absl::StatusOr<SnapshotShard> back = FromProto(ToProto(shard));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, shard);

  SnapshotReport report;
  report.worker_id = "w4";
  report.incarnation = 11;
  report.held = {shard};
  report.dropped = {"step-00000020-g3"};
  report.failed_id = "step-00000050-g3";
  report.error = "out of memory";
  report.snapshot_address = "10.0.0.4:41234";
  absl::StatusOr<SnapshotReport> report_back = FromProto(ToProto(report));
  ASSERT_TRUE(report_back.ok()) << report_back.status();
  EXPECT_EQ(*report_back, report);

  RestoreReport restore;
  restore.worker_id = "w4";
  restore.incarnation = 11;
  restore.generation = 5;
  restore.checkpoint_id = shard.id;
  restore.in_memory = true;
  restore.duration = absl::Milliseconds(84.5);
  restore.bytes_from_peers = 1 << 20;
  restore.bytes = 3 << 20;
  EXPECT_EQ(FromProto(ToProto(restore)), restore);

  const SnapshotHolder holder{"w4", 11, "10.0.0.4:41234"};
  EXPECT_EQ(FromProto(ToProto(holder)), holder);
}

TEST(ControlConvertTest, AMalformedSnapshotShardIsRefusedNamingTheField) {
  v1::SnapshotShard wire = ToProto(HeldShard());
  wire.mutable_record()->add_block_xxh3("04");  // one checksum too many for its bytes
  EXPECT_THAT(FromProto(wire).status().message(), ::testing::HasSubstr("block checksums"));
  wire = ToProto(HeldShard());
  wire.set_id("step-00000041-g3");  // not the id of its step
  EXPECT_TRUE(absl::IsInvalidArgument(FromProto(wire).status()));
  wire = ToProto(HeldShard());
  wire.set_id("../../etc");
  EXPECT_TRUE(absl::IsInvalidArgument(FromProto(wire).status()));
  wire = ToProto(HeldShard());
  wire.set_rank(2);  // outside its world of 2
  EXPECT_TRUE(absl::IsInvalidArgument(FromProto(wire).status()));
  wire = ToProto(HeldShard());
  wire.set_optimizer_step(41);  // past its step
  EXPECT_TRUE(absl::IsInvalidArgument(FromProto(wire).status()));
  // What the protobuf's signed fields can carry and a peer's JSON could not.
  wire = ToProto(HeldShard());
  wire.set_rank(-1);
  EXPECT_THAT(FromProto(wire).status().message(), ::testing::HasSubstr("rank is negative"));
  wire = ToProto(HeldShard());
  wire.set_request(-3);
  EXPECT_THAT(FromProto(wire).status().message(), ::testing::HasSubstr("request is negative"));
  wire = ToProto(HeldShard());
  wire.mutable_plan()->add_gradient_order(-1);
  EXPECT_THAT(FromProto(wire).status().message(), ::testing::HasSubstr("gradient_order"));
  SnapshotShard with_extras = HeldShard();
  with_extras.record.extras = {{-2, 0, 8}};
  EXPECT_THAT(FromProto(ToProto(with_extras)).status().message(),
              ::testing::HasSubstr("not a parameter index or -1"));
  with_extras.record.extras = {{-1, 0, 8}, {0, 4, 8}};  // overlapping
  EXPECT_THAT(FromProto(ToProto(with_extras)).status().message(),
              ::testing::HasSubstr("extras lie outside it or overlap"));
  with_extras.record.extras = {{-1, 0, 8}, {0, 8, 8}};
  EXPECT_TRUE(FromProto(ToProto(with_extras)).ok()) << "back to back inside the shard";

  v1::JoinRequest join = ToProto(JoinParams{});
  *join.add_holdings() = wire;
  EXPECT_FALSE(FromProto(join).ok()) << "a join carrying a malformed holding is refused";
}

TEST(ControlConvertTest, WorkerReportsRoundTrip) {
  const StepReport step{17, 12.5, 4.25, 3.0, 2.5, {1024, 64}, 0.75};
  EXPECT_EQ(FromProto(ToProto(step)), step);

  ShardReport shard;
  shard.worker_id = "w3";
  shard.incarnation = 99;
  shard.generation = 5;
  shard.rank = 2;  // travels inside the shard record
  shard.id = "step-00000010-g5";
  shard.step = 10;
  shard.request = 4;
  shard.plan_version = 2;
  shard.plan_hash = "abc";
  shard.record = ShardRecord{"shard-00002.bin", 2, 8 << 20, "00ff", {"01", "02"}, {{0, 64, 8}}};
  shard.state = OptimizerStateKind{"my.Lion", {"exp_avg"}};
  shard.pause_ms = 1.5;
  shard.write_ms = 20;
  shard.counters = TrainingCounters{9, 1024.0f, 3};
  EXPECT_EQ(FromProto(ToProto(shard)), shard);

  JoinParams join;
  join.worker_id = "w1";
  join.host = "10.0.0.2";
  join.device = "cuda:0";
  join.capabilities = {"nccl", "gloo"};
  join.incarnation = 7;
  join.snapshot_address = "10.0.0.2:41234";
  join.holdings = {HeldShard()};
  EXPECT_EQ(*FromProto(ToProto(join)), join);
  join.requested_rank = 0;  // rank 0 is a rank, not "unset"
  EXPECT_EQ(*FromProto(ToProto(join)), join);

  HeartbeatParams beat;
  beat.worker_id = "w1";
  beat.incarnation = 7;
  beat.known_generation = 12;
  beat.known_state = JobState::kRunning;
  beat.wait = absl::Milliseconds(2500);
  beat.paused_generation = 12;
  EXPECT_EQ(FromProto(ToProto(beat)), beat);
  beat.activity = TrainingActivity{12, 810, absl::Milliseconds(14000), absl::Milliseconds(13900)};
  EXPECT_EQ(FromProto(ToProto(beat)), beat);
}

TEST(ControlConvertTest, JoinAndHeartbeatRepliesRoundTrip) {
  World world;
  world.state = JobState::kReshaping;
  world.generation = 8;
  world.world_size = 3;
  world.expected_world_size = 4;
  world.ranks = 3;
  world.min_world_size = 2;
  world.standby = 1;
  world.transition = "folding in a standby";
  const TrainingStartPoint start{"step-00000040-g7", "/ckpt/step-00000040-g7", 40, false};
  const JoinReply joined{JoinOutcome{2, world}, absl::Seconds(10), absl::Milliseconds(2500), start};
  const v1::JoinResponse join_response = ToProto(joined, "job");
  EXPECT_EQ(join_response.world().scope().job(), "job");
  EXPECT_EQ(join_response.generation(), 8);
  EXPECT_EQ(FromProto(join_response), joined);

  HeartbeatReply beat;
  beat.outcome.world = world;
  beat.outcome.rank = -1;
  beat.outcome.stop = true;
  beat.outcome.stop_reason = "drained";
  beat.outcome.probe = {PeerProbe{"w1", "10.0.0.1:7000", false, ""}};
  beat.orders = StepOrders{8, 4, 6, /*pause_in_memory=*/true};
  beat.start = TrainingStartPoint{"snap-40", "", 40, true};
  EXPECT_EQ(FromProto(ToProto(beat, "job")), beat);
}

TEST(ControlConvertTest, OrdersBelongToTheGenerationOfTheReplysWorld) {
  HeartbeatReply beat;
  beat.outcome.world.generation = 8;
  beat.orders = StepOrders{3, 5, 5};  // the orders' own generation is not on the wire
  EXPECT_EQ(FromProto(ToProto(beat, "job")).orders, (StepOrders{8, 5, 5}));
}

TEST(ControlConvertTest, StatusAndProgressRoundTrip) {
  const SaveProgress progress{3, 4, 3 << 20, "", "cancelled: generation 4 ended"};
  EXPECT_EQ(FromProto(ToProto(progress)), progress);

  WorkerSnapshot worker;
  worker.id = "w2";
  worker.rank = 1;
  worker.host = "10.0.0.3";
  worker.device = "cpu";
  worker.capabilities = {"gloo"};
  worker.state = WorkerState::kReady;
  worker.since_heartbeat = absl::Milliseconds(250);
  worker.self_check = SelfCheckRecord{SelfCheckState::kPassed, 6, "all-reduce of 65536 ok"};
  worker.joined_generation = 6;
  EXPECT_EQ(FromProto(ToProto(worker)), worker);

  TrainingProgress progress_now;
  progress_now.step = 812;
  progress_now.steps = 1000;
  progress_now.loss = 0.25;
  progress_now.steps_per_second = 12.5;
  progress_now.eta = absl::Milliseconds(15040);
  progress_now.last_checkpoint = "step-00000800-g3";
  progress_now.last_checkpoint_step = 800;
  progress_now.last_checkpoint_age = absl::Milliseconds(960);
  progress_now.overlap_fraction = 0.75;
  progress_now.last_snapshot = "step-00000810-g3";
  progress_now.last_snapshot_step = 810;
  progress_now.last_snapshot_age = absl::Milliseconds(120);
  progress_now.last_snapshot_copies = 2;
  progress_now.replica_lag_steps = 10;
  progress_now.replica_lag = absl::Milliseconds(35);
  EXPECT_EQ(FromProto(ToProto(progress_now)), progress_now);
  // Unknown stays unknown: no loss, ETA or checkpoint reads back as such, not as zero.
  EXPECT_EQ(FromProto(ToProto(TrainingProgress{})), TrainingProgress{});
  EXPECT_FALSE(ToProto(TrainingProgress{}).has_loss());
}

TEST(ControlConvertTest, EventsReadAsLowercaseKinds) {
  v1::MembershipEvent event;
  event.set_kind(v1::MEMBERSHIP_EVENT_KIND_WORLD_FORMED);
  event.set_sequence(3);
  event.set_generation(1);
  event.set_detail("4 workers");
  const v1::Event shown = ToApiEvent(event);
  EXPECT_EQ(shown.kind(), "world_formed");
  EXPECT_EQ(shown.sequence(), 3);
  EXPECT_EQ(shown.detail(), "4 workers");
}

}  // namespace
}  // namespace shard
