#include "worker/agent.h"

#include <algorithm>
#include <future>
#include <random>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/host_cores.h"
#include "common/logging.h"
#include "common/progress_lease.h"
#include "common/status_macros.h"
#include "proto/control_convert.h"
#include "proto/job_convert.h"
#include "spdlog/spdlog.h"
#include "worker/dataplane/engine.h"
#include "worker/dataplane/self_check.h"
#include "worker/dataplane/snapshot_fetch.h"
#include "worker/dataplane/trainer.h"
#include "worker/plan_session.h"
#include "worker/stats_reporter.h"

namespace shard {
namespace {

uint64_t RandomIncarnation() {
  std::random_device device;
  return (static_cast<uint64_t>(device()) << 32) ^ device();
}

bool IsTransient(const absl::Status& status) {
  return absl::IsUnavailable(status) || absl::IsDeadlineExceeded(status);
}

// The coordinator answered but cannot take this worker yet.
bool IsRefusedForNow(const absl::Status& status) {
  return absl::IsResourceExhausted(status) || absl::IsAlreadyExists(status);
}

}  // namespace

WorkerAgent::WorkerAgent(WorkerOptions options, std::unique_ptr<CoordinatorClient> client,
                         std::unique_ptr<DataPath> data_path)
    : options_(std::move(options)),
      client_(std::move(client)),
      data_path_(std::move(data_path)),
      incarnation_(RandomIncarnation()),
      probe_timeout_(options_.connect_probe_timeout) {}

void WorkerAgent::RequestStop(const std::string& reason) {
  absl::MutexLock lock(&mu_);
  SetStop(reason);
}

void WorkerAgent::SetStop(const std::string& reason) {
  if (stop_) return;
  stop_ = true;
  stop_requested_ = true;
  stop_reason_ = reason;
  generation_over_ = true;
  // Whatever the data path is blocked in must give way now.
  if (communicator_ != nullptr) communicator_->Abort(absl::StrCat("worker stopping: ", reason));
  if (rendezvous_ != nullptr) rendezvous_->Cancel();
}

void WorkerAgent::Fail(absl::Status status) {
  if (fatal_.ok()) fatal_ = std::move(status);
}

void WorkerAgent::UpdateWorld(const v1::WorldView& world, int rank) {
  const bool changed = world.generation() != world_.generation || rank != world_.rank ||
                       world.state() != world_.state;
  world_.generation = world.generation();
  world_.rank = rank;
  world_.world_size = world.world_size();
  world_.state = world.state();
  world_.running = world.state() == v1::JOB_STATE_RUNNING;
  world_.scope = world.scope();
  if (!changed) return;
  SetLogContext(absl::StrCat("worker=", options_.worker_id,
                             rank >= 0 ? absl::StrCat(" rank=", rank) : std::string(" standby"),
                             " gen=", world.generation()));
  spdlog::info("world is {} at generation {} with {}/{} ranks held (target {}){}",
               absl::AsciiStrToLower(v1::JobState_Name(world.state()).substr(10)),
               world.generation(), world.world_size(), world.ranks(),
               world.expected_world_size(),
               rank < 0 ? "; this worker is a standby, folded in at the next checkpoint boundary"
                        : "");
  if (communicator_ != nullptr && communicator_generation_ < world.generation()) {
    communicator_->Abort(absl::StrCat("generation ", communicator_generation_,
                                      " ended; the world moved to generation ",
                                      world.generation()));
    generation_over_ = true;
  }
  // A rendezvous of an ended generation can never complete: give it up now.
  if (rendezvous_ != nullptr && rendezvous_generation_ < world.generation()) rendezvous_->Cancel();
}

absl::Status WorkerAgent::JoinWithRetry() {
  JoinParams params;
  params.worker_id = options_.worker_id;
  params.host = options_.host;
  params.device = options_.device;
  params.capabilities = data_path_->capabilities();
  params.incarnation = incarnation_;
  params.requested_rank = options_.rank;
  if (snapshot_server_ != nullptr) {
    params.snapshot_address = snapshot_server_->address();
    params.holdings = snapshots_.Holdings();
  }
  const v1::JoinRequest request = ToProto(params);

  const absl::Time give_up = absl::Now() + options_.coordinator_timeout;
  absl::Duration backoff = absl::Milliseconds(100);
  while (true) {
    const absl::Time sent_at = absl::Now();
    absl::StatusOr<v1::JoinResponse> joined = client_->Join(request);
    absl::MutexLock lock(&mu_);
    if (joined.ok()) {
      heartbeat_interval_ = absl::Milliseconds(joined->heartbeat_interval_ms());
      lease_ = absl::Milliseconds(joined->lease_ms());
      NoteContact(sent_at);
      if (joined->has_job_spec() && !job_.has_value()) {
        absl::StatusOr<JobConfig> job = JobConfigFromProto(joined->job_spec(), "");
        if (!job.ok()) {
          return absl::Status(job.status().code(),
                              absl::StrCat("the coordinator's job spec is not usable here: ",
                                           job.status().message()));
        }
        job_ = std::move(*job);
      }
      start_ = joined->start();
      UpdateWorld(joined->world(), joined->rank());
      spdlog::info("joined job '{}' as rank {} (lease {}ms)", joined->job(), joined->rank(),
                   joined->lease_ms());
      return absl::OkStatus();
    }
    if (IsRefusedForNow(joined.status())) {
      // The coordinator is there and says "not yet" (the world is full, or the rank asked for
      // is still held): keep asking, however long it takes; a restarted pod must not
      // crash-loop while its predecessor's lease runs out.
      spdlog::warn("{}; asking again in {}", joined.status().message(),
                   absl::FormatDuration(backoff));
      auto stopping = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_; };
      if (mu_.AwaitWithTimeout(absl::Condition(&stopping), backoff)) {
        return absl::CancelledError(absl::StrCat("stopped before joining: ", stop_reason_));
      }
      backoff = std::min(backoff * 2, absl::Seconds(5));
      continue;
    }
    if (!IsTransient(joined.status())) return joined.status();
    if (absl::Now() + backoff > give_up) {
      return absl::UnavailableError(absl::StrCat(
          "cannot reach the coordinator at ", client_->address(), " for ",
          absl::FormatDuration(options_.coordinator_timeout), " (last error: ",
          joined.status().message(), "); is shard-coordinator running there? Check --coordinator"));
    }
    spdlog::warn("{}; retrying in {}", joined.status().message(), absl::FormatDuration(backoff));
    auto stopping = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_; };
    if (mu_.AwaitWithTimeout(absl::Condition(&stopping), backoff)) {
      return absl::CancelledError(absl::StrCat("stopped before joining: ", stop_reason_));
    }
    backoff = std::min(backoff * 2, absl::Seconds(2));
  }
}

void WorkerAgent::HeartbeatLoop() {
  HeartbeatParams params;
  params.worker_id = options_.worker_id;
  params.incarnation = incarnation_;
  absl::Time last_contact = absl::Now();
  absl::Duration pause = absl::ZeroDuration();
  absl::Duration backoff = absl::ZeroDuration();  // grows while the coordinator is unreachable
  // An isolated standby's probe runs beside the heartbeats (it may take longer than a lease);
  // its results go with the first heartbeat after it finished.
  std::future<std::vector<PeerProbe>> probing;
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      auto done = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || !fatal_.ok(); };
      if (mu_.AwaitWithTimeout(absl::Condition(&done), pause)) return;
      // Long-poll: the coordinator answers as soon as the world changes, or after the interval.
      params.known_generation = world_.generation;
      params.known_state = FromProto(world_.state);
      params.wait = heartbeat_interval_;
      params.paused_generation = paused_generation_;
      pause = std::max(heartbeat_interval_, backoff);
    }
    params.activity = activity_.Read();
    params.probed.clear();
    if (probing.valid() &&
        probing.wait_for(std::chrono::seconds(0)) == std::future_status::ready) {
      params.probed = probing.get();
    }
    ReportAllHeldIfNeeded();
    const absl::Time sent_at = absl::Now();
    absl::StatusOr<v1::HeartbeatResponse> beat = client_->Heartbeat(ToProto(params));
    if (beat.ok()) {
      pause = absl::ZeroDuration();
      backoff = absl::ZeroDuration();
      last_contact = absl::Now();
      if (beat->probe_size() > 0 && !probing.valid()) {
        probing = std::async(std::launch::async,
                             [this, reply = *beat] { return ProbeMembers(reply); });
      }
      absl::MutexLock lock(&mu_);
      NoteContact(sent_at);
      UpdateWorld(beat->world(), beat->rank());
      orders_ = OrdersOf(*beat);
      start_ = beat->start();
      if (beat->order().kind() == v1::ORDER_KIND_STOP && !stop_) {
        spdlog::info("coordinator ordered a stop: {}", beat->order().reason());
        SetStop(beat->order().reason());
      }
      continue;
    }
    const absl::Status& status = beat.status();
    if (absl::IsNotFound(status)) {
      // Declared dead (e.g. after a long pause) or the coordinator restarted: join again.
      spdlog::warn("{}; joining again", status.message());
      if (absl::Status rejoined = JoinWithRetry(); !rejoined.ok()) {
        absl::MutexLock lock(&mu_);
        Fail(rejoined);
        return;
      }
      last_contact = absl::Now();
      continue;
    }
    if (IsTransient(status)) {
      {
        absl::MutexLock lock(&mu_);
        report_all_held_ = true;
      }
      const absl::Duration silent = absl::Now() - last_contact;
      if (silent > options_.coordinator_timeout) {
        absl::MutexLock lock(&mu_);
        Fail(absl::UnavailableError(absl::StrCat(
            "lost the coordinator at ", client_->address(), " for ",
            absl::FormatDuration(absl::Trunc(silent, absl::Seconds(1))), ": ", status.message())));
        return;
      }
      // Capped at the heartbeat interval: a restarted coordinator must hear from us within
      // the lease.
      {
        absl::MutexLock lock(&mu_);
        backoff = std::min(std::max(2 * backoff, absl::Milliseconds(50)), heartbeat_interval_);
      }
      spdlog::warn("{} (coordinator silent for {}; retrying in {}, giving up after {})",
                   status.message(), absl::FormatDuration(absl::Trunc(silent, absl::Milliseconds(1))),
                   absl::FormatDuration(backoff), absl::FormatDuration(options_.coordinator_timeout));
      continue;
    }
    // Taken over by a newer process, or evicted because this one made no progress: it must
    // exit. A collective gives way (Fail aborts it), but a computation that hangs cannot: if the
    // training thread has not returned after a grace, the process exits anyway.
    if (absl::IsFailedPrecondition(status)) {
      std::thread([finished = finished_, message = std::string(status.message())] {
        absl::SleepFor(absl::Seconds(10));
        if (finished->load()) return;
        spdlog::error("{}; the training thread did not return within 10s: exiting the process",
                      message);
        std::_Exit(1);
      }).detach();
    }
    absl::MutexLock lock(&mu_);
    Fail(status);
    return;
  }
}

absl::Status WorkerAgent::ConnectGeneration(const WorldSnapshot& world) {
  std::shared_ptr<RendezvousClient> rendezvous = client_->RendezvousStore(world.scope);
  {
    absl::MutexLock lock(&mu_);
    if (stop_) return absl::CancelledError("stopping");
    rendezvous_ = rendezvous;
    rendezvous_generation_ = world.generation;
    paused_generation_ = 0;  // a new generation: whatever paused before is over
    link_faults_.clear();
    if (world_.generation != world.generation) rendezvous_->Cancel();  // ended already
  }
  spdlog::info("connecting the data path: rank {} of {} on {} over {} (peers reach {})",
               world.rank, world.world_size, data_path_->device().name(), data_path_->backend(),
               options_.host);
  std::optional<JobConfig> job;
  {
    absl::MutexLock lock(&mu_);
    job = job_;
  }
  // This rank's host and where its snapshots are served, published before connecting: once the
  // data path is connected, every peer's are in the store.
  const bool snapshots = job.has_value() && job->snapshot_every > 0;
  const auto host_key = [](int rank) { return absl::StrCat("host/", rank); };
  const auto snapshot_key = [](int rank) { return absl::StrCat("snapshot/", rank); };
  SHARD_RETURN_IF_ERROR(rendezvous->Set(host_key(world.rank), options_.host));
  SHARD_RETURN_IF_ERROR(ProbePeers(world, *rendezvous));
  if (snapshots) {
    SHARD_RETURN_IF_ERROR(
        rendezvous->Set(snapshot_key(world.rank), snapshot_server_->address()));
  }
  absl::StatusOr<std::unique_ptr<Communicator>> created =
      data_path_->Connect(rendezvous.get(), world.rank, world.world_size);
  Peers peers;
  // Appends rank `rank`'s value of `key` to `values`; false (with `created` the error) if absent.
  const auto collect = [&](int rank, const std::string& key, absl::string_view what,
                           std::vector<std::string>* values) {
    absl::StatusOr<std::string> value = rendezvous->Get(key);
    if (!value.ok()) {
      created = absl::Status(value.status().code(), absl::StrCat("rank ", rank, "'s ", what, ": ",
                                                                 value.status().message()));
      return false;
    }
    values->push_back(*std::move(value));
    return true;
  };
  for (int rank = 0; created.ok() && rank < world.world_size; ++rank) {
    if (!collect(rank, host_key(rank), "host", &peers.hosts)) break;
    if (snapshots &&
        !collect(rank, snapshot_key(rank), "snapshot server", &peers.snapshot_servers)) {
      break;
    }
  }
  {
    absl::MutexLock lock(&mu_);
    rendezvous_ = nullptr;
    if (!created.ok()) return created.status();
    communicator_ = TrackCollectives(std::move(*created), &activity_);
    if (stop_ || world_.generation != world.generation) {
      return absl::AbortedError("the world moved on while connecting");
    }
  }
  std::shared_ptr<Communicator> communicator;
  {
    absl::MutexLock lock(&mu_);
    communicator = communicator_;
  }
  absl::StatusOr<SelfCheckResult> checked =
      RunSelfCheck(*communicator, options_.self_check_elements, data_path_->device());
  if (!checked.ok() && (absl::IsAborted(checked.status()) || absl::IsCancelled(checked.status()))) {
    return checked.status();
  }
  v1::ReportSelfCheckRequest report;
  report.set_worker_id(options_.worker_id);
  report.set_incarnation(incarnation_);
  report.set_generation(world.generation);
  report.set_passed(checked.ok());
  report.set_detail(checked.ok() ? checked->summary : std::string(checked.status().message()));
  absl::Status reported = client_->ReportSelfCheck(report);
  if (!checked.ok()) {
    return absl::Status(checked.status().code(),
                        absl::StrCat("self-check failed: ", checked.status().message()));
  }
  if (!reported.ok()) return reported;
  spdlog::info("self-check passed: {}", checked->summary);
  {
    // Connected and checked: a later generation change aborts this communicator.
    absl::MutexLock lock(&mu_);
    communicator_generation_ = world.generation;
  }
  // Also after this worker finished: a new generation means the job is not finished (a rank
  // died before it reported the end), and every rank trains again from the restore point.
  if (job.has_value()) {
    SHARD_RETURN_IF_ERROR(Train(*job, world.rank, world.generation, peers));
  } else if (options_.manifest.has_value()) {
    SHARD_RETURN_IF_ERROR(ApplyPlan());
  }
  return absl::OkStatus();
}

void WorkerAgent::ReportHeld(const std::vector<SnapshotShard>& held,
                             const std::vector<std::string>& dropped) {
  SnapshotReport report;
  report.worker_id = options_.worker_id;
  report.incarnation = incarnation_;
  report.held = held;
  report.dropped = dropped;
  report.snapshot_address = snapshot_server_->address();
  if (absl::Status sent = client_->ReportSnapshot(ToProto(report)); !sent.ok()) {
    spdlog::warn("could not tell the coordinator about snapshot shards held ({}); telling it "
                 "everything held before the next heartbeat",
                 sent.message());
    absl::MutexLock lock(&mu_);
    report_all_held_ = true;
  }
}

void WorkerAgent::ReportAllHeldIfNeeded() {
  {
    absl::MutexLock lock(&mu_);
    if (!report_all_held_) return;
    report_all_held_ = false;
  }
  std::vector<SnapshotShard> held = snapshots_.Holdings();
  if (held.empty()) return;
  ReportHeld(held, {});
}

absl::StatusOr<std::unique_ptr<CheckpointReader>> WorkerAgent::OpenMemoryRestore(
    int64_t generation, SnapshotReadStats* stats) {
  v1::GetRestoreSnapshotRequest request;
  request.set_worker_id(options_.worker_id);
  request.set_incarnation(incarnation_);
  request.set_generation(generation);
  SHARD_ASSIGN_OR_RETURN(const v1::RestoreSnapshot where, client_->GetRestoreSnapshot(request));
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
      SnapshotShards(where.id(), std::move(holders), &snapshots_, absl::Seconds(10),
                     &generation_over_, stats),
      "memory snapshot " + where.id());
}

absl::Status WorkerAgent::Train(const JobConfig& job, int rank, int64_t generation,
                                const Peers& peers) {
  std::shared_ptr<Communicator> communicator;
  v1::TrainingStart start;
  {
    absl::MutexLock lock(&mu_);
    communicator = communicator_;
    start = start_;
    generation_over_ = stop_ || world_.generation != generation;
  }
  // The progress lease counts from here: restoring is part of the first step.
  activity_.Begin(generation, start.step());
  struct EndActivity {
    ActivityTracker& activity;
    ~EndActivity() { activity.End(); }
  } end_activity{activity_};
  // Collectives wait for a peer 20 x the p99 step time, within the floor and the ceiling.
  std::vector<double> recent_step_ms;
  PlanSession plans(client_.get(), options_.worker_id, incarnation_,
                    options_.collective_timeout);
  const int64_t log_every = std::max<int64_t>(1, job.steps / 50);
  StatsReporter reporter(
      [this](const v1::ReportStepStatsRequest& report) { return client_->ReportStepStats(report); });
  TrainerOptions trainer;
  trainer.stop = &stop_requested_;
  trainer.orders = [this] {
    absl::MutexLock lock(&mu_);
    return orders_;
  };
  trainer.generation = generation;
  trainer.checkpoint_tag = absl::StrCat("g", generation);
  SnapshotReadStats read_stats;
  if (start.in_memory()) {
    trainer.open_restore = [this, generation, &read_stats] {
      return OpenMemoryRestore(generation, &read_stats);
    };
    spdlog::info("restoring from memory snapshot {} (step {}), held by the job's workers",
                 start.checkpoint_id(), start.step());
  } else if (!start.checkpoint_id().empty()) {
    trainer.restore_dir = start.checkpoint_dir();
    spdlog::info("restoring from checkpoint {} (step {}) in {}", start.checkpoint_id(),
                 start.step(), start.checkpoint_dir());
  }
  trainer.on_restored = [&](const absl::Status& restored, absl::Duration took,
                            const RestoreTimings& timings) -> absl::Status {
    RestoreReport report;
    report.worker_id = options_.worker_id;
    report.incarnation = incarnation_;
    report.generation = generation;
    report.checkpoint_id = start.checkpoint_id();
    report.in_memory = start.in_memory();
    report.duration = took;
    report.bytes = read_stats.bytes;
    report.bytes_from_peers = read_stats.bytes_from_peers;
    report.refused = read_stats.refusals();
    for (const std::string& refused : report.refused) spdlog::warn("{}", refused);
    const bool cut_short = absl::IsCancelled(restored) || absl::IsAborted(restored);
    if (!restored.ok() && !cut_short) report.error = std::string(restored.message());
    if (!cut_short) {
      if (absl::Status sent = client_->ReportRestore(ToProto(report)); !sent.ok()) {
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
  };
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
    trainer.snapshots = &snapshots_;
    for (int buddy : SnapshotBuddies(peers.hosts, rank, job.snapshot_replicas)) {
      trainer.snapshot_buddies.push_back(peers.snapshot_servers[buddy]);
    }
    trainer.on_snapshot = [this](const SnapshotShard& shard,
                                 const std::vector<std::string>& dropped) {
      ReportHeld({shard}, dropped);
    };
    trainer.on_snapshot_push_failed = [](const SnapshotShard& shard, const std::string& buddy,
                                         const absl::Status& why) {
      spdlog::warn("snapshot {}: the buddy at {} did not take this rank's replica: {}", shard.id,
                   buddy, why.message());
    };
  }
  trainer.on_checkpoint = [&](const SavedShard& saved) {
    ShardReport report;
    report.worker_id = options_.worker_id;
    report.incarnation = incarnation_;
    report.generation = generation;
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
      if (rank == 0) {
        spdlog::info("checkpoint {} (step {}): shard written in {:.1f} ms, training paused "
                     "{:.2f} ms",
                     saved.id, saved.step, saved.write_ms, saved.pause_ms);
      }
    } else {
      report.error = std::string(saved.record.status().message());
      spdlog::error("checkpoint {}: {}", saved.id, saved.record.status().message());
    }
    if (absl::Status sent = client_->ReportCheckpointShard(ToProto(report)); !sent.ok()) {
      spdlog::warn("could not report checkpoint {}: {}", saved.id, sent.message());
    }
  };
  bool first_step = true;
  trainer.on_step = [&](const StepRecord& record) {
    const StepTimings& t = record.timings;
    // Marks the end of a (re)start, restore included, in the logs (scripts/bench-recovery.sh).
    if (first_step && rank == 0) {
      spdlog::info("first step of this run done: step {} ({:.1f} ms)", record.step,
                   record.step_ms);
    }
    first_step = false;
    activity_.StepDone(record.step);
    recent_step_ms.push_back(record.step_ms);
    if (recent_step_ms.size() > 100) recent_step_ms.erase(recent_step_ms.begin());
    if (record.step % 10 == 0) {
      communicator->SetCollectiveTimeout(DerivedTimeout(
          absl::Milliseconds(Quantile(recent_step_ms, 0.99)), 20,
          options_.collective_timeout_floor, options_.collective_timeout));
    }
    if (rank == 0 && (record.step % log_every == 0 || record.step == 1 || record.step == job.steps)) {
      // The global loss is agreed a step late (training_session.h), but for the last step.
      const std::string loss =
          record.loss_step == record.step ? absl::StrFormat("loss %.6f", record.loss)
          : record.loss_step > 0
              ? absl::StrFormat("loss %.6f (step %d's)", record.loss, record.loss_step)
              : std::string("loss -");
      spdlog::info("step {}/{} {} ({:.1f} ms: backward {:.1f} ms, reduction {:.1f} ms of "
                   "which {:.0f}% hidden, update {:.2f} ms, gather {:.1f} ms, waited for "
                   "gathers {:.1f} ms{}; plan v{}{})",
                   record.step, job.steps, loss, record.step_ms, t.backward_ms,
                   t.communication_ms,
                   t.communication_ms > 0 ? 100 * t.hidden_ms / t.communication_ms : 0.0,
                   t.optimizer_ms, t.gather_ms, t.gather_wait_ms,
                   t.gathered_units > 0
                       ? absl::StrCat(", at most ", t.gathered_units, " buckets gathered")
                       : "",
                   record.plan_version, t.rebuilt ? ", buckets rebuilt" : "");
    }
    if (rank == 0 && t.skipped) {
      spdlog::warn("step {}: inf/NaN gradients at loss scale {}; update skipped, scale lowered",
                   record.step, t.loss_scale);
    }
    v1::ReportStepStatsRequest report;
    report.set_worker_id(options_.worker_id);
    report.set_incarnation(incarnation_);
    report.set_generation(generation);
    *report.mutable_stats() =
        ToProto(StepReport{record.step, record.step_ms, t.backward_ms, t.communication_ms,
                           t.hidden_ms, t.bucket_bytes, record.loss, record.held_bytes,
                           t.gathered_units, t.gather_wait_ms});
    reporter.Submit(std::move(report));
  };
  trainer.device = &data_path_->device();
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
                                           ? options_.trainer(job, *communicator, plans, trainer)
                                           : TrainMlp(job, *communicator, plans, trainer);
  if (!result.ok()) {
    if (stop_requested_) return absl::CancelledError(result.status().message());
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
    absl::MutexLock lock(&mu_);
    paused_generation_ = generation;
    return absl::OkStatus();
  }
  spdlog::info("training finished: {} steps{}, loss {:.6f} -> {:.6f}, {:.2f} steps/s over steps "
               "{}-{}, {:.0f}% of gradient reduction hidden behind backward, a step {:.2f}x its forward "
               "and backward, optimizer state {} "
               "bytes on this rank, model state held {} bytes (parameters {}, gradients {}, "
               "optimizer state {}, gathered buckets {}, frozen {}){}",
               result->steps,
               result->start_step > 0
                   ? absl::StrCat(" (this run: steps ", result->start_step + 1, "-", result->steps,
                                  " after restoring step ", result->start_step, ")")
                   : "",
               result->first_loss, result->last_loss, result->steps_per_second,
               result->start_step + 2, result->steps, 100 * result->hidden_fraction,
               result->step_over_compute,
               result->optimizer_state_bytes, result->held_bytes.total(),
               result->held_bytes.params, result->held_bytes.grads,
               result->held_bytes.optimizer_state, result->held_bytes.gathered,
               result->held_bytes.frozen,
               result->output_path.empty() ? "" : ", parameters written to " + result->output_path);
  v1::ReportTrainingDoneRequest done;
  done.set_worker_id(options_.worker_id);
  done.set_incarnation(incarnation_);
  done.set_steps(result->steps);
  done.set_final_loss(result->last_loss);
  done.set_output_path(result->output_path);
  // The coordinator may be restarting: the result is worth waiting for.
  const absl::Time give_up = absl::Now() + options_.coordinator_timeout;
  absl::Duration backoff = absl::Milliseconds(200);
  while (true) {
    absl::Status reported = client_->ReportTrainingDone(done);
    if (!IsTransient(reported) || absl::Now() + backoff > give_up) return reported;
    spdlog::warn("could not report the end of training ({}); retrying in {}", reported.message(),
                 absl::FormatDuration(backoff));
    absl::SleepFor(backoff);
    backoff = std::min(2 * backoff, absl::Seconds(2));
  }
}

absl::Status WorkerAgent::ApplyPlan() {
  PlanSession session(client_.get(), options_.worker_id, incarnation_,
                      options_.collective_timeout);
  SHARD_ASSIGN_OR_RETURN(AppliedPlan applied, session.Initial(*options_.manifest));
  auto describe = [](const AppliedPlan& p, int rank) {
    const RankOwnership& mine = p.plan->ranks[rank];
    return absl::StrCat("plan v", p.version, " (hash ", p.plan->hash, "): ",
                        p.plan->buckets.size(), " buckets, this rank owns ", mine.owned_numel,
                        " elements in ", mine.ranges.size(), " ranges, imbalance ",
                        absl::StrFormat("%.3f", p.plan->imbalance),
                        p.rebuilt ? ", buckets rebuilt" : "");
  };
  int rank = 0;
  {
    absl::MutexLock lock(&mu_);
    rank = world_.rank;
  }
  spdlog::info("applied {}", describe(applied, rank));
  if (applied.rebuilt) return absl::OkStatus();
  // No model runs in this worker, so the first iteration's gradients become ready in the
  // order a sequential backward produces: the plan's default, reverse registration order.
  SHARD_ASSIGN_OR_RETURN(AppliedPlan rebuilt,
                         session.Rebuild(applied.version, applied.plan->options.gradient_order));
  spdlog::info("applied rebuilt {}", describe(rebuilt, rank));
  return absl::OkStatus();
}

void WorkerAgent::Leave() {
  std::string reason;
  {
    absl::MutexLock lock(&mu_);
    reason = fatal_.ok() ? stop_reason_ : std::string(fatal_.message());
  }
  v1::LeaveRequest request;
  request.set_worker_id(options_.worker_id);
  request.set_incarnation(incarnation_);
  request.set_reason(reason);
  absl::Status left = client_->Leave(request);
  if (left.ok()) {
    spdlog::info("left the job ({})", reason);
  } else {
    spdlog::warn("could not leave cleanly: {}", left.message());
  }
}

bool WorkerAgent::GenerationStillMine(int64_t generation) {
  HeartbeatParams params;
  params.worker_id = options_.worker_id;
  params.incarnation = incarnation_;
  params.known_generation = generation;
  absl::Duration backoff = absl::Milliseconds(50);
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      if (stop_ || !fatal_.ok()) return true;  // the process ends either way
      params.paused_generation = paused_generation_;
    }
    const absl::Time sent_at = absl::Now();
    absl::StatusOr<v1::HeartbeatResponse> beat = client_->Heartbeat(ToProto(params));
    if (absl::IsNotFound(beat.status())) return false;  // declared dead: the heartbeat rejoins
    if (beat.ok()) {
      absl::MutexLock lock(&mu_);
      NoteContact(sent_at);
      UpdateWorld(beat->world(), beat->rank());
      return world_.generation == generation;
    }
    if (!IsTransient(beat.status())) return true;
    absl::MutexLock lock(&mu_);
    auto gone = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || !fatal_.ok(); };
    mu_.AwaitWithTimeout(absl::Condition(&gone), backoff);
    backoff = std::min(2 * backoff, heartbeat_interval_);
  }
}

void WorkerAgent::ReportGenerationFailed(const WorldSnapshot& world, const absl::Status& why) {
  {
    absl::MutexLock lock(&mu_);
    if (stop_ || world_.generation != world.generation) return;  // it is over already
  }
  spdlog::warn("the data path of generation {} failed: asking the coordinator for the next",
               world.generation);
  SelfCheckReport report;
  report.worker_id = options_.worker_id;
  report.incarnation = incarnation_;
  report.generation = world.generation;
  report.detail = std::string(why.message());
  {
    absl::MutexLock lock(&mu_);
    report.unreachable = link_faults_;
    if (communicator_ != nullptr && communicator_generation_ == world.generation) {
      if (std::optional<PeerFault> fault = communicator_->peer_fault()) {
        report.unreachable.push_back(*std::move(fault));
      }
    }
  }
  if (absl::Status sent = client_->ReportSelfCheck(ToProto(report)); !sent.ok()) {
    // The generation ended meanwhile, or the coordinator is away: its next answer tells.
    spdlog::info("could not report it: {}", sent.message());
  }
}

void WorkerAgent::NoteContact(absl::Time sent_at) {
  last_contact_ = std::max(last_contact_, sent_at);
  if (!cut_off_) return;
  cut_off_ = false;
  ++contact_epoch_;
  spdlog::info("the coordinator answers again");
}

void WorkerAgent::CoordinatorLeaseWatch() {
  absl::MutexLock lock(&mu_);
  auto done = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || !fatal_.ok(); };
  while (!done()) {
    if (cut_off_) {
      auto back = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return done() || !cut_off_; };
      mu_.Await(absl::Condition(&back));
      continue;
    }
    const absl::Time expires = last_contact_ + lease_;
    if (absl::Now() < expires) {
      mu_.AwaitWithDeadline(absl::Condition(&done), expires);
      continue;  // contact may have been renewed meanwhile
    }
    cut_off_ = true;
    const std::string why = absl::StrCat(
        "the coordinator at ", client_->address(), " has not answered for its lease (",
        absl::FormatDuration(lease_),
        "): it counts this worker dead, so this rank stops training (nothing it trains now could "
        "be committed) and rejoins once the coordinator answers");
    spdlog::warn("{}", why);
    generation_over_ = true;
    if (communicator_ != nullptr) communicator_->Abort(why);
    if (rendezvous_ != nullptr) rendezvous_->Cancel();
  }
}

std::vector<ConnectProbe> WorkerAgent::Probe(const std::vector<std::string>& addresses) {
  PeerCallOptions options;
  {
    absl::MutexLock lock(&mu_);
    options.timeout = probe_timeout_;
  }
  options.cancel = &stop_requested_;
  std::vector<ConnectProbe> probes = ProbeConnect(addresses, options);
  absl::Duration slowest;
  bool any = false;
  for (const ConnectProbe& probe : probes) {
    if (!probe.reachable) continue;
    slowest = std::max(slowest, probe.took);
    any = true;
  }
  if (any) {
    absl::MutexLock lock(&mu_);
    probe_timeout_ =
        std::clamp(50 * slowest, absl::Seconds(1), options_.connect_probe_timeout);
  }
  return probes;
}

absl::Status WorkerAgent::ProbePeers(const WorldSnapshot& world, RendezvousClient& rendezvous) {
  const auto probe_key = [](int rank) { return absl::StrCat("probe/", rank); };
  SHARD_RETURN_IF_ERROR(rendezvous.Set(probe_key(world.rank), snapshot_server_->address()));
  std::vector<std::string> keys;
  for (int rank = 0; rank < world.world_size; ++rank) keys.push_back(probe_key(rank));
  SHARD_RETURN_IF_ERROR(rendezvous.Wait(keys, options_.collective_timeout));
  std::vector<std::string> addresses;
  std::vector<int> ranks;
  for (int rank = 0; rank < world.world_size; ++rank) {
    if (rank == world.rank) continue;
    SHARD_ASSIGN_OR_RETURN(std::string address, rendezvous.Get(probe_key(rank)));
    addresses.push_back(std::move(address));
    ranks.push_back(rank);
  }
  const std::vector<ConnectProbe> probes = Probe(addresses);
  std::vector<PeerFault> faults;
  std::vector<std::string> failed;
  for (size_t i = 0; i < probes.size(); ++i) {
    if (probes[i].reachable) continue;
    faults.push_back(PeerFault{ranks[i], LinkFailure::kConnect, probes[i].detail});
    failed.push_back(absl::StrCat("rank ", ranks[i], " (", probes[i].detail, ")"));
  }
  if (faults.empty()) return absl::OkStatus();
  {
    absl::MutexLock lock(&mu_);
    if (world_.generation != world.generation) return absl::AbortedError("generation ended");
    link_faults_ = std::move(faults);
  }
  return absl::UnavailableError(
      absl::StrCat("cannot connect to ", absl::StrJoin(failed, ", "),
                   " over the data path's network: the coordinator re-forms the world with "
                   "workers that reach one another"));
}

std::vector<PeerProbe> WorkerAgent::ProbeMembers(const v1::HeartbeatResponse& reply) {
  std::vector<std::string> addresses;
  for (const v1::PeerProbe& target : reply.probe()) addresses.push_back(target.address());
  const std::vector<ConnectProbe> probes = Probe(addresses);
  std::vector<PeerProbe> probed;
  int reached = 0;
  for (int i = 0; i < reply.probe_size(); ++i) {
    probed.push_back(PeerProbe{reply.probe(i).worker_id(), reply.probe(i).address(),
                               probes[i].reachable, probes[i].detail});
    reached += probes[i].reachable ? 1 : 0;
  }
  spdlog::info("isolated standby: reached {} of the {} members of the world", reached,
               probed.size());
  return probed;
}

absl::Status WorkerAgent::Run() {
  absl::StatusOr<std::unique_ptr<SnapshotServer>> server = SnapshotServer::Start(
      options_.host, options_.snapshot_port, &snapshots_,
      [this](const SnapshotShard& shard, const std::vector<std::string>& dropped) {
        ReportHeld({shard}, dropped);
      });
  if (!server.ok()) {
    return absl::Status(server.status().code(),
                        absl::StrCat("cannot serve snapshots to peers (--host ", options_.host,
                                     ", --snapshot-port ", options_.snapshot_port, "): ",
                                     server.status().message()));
  }
  snapshot_server_ = *std::move(server);
  SHARD_RETURN_IF_ERROR(JoinWithRetry());
  {
    absl::MutexLock lock(&mu_);
    if (job_.has_value() && job_->external_model && !options_.trainer) {
      Fail(absl::FailedPreconditionError(absl::StrCat(
          "job '", job_->name, "' trains a model its workers bring (model.external in the job "
          "spec): start the training script (python3 train.py, with SHARD_COORDINATOR set to "
          "the coordinator's address) in place of shard-worker")));
    } else if (job_.has_value() && !job_->external_model && options_.trainer) {
      Fail(absl::FailedPreconditionError(absl::StrCat(
          "job '", job_->name, "' trains shard-worker's built-in MLP (model.mlp in the job spec), "
          "not a model of its own: start shard-worker for it, or give the coordinator a job "
          "spec with \"model\": {\"external\": {}}")));
    }
  }
  std::thread heartbeat([this] { HeartbeatLoop(); });
  std::thread lease_watch([this] { CoordinatorLeaseWatch(); });
  int64_t attempted_generation = 0;
  while (true) {
    WorldSnapshot target;
    {
      absl::MutexLock lock(&mu_);
      auto next = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stop_ || !fatal_.ok() ||
               (world_.running && world_.rank >= 0 && world_.generation > attempted_generation);
      };
      mu_.Await(absl::Condition(&next));
      if (stop_ || !fatal_.ok()) break;
      target = world_;
    }
    attempted_generation = target.generation;
    absl::Status connected = ConnectGeneration(target);
    if (connected.ok()) continue;
    if (absl::IsAborted(connected) || IsTransient(connected)) {
      // This generation's data path failed (a peer died or hangs, the generation ended, the
      // coordinator restarted): say so, so that the coordinator ends the generation if it has
      // not, and wait for the next one for as long as the coordinator answers (the heartbeat
      // thread gives up on a lost coordinator after --coordinator-timeout).
      spdlog::info("generation {} ended for this worker ({}); waiting for the next generation",
                   target.generation, connected.message());
      int64_t epoch = 0;
      {
        absl::MutexLock lock(&mu_);
        epoch = contact_epoch_;
      }
      ReportGenerationFailed(target, connected);
      absl::MutexLock lock(&mu_);
      while (true) {
        // Back in touch after the coordinator was silent for a lease (training stopped) while
        // it still runs that generation (it restarted and kept it, say): tell it again.
        auto moved_on = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          return stop_ || !fatal_.ok() || world_.generation != target.generation ||
                 contact_epoch_ != epoch;
        };
        mu_.Await(absl::Condition(&moved_on));
        if (stop_ || !fatal_.ok() || world_.generation != target.generation) break;
        epoch = contact_epoch_;
        mu_.Unlock();
        ReportGenerationFailed(target, connected);
        mu_.Lock();
      }
      if (stop_ || !fatal_.ok()) break;
      continue;
    }
    // An error of a generation that is over (its restore point since removed by retention,
    // say) ends that generation, not the process.
    const bool mine = GenerationStillMine(target.generation);
    absl::MutexLock lock(&mu_);
    if (stop_) break;
    if (!mine || world_.generation != target.generation) {
      spdlog::info("generation {} ended ({}); waiting for the next", target.generation,
                   connected.message());
      continue;
    }
    Fail(connected);
    break;
  }
  absl::Status result;
  finished_->store(true);
  {
    absl::MutexLock lock(&mu_);
    result = fatal_;
    stop_ = true;
    if (communicator_ != nullptr) communicator_->Abort("worker exiting");
  }
  heartbeat.join();
  lease_watch.join();
  Leave();
  return result;
}

}  // namespace shard
