#include "worker/generation_training.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/backoff.h"
#include "common/checkpoint.h"
#include "common/host_cores.h"
#include "common/logging.h"
#include "common/progress_lease.h"
#include "common/status_macros.h"
#include "proto/control_convert.h"
#include "spdlog/spdlog.h"
#include "worker/dataplane/engine.h"
#include "worker/dataplane/snapshot_fetch.h"
#include "worker/dataplane/trainer.h"
#include "worker/plan_session.h"
#include "worker/stats_reporter.h"

namespace shard {

namespace {

// What the training of one generation tells this worker, and through it the coordinator: how the
// restore went (and the memory snapshot it reads from its holders), every step (logged, reported,
// and the collective timeout derived from the step times), every checkpoint and snapshot shard;
// and what it asks: the coordinator's orders. Lives as long as the generation's Train.
class GenerationObserver : public TrainingObserver {
 public:
  GenerationObserver(const GenerationTraining::Options& options, const JobConfig& job,
                     const GenerationTraining::Generation& generation)
      : options_(options),
        job_(job),
        generation_(generation),
        log_every_(std::max<int64_t>(1, job.steps / 50)),
        reporter_([client = options.client](const v1::ReportStepStatsRequest& report) {
          return client->ReportStepStats(report);
        }) {}

  void OnStep(const StepRecord& record) override;
  // Reads the memory restore point of the generation from its holders.
  absl::StatusOr<std::unique_ptr<CheckpointReader>> OpenRestore() override;
  // Tells the coordinator how the restore went, and returns what the training makes of it.
  absl::Status OnRestored(const absl::Status& restored, absl::Duration took,
                          const RestoreTimings& timings) override;
  void OnSnapshot(const SnapshotShard& shard, const std::vector<std::string>& dropped) override {
    options_.on_snapshot(shard, dropped);
  }
  void OnSnapshotPushFailed(const SnapshotShard& shard, const std::string& buddy,
                            const absl::Status& why) override {
    spdlog::warn("snapshot {}: the buddy at {} did not take this rank's replica: {}", shard.id,
                 buddy, why.message());
  }
  void OnSnapshotPagesRefused(const SnapshotShard& shard, const std::string& buddy,
                              const absl::Status& why) override {
    spdlog::warn("snapshot {}: the buddy at {}, on this host, did not keep this rank's pages, so "
                 "its replicas go over TCP, a copy more each ({})",
                 shard.id, buddy, why.message());
  }
  StepOrders Orders() override { return options_.orders(); }
  // Tells the coordinator about a checkpoint shard this rank saved (or could not).
  void OnCheckpoint(const SavedShard& saved) override;

 private:
  const GenerationTraining::Options& options_;
  const JobConfig& job_;
  const GenerationTraining::Generation& generation_;
  const int64_t log_every_;  // rank 0 logs every log_every_-th step
  SnapshotReadStats read_stats_;  // of the memory snapshot OpenRestore reads
  bool first_step_ = true;
  // Collectives wait for a peer 20 x the p99 step time, within the floor and the ceiling.
  std::vector<double> recent_step_ms_;
  StatsReporter reporter_;
};

void GenerationObserver::OnStep(const StepRecord& record) {
  const StepTimings& t = record.timings;
  // Marks the end of a (re)start, restore included, in the logs (scripts/bench-recovery.sh).
  if (first_step_ && generation_.rank == 0) {
    spdlog::info("first step of this run done: step {} ({:.1f} ms)", record.step,
                 record.step_ms);
  }
  first_step_ = false;
  options_.activity->StepDone(record.step);
  recent_step_ms_.push_back(record.step_ms);
  if (recent_step_ms_.size() > 100) recent_step_ms_.erase(recent_step_ms_.begin());
  if (record.step % 10 == 0) {
    generation_.communicator->SetCollectiveTimeout(DerivedTimeout(
        absl::Milliseconds(Quantile(recent_step_ms_, 0.99)), 20,
        options_.collective_timeout_floor, options_.collective_timeout));
  }
  if (generation_.rank == 0 &&
      (record.step % log_every_ == 0 || record.step == 1 || record.step == job_.steps)) {
    // The global loss is agreed a step late (training_session.h), but for the last step.
    const std::string loss =
        record.loss_step == record.step ? absl::StrFormat("loss %.6f", record.loss)
        : record.loss_step > 0
            ? absl::StrFormat("loss %.6f (step %d's)", record.loss, record.loss_step)
            : std::string("loss -");
    spdlog::info("step {}/{} {} ({:.1f} ms: backward {:.1f} ms, reduction {:.1f} ms of "
                 "which {:.0f}% hidden, update {:.2f} ms, gather {:.1f} ms, waited for "
                 "gathers {:.1f} ms{}; plan v{}{})",
                 record.step, job_.steps, loss, record.step_ms, t.backward_ms,
                 t.communication_ms,
                 t.communication_ms > 0 ? 100 * t.hidden_ms / t.communication_ms : 0.0,
                 t.optimizer_ms, t.gather_ms, t.gather_wait_ms,
                 t.gathered_units > 0
                     ? absl::StrCat(", at most ", t.gathered_units, " buckets gathered")
                     : "",
                 record.plan_version, t.rebuilt ? ", buckets rebuilt" : "");
  }
  if (!record.buckets_unshared.empty()) {
    spdlog::warn("step {}: the buckets are not shared with this host's other ranks ({}); their "
                 "collectives copy through the shared-memory slots, one copy more each way. "
                 "Sharing them takes /dev/shm room for twice the model's fp32 size per rank (on "
                 "Kubernetes, a memory-backed emptyDir at /dev/shm)",
                 record.step, record.buckets_unshared);
  }
  if (generation_.rank == 0 && t.skipped) {
    spdlog::warn("step {}: inf/NaN gradients at loss scale {}; update skipped, scale lowered",
                 record.step, t.loss_scale);
  }
  v1::ReportStepStatsRequest report;
  report.set_worker_id(options_.worker_id);
  report.set_incarnation(options_.incarnation);
  report.set_generation(generation_.generation);
  *report.mutable_stats() =
      ToProto(StepReport{record.step, record.step_ms, t.backward_ms, t.communication_ms,
                         t.hidden_ms, t.bucket_bytes, record.loss, record.held_bytes,
                         t.gathered_units, t.gather_wait_ms});
  reporter_.Submit(std::move(report));
}

absl::StatusOr<std::unique_ptr<CheckpointReader>> GenerationObserver::OpenRestore() {
  v1::GetRestoreSnapshotRequest request;
  request.set_worker_id(options_.worker_id);
  request.set_incarnation(options_.incarnation);
  request.set_generation(generation_.generation);
  SHARD_ASSIGN_OR_RETURN(const v1::RestoreSnapshot where,
                         options_.client->GetRestoreSnapshot(request));
  SHARD_ASSIGN_OR_RETURN(
      CheckpointManifest manifest,
      CheckpointManifestFromJson(where.manifest_json(), "memory snapshot " + where.id()));
  std::vector<std::vector<SnapshotHolderAddress>> holders;
  for (const v1::RestoreSnapshot::Shard& shard : where.shards()) {
    std::vector<SnapshotHolderAddress>& list = holders.emplace_back();
    for (const v1::SnapshotHolder& holder : shard.holders()) {
      list.push_back({holder.worker_id(), holder.address()});
    }
  }
  if (holders.size() != manifest.shards.size()) {
    return absl::InternalError(absl::StrCat("the coordinator lists holders of ", holders.size(),
                                            " shards of memory snapshot ", where.id(), " for ",
                                            manifest.shards.size()));
  }
  return CheckpointReader::Open(
      std::move(manifest),
      SnapshotShards(where.id(), std::move(holders), options_.snapshots, absl::Seconds(10),
                     options_.generation_over, &read_stats_),
      "memory snapshot " + where.id());
}

absl::Status GenerationObserver::OnRestored(const absl::Status& restored, absl::Duration took,
                                           const RestoreTimings& timings) {
  const v1::TrainingStart& start = generation_.start;
  RestoreReport report;
  report.worker_id = options_.worker_id;
  report.incarnation = options_.incarnation;
  report.generation = generation_.generation;
  report.checkpoint_id = start.checkpoint_id();
  report.in_memory = start.in_memory();
  report.duration = took;
  report.bytes = read_stats_.bytes;
  report.bytes_from_peers = read_stats_.bytes_from_peers;
  report.refused = read_stats_.refusals();
  for (const std::string& refused : report.refused) spdlog::warn("{}", refused);
  const bool cut_short = absl::IsCancelled(restored) || absl::IsAborted(restored);
  if (!restored.ok() && !cut_short) report.error = std::string(restored.message());
  if (!cut_short) {
    if (absl::Status sent = options_.client->ReportRestore(ToProto(report)); !sent.ok()) {
      spdlog::warn("could not report the restore: {}", sent.message());
    }
  }
  if (restored.ok()) {
    spdlog::info("restored {} {} (step {}) in {:.1f} ms (read {:.1f} ms, then the parameters' "
                 "all-gather's last {:.1f} ms){}",
                 start.in_memory() ? "memory snapshot" : "checkpoint", start.checkpoint_id(),
                 start.step(), absl::ToDoubleMilliseconds(took), timings.read_ms,
                 timings.gather_ms,
                 start.in_memory() ? absl::StrCat(": ", report.bytes, " bytes, ",
                                                  report.bytes_from_peers, " from peers")
                                   : "");
    return restored;
  }
  if (start.in_memory() && !cut_short) {
    // The coordinator will not use this snapshot again: the next generation restores from
    // another one, or from disk.
    return absl::UnavailableError(absl::StrCat("restoring memory snapshot ",
                                               start.checkpoint_id(),
                                               " failed: ", restored.message()));
  }
  return restored;
}

void GenerationObserver::OnCheckpoint(const SavedShard& saved) {
  ShardReport report;
  report.worker_id = options_.worker_id;
  report.incarnation = options_.incarnation;
  report.generation = generation_.generation;
  report.id = saved.id;
  report.step = saved.step;
  report.request = saved.request;
  report.plan_version = saved.plan_version;
  report.plan_hash = saved.plan->hash;
  report.pause_ms = saved.pause_ms;
  report.write_ms = saved.write_ms;
  report.counters = saved.counters;
  report.state = saved.state;
  report.skipped = saved.skipped;
  if (!saved.skipped.empty()) {
    report.error = saved.skipped;
    spdlog::warn("{}", saved.skipped);
  } else if (saved.record.ok()) {
    report.record = *saved.record;
    if (generation_.rank == 0) {
      spdlog::info("checkpoint {} (step {}): shard written in {:.1f} ms, training paused "
                   "{:.2f} ms",
                   saved.id, saved.step, saved.write_ms, saved.pause_ms);
    }
  } else {
    report.error = std::string(saved.record.status().message());
    spdlog::error("checkpoint {}: {}", saved.id, saved.record.status().message());
  }
  if (absl::Status sent = options_.client->ReportCheckpointShard(ToProto(report)); !sent.ok()) {
    spdlog::warn("could not report checkpoint {}: {}", saved.id, sent.message());
  }
}

}  // namespace

GenerationTraining::GenerationTraining(Options options) : options_(std::move(options)) {}

absl::Status GenerationTraining::CheckModel(const JobConfig& job) const {
  if (job.external_model && !options_.trainer) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job '", job.name, "' trains a model its workers bring (model.external in the job "
        "spec): start the training script (python3 train.py, with SHARD_COORDINATOR set to "
        "the coordinator's address) in place of shard-worker"));
  }
  if (!job.external_model && options_.trainer) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job '", job.name, "' trains shard-worker's built-in MLP (model.mlp in the job spec), "
        "not a model of its own: start shard-worker for it, or give the coordinator a job "
        "spec with \"model\": {\"external\": {}}"));
  }
  return absl::OkStatus();
}

absl::StatusOr<GenerationTraining::End> GenerationTraining::Train(const JobConfig& job,
                                                                  const Generation& generation) {
  const int rank = generation.rank;
  const v1::TrainingStart& start = generation.start;
  const GenerationPeers& peers = *generation.peers;
  Communicator& communicator = *generation.communicator;
  // The progress lease counts from here: restoring is part of the first step.
  options_.activity->Begin(generation.generation, start.step());
  struct EndActivity {
    ActivityTracker& activity;
    ~EndActivity() { activity.End(); }
  } end_activity{*options_.activity};
  PlanSession plans(options_.client, options_.worker_id, options_.incarnation,
                    options_.collective_timeout);
  GenerationObserver observer(options_, job, generation);
  TrainerOptions trainer;
  trainer.observer = &observer;
  trainer.stop = options_.stop;
  trainer.generation = generation.generation;
  trainer.checkpoint_tag = absl::StrCat("g", generation.generation);
  if (start.in_memory()) {
    trainer.restore_from_observer = true;
    spdlog::info("restoring from memory snapshot {} (step {}), held by the job's workers",
                 start.checkpoint_id(), start.step());
  } else if (!start.checkpoint_id().empty()) {
    trainer.restore_dir = start.checkpoint_dir();
    spdlog::info("restoring from checkpoint {} (step {}) in {}", start.checkpoint_id(),
                 start.step(), start.checkpoint_dir());
  }
  const int ranks_on_host =
      static_cast<int>(std::count(peers.hosts.begin(), peers.hosts.end(), peers.hosts[rank]));
  trainer.gather_during_reads = GatherDuringReadsPays(ranks_on_host);
  if (job.zero_stage > 0) {
    spdlog::info("{} of the {} ranks on this host, {} usable cores: a restore gathers the "
                 "parameters {} its reads",
                 ranks_on_host, peers.hosts.size(), UsableCores(),
                 trainer.gather_during_reads ? "during" : "after");
  }
  if (job.snapshot_every > 0) {
    trainer.snapshots = options_.snapshots;
    trainer.snapshot_replication =
        ReplicationOf(peers.hosts, peers.snapshot_servers, rank, job.snapshot_replicas,
                      options_.snapshot_same_host);
  }
  trainer.device = options_.device;
  spdlog::info("training job '{}': {} in {} on {}, {} steps, global batch {}, {}, "
               "ZeRO stage {}, {} shards, overlap {}{}",
               job.name,
               job.external_model ? "the training script's model"
                                  : absl::StrCat("MLP ", absl::StrJoin(job.widths, "x")),
               job.precision, trainer.device->name(), job.steps, job.global_batch,
               job.optimizer.kind == OptimizerKind::kTorch
                   ? std::string("the script's own optimizer")
                   : absl::StrCat(OptimizerKindName(job.optimizer.kind), " with lr ",
                                  job.optimizer.lr),
               job.zero_stage, ShardModeName(job.shard_mode), job.overlap ? "on" : "off",
               job.zero_stage == 3
                   ? absl::StrCat(", prefetch ", job.prefetch)
                   : (job.zero_stage > 0 && job.overlap_param_gather && !job.external_model &&
                              trainer.device->host_memory()
                          ? ", parameter gather overlapped with forward"
                          : ""));
  absl::StatusOr<TrainResult> result = options_.trainer
                                           ? options_.trainer(job, communicator, plans, trainer)
                                           : TrainMlp(job, communicator, plans, trainer);
  if (!result.ok()) {
    if (*options_.stop) return absl::CancelledError(result.status().message());
    if (absl::IsAborted(result.status())) {
      // The world moved on (a membership change or a restore): the next generation's training
      // starts where the coordinator says (its latest checkpoint, or the beginning).
      return result.status();
    }
    return absl::Status(result.status().code(),
                        absl::StrCat("training failed: ", result.status().message()));
  }
  if (result->paused_at > 0) {
    // The world re-forms from the checkpoint just saved; the next generation continues.
    spdlog::info("training paused after step {} for a re-formation of the world; waiting for "
                 "the next generation",
                 result->paused_at);
    return End::kPaused;
  }
  spdlog::info("training finished: {} steps{}, loss {:.6f} -> {:.6f}, {:.2f} steps/s over steps "
               "{}-{}, {:.0f}% of gradient reduction hidden behind backward, a step {:.2f}x its forward "
               "and backward, {} memory snapshots taken, training paused at most {:.1f} ms for a "
               "snapshot or checkpoint, optimizer state {} "
               "bytes on this rank, model state held {} bytes (parameters {}, gradients {}, "
               "optimizer state {}, gathered buckets {}, frozen {}){}{}",
               result->steps,
               result->start_step > 0
                   ? absl::StrCat(" (this run: steps ", result->start_step + 1, "-", result->steps,
                                  " after restoring step ", result->start_step, ")")
                   : "",
               result->first_loss, result->last_loss, result->steps_per_second,
               result->start_step + 2, result->steps, 100 * result->hidden_fraction,
               result->step_over_compute, result->snapshots_taken, result->max_checkpoint_pause_ms,
               result->optimizer_state_bytes, result->held_bytes.total(),
               result->held_bytes.params, result->held_bytes.grads,
               result->held_bytes.optimizer_state, result->held_bytes.gathered,
               result->held_bytes.frozen,
               result->unshared_reason.empty()
                   ? ""
                   : absl::StrCat(", buckets copied through the shared-memory slots (",
                                  result->unshared_reason, ")"),
               result->output_path.empty() ? "" : ", parameters written to " + result->output_path);
  SHARD_RETURN_IF_ERROR(ReportDone(*result));
  return End::kFinished;
}

absl::Status GenerationTraining::ReportDone(const TrainResult& result) {
  v1::ReportTrainingDoneRequest done;
  done.set_worker_id(options_.worker_id);
  done.set_incarnation(options_.incarnation);
  done.set_steps(result.steps);
  done.set_final_loss(result.last_loss);
  done.set_output_path(result.output_path);
  // The coordinator may be restarting: the result is worth waiting for.
  const absl::Time give_up = absl::Now() + options_.coordinator_timeout;
  Backoff backoff(absl::Milliseconds(200), absl::Seconds(2));
  while (true) {
    absl::Status reported = options_.client->ReportTrainingDone(done);
    const absl::Duration wait = backoff.Next();
    if (!IsTransient(reported) || absl::Now() + wait > give_up) return reported;
    spdlog::warn("could not report the end of training ({}); retrying in {}", reported.message(),
                 absl::FormatDuration(wait));
    absl::SleepFor(wait);
  }
}

}  // namespace shard
