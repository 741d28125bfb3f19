#include "worker/agent.h"

#include <algorithm>
#include <future>
#include <random>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/backoff.h"
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
                 .activity = &activity_,
                 .stop = &stop_requested_,
                 .generation_over = &generation_over_,
                 .orders =
                     [this] {
                       absl::MutexLock lock(&mu_);
                       return orders_;
                     },
                 .on_snapshot =
                     [this](const SnapshotShard& shard, const std::vector<std::string>& dropped) {
                       ReportHeld({shard}, dropped);
                     }}) {}

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
  // A reshaping world still trains: its ranks connect and train until they pause.
  world_.running = Trains(FromProto(world.state()));
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
  Backoff refused(absl::Milliseconds(100), absl::Seconds(5));
  Backoff unreachable(absl::Milliseconds(100), absl::Seconds(2));
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
      const absl::Duration wait = refused.Next();
      spdlog::warn("{}; asking again in {}", joined.status().message(),
                   absl::FormatDuration(wait));
      auto stopping = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_; };
      if (mu_.AwaitWithTimeout(absl::Condition(&stopping), wait)) {
        return absl::CancelledError(absl::StrCat("stopped before joining: ", stop_reason_));
      }
      continue;
    }
    if (!IsTransient(joined.status())) return joined.status();
    const absl::Duration wait = unreachable.Next();
    if (absl::Now() + wait > give_up) {
      return absl::UnavailableError(absl::StrCat(
          "cannot reach the coordinator at ", client_->address(), " for ",
          absl::FormatDuration(options_.coordinator_timeout), " (last error: ",
          joined.status().message(), "); is shard-coordinator running there? Check --coordinator"));
    }
    spdlog::warn("{}; retrying in {}", joined.status().message(), absl::FormatDuration(wait));
    auto stopping = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_; };
    if (mu_.AwaitWithTimeout(absl::Condition(&stopping), wait)) {
      return absl::CancelledError(absl::StrCat("stopped before joining: ", stop_reason_));
    }
  }
}

void WorkerAgent::HeartbeatLoop() {
  HeartbeatParams params;
  params.worker_id = options_.worker_id;
  params.incarnation = incarnation_;
  absl::Time last_contact = absl::Now();
  absl::Duration pause = absl::ZeroDuration();
  // While the coordinator is unreachable: 50ms doubling, capped at the heartbeat interval (a
  // restarted coordinator must hear from us within the lease).
  Backoff unreachable(absl::Milliseconds(50), absl::InfiniteDuration());
  absl::Duration backoff = absl::ZeroDuration();  // the latest of those; zero once answered
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
      unreachable.Reset();
      last_contact = absl::Now();
      if (beat->probe_size() > 0 && !probing.valid()) {
        probing = std::async(std::launch::async,
                             [this, reply = *beat] { return prober_.ProbeMembers(reply); });
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
      {
        absl::MutexLock lock(&mu_);
        unreachable.set_max(heartbeat_interval_);
        backoff = unreachable.Next();
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

absl::Status WorkerAgent::RunGeneration(const WorldSnapshot& world) {
  SHARD_ASSIGN_OR_RETURN(const Connected connected, Connect(world));
  SHARD_RETURN_IF_ERROR(Check(world));
  return Train(world, connected);
}

absl::StatusOr<WorkerAgent::Connected> WorkerAgent::Connect(const WorldSnapshot& world) {
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
  if (stop_ || world_.generation != world.generation) {
    return absl::AbortedError("the world moved on while connecting");
  }
  return connected;
}

absl::Status WorkerAgent::Check(const WorldSnapshot& world) {
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

absl::Status WorkerAgent::Train(const WorldSnapshot& world, const Connected& connected) {
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
    start = start_;
    generation_over_ = stop_ || world_.generation != world.generation;
  }
  const GenerationTraining::Generation generation{world.generation, world.rank, communicator.get(),
                                                  std::move(start), &connected.peers};
  SHARD_ASSIGN_OR_RETURN(const GenerationTraining::End end,
                         training_.Train(*connected.job, generation));
  if (end == GenerationTraining::End::kPaused) {
    absl::MutexLock lock(&mu_);
    paused_generation_ = world.generation;
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
  LeaveParams params;
  params.worker_id = options_.worker_id;
  params.incarnation = incarnation_;
  {
    absl::MutexLock lock(&mu_);
    // A process that ends with an error says so: beyond --max-worker-failures the job fails.
    params.failed = !fatal_.ok();
    params.reason = params.failed ? std::string(fatal_.message()) : stop_reason_;
  }
  const std::string& reason = params.reason;
  absl::Status left = client_->Leave(ToProto(params));
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
  // 50ms, then doubling up to the heartbeat interval (set after each wait).
  Backoff unreachable(absl::Milliseconds(50), absl::InfiniteDuration());
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
    mu_.AwaitWithTimeout(absl::Condition(&gone), unreachable.Next());
    unreachable.set_max(heartbeat_interval_);
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

absl::Status WorkerAgent::ProbePeers(const WorldSnapshot& world, RendezvousClient& rendezvous) {
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
    if (world_.generation != world.generation) return absl::AbortedError("generation ended");
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
    if (job_.has_value()) {
      if (absl::Status model = training_.CheckModel(*job_); !model.ok()) Fail(std::move(model));
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
    absl::Status connected = RunGeneration(target);
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
