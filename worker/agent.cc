#include "worker/agent.h"

#include <future>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "proto/control_convert.h"
#include "proto/job_convert.h"
#include "spdlog/spdlog.h"
#include "worker/dataplane/self_check.h"
#include "worker/plan_session.h"

namespace shard {
namespace {

uint64_t RandomIncarnation() {
  std::random_device device;
  return (static_cast<uint64_t>(device()) << 32) ^ device();
}

}  // namespace

WorkerAgent::WorkerAgent(WorkerOptions options, std::unique_ptr<CoordinatorClient> client,
                         std::unique_ptr<DataPath> data_path)
    : options_(std::move(options)),
      client_(std::move(client)),
      data_path_(std::move(data_path)),
      incarnation_(RandomIncarnation()),
      core_({.worker_id = options_.worker_id,
             .incarnation = incarnation_,
             .coordinator = client_->address(),
             .coordinator_timeout = options_.coordinator_timeout}),
      prober_(options_.connect_probe_timeout, &stop_requested_),
      training_({.client = client_.get(),
                 .worker_id = options_.worker_id,
                 .incarnation = incarnation_,
                 .coordinator_timeout = options_.coordinator_timeout,
                 .collective_timeout = options_.collective_timeout,
                 .collective_timeout_floor = options_.collective_timeout_floor,
                 .trainer = options_.trainer,
                 .device = &data_path_->device(),
                 .snapshots = &snapshots_,
                 .snapshot_same_host = options_.snapshot_same_host,
                 .activity = &activity_,
                 .stop = &stop_requested_,
                 .generation_over = &generation_over_,
                 .orders =
                     [this] {
                       absl::MutexLock lock(&mu_);
                       return core_.orders();
                     },
                 .on_snapshot =
                     [this](const SnapshotShard& shard, const std::vector<std::string>& dropped) {
                       held_reports_.Report({shard}, dropped);
                     }}) {}

void WorkerAgent::RequestStop(const std::string& reason) {
  absl::MutexLock lock(&mu_);
  Apply(core_.RequestStop(reason));
}

void WorkerAgent::Apply(const WorkerStep& step) {
  if (step.next == WorkerNext::kEnd) stop_requested_ = true;
  if (step.abort_below <= 0) return;
  // Whatever the data path of an ended generation is blocked in must give way now.
  if (communicator_ != nullptr && communicator_generation_ < step.abort_below) {
    communicator_->Abort(step.abort_reason);
    generation_over_ = true;
  }
  if (step.abort_below == kAbortAll) generation_over_ = true;
  // A rendezvous of an ended generation can never complete: give it up now.
  if (rendezvous_ != nullptr && rendezvous_generation_ < step.abort_below) rendezvous_->Cancel();
}

absl::StatusOr<HeartbeatReply> WorkerAgent::Heartbeat(const v1::HeartbeatRequest& request) {
  absl::StatusOr<v1::HeartbeatResponse> beat = client_->Heartbeat(request);
  if (!beat.ok()) return beat.status();
  return FromProto(*beat);
}

WorkerStep WorkerAgent::Feed(absl::FunctionRef<WorkerStep()> event) {
  const World before = core_.world();
  const int rank_before = core_.rank();
  const WorkerStep step = event();
  Apply(step);
  const World& world = core_.world();
  const int rank = core_.rank();
  if (world.generation == before.generation && rank == rank_before &&
      world.state == before.state) {
    return step;
  }
  SetLogContext(absl::StrCat("worker=", options_.worker_id,
                             rank >= 0 ? absl::StrCat(" rank=", rank) : std::string(" standby"),
                             " gen=", world.generation));
  spdlog::info("world is {} at generation {} with {}/{} ranks held (target {}){}",
               JobStateName(world.state), world.generation, world.world_size, world.ranks,
               world.expected_world_size,
               rank < 0 ? "; this worker is a standby, folded in at the next checkpoint boundary"
                        : "");
  return step;
}

WorkerStep WorkerAgent::Join(WorkerStep step) {
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
  while (step.next == WorkerNext::kJoin) {
    {
      absl::MutexLock lock(&mu_);
      auto ended = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return Ended(); };
      if (mu_.AwaitWithTimeout(absl::Condition(&ended), step.wait)) {
        WorkerStep end;
        end.next = WorkerNext::kEnd;
        return end;
      }
    }
    const absl::Time sent_at = absl::Now();
    absl::StatusOr<v1::JoinResponse> joined = client_->Join(request);
    absl::MutexLock lock(&mu_);
    step = Feed([&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return core_.OnJoinReply(joined.ok() ? absl::StatusOr<JoinReply>(FromProto(*joined))
                                           : absl::StatusOr<JoinReply>(joined.status()),
                               sent_at, absl::Now());
    });
    if (joined.ok() && step.next == WorkerNext::kHeartbeat) {
      job_name_ = joined->job();
      if (joined->has_job_spec() && !job_.has_value()) {
        absl::StatusOr<JobConfig> job = JobConfigFromProto(joined->job_spec(), "");
        if (!job.ok()) {
          step = core_.Fail(absl::Status(
              job.status().code(), absl::StrCat("the coordinator's job spec is not usable here: ",
                                                job.status().message())));
          Apply(step);
        } else {
          job_ = std::move(*job);
        }
      }
      spdlog::info("joined job '{}' as rank {} (lease {}ms)", joined->job(), joined->rank(),
                   joined->lease_ms());
    } else if (step.next == WorkerNext::kJoin) {
      spdlog::warn("{}; asking again in {}", joined.status().message(),
                   absl::FormatDuration(step.wait));
    }
  }
  return step;
}

void WorkerAgent::HeartbeatLoop(WorkerStep step) {
  // An isolated standby's probe runs beside the heartbeats (it may take longer than a lease);
  // its results go with the first heartbeat after it finished.
  std::future<std::vector<PeerProbe>> probing;
  while (true) {
    if (step.next == WorkerNext::kJoin) step = Join(step);
    if (step.next != WorkerNext::kHeartbeat) return;
    {
      absl::MutexLock lock(&mu_);
      auto ended = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return Ended(); };
      if (mu_.AwaitWithTimeout(absl::Condition(&ended), step.wait)) return;
    }
    std::vector<PeerProbe> probed;
    if (probing.valid() &&
        probing.wait_for(std::chrono::seconds(0)) == std::future_status::ready) {
      probed = probing.get();
    }
    ReportAllHeldIfNeeded();
    v1::HeartbeatRequest request;
    {
      absl::MutexLock lock(&mu_);
      request = ToProto(core_.NextHeartbeat(activity_.Read(), std::move(probed)));
    }
    const absl::Time sent_at = absl::Now();
    const absl::StatusOr<HeartbeatReply> beat = Heartbeat(request);
    {
      absl::MutexLock lock(&mu_);
      step = Feed([&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return core_.OnHeartbeatReply(beat, sent_at, absl::Now());
      });
      if (beat.ok() && beat->outcome.stop) {
        spdlog::info("coordinator ordered a stop: {}", beat->outcome.stop_reason);
      } else if (step.next == WorkerNext::kJoin) {
        spdlog::warn("{}; joining again", beat.status().message());
      } else if (step.next == WorkerNext::kHeartbeat && !beat.ok()) {
        spdlog::warn(
            "{} (coordinator silent for {}; retrying in {}, giving up after {})",
            beat.status().message(),
            absl::FormatDuration(absl::Trunc(absl::Now() - core_.last_contact(),
                                             absl::Milliseconds(1))),
            absl::FormatDuration(step.wait), absl::FormatDuration(options_.coordinator_timeout));
      }
      // Taken over by a newer process, or evicted because this one made no progress: it must
      // exit. A collective gives way (the step aborts it), but a computation that hangs cannot:
      // if the training thread has not returned after a grace, the process exits anyway.
      if (core_.taken_out()) {
        std::thread([finished = finished_, message = std::string(beat.status().message())] {
          absl::SleepFor(absl::Seconds(10));
          if (finished->load()) return;
          spdlog::error("{}; the training thread did not return within 10s: exiting the process",
                        message);
          std::_Exit(1);
        }).detach();
      }
    }
    if (!step.probe.empty() && !probing.valid()) {
      probing = std::async(std::launch::async,
                           [this, members = step.probe] { return prober_.ProbeMembers(members); });
    }
    SendFailureReport(step.report_failure);
  }
}

absl::Status WorkerAgent::RunGeneration(const GenerationAssignment& generation) {
  SHARD_ASSIGN_OR_RETURN(const Connected connected, Connect(generation));
  SHARD_RETURN_IF_ERROR(Check(generation));
  return Train(generation, connected);
}

absl::StatusOr<WorkerAgent::Connected> WorkerAgent::Connect(const GenerationAssignment& world) {
  v1::RendezvousScope scope;
  {
    absl::MutexLock lock(&mu_);
    scope.set_job(job_name_);
  }
  scope.set_generation(world.generation);
  std::shared_ptr<RendezvousClient> rendezvous = client_->RendezvousStore(scope);
  {
    absl::MutexLock lock(&mu_);
    if (Ended()) return absl::CancelledError("stopping");
    rendezvous_ = rendezvous;
    rendezvous_generation_ = world.generation;
    link_faults_.clear();
    if (core_.world().generation != world.generation) rendezvous_->Cancel();  // ended already
  }
  spdlog::info("connecting the data path: rank {} of {} on {} over {} (peers reach {})",
               world.rank, world.world_size, data_path_->device().name(), data_path_->backend(),
               options_.host);
  Connected connected;
  {
    absl::MutexLock lock(&mu_);
    connected.job = job_;
  }
  // This rank's host and where its snapshots are served, published before connecting: once the
  // data path is connected, every peer's are in the store.
  const bool snapshots = connected.job.has_value() && connected.job->snapshot_every > 0;
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
  GenerationPeers& peers = connected.peers;
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
  absl::MutexLock lock(&mu_);
  rendezvous_ = nullptr;
  if (!created.ok()) return created.status();
  communicator_ = TrackCollectives(std::move(*created), &activity_);
  if (Ended() || core_.world().generation != world.generation) {
    return absl::AbortedError("the world moved on while connecting");
  }
  return connected;
}

absl::Status WorkerAgent::Check(const GenerationAssignment& world) {
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
  // Connected and checked: a later generation change aborts this communicator.
  absl::MutexLock lock(&mu_);
  communicator_generation_ = world.generation;
  return absl::OkStatus();
}

absl::Status WorkerAgent::Train(const GenerationAssignment& world, const Connected& connected) {
  // Also after this worker finished: a new generation means the job is not finished (a rank
  // died before it reported the end), and every rank trains again from the restore point.
  if (!connected.job.has_value()) {
    return options_.manifest.has_value() ? ApplyPlan() : absl::OkStatus();
  }
  std::shared_ptr<Communicator> communicator;
  v1::TrainingStart start;
  {
    absl::MutexLock lock(&mu_);
    communicator = communicator_;
    start = ToProto(core_.start());
    generation_over_ = Ended() || core_.world().generation != world.generation;
  }
  const GenerationTraining::Generation generation{world.generation, world.rank, communicator.get(),
                                                  std::move(start), &connected.peers};
  SHARD_ASSIGN_OR_RETURN(const GenerationTraining::End end,
                         training_.Train(*connected.job, generation));
  if (end == GenerationTraining::End::kPaused) {
    absl::MutexLock lock(&mu_);
    core_.OnPaused(world.generation);
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
  report.snapshot_address = snapshot_address_;
  if (absl::Status sent = client_->ReportSnapshot(ToProto(report)); !sent.ok()) {
    spdlog::warn("could not tell the coordinator about snapshot shards held ({}); telling it "
                 "everything held before the next heartbeat",
                 sent.message());
    absl::MutexLock lock(&mu_);
    core_.OnHeldReportFailed();
  }
}

void WorkerAgent::ReportAllHeldIfNeeded() {
  {
    absl::MutexLock lock(&mu_);
    if (!core_.TakeReportAllHeld()) return;
  }
  std::vector<SnapshotShard> held = snapshots_.Holdings();
  if (held.empty()) return;
  ReportHeld(held, {});
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
    rank = core_.rank();
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
  std::optional<LeaveParams> params;
  {
    absl::MutexLock lock(&mu_);
    params = core_.LeaveRequest();
  }
  if (!params.has_value()) return;  // the coordinator no longer counts this worker
  absl::Status left = client_->Leave(ToProto(*params));
  if (left.ok()) {
    spdlog::info("left the job ({})", params->reason);
  } else {
    spdlog::warn("could not leave cleanly: {}", left.message());
  }
}

void WorkerAgent::GenerationEnded(const GenerationAssignment& generation,
                                  const absl::Status& status) {
  std::vector<PeerFault> unreachable;
  WorkerStep step;
  {
    absl::MutexLock lock(&mu_);
    unreachable = link_faults_;
    if (communicator_ != nullptr && communicator_generation_ == generation.generation) {
      if (std::optional<PeerFault> fault = communicator_->peer_fault()) {
        unreachable.push_back(*std::move(fault));
      }
    }
    step = core_.OnGenerationEnded(generation.generation, status, std::move(unreachable));
    Apply(step);
  }
  if (step.next == WorkerNext::kAskStillMine) {
    spdlog::warn("generation {} failed ({}); asking the coordinator whether it is still this "
                 "worker's before exiting with the error",
                 generation.generation, status.message());
  } else if (!status.ok() && step.next != WorkerNext::kEnd) {
    spdlog::info("generation {} ended for this worker ({}); waiting for the next generation",
                 generation.generation, status.message());
  }
  SendFailureReport(step.report_failure);
  // An error of its own: the process ends with it unless the generation is no longer this
  // worker's, which the coordinator is asked now.
  while (step.next == WorkerNext::kAskStillMine) {
    HeartbeatParams params;
    {
      absl::MutexLock lock(&mu_);
      auto ended = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return Ended(); };
      if (mu_.AwaitWithTimeout(absl::Condition(&ended), step.wait)) return;
      params = core_.StillMineRequest();
    }
    const absl::Time sent_at = absl::Now();
    const absl::StatusOr<HeartbeatReply> beat = Heartbeat(ToProto(params));
    {
      absl::MutexLock lock(&mu_);
      step = Feed([&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return core_.OnStillMineReply(beat, sent_at, absl::Now());
      });
    }
    SendFailureReport(step.report_failure);
    if (step.next == WorkerNext::kWait) {
      spdlog::info("generation {} ended ({}); waiting for the next", generation.generation,
                   status.message());
    }
  }
}

void WorkerAgent::SendFailureReport(const std::optional<SelfCheckReport>& report) {
  if (!report.has_value()) return;
  absl::Status sent = client_->ReportSelfCheck(ToProto(*report));
  if (!sent.ok()) {
    // The generation ended meanwhile, or the coordinator is away: told again once it answers.
    spdlog::info("could not report the failure of generation {}: {}", report->generation,
                 sent.message());
  }
  absl::MutexLock lock(&mu_);
  core_.OnFailureReported(*report, sent);
}

void WorkerAgent::CoordinatorLeaseWatch() {
  absl::MutexLock lock(&mu_);
  while (!Ended()) {
    const absl::Time expiry = core_.LeaseExpiry();
    auto changed = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return Ended() || core_.LeaseExpiry() != expiry;
    };
    if (mu_.AwaitWithDeadline(absl::Condition(&changed), expiry)) continue;
    const WorkerStep step = core_.OnLeaseCheck(absl::Now());
    if (step.abort_below > 0) spdlog::warn("{}", step.abort_reason);
    Apply(step);
  }
}

absl::Status WorkerAgent::ProbePeers(const GenerationAssignment& world,
                                     RendezvousClient& rendezvous) {
  SHARD_ASSIGN_OR_RETURN(std::vector<PeerFault> faults,
                         prober_.ProbeRanks(rendezvous, world.rank, world.world_size,
                                            snapshot_server_->address(),
                                            options_.collective_timeout));
  if (faults.empty()) return absl::OkStatus();
  std::vector<std::string> failed;
  for (const PeerFault& fault : faults) {
    failed.push_back(absl::StrCat("rank ", fault.peer_rank, " (", fault.detail, ")"));
  }
  {
    absl::MutexLock lock(&mu_);
    if (core_.world().generation != world.generation) {
      return absl::AbortedError("generation ended");
    }
    link_faults_ = std::move(faults);
  }
  return absl::UnavailableError(
      absl::StrCat("cannot connect to ", absl::StrJoin(failed, ", "),
                   " over the data path's network: the coordinator re-forms the world with "
                   "workers that reach one another"));
}

absl::Status WorkerAgent::Run() {
  absl::StatusOr<std::unique_ptr<SnapshotServer>> server = SnapshotServer::Start(
      options_.host, options_.snapshot_port, &snapshots_,
      [this](const SnapshotShard& shard, const std::vector<std::string>& dropped) {
        held_reports_.Report({shard}, dropped);
      });
  if (!server.ok()) {
    return absl::Status(server.status().code(),
                        absl::StrCat("cannot serve snapshots to peers (--host ", options_.host,
                                     ", --snapshot-port ", options_.snapshot_port, "): ",
                                     server.status().message()));
  }
  snapshot_server_ = *std::move(server);
  snapshot_address_ = snapshot_server_->address();
  WorkerStep step;
  {
    absl::MutexLock lock(&mu_);
    step = core_.Start(absl::Now());
  }
  step = Join(step);
  {
    absl::MutexLock lock(&mu_);
    // Before joining there is nothing to leave.
    if (step.next != WorkerNext::kHeartbeat) return core_.exit_status();
    if (job_.has_value()) {
      if (absl::Status model = training_.CheckModel(*job_); !model.ok()) {
        Apply(core_.Fail(std::move(model)));
      }
    }
  }
  std::thread heartbeat([this, step] { HeartbeatLoop(step); });
  std::thread lease_watch([this] { CoordinatorLeaseWatch(); });
  while (true) {
    GenerationAssignment target;
    {
      absl::MutexLock lock(&mu_);
      auto next = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return Ended() || core_.HasGenerationToTrain();
      };
      mu_.Await(absl::Condition(&next));
      if (Ended()) break;
      target = *core_.TakeGeneration();
    }
    GenerationEnded(target, RunGeneration(target));
  }
  absl::Status result;
  finished_->store(true);
  {
    absl::MutexLock lock(&mu_);
    result = core_.exit_status();
    Apply(core_.RequestStop("worker exiting"));
  }
  heartbeat.join();
  lease_watch.join();
  Leave();
  return result;
}

}  // namespace shard
