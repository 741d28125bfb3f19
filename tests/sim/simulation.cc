#include "tests/sim/simulation.h"

#include <algorithm>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <queue>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/job_spec.h"
#include "common/step_boundary.h"
#include "common/worker_core.h"
#include "server/coordinator_core.h"
#include "server/membership_log.h"
#include "tests/sim/sim_store.h"

namespace shard::sim {
namespace {

// Timing of the simulated system, in simulated time.
constexpr absl::Duration kLease = absl::Seconds(1);
constexpr absl::Duration kHousekeeping = absl::Milliseconds(50);
constexpr absl::Duration kCoordinatorTimeout = absl::Seconds(60);  // shard-worker's default
constexpr absl::Duration kCollectiveTimeout = absl::Seconds(60);
constexpr absl::Duration kConnectTimeout = absl::Seconds(10);
// A connect probe across a cut link gives up after this; a collective across one fails after
// the link timeout (TCP_USER_TIMEOUT on the Gloo mesh, worker/dataplane/gloo_communicator.h).
constexpr absl::Duration kProbeTimeout = absl::Seconds(2);
constexpr absl::Duration kLinkTimeout = absl::Seconds(10);
constexpr char kCheckpointRoot[] = "/sim/checkpoints";

// How a profile draws: the share (percent) of each fault, what is left going to an operator's
// call, and of each operator's call, what is left being a stop.
struct Weights {
  int kill = 0, stop = 0, coordinator_crash = 0, start_gone = 0, new_worker = 0, partition = 0,
      stall = 0;
  int resize = 0, drain = 0, save = 0, restore = 0;
  absl::Duration longest_stop;
  bool stop_as_generation_starts = false;  // SIGSTOP mostly a worker whose generation starts
  // The chance (percent) that the coordinator crashes within 2 s of an operator's resize or
  // drain: before the reshape is journaled, or while it is in flight.
  int crash_after_reshape = 0;
  // Once faults stop, workers are started up to the job's minimum world size (or the operators'
  // target, in a run that has not trained) rather than its size: the job must finish with the
  // workers it has, as a job whose lost pods never come back must.
  bool heal_to_min_world = false;
  // Counts the live workers again 3 leases after faults stop: a resumed worker may exit on what
  // it learns then (a stop it missed).
  bool recount_after_heal = false;
  // The job: at least one standby allowed and one worker more than the world at the start; at
  // least this many ranks; a disk checkpoint every 5 steps, 1 or 2 kept, no snapshots. These
  // are drawn after the mixed draws, so that the mixed profile keeps every seed as it was.
  bool standby_at_start = false;
  int least_world_size = 0;
  bool frequent_disk_checkpoints = false;
  absl::Duration last_start = absl::Milliseconds(500);  // the first workers start by then
};

const Weights& WeightsOf(Profile profile) {
  static const Weights kMixed{.kill = 25, .stop = 15, .coordinator_crash = 10, .start_gone = 10,
                              .new_worker = 5, .partition = 3, .stall = 2,
                              .resize = 35, .drain = 20, .save = 25, .restore = 17,
                              .longest_stop = absl::Seconds(4)};
  static const Weights kReshapeAndRestart{
      .kill = 10, .stop = 5, .coordinator_crash = 25, .start_gone = 10, .new_worker = 5,
      .resize = 60, .drain = 15, .save = 10, .restore = 14,
      .longest_stop = absl::Seconds(4), .crash_after_reshape = 50, .heal_to_min_world = true,
      .recount_after_heal = true, .standby_at_start = true, .least_world_size = 3,
      .last_start = absl::Seconds(6)};  // operators reshape worlds still forming
  static const Weights kStoppedWorker{
      .kill = 5, .stop = 35, .coordinator_crash = 5, .start_gone = 10, .new_worker = 5,
      .resize = 10, .drain = 10, .save = 30, .restore = 48,
      .longest_stop = absl::Seconds(6), .stop_as_generation_starts = true,
      .recount_after_heal = true, .standby_at_start = true, .frequent_disk_checkpoints = true};
  switch (profile) {
    case Profile::kMixed:
      return kMixed;
    case Profile::kReshapeAndRestart:
      return kReshapeAndRestart;
    case Profile::kStoppedWorker:
      return kStoppedWorker;
  }
  return kMixed;
}

constexpr std::pair<Profile, absl::string_view> kProfileNames[] = {
    {Profile::kMixed, "mixed"},
    {Profile::kReshapeAndRestart, "reshape-and-restart"},
    {Profile::kStoppedWorker, "stopped-worker"},
};

// The model's parameters after `step`, as a hash chain: equal chains mean equal training.
uint64_t Mix(uint64_t hash, int64_t step) {
  uint64_t z = hash + 0x9e3779b97f4a7c15ULL * static_cast<uint64_t>(step + 1);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

class Failure {
 public:
  void Set(std::string message) {
    if (message_.empty()) message_ = std::move(message);
  }
  bool failed() const { return !message_.empty(); }
  const std::string& message() const { return message_; }

 private:
  std::string message_;
};

// One worker's data path in one generation (worker/agent.cc RunGeneration, and
// worker/generation_training.cc).
struct Session {
  enum class Phase { kRendezvous, kConnecting, kChecking, kTraining, kPaused, kDone, kFailed };
  int64_t generation = 0;
  int rank = 0;
  int size = 0;
  Phase phase = Phase::kRendezvous;
  int writes = 0;             // shard writes not yet reported
  int snapshot_work = 0;      // its snapshot's report and pushes to buddies not yet done
  bool pause_after_writes = false;
  bool done_after_writes = false;
  std::shared_ptr<const Plan> plan;  // the plan it trains with (snapshots are laid out by it)
};

// The ranks of one generation that connected their data path: they step in lockstep.
// The orders the ranks agreed on at a step boundary, and whether a rank's snapshot work was
// still in flight then.
struct PostedAgreement {
  StepOrders orders;
  bool snapshots_busy = false;
};

struct Group {
  int64_t generation = 0;
  int size = 0;
  std::map<int, int> members;  // rank -> worker index
  bool started = false;        // restored and stepping
  bool stepping = false;       // a step is scheduled
  bool over = false;           // failed, paused or done
  absl::Time last_step_at;     // when it finished its last step (or started)
  std::optional<absl::Time> halted_at;  // since when a member holds the others up
  int64_t step = 0;
  uint64_t hash = 0;
  StepBoundaryState boundary;
  // What the ranks posted at the last boundary, for the next one to act on.
  std::optional<PostedAgreement> posted;
  std::string restored_from;
};

// One worker's process: the shipped protocol (WorkerCore) and what the simulation fakes
// around it (the process, its data path, the snapshots it holds).
struct Worker {
  std::string id;
  uint64_t incarnation = 0;
  uint64_t process = 0;  // bumped at every start and death: events of an older one are void
  bool alive = false;
  bool stopped = false;  // SIGSTOP
  // Its training thread hangs outside any collective while its heartbeats go on (a hung
  // kernel, a deadlocked data loader): the progress lease must find it.
  bool training_stalled = false;
  bool exited = false;
  std::string exit_reason;
  // worker/agent.cc's protocol, the same class: a new one for every process.
  std::unique_ptr<WorkerCore> core;
  std::vector<PeerProbe> probed;  // an isolated standby's probe, sent with its next heartbeat
  std::optional<Session> session;
  bool trained = false;
  bool leaving = false;
  bool failure_injected = false;  // its training failed with an error on purpose
  absl::Time lease_check;  // when the lease watch looks next (worker/agent.cc)
  std::vector<std::function<void()>> deferred;  // events that came while stopped
  // The snapshot shards this process holds in memory (its own and its buddies'), by snapshot id
  // and rank, the newest two snapshots (worker/dataplane/snapshot_store.h).
  std::map<std::string, std::map<int, SnapshotShard>> held;
};

class Simulation {
 public:
  explicit Simulation(const SimulationOptions& options)
      : options_(options),
        weights_(WeightsOf(options.profile)),
        rng_(options.seed),
        failure_rng_(options.seed ^ 0x5eedfa11u) {}

  SimulationResult Run();

 private:
  // --- Scheduling ---
  void At(absl::Time when, std::function<void()> action) {
    queue_.push(Event{when, next_event_++, std::move(action)});
  }
  void After(absl::Duration delay, std::function<void()> action) {
    At(now_ + delay, std::move(action));
  }
  // An event of worker `index`'s current process: void once it dies, deferred while stopped.
  void ForWorker(int index, absl::Duration delay, std::function<void(Worker&)> action);
  // The same for process `process` of the worker (replies to a request it sent).
  void ForProcess(int index, uint64_t process, absl::Duration delay,
                  std::function<void(Worker&)> action);
  absl::Duration Uniform(absl::Duration low, absl::Duration high) {
    return low + absl::Nanoseconds(std::uniform_int_distribution<int64_t>(
                     0, absl::ToInt64Nanoseconds(high - low))(rng_));
  }
  int Pick(int n) { return std::uniform_int_distribution<int>(0, n - 1)(rng_); }
  bool Chance(double p) { return std::bernoulli_distribution(p)(rng_); }
  absl::Duration NetworkDelay() { return Uniform(absl::Microseconds(200), absl::Milliseconds(3)); }
  void Log(const std::string& line) {
    if (options_.verbose) {
      std::printf("%9.3fs %s\n", absl::ToDoubleSeconds(now_ - epoch_), line.c_str());
    }
  }

  // --- The coordinator ---
  void StartCoordinator();
  void CrashCoordinator();
  void CrashAndRestartCoordinator();  // restarted on its state after up to 3 s
  void MaybeCrashAfterReshape();      // as the profile's crash_after_reshape says
  void Housekeep(uint64_t coordinator);
  void ScheduleFlush();
  // Sends a request: `call` runs on the coordinator after the network delay and answers
  // through `reply`, whose result reaches the worker after the delay back. A request to a down
  // or restarting coordinator, or one it held when it died, fails with Unavailable.
  using Deliver = std::function<void(std::function<void(Worker&)>)>;
  void Call(int index, std::function<void(CoordinatorCore&, Deliver)> call,
            std::function<void(Worker&)> unavailable);

  // --- Workers (worker/agent.cc) ---
  int AddWorker(std::string id);
  void StartProcess(int index);
  void Kill(int index, const std::string& why);
  void Stop(int index, absl::Duration for_how_long);
  void Resume(int index);
  void Exit(Worker& worker, const std::string& reason, bool error);
  // The calls of WorkerCore's chains, and what the worker does with each step it returns.
  // Exchange sends one: `send` runs on the coordinator, and its reply (Unavailable when the
  // coordinator is down or dies holding the call) goes to `answer` in the worker's process,
  // with when it was sent; the step `answer` returns is applied.
  template <typename Reply>
  void Exchange(int index,
                std::function<void(CoordinatorCore&, Callback<absl::StatusOr<Reply>>)> send,
                std::function<WorkerStep(Worker&, const absl::StatusOr<Reply>&, absl::Time)> answer);
  void Join(int index);
  void Heartbeat(int index);
  void AskStillMine(int index);
  void Apply(int index, const WorkerStep& step);
  // A reply's world, before the core sees it: never older than what the worker knew when it
  // sent the request (replies on its two chains may overtake one another).
  void CheckToldWorld(const Worker& worker, const World& world, int64_t known_at_send);
  void ScheduleLeaseCheck(int index);
  void SendFailureReport(int index, const SelfCheckReport& report);
  // The process ends as its core decided: leaves if the core says so, and exits.
  void End(int index);
  void TryConnect(int index);
  // `unreachable`: the peers it reports it could not reach.
  void FailSession(int index, const absl::Status& status,
                   std::vector<PeerFault> unreachable = {});
  // Whether the link between workers `a` and `b` (indexes) is cut.
  bool Cut(int a, int b) const {
    return cut_links_.contains({std::min(a, b), std::max(a, b)});
  }
  // Cuts the links of `links` for `how_long`; collectives across them time out.
  void Partition(const std::vector<std::pair<int, int>>& links, absl::Duration how_long);
  // FailSession later, if the worker's session is still of `generation` by then.
  void FailSessionLater(int index, int64_t generation, absl::Duration delay, absl::Status status);
  void OnConnected(int index);
  void Rendezvoused(int index);
  void CheckGroup(int64_t generation);
  void Step(int64_t generation);
  // Every rank of `generation` reports `step` done, the coordinator notes that training
  // started, and its status must show the step.
  void ReportStep(int64_t generation, int64_t step);
  void ShardWritten(int index, int64_t generation, std::string id, int64_t step, int64_t request,
                    uint64_t hash);
  void WritesDone(int index);
  Group* GroupOf(const Worker& worker);
  // --- Snapshots (worker/dataplane/snapshotter.h, snapshot_peer.h) ---
  // Worker `index` keeps `shard`; returns the snapshot ids it dropped (it keeps the newest two).
  std::vector<std::string> Hold(int index, const SnapshotShard& shard);
  // Tells the coordinator (a call), then runs `then` in the worker's process.
  void ReportHeld(int index, std::vector<SnapshotShard> held, std::vector<std::string> dropped,
                  std::function<void(Worker&)> then);
  // Rank `rank` of `generation` took its shard of a snapshot: keep, report, push to buddies.
  void TakeSnapshot(int index, int64_t generation, SnapshotShard shard,
                    std::vector<int> buddies);
  void SnapshotWorkDone(int index, int64_t generation);
  // Rank `rank`'s shard record laid out by `plan`, for the state the ranks save and with the
  // job's extras on rank 0 of a script's own optimizer; `hash` stands in for every checksum.
  ShardRecord ShardRecordOf(const Manifest& model, const Plan& plan, int rank,
                            uint64_t hash) const;
  std::string SnapshotAddress(int index) const {
    return absl::StrCat("10.0.0.", index % 250 + 1, ":9000");
  }
  // Restores a generation from its memory restore point: OK, or why a holder did not serve.
  absl::Status RestoreFromMemory(int index, int64_t generation, int64_t* step, uint64_t* hash);

  // --- Faults and operators ---
  void Fault();
  // Worker `index`'s training fails with an error a restart does not fix: it leaves failed and
  // exits; its pod is restarted (and may fail again).
  void FailTraining(int index);
  void Operator();
  void Heal();
  // Starts workers (those gone first, then new ones) until enough are alive.
  void StartEnoughWorkers();

  // --- Properties ---
  void CheckInvariants();
  void CheckDiskEqualsMemory();
  bool Settled();
  std::string Describe();

  SimulationOptions options_;
  const Weights& weights_;
  std::mt19937_64 rng_;
  // Draws for training failures, apart: seeds that inject none draw the same as before they
  // existed (pinned seeds keep their scenario).
  std::mt19937_64 failure_rng_;
  bool inject_failures_ = false;
  int failed_leaves_sent_ = 0;   // leaves that said the worker failed
  int failed_leaves_acked_ = 0;  // ... that the coordinator acknowledged (durably counted)
  struct Event {
    absl::Time when;
    uint64_t sequence;
    std::function<void()> action;
    bool operator>(const Event& other) const {
      return when != other.when ? when > other.when : sequence > other.sequence;
    }
  };
  std::priority_queue<Event, std::vector<Event>, std::greater<Event>> queue_;
  uint64_t next_event_ = 0;
  const absl::Time epoch_ = absl::FromUnixSeconds(1700000000);
  absl::Time now_ = epoch_;
  SimulationResult result_;
  Failure failure_;

  // The job. Its model is the MLP's manifest, registered by the workers either as the built-in
  // MLP or as an external model whose script brings its own optimizer (kTorch): then the ranks
  // report the state that optimizer keeps, and rank 0 appends the job's extras to its shards.
  JobConfig job_;
  Manifest model_;
  OptimizerStateKind saved_state_;
  std::set<std::string> manifests_checked_;
  CoreOptions core_options_;
  uint64_t reference_hash_ = 0;
  absl::Duration step_time_;
  absl::Time faults_end_;
  absl::Time deadline_;

  SimStateStore store_;
  SimCheckpointStorage storage_;
  std::unique_ptr<CoordinatorCore> core_;
  uint64_t coordinator_ = 0;  // bumped at every start and crash
  bool flush_scheduled_ = false;
  struct PendingCall {
    int index;
    uint64_t process;
    std::function<void(Worker&)> unavailable;
  };
  std::map<uint64_t, PendingCall> pending_calls_;
  uint64_t next_call_ = 0;

  std::vector<std::unique_ptr<Worker>> workers_;
  int next_worker_id_ = 0;
  std::map<int64_t, Group> groups_;

  // What the invariants remember.
  int64_t max_generation_told_ = 0;
  std::set<std::pair<int, int>> cut_links_;  // (lower index, higher index)
  int64_t newest_trained_generation_ = 0;    // the newest generation that took a step
  std::map<std::string, std::string> catalog_;  // as last seen: id -> dir
  std::set<std::string> removed_;               // directories removed by retention or a delete
  int committed_ = 0;                           // checkpoints seen committed
  size_t removals_checked_ = 0;
  bool operator_stopped_ = false;
  bool run_trained_ = false;  // a generation trained since the coordinator last started a run
  std::optional<uint64_t> final_hash_;
};

void Simulation::ForWorker(int index, absl::Duration delay, std::function<void(Worker&)> action) {
  ForProcess(index, workers_[index]->process, delay, std::move(action));
}

void Simulation::ForProcess(int index, uint64_t process, absl::Duration delay,
                            std::function<void(Worker&)> action) {
  After(delay, [this, index, process, action = std::move(action)]() {
    Worker& worker = *workers_[index];
    if (worker.process != process || !worker.alive) return;
    if (worker.stopped) {
      worker.deferred.push_back([this, index, process, action]() {
        Worker& resumed = *workers_[index];
        if (resumed.process == process && resumed.alive) action(resumed);
      });
      return;
    }
    action(worker);
  });
}

// --- The coordinator -----------------------------------------------------------------------------

void Simulation::StartCoordinator() {
  absl::StatusOr<std::unique_ptr<CoordinatorCore>> core =
      CoordinatorCore::Create(core_options_, &store_, &storage_, now_);
  if (!core.ok()) {
    failure_.Set(absl::StrCat("the coordinator cannot start on its own state: ",
                              core.status().ToString()));
    return;
  }
  core_ = std::move(*core);
  if (!core_->recovered()) run_trained_ = false;
  const uint64_t coordinator = ++coordinator_;
  Log(absl::StrCat("coordinator up at generation ", core_->world().world().generation,
                   core_->recovered() ? (core_->kept_generation() ? " (kept)" : " (new)") : ""));
  After(kHousekeeping, [this, coordinator] { Housekeep(coordinator); });
  ScheduleFlush();
}

void Simulation::CrashAndRestartCoordinator() {
  if (core_ == nullptr) return;
  CrashCoordinator();
  After(Uniform(absl::Milliseconds(100), absl::Seconds(3)), [this] {
    if (core_ == nullptr && !failure_.failed()) StartCoordinator();
  });
}

void Simulation::CrashCoordinator() {
  if (core_ == nullptr) return;
  ++result_.coordinator_crashes;
  Log("coordinator SIGKILLed");
  store_.Crash();
  core_.reset();
  ++coordinator_;
  // Every request it held fails: the connection is gone.
  std::map<uint64_t, PendingCall> lost;
  lost.swap(pending_calls_);
  for (auto& [id, call] : lost) {
    ForProcess(call.index, call.process, absl::Milliseconds(1), std::move(call.unavailable));
  }
}

void Simulation::Housekeep(uint64_t coordinator) {
  if (coordinator != coordinator_ || core_ == nullptr) return;
  // As the server's housekeeping thread: again at once while fired heartbeats wait for answers.
  const bool more = core_->Housekeep(now_);
  ScheduleFlush();
  After(more ? absl::ZeroDuration() : kHousekeeping,
        [this, coordinator] { Housekeep(coordinator); });
}

void Simulation::ScheduleFlush() {
  if (flush_scheduled_ || !store_.has_pending()) return;
  flush_scheduled_ = true;
  const uint64_t coordinator = coordinator_;
  After(Uniform(absl::Microseconds(500), absl::Milliseconds(8)), [this, coordinator] {
    flush_scheduled_ = false;
    if (coordinator != coordinator_ || core_ == nullptr) return;
    store_.Flush();
    CheckDiskEqualsMemory();
  });
}

void Simulation::Call(int index, std::function<void(CoordinatorCore&, Deliver)> call,
                      std::function<void(Worker&)> unavailable) {
  const uint64_t id = next_call_++;
  const uint64_t process = workers_[index]->process;
  const uint64_t coordinator = coordinator_;
  After(NetworkDelay(), [this, index, id, process, coordinator, call = std::move(call),
                         unavailable = std::move(unavailable)]() mutable {
    if (coordinator != coordinator_ || core_ == nullptr) {
      ForProcess(index, process, absl::Milliseconds(1), std::move(unavailable));
      return;
    }
    pending_calls_[id] = PendingCall{index, process, std::move(unavailable)};
    const uint64_t served_by = coordinator_;
    call(*core_, [this, id, index, process, served_by](std::function<void(Worker&)> handle) {
      if (served_by != coordinator_) return;  // answered by a coordinator that died
      pending_calls_.erase(id);
      ForProcess(index, process, NetworkDelay(), std::move(handle));
    });
    ScheduleFlush();
  });
}

// --- Workers ----------------------------------------------------------------------------------

int Simulation::AddWorker(std::string id) {
  auto worker = std::make_unique<Worker>();
  worker->id = std::move(id);
  workers_.push_back(std::move(worker));
  return static_cast<int>(workers_.size()) - 1;
}

void Simulation::StartProcess(int index) {
  Worker& worker = *workers_[index];
  const std::string id = worker.id;
  const uint64_t incarnation = worker.incarnation + 1;
  const uint64_t process = worker.process + 1;
  worker = Worker{};
  worker.id = id;
  worker.incarnation = incarnation;
  worker.process = process;
  worker.alive = true;
  worker.core = std::make_unique<WorkerCore>(WorkerCoreOptions{
      .worker_id = id,
      .incarnation = incarnation,
      .coordinator = "coordinator:7000",
      .coordinator_timeout = kCoordinatorTimeout});
  Log(absl::StrCat(id, " starts (incarnation ", incarnation, ")"));
  Apply(index, worker.core->Start(now_));
}

void Simulation::Exit(Worker& worker, const std::string& reason, bool error) {
  Log(absl::StrCat(worker.id, " exits: ", reason));
  worker.alive = false;
  worker.exited = true;
  worker.exit_reason = reason;
  ++worker.process;
  if (error) {
    failure_.Set(absl::StrCat("worker ", worker.id, " exited with an error: ", reason));
  }
}

void Simulation::Kill(int index, const std::string& why) {
  Worker& worker = *workers_[index];
  Log(absl::StrCat(worker.id, " SIGKILLed (", why, ")"));
  worker.alive = false;
  worker.stopped = false;
  worker.deferred.clear();
  worker.held.clear();
  ++worker.process;
  // Its peers' collectives fail at once: the sockets reset.
  if (Group* group = GroupOf(worker); group != nullptr && !group->over) {
    for (const auto& [rank, peer] : group->members) {
      if (peer == index) continue;
      FailSessionLater(peer, group->generation, absl::Milliseconds(10),
                       absl::UnavailableError("a peer's connection was reset"));
    }
    group->over = true;
  }
}

void Simulation::Stop(int index, absl::Duration for_how_long) {
  Worker& worker = *workers_[index];
  Log(absl::StrCat(worker.id, " SIGSTOPped for ", absl::FormatDuration(for_how_long)));
  worker.stopped = true;
  const uint64_t process = worker.process;
  After(for_how_long, [this, index, process] {
    if (workers_[index]->process == process) Resume(index);
  });
}

void Simulation::Resume(int index) {
  Worker& worker = *workers_[index];
  if (!worker.stopped) return;
  Log(absl::StrCat(worker.id, " SIGCONTed"));
  worker.stopped = false;
  std::vector<std::function<void()>> deferred;
  deferred.swap(worker.deferred);
  for (std::function<void()>& event : deferred) After(absl::ZeroDuration(), std::move(event));
  // A collective it was part of may have moved on without it.
  if (Group* group = GroupOf(worker); group != nullptr && group->over && worker.session &&
                                      worker.session->phase == Session::Phase::kTraining) {
    FailSessionLater(index, group->generation, absl::Milliseconds(5),
                     absl::UnavailableError("peers gave up the collective"));
  }
  if (Group* group = GroupOf(worker); group != nullptr && !group->over && !group->stepping &&
                                      group->started) {
    group->stepping = true;
    const int64_t generation = group->generation;
    After(step_time_, [this, generation] { Step(generation); });
  }
}

void Simulation::Apply(int index, const WorkerStep& step) {
  Worker& worker = *workers_[index];
  if (!worker.alive) return;
  // The agent aborts the communicator (or cancels the rendezvous) of an ended generation.
  if (step.abort_below > 0 && worker.session.has_value() &&
      worker.session->generation < step.abort_below) {
    FailSession(index, absl::AbortedError(step.abort_reason));
  }
  if (step.report_failure.has_value()) SendFailureReport(index, *step.report_failure);
  // An isolated standby connects to every member it was given
  // (worker/peer_probe.cc PeerProber::ProbeMembers).
  for (PeerProbe probe : step.probe) {
    for (int peer = 0; peer < static_cast<int>(workers_.size()); ++peer) {
      if (workers_[peer]->id != probe.worker_id) continue;
      probe.reachable = workers_[peer]->alive && !workers_[peer]->stopped && !Cut(index, peer);
      if (!probe.reachable) probe.detail = "timed out";
    }
    worker.probed.push_back(std::move(probe));
  }
  switch (step.next) {
    case WorkerNext::kWait:
      break;
    case WorkerNext::kJoin:
      ForWorker(index, step.wait, [this, index](Worker&) { Join(index); });
      break;
    case WorkerNext::kHeartbeat:
      ForWorker(index, step.wait, [this, index](Worker&) { Heartbeat(index); });
      break;
    case WorkerNext::kAskStillMine:
      ForWorker(index, step.wait, [this, index](Worker&) { AskStillMine(index); });
      break;
    case WorkerNext::kEnd:
      End(index);
      return;
  }
  ScheduleLeaseCheck(index);
  TryConnect(index);
}

void Simulation::ScheduleLeaseCheck(int index) {
  Worker& worker = *workers_[index];
  const absl::Time expiry = worker.core->LeaseExpiry();
  if (expiry == absl::InfiniteFuture() || expiry == worker.lease_check) return;
  worker.lease_check = expiry;
  // worker/agent.cc CoordinatorLeaseWatch(): a rank the coordinator has not answered for a
  // lease stops training (it counts as dead there, and may have been replaced).
  ForWorker(index, std::max(expiry - now_, absl::ZeroDuration()), [this, index](Worker& w) {
    const WorkerStep step = w.core->OnLeaseCheck(now_);
    if (step.abort_below > 0) Log(absl::StrCat(w.id, ": ", step.abort_reason));
    Apply(index, step);
  });
}

void Simulation::CheckToldWorld(const Worker& worker, const World& world,
                                int64_t known_at_send) {
  const World& known = worker.core->world();
  if (world.generation != known.generation || world.state != known.state) {
    Log(absl::StrCat(worker.id, " learns generation ", world.generation, " (",
                     JobStateName(world.state), ")"));
  }
  if (world.generation < known_at_send) {
    failure_.Set(absl::StrCat(worker.id, " was told generation ", world.generation,
                              " after generation ", known_at_send));
  }
  max_generation_told_ = std::max(max_generation_told_, world.generation);
}

void Simulation::Join(int index) {
  Worker& w = *workers_[index];
  JoinParams params;
  params.worker_id = w.id;
  params.host = absl::StrCat("10.0.0.", index % 250 + 1);
  params.device = "cpu";
  params.capabilities = {"gloo"};
  params.incarnation = w.incarnation;
  params.snapshot_address = SnapshotAddress(index);
  for (const auto& [id, shards] : w.held) {
    for (const auto& [rank, shard] : shards) params.holdings.push_back(shard);
  }
  Exchange<JoinReply>(
      index,
      [this, params](CoordinatorCore& core, Callback<absl::StatusOr<JoinReply>> done) {
        core.Join(params, now_, std::move(done));
      },
      [this](Worker& worker, const absl::StatusOr<JoinReply>& reply, absl::Time sent) {
        return worker.core->OnJoinReply(reply, sent, now_);
      });
}

template <typename Reply>
void Simulation::Exchange(
    int index, std::function<void(CoordinatorCore&, Callback<absl::StatusOr<Reply>>)> send,
    std::function<WorkerStep(Worker&, const absl::StatusOr<Reply>&, absl::Time)> answer) {
  const absl::Time sent = now_;
  const int64_t known = workers_[index]->core->world().generation;
  Call(
      index,
      [this, send, answer, index, sent, known](CoordinatorCore& core, Deliver deliver) {
        send(core, [this, deliver, answer, index, sent, known](absl::StatusOr<Reply> reply) {
          deliver([this, reply, answer, index, sent, known](Worker& worker) {
            if (reply.ok()) CheckToldWorld(worker, reply->outcome.world, known);
            Apply(index, answer(worker, reply, sent));
          });
        });
      },
      [this, answer, index, sent](Worker& worker) {
        Apply(index, answer(worker, absl::UnavailableError("unavailable"), sent));
      });
}

void Simulation::Heartbeat(int index) {
  Worker& w = *workers_[index];
  if (w.core->TakeReportAllHeld()) {
    // worker/agent.cc: after losing the coordinator, everything held is told again first.
    std::vector<SnapshotShard> all;
    for (const auto& [id, shards] : w.held) {
      for (const auto& [rank, shard] : shards) all.push_back(shard);
    }
    if (!all.empty()) {
      ReportHeld(index, std::move(all), {}, [this, index](Worker&) { Heartbeat(index); });
      return;
    }
  }
  // worker/dataplane/training_activity.h: what its training does, for the progress lease.
  TrainingActivity activity;
  if (const Group* group = GroupOf(w); group != nullptr && group->started && !group->over &&
                                       w.session->phase == Session::Phase::kTraining) {
    activity.generation = group->generation;
    activity.step = group->step;
    activity.since_step = now_ - group->last_step_at;
    if (group->halted_at.has_value() && !w.training_stalled) {
      activity.waiting = std::max(now_ - *group->halted_at, absl::Nanoseconds(1));
    }
  }
  const HeartbeatParams params = w.core->NextHeartbeat(activity, std::move(w.probed));
  w.probed.clear();
  // The lease runs from when the coordinator heard the request: the worker counts from when it
  // sent it.
  Exchange<HeartbeatReply>(
      index,
      [this, params](CoordinatorCore& core, Callback<absl::StatusOr<HeartbeatReply>> done) {
        core.Heartbeat(params, now_, std::move(done));
      },
      [this, index](Worker& worker, const absl::StatusOr<HeartbeatReply>& reply, absl::Time sent) {
        const WorkerStep step = worker.core->OnHeartbeatReply(reply, sent, now_);
        if (worker.core->taken_out() &&
            absl::StrContains(reply.status().message(), "was evicted")) {
          // Its supervisor starts it again, as Kubernetes restarts a container that exited
          // (seed 8462: evicted just as the faults stopped, nobody replaced it).
          const uint64_t exited = worker.process + 1;  // the process number once it exits
          After(Uniform(absl::Milliseconds(200), absl::Seconds(2)), [this, index, exited] {
            if (workers_[index]->process == exited && !workers_[index]->alive) {
              StartProcess(index);
            }
          });
        }
        return step;
      });
}

void Simulation::AskStillMine(int index) {
  const HeartbeatParams params = workers_[index]->core->StillMineRequest();
  Exchange<HeartbeatReply>(
      index,
      [this, params](CoordinatorCore& core, Callback<absl::StatusOr<HeartbeatReply>> done) {
        core.Heartbeat(params, now_, std::move(done));
      },
      [this](Worker& worker, const absl::StatusOr<HeartbeatReply>& reply, absl::Time sent) {
        return worker.core->OnStillMineReply(reply, sent, now_);
      });
}

void Simulation::SendFailureReport(int index, const SelfCheckReport& report) {
  Call(
      index,
      [this, report](CoordinatorCore& core, Deliver deliver) {
        core.ReportSelfCheck(report, now_, [deliver, report](absl::Status sent) {
          deliver([report, sent](Worker& w) { w.core->OnFailureReported(report, sent); });
        });
      },
      [report](Worker& w) {
        w.core->OnFailureReported(report, absl::UnavailableError("unavailable"));
      });
}

void Simulation::End(int index) {
  Worker& worker = *workers_[index];
  if (worker.leaving) return;
  worker.leaving = true;
  if (worker.session.has_value() && worker.session->phase != Session::Phase::kDone) {
    FailSession(index, absl::CancelledError("stopping"));
  }
  const absl::Status exit = worker.core->exit_status();
  // Errors the worker exits with on purpose: its training failed (injected), or a newer process
  // took it over, or it was evicted as stuck. Any other is a bug the seed found.
  const bool error = !exit.ok() && !worker.failure_injected && !worker.core->taken_out();
  const std::string reason = exit.ok() ? worker.core->stop_reason() : exit.ToString();
  const std::optional<LeaveParams> leave = worker.core->LeaveRequest();
  if (!leave.has_value()) {
    Exit(worker, reason, error);
    return;
  }
  if (leave->failed) ++failed_leaves_sent_;
  Call(
      index,
      [this, params = *leave, reason, error](CoordinatorCore& core, Deliver deliver) {
        core.Leave(params, now_,
                   [this, deliver, failed = params.failed, reason, error](absl::Status left) {
                     if (failed && left.ok()) ++failed_leaves_acked_;
                     deliver([this, reason, error](Worker& worker) {
                       Exit(worker, absl::StrCat("left: ", reason), error);
                     });
                   });
      },
      [this, reason, error](Worker& worker) {
        Exit(worker, absl::StrCat("left (the coordinator did not answer): ", reason), error);
      });
}

Group* Simulation::GroupOf(const Worker& worker) {
  if (!worker.session.has_value()) return nullptr;
  auto it = groups_.find(worker.session->generation);
  return it == groups_.end() ? nullptr : &it->second;
}

void Simulation::TryConnect(int index) {
  Worker& worker = *workers_[index];
  if (!worker.alive || worker.leaving) return;
  // One generation at a time, as the agent's thread runs them.
  if (worker.session.has_value() && worker.session->phase != Session::Phase::kDone &&
      worker.session->phase != Session::Phase::kFailed &&
      worker.session->phase != Session::Phase::kPaused) {
    return;
  }
  const std::optional<GenerationAssignment> target = worker.core->TakeGeneration();
  if (!target.has_value()) return;
  Session session;
  session.generation = target->generation;
  session.rank = target->rank;
  session.size = target->world_size;
  worker.session = session;
  Log(absl::StrCat(worker.id, " connects as rank ", session.rank, " of ", session.size,
                   " at generation ", session.generation));
  // Gloo's rendezvous through the coordinator's store: publish, then wait for every peer.
  const KvScope scope{job_.name, session.generation};
  const std::string key = absl::StrCat("addr/", session.rank);
  std::vector<std::string> keys;
  for (int rank = 0; rank < session.size; ++rank) keys.push_back(absl::StrCat("addr/", rank));
  const int64_t generation = session.generation;
  auto failed = [this, index, generation](Worker& w, absl::Status status) {
    if (w.session.has_value() && w.session->generation == generation) FailSession(index, status);
  };
  Call(
      index,
      [this, scope, key, keys, failed, generation, index](CoordinatorCore& core, Deliver deliver) {
        const absl::Status set = core.KvSet(scope, key, workers_[index]->id);
        if (!set.ok()) {
          deliver([failed, set](Worker& w) { failed(w, set); });
          return;
        }
        core.KvWait(scope, keys, kCollectiveTimeout, now_,
                    [this, deliver, failed, generation, index](absl::Status waited) {
                      deliver([this, failed, waited, generation, index](Worker& w) {
                        if (!waited.ok()) {
                          failed(w, waited);
                        } else if (w.session.has_value() && w.session->generation == generation &&
                                   w.session->phase == Session::Phase::kRendezvous) {
                          Rendezvoused(index);
                        }
                      });
                    });
      },
      [failed](Worker& w) { failed(w, absl::UnavailableError("rendezvous: unavailable")); });
}

void Simulation::Rendezvoused(int index) {
  Worker& worker = *workers_[index];
  Session& session = *worker.session;
  session.phase = Session::Phase::kConnecting;
  Group& group = groups_[session.generation];
  if (group.size == 0) {
    group.generation = session.generation;
    group.size = session.size;
  }
  if (group.size != session.size) {
    failure_.Set(absl::StrCat("generation ", session.generation, " has ranks of worlds of ",
                              group.size, " and ", session.size, " workers"));
  }
  if (auto it = group.members.find(session.rank);
      it != group.members.end() && it->second != index) {
    failure_.Set(absl::StrCat("two live workers connect as rank ", session.rank,
                              " of generation ", session.generation, ": ",
                              workers_[it->second]->id, " and ", worker.id));
  }
  group.members[session.rank] = index;
  // A peer that published its address and died never answers: the connect times out.
  const int64_t generation = session.generation;
  ForWorker(index, kConnectTimeout, [this, index, generation](Worker& w) {
    if (w.session.has_value() && w.session->generation == generation &&
        w.session->phase == Session::Phase::kConnecting) {
      FailSession(index, absl::UnavailableError("connecting to a peer timed out"));
    }
  });
  CheckGroup(generation);
}

void Simulation::CheckGroup(int64_t generation) {
  Group& group = groups_[generation];
  if (group.over || static_cast<int>(group.members.size()) < group.size) return;
  // worker/agent.cc ProbePeers(): every rank connects to every peer first; one that cannot
  // reports the peers after the probe's deadline, and the others' connects fail with it.
  bool probe_failed = false;
  for (const auto& [rank, index] : group.members) {
    std::vector<PeerFault> unreachable;
    for (const auto& [peer_rank, peer] : group.members) {
      if (peer != index && Cut(index, peer)) {
        unreachable.push_back(PeerFault{peer_rank, LinkFailure::kConnect, "probe timed out"});
      }
    }
    if (unreachable.empty()) continue;
    probe_failed = true;
    ForWorker(index, kProbeTimeout,
              [this, index, generation, unreachable = std::move(unreachable)](Worker& w) {
                if (w.session.has_value() && w.session->generation == generation) {
                  FailSession(index, absl::UnavailableError("cannot connect to a peer"),
                              unreachable);
                }
              });
  }
  if (probe_failed) return;
  std::vector<int> ready;
  for (const auto& [rank, index] : group.members) {
    const Worker& worker = *workers_[index];
    if (!worker.alive || !worker.session.has_value() ||
        worker.session->generation != generation) {
      return;
    }
    if (worker.session->phase == Session::Phase::kConnecting) ready.push_back(index);
  }
  for (int index : ready) {
    workers_[index]->session->phase = Session::Phase::kChecking;
    ForWorker(index, Uniform(absl::Milliseconds(2), absl::Milliseconds(20)),
              [this, index, generation](Worker& w) {
                if (w.session.has_value() && w.session->generation == generation &&
                    w.session->phase == Session::Phase::kChecking) {
                  OnConnected(index);
                }
              });
  }
}

void Simulation::OnConnected(int index) {
  Worker& worker = *workers_[index];
  const int64_t generation = worker.session->generation;
  const std::string id = worker.id;
  const uint64_t incarnation = worker.incarnation;
  auto failed = [this, index, generation](Worker& w, absl::Status status) {
    if (w.session.has_value() && w.session->generation == generation) FailSession(index, status);
  };
  // Self-check, then the plan: register the manifest and acknowledge it.
  Call(
      index,
      [this, id, incarnation, generation, index, failed](CoordinatorCore& core, Deliver deliver) {
        core.ReportSelfCheck(
            SelfCheckReport{id, incarnation, generation, true, "simulated", {}}, now_,
            [this, deliver, id, incarnation, generation, index, failed](absl::Status checked) {
              if (!checked.ok()) {
                deliver([failed, checked](Worker& w) { failed(w, checked); });
                return;
              }
              if (core_ == nullptr) return;
              absl::StatusOr<PlanView> view =
                  core_->RegisterManifest(id, incarnation, model_);
              if (view.ok()) view = core_->AckPlan(id, incarnation, view->version, view->plan->hash);
              deliver([this, view, generation, index, failed](Worker& w) {
                if (!view.ok()) {
                  failed(w, view.status());
                  return;
                }
                if (!w.session.has_value() || w.session->generation != generation ||
                    w.session->phase != Session::Phase::kChecking) {
                  return;
                }
                w.session->phase = Session::Phase::kTraining;
                w.session->plan = view->plan;
                Group& group = groups_[generation];
                for (const auto& [rank, member] : group.members) {
                  const Worker& peer = *workers_[member];
                  if (!peer.session.has_value() || peer.session->generation != generation ||
                      peer.session->phase != Session::Phase::kTraining) {
                    return;
                  }
                }
                // Every rank is ready: restore where the coordinator says and start stepping.
                std::set<std::string> starts;
                for (const auto& [rank, member] : group.members) {
                  starts.insert(workers_[member]->core->start().checkpoint_id);
                }
                if (starts.size() != 1) {
                  failure_.Set(absl::StrCat("the ranks of generation ", generation,
                                            " restore different checkpoints: ",
                                            absl::StrJoin(starts, ", ")));
                  return;
                }
                const TrainingStartPoint start = workers_[index]->core->start();
                group.restored_from = start.checkpoint_id;
                if (start.checkpoint_id.empty()) {
                  group.step = 0;
                  group.hash = Mix(job_.seed, 0);
                } else if (start.in_memory) {
                  // Read from the holders' memory, peer to peer; a holder that is gone, stopped
                  // or no longer holds it does not serve it, and the generation ends.
                  absl::Status restored =
                      RestoreFromMemory(index, generation, &group.step, &group.hash);
                  if (!restored.ok()) {
                    ++result_.memory_restore_failures;
                    Log(absl::StrCat("generation ", generation, " cannot restore ",
                                     start.checkpoint_id, ": ", restored.ToString()));
                    if (core_ != nullptr && !absl::IsAborted(restored)) {
                      RestoreReport report;
                      report.worker_id = workers_[index]->id;
                      report.incarnation = workers_[index]->incarnation;
                      report.generation = generation;
                      report.checkpoint_id = start.checkpoint_id;
                      report.in_memory = true;
                      report.error = std::string(restored.message());
                      (void)core_->ReportRestore(report, now_);
                    }
                    FailSession(index, absl::UnavailableError(restored.message()));
                    return;
                  }
                } else {
                  absl::StatusOr<CheckpointManifest> manifest = storage_.ReadManifest(start.dir);
                  if (!manifest.ok()) {
                    // Gone is the end of this generation if it is over (retention removed its
                    // restore point while this worker was stopped); if not, the worker exits with
                    // the error and the seed fails.
                    FailSession(index, absl::NotFoundError(absl::StrCat(
                                           "cannot restore checkpoint ", start.checkpoint_id, ": ",
                                           manifest.status().message())));
                    return;
                  }
                  uint64_t hash = 0;
                  if (manifest->shards.empty() ||
                      !absl::SimpleHexAtoi(manifest->shards[0].xxh3, &hash)) {
                    failure_.Set(absl::StrCat("generation ", generation,
                                              " cannot restore checkpoint ", start.checkpoint_id,
                                              ": ", manifest.status().ToString()));
                    return;
                  }
                  for (const ShardRecord& shard : manifest->shards) {
                    if (shard.xxh3 != manifest->shards[0].xxh3) {
                      failure_.Set(absl::StrCat("checkpoint ", start.checkpoint_id,
                                                " holds shards of different states"));
                    }
                  }
                  group.step = manifest->step;
                  group.hash = hash;
                }
                Log(absl::StrCat("generation ", generation, " trains from step ", group.step,
                                 start.checkpoint_id.empty() ? "" : " of ", start.checkpoint_id,
                                 start.in_memory ? " (memory)" : ""));
                // Every rank says it restored (which lets held leavers go).
                for (const auto& [rank, member] : group.members) {
                  if (core_ == nullptr || start.checkpoint_id.empty()) break;
                  RestoreReport report;
                  report.worker_id = workers_[member]->id;
                  report.incarnation = workers_[member]->incarnation;
                  report.generation = generation;
                  report.checkpoint_id = start.checkpoint_id;
                  report.in_memory = start.in_memory;
                  (void)core_->ReportRestore(report, now_);
                }
                group.boundary.last_snapshot_step = group.step;
                group.last_step_at = now_;
                if (!start.checkpoint_id.empty()) {
                  ++(start.in_memory ? result_.memory_restores : result_.disk_restores);
                }
                group.started = true;
                group.stepping = true;
                run_trained_ = true;
                // A checkpoint of the last step leaves nothing to train: the trainer ends at once.
                After(group.step >= job_.steps ? absl::ZeroDuration() : step_time_,
                      [this, generation] { Step(generation); });
              });
            });
      },
      [failed](Worker& w) { failed(w, absl::UnavailableError("self-check: unavailable")); });
}

void Simulation::ReportStep(int64_t generation, int64_t step) {
  if (core_ == nullptr) return;
  bool heard = false;
  for (const auto& [rank, index] : groups_[generation].members) {
    StepReport report;
    report.step = step;
    report.step_ms = absl::ToDoubleMilliseconds(step_time_);
    heard |= core_
                 ->ReportStepStats(workers_[index]->id, workers_[index]->incarnation, generation,
                                   report, now_)
                 .ok();
  }
  if (const int64_t shown = core_->Progress(now_).step; heard && shown != step) {
    failure_.Set(absl::StrCat("status shows step ", shown, " while generation ", generation,
                              " trained step ", step));
  }
}

void Simulation::Step(int64_t generation) {
  Group& group = groups_[generation];
  group.stepping = false;
  if (group.over) return;
  for (const auto& [rank, index] : group.members) {
    const Worker& worker = *workers_[index];
    if (!worker.alive) return;  // Kill() failed the peers
    if (worker.stopped || worker.training_stalled) {
      if (!group.halted_at.has_value()) group.halted_at = now_;
      // The others wait in the collective: until their generation ends, or it times out.
      for (const auto& [peer_rank, peer] : group.members) {
        if (peer == index) continue;
        ForWorker(peer, kCollectiveTimeout, [this, peer, generation](Worker& w) {
          if (w.session.has_value() && w.session->generation == generation &&
              w.session->phase == Session::Phase::kTraining && groups_[generation].step > 0 &&
              !groups_[generation].stepping) {
            FailSession(peer, absl::DeadlineExceededError("collective timed out"));
          }
        });
      }
      return;  // Resume() starts stepping again
    }
    if (!worker.session.has_value() || worker.session->generation != generation ||
        worker.session->phase != Session::Phase::kTraining) {
      return;
    }
  }
  // A cut link between two members: their collective fails after the link timeout, the rank
  // that sends across it blaming its peer.
  for (const auto& [rank, index] : group.members) {
    for (const auto& [peer_rank, peer] : group.members) {
      if (peer <= index || !Cut(index, peer)) continue;
      const int peer_rank_of_link = peer_rank;
      ForWorker(index, kLinkTimeout, [this, index, generation, peer_rank_of_link](Worker& w) {
        if (w.session.has_value() && w.session->generation == generation) {
          FailSession(index, absl::UnavailableError("connection to a peer timed out"),
                      {PeerFault{peer_rank_of_link, LinkFailure::kSend, "timed out"}});
        }
      });
      return;  // the collective waits
    }
  }
  // A restore of the last step's checkpoint leaves no step to take: the trainer ends at once.
  const bool stepped = group.step < job_.steps;
  StepBoundary boundary;
  group.halted_at.reset();
  if (stepped) {
    // No two generations train at once: once a generation stepped, no older one does.
    if (generation < newest_trained_generation_) {
      failure_.Set(absl::StrCat("generation ", generation, " took a step after generation ",
                                newest_trained_generation_, " had trained"));
    }
    newest_trained_generation_ = std::max(newest_trained_generation_, generation);
    for (const auto& [rank, index] : group.members) {
      for (const auto& [peer_rank, peer] : group.members) {
        if (peer > index && Cut(index, peer)) {
          failure_.Set(absl::StrCat("generation ", generation, " trains with ",
                                    workers_[index]->id, " and ", workers_[peer]->id,
                                    ", whose link is cut"));
        }
      }
    }
    ++group.step;
    group.last_step_at = now_;
    group.hash = Mix(group.hash, group.step);
    ReportStep(generation, group.step);
    // This boundary acts on what the ranks posted at the previous one (worker/dataplane/
    // training_session.cc: the agreement runs one step ahead, while the next step computes).
    // The first boundary of a run has nothing posted.
    StepOrders agreed{generation, 0, 0};
    bool busy = false;  // a rank still reported or pushed its previous snapshot then
    if (group.posted.has_value()) {
      agreed = group.posted->orders;
      busy = group.posted->snapshots_busy;
      group.posted.reset();
    }
    boundary = DecideStepBoundary(
        group.step, StepBoundaryRules{job_.steps, job_.checkpoint_every, job_.snapshot_every},
        agreed, busy, &group.boundary);
  }
  const bool last = group.step >= job_.steps;
  if (boundary.snapshot) {
    // Every rank copies what it owns, keeps it and sends it to its buddies (a ring over hosts).
    std::vector<std::string> hosts(group.size);
    std::vector<int> by_rank(group.size);
    for (const auto& [rank, index] : group.members) {
      hosts[rank] = SnapshotAddress(index).substr(0, SnapshotAddress(index).rfind(':'));
      by_rank[rank] = index;
    }
    for (const auto& [rank, index] : group.members) {
      const Plan& plan = *workers_[index]->session->plan;
      SnapshotShard shard;
      shard.id = SnapshotId(group.step, generation);
      shard.generation = generation;
      shard.step = group.step;
      shard.rank = rank;
      shard.plan = plan.options;
      shard.plan_hash = plan.hash;
      shard.counters.optimizer_step = group.step;
      shard.request = boundary.snapshot_request;
      shard.state = saved_state_;
      shard.record = ShardRecordOf(model_, plan, rank, group.hash);
      shard.record.file = ShardFileName(rank, group.size);
      std::vector<int> buddies;
      for (int buddy : SnapshotBuddies(hosts, rank, job_.snapshot_replicas)) {
        buddies.push_back(by_rank[buddy]);
      }
      TakeSnapshot(index, generation, std::move(shard), std::move(buddies));
    }
  }
  if (boundary.save) {
    const std::string id = CheckpointIdForStep(group.step, absl::StrCat("g", generation));
    for (const auto& [rank, index] : group.members) {
      storage_.AddShard(CheckpointDirectory(kCheckpointRoot, job_.name, id));
      ++workers_[index]->session->writes;
      const int64_t step = group.step;
      const int64_t request = boundary.request;
      const uint64_t hash = group.hash;
      ForWorker(index, Uniform(absl::Milliseconds(1), absl::Milliseconds(40)),
                [this, index, generation, id, step, request, hash](Worker&) {
                  ShardWritten(index, generation, id, step, request, hash);
                });
    }
  }
  if (stepped) {
    // Every rank posts the newest orders of this generation it knows and whether its snapshot
    // work is still in flight (after this boundary's snapshot started); the ranks agree on them
    // with a max.
    PostedAgreement posted{StepOrders{generation, 0, 0}, false};
    for (const auto& [rank, index] : group.members) {
      posted.snapshots_busy =
          posted.snapshots_busy || workers_[index]->session->snapshot_work > 0;
      const StepOrders& known = workers_[index]->core->orders();
      if (known.generation != generation) continue;
      posted.orders.save_request = std::max(posted.orders.save_request, known.save_request);
      posted.orders.pause_request = std::max(posted.orders.pause_request, known.pause_request);
      posted.orders.pause_in_memory = posted.orders.pause_in_memory || known.pause_in_memory;
    }
    group.posted = posted;
  }
  if (boundary.pause || last) {
    group.over = true;
    for (const auto& [rank, index] : group.members) {
      Session& session = *workers_[index]->session;
      if (last) {
        session.done_after_writes = true;
      } else {
        session.pause_after_writes = true;
      }
      if (session.writes == 0) WritesDone(index);
    }
    if (last) {
      Log(absl::StrCat("generation ", generation, " finished training at step ", group.step));
      if (!final_hash_.has_value()) final_hash_ = group.hash;
      if (group.hash != reference_hash_) {
        failure_.Set(absl::StrCat("training ended with other parameters than an undisturbed "
                                  "run (generation ",
                                  generation, " restored ", group.restored_from, ")"));
      }
    } else {
      Log(absl::StrCat("generation ", generation, " pauses after step ", group.step));
    }
    return;
  }
  group.stepping = true;
  After(step_time_, [this, generation] { Step(generation); });
}

ShardRecord Simulation::ShardRecordOf(const Manifest& model, const Plan& plan, int rank,
                                      uint64_t hash) const {
  ShardRecord record;
  record.rank = rank;
  record.bytes =
      MakeShardLayout(model, plan, rank, static_cast<int>(saved_state_.names.size())).bytes;
  if (job_.optimizer.kind == OptimizerKind::kTorch && rank == 0) {
    record.extras.push_back(ShardExtra{-1, record.bytes, 24});
    record.bytes += 24;
  }
  record.xxh3 = absl::StrFormat("%016x", hash);
  // One block checksum per block started, as the writer leaves them.
  record.block_xxh3.assign(
      record.bytes / kCheckpointBlockBytes + (record.bytes % kCheckpointBlockBytes != 0 ? 1 : 0),
      record.xxh3);
  return record;
}

void Simulation::ShardWritten(int index, int64_t generation, std::string id, int64_t step,
                              int64_t request, uint64_t hash) {
  Worker& worker = *workers_[index];
  if (!worker.session.has_value() || worker.session->generation != generation) return;
  ShardReport report;
  report.worker_id = worker.id;
  report.incarnation = worker.incarnation;
  report.generation = generation;
  report.id = id;
  report.step = step;
  report.request = request;
  report.record.file = absl::StrCat("shard-", worker.session->rank, ".bin");
  report.record.rank = worker.session->rank;
  report.record.xxh3 = absl::StrFormat("%016x", hash);
  report.counters.optimizer_step = step;
  report.state = saved_state_;
  auto reported = [this, index, generation](Worker& w) {
    if (w.session.has_value() && w.session->generation == generation) WritesDone(index);
  };
  Call(
      index,
      [this, report, reported, hash](CoordinatorCore& core, Deliver deliver) mutable {
        // The worker lays its shard out by the plan it applied: the generation's current one.
        std::optional<PlanView> plan = core.plan().Current();
        if (plan.has_value() && plan->generation == report.generation &&
            report.record.rank < plan->plan->options.world_size) {
          report.plan_hash = plan->plan->hash;
          const std::string file = report.record.file;
          report.record = ShardRecordOf(*plan->manifest, *plan->plan, report.record.rank, hash);
          report.record.file = file;
        }
        absl::StatusOr<bool> committed = core.ReportCheckpointShard(report, now_);
        if (!committed.ok()) {
          Log(absl::StrCat(report.worker_id, " shard of ", report.id, ": ",
                           committed.status().ToString()));
        }
        deliver(reported);
      },
      reported);
}

// A shard was reported (or its report failed); once none is in flight, a pause or the end of
// training takes effect (the trainer waits for its writer first).
void Simulation::WritesDone(int index) {
  Worker& worker = *workers_[index];
  Session& session = *worker.session;
  if (session.writes > 0) --session.writes;
  if (session.writes > 0) return;
  // A pause also waits for its snapshot to be reported and pushed (the trainer waits for it).
  if (session.pause_after_writes && session.snapshot_work == 0 &&
      session.phase == Session::Phase::kTraining) {
    session.phase = Session::Phase::kPaused;
    worker.core->OnPaused(session.generation);
  }
  if (session.done_after_writes && session.phase == Session::Phase::kTraining) {
    session.phase = Session::Phase::kDone;
    worker.trained = true;
    const std::string id = worker.id;
    const uint64_t incarnation = worker.incarnation;
    auto report = std::make_shared<std::function<void()>>();
    *report = [this, index, id, incarnation, report]() {
      Call(
          index,
          [this, id, incarnation](CoordinatorCore& core, Deliver deliver) {
            core.ReportTrainingDone(id, incarnation, "simulated", now_,
                                    [deliver](absl::Status) { deliver([](Worker&) {}); });
          },
          [this, index, report](Worker&) {
            ForWorker(index, absl::Milliseconds(200), [report](Worker&) { (*report)(); });
          });
    };
    (*report)();
  }
}

std::vector<std::string> Simulation::Hold(int index, const SnapshotShard& shard) {
  Worker& worker = *workers_[index];
  worker.held[shard.id][shard.rank] = shard;
  std::vector<std::pair<std::pair<int64_t, int64_t>, std::string>> order;
  for (const auto& [id, shards] : worker.held) {
    const SnapshotShard& any = shards.begin()->second;
    order.push_back({{any.generation, any.step}, id});
  }
  std::sort(order.begin(), order.end(), [](const auto& a, const auto& b) {
    return NewerSnapshot(a.first.first, a.first.second, b.first.first, b.first.second);
  });
  std::vector<std::string> dropped;
  for (size_t i = 2; i < order.size(); ++i) {
    dropped.push_back(order[i].second);
    worker.held.erase(order[i].second);
  }
  return dropped;
}

void Simulation::ReportHeld(int index, std::vector<SnapshotShard> held,
                            std::vector<std::string> dropped, std::function<void(Worker&)> then) {
  const Worker& worker = *workers_[index];
  SnapshotReport report;
  report.worker_id = worker.id;
  report.incarnation = worker.incarnation;
  report.held = std::move(held);
  report.dropped = std::move(dropped);
  report.snapshot_address = SnapshotAddress(index);
  Call(
      index,
      [this, report, then](CoordinatorCore& core, Deliver deliver) {
        (void)core.ReportSnapshot(report, now_);
        deliver(then);
      },
      [then](Worker& w) {
        w.core->OnHeldReportFailed();
        then(w);
      });
}

void Simulation::TakeSnapshot(int index, int64_t generation, SnapshotShard shard,
                              std::vector<int> buddies) {
  ++workers_[index]->session->snapshot_work;
  const std::vector<std::string> dropped = Hold(index, shard);
  // Pushed one buddy after another (a push fails when the buddy is gone or stopped), then done.
  auto push = std::make_shared<std::function<void(size_t)>>();
  const uint64_t process = workers_[index]->process;
  *push = [this, index, generation, shard, buddies, process, push](size_t k) {
    if (k >= buddies.size()) {
      SnapshotWorkDone(index, generation);
      return;
    }
    ForWorker(index, Uniform(absl::Milliseconds(1), absl::Milliseconds(20)),
              [this, index, shard, buddies, process, push, k](Worker&) {
                const int buddy = buddies[k];
                Worker& receiver = *workers_[buddy];
                // Whichever comes first: the buddy's answer, or the push failing on its
                // timeout (the buddy died or stopped before it answered).
                auto answered = std::make_shared<bool>(false);
                auto next = [this, index, process, push, k, answered](absl::Duration delay) {
                  ForProcess(index, process, delay, [push, k, answered](Worker&) {
                    if (*answered) return;
                    *answered = true;
                    (*push)(k + 1);
                  });
                };
                next(Uniform(absl::Milliseconds(200), absl::Seconds(2)));
                if (!receiver.alive || receiver.stopped) return;
                const std::vector<std::string> dropped_there = Hold(buddy, shard);
                ReportHeld(buddy, {shard}, dropped_there,
                           [this, next](Worker&) { next(NetworkDelay()); });
              });
  };
  ReportHeld(index, {shard}, dropped, [push](Worker&) { (*push)(0); });
}

void Simulation::SnapshotWorkDone(int index, int64_t generation) {
  Worker& worker = *workers_[index];
  if (!worker.session.has_value() || worker.session->generation != generation) return;
  Session& session = *worker.session;
  if (session.snapshot_work > 0) --session.snapshot_work;
  if (session.snapshot_work == 0 && session.writes == 0 && session.pause_after_writes) {
    WritesDone(index);
  }
}

absl::Status Simulation::RestoreFromMemory(int index, int64_t generation, int64_t* step,
                                           uint64_t* hash) {
  if (core_ == nullptr) return absl::UnavailableError("restore point request: unavailable");
  const Worker& worker = *workers_[index];
  absl::StatusOr<RestoreSnapshotView> view =
      core_->GetRestoreSnapshot(worker.id, worker.incarnation, generation);
  if (!view.ok()) return view.status();
  absl::StatusOr<CheckpointManifest> manifest =
      CheckpointManifestFromJson(view->manifest_json, view->id);
  if (!manifest.ok()) {
    failure_.Set(absl::StrCat("the coordinator gave an unreadable manifest for memory snapshot ",
                              view->id, ": ", manifest.status().ToString()));
    return manifest.status();
  }
  for (size_t rank = 0; rank < manifest->shards.size(); ++rank) {
    const std::string& wanted = manifest->shards[rank].xxh3;
    if (wanted != manifest->shards[0].xxh3) {
      failure_.Set(absl::StrCat("memory snapshot ", view->id, " holds shards of different states"));
    }
    bool served = false;
    for (const SnapshotHolder& holder : view->holders[rank]) {
      for (const auto& candidate : workers_) {
        if (candidate->id != holder.worker_id || !candidate->alive || candidate->stopped ||
            candidate->incarnation != holder.incarnation) {
          continue;
        }
        auto it = candidate->held.find(view->id);
        served = it != candidate->held.end() && it->second.count(static_cast<int>(rank)) > 0 &&
                 it->second.at(static_cast<int>(rank)).record.xxh3 == wanted;
      }
      if (served) break;
    }
    if (!served) {
      return absl::UnavailableError(absl::StrCat("no live holder served rank ", rank,
                                                 "'s shard of memory snapshot ", view->id));
    }
  }
  if (!absl::SimpleHexAtoi(manifest->shards[0].xxh3, hash)) {
    failure_.Set(absl::StrCat("memory snapshot ", view->id, " has no state hash"));
  }
  *step = manifest->step;
  return absl::OkStatus();
}

void Simulation::FailSessionLater(int index, int64_t generation, absl::Duration delay,
                                  absl::Status status) {
  ForWorker(index, delay, [this, index, generation, status](Worker& w) {
    if (w.session.has_value() && w.session->generation == generation) FailSession(index, status);
  });
}

void Simulation::FailSession(int index, const absl::Status& status,
                             std::vector<PeerFault> unreachable) {
  Worker& worker = *workers_[index];
  if (!worker.session.has_value()) return;
  Session& session = *worker.session;
  if (session.phase == Session::Phase::kFailed || session.phase == Session::Phase::kDone) return;
  const bool was_paused = session.phase == Session::Phase::kPaused;
  session.phase = Session::Phase::kFailed;
  const int64_t generation = session.generation;
  if (auto it = groups_.find(generation); it != groups_.end() && !it->second.over) {
    it->second.over = true;
    // The others' collectives fail with it.
    for (const auto& [rank, peer] : it->second.members) {
      if (peer == index) continue;
      FailSessionLater(peer, generation, absl::Milliseconds(5),
                       absl::UnavailableError("a peer left the collective"));
    }
  }
  if (was_paused) return;  // its training ended well; the world moves on without it
  if (!absl::IsCancelled(status)) {
    Log(absl::StrCat(worker.id, " generation ", generation, " failed: ", status.ToString()));
  }
  // worker/agent.cc: what the end of the generation means is the core's to decide.
  Apply(index, worker.core->OnGenerationEnded(generation, status, std::move(unreachable)));
}

// --- Faults and operators -----------------------------------------------------------------------

void Simulation::Fault() {
  if (now_ >= faults_end_ || failure_.failed()) return;
  std::vector<int> running;
  std::vector<int> gone;
  for (int i = 0; i < static_cast<int>(workers_.size()); ++i) {
    if (workers_[i]->alive && !workers_[i]->stopped) running.push_back(i);
    if (!workers_[i]->alive) gone.push_back(i);
  }
  if (inject_failures_ && std::bernoulli_distribution(0.1)(failure_rng_)) {
    std::vector<int> members;
    for (int index : running) {
      if (workers_[index]->core->member() && !workers_[index]->leaving) members.push_back(index);
    }
    if (!members.empty()) {
      FailTraining(members[std::uniform_int_distribution<size_t>(0, members.size() - 1)(
          failure_rng_)]);
    }
    After(Uniform(absl::Milliseconds(100), absl::Seconds(3)), [this] { Fault(); });
    return;
  }
  const Weights& w = weights_;
  const int kind = Pick(100);
  // Each kind of fault below its bound (and at or above the one before).
  const int kill_below = w.kill, stop_below = kill_below + w.stop,
            crash_below = stop_below + w.coordinator_crash,
            start_gone_below = crash_below + w.start_gone,
            new_worker_below = start_gone_below + w.new_worker,
            partition_below = new_worker_below + w.partition,
            stall_below = partition_below + w.stall;
  if (kind < kill_below && !running.empty()) {
    ++result_.worker_kills;
    const int victim = running[Pick(static_cast<int>(running.size()))];
    Kill(victim, "fault");
    // A replacement: the same pod restarted (same id), or a new one; at once or late.
    if (Chance(0.8)) {
      const bool same = Chance(0.5);
      const int index = same ? victim : AddWorker(absl::StrCat("w", next_worker_id_++));
      After(Chance(0.5) ? absl::Milliseconds(1) : Uniform(absl::Seconds(1), absl::Seconds(6)),
            [this, index] {
              if (!workers_[index]->alive) StartProcess(index);
            });
    }
  } else if (kind < stop_below && !running.empty()) {
    ++result_.worker_stops;
    std::vector<int> starting;
    if (w.stop_as_generation_starts) {
      for (int index : running) {
        const std::optional<Session>& session = workers_[index]->session;
        if (session.has_value() && session->phase < Session::Phase::kTraining) {
          starting.push_back(index);
        }
      }
    }
    const std::vector<int>& candidates = !starting.empty() && Chance(0.8) ? starting : running;
    const int victim = candidates[Pick(static_cast<int>(candidates.size()))];
    Stop(victim, Uniform(absl::Milliseconds(200), w.longest_stop));
    if (Chance(0.3)) {
      // The hung pod is replaced by a new one while it is stopped.
      const int index = AddWorker(absl::StrCat("w", next_worker_id_++));
      After(Uniform(absl::Milliseconds(1), absl::Seconds(3)), [this, index] { StartProcess(index); });
    }
  } else if (kind < crash_below) {
    CrashAndRestartCoordinator();
  } else if (kind < start_gone_below && !gone.empty()) {
    StartProcess(gone[Pick(static_cast<int>(gone.size()))]);
  } else if (kind < new_worker_below) {
    StartProcess(AddWorker(absl::StrCat("w", next_worker_id_++)));
  } else if (kind < partition_below && running.size() >= 2) {
    // A pair, or one worker from every peer; both still reach the coordinator.
    ++result_.partitions;
    const int a = running[Pick(static_cast<int>(running.size()))];
    std::vector<std::pair<int, int>> links;
    if (Chance(0.5)) {
      int b = a;
      while (b == a) b = running[Pick(static_cast<int>(running.size()))];
      links.emplace_back(a, b);
    } else {
      for (int i = 0; i < static_cast<int>(workers_.size()); ++i) {
        if (i != a) links.emplace_back(a, i);
      }
    }
    Partition(links, Uniform(absl::Seconds(1), absl::Seconds(20)));
  } else if (kind < stall_below && !running.empty()) {
    const int victim = running[Pick(static_cast<int>(running.size()))];
    if (workers_[victim]->session.has_value() &&
        workers_[victim]->session->phase == Session::Phase::kTraining) {
      ++result_.training_stalls;
      Log(absl::StrCat(workers_[victim]->id, "'s training thread hangs (heartbeats go on)"));
      workers_[victim]->training_stalled = true;
    }
  } else {
    Operator();
  }
  After(Uniform(absl::Milliseconds(100), absl::Seconds(3)), [this] { Fault(); });
}

void Simulation::FailTraining(int index) {
  ++result_.worker_failures;
  Worker& worker = *workers_[index];
  Log(absl::StrCat(worker.id, "'s training fails with an error: it leaves and exits"));
  worker.failure_injected = true;
  Apply(index, worker.core->Fail(absl::InternalError("training failed (simulated)")));
  // The pod restarts with the same id.
  After(Uniform(absl::Milliseconds(1), absl::Seconds(3)), [this, index] {
    if (!workers_[index]->alive) StartProcess(index);
  });
}

void Simulation::Operator() {
  if (core_ == nullptr) return;
  ++result_.admin_calls;
  const Weights& w = weights_;
  const int kind = Pick(100);
  const int resize_below = w.resize, drain_below = resize_below + w.drain,
            save_below = drain_below + w.save, restore_below = save_below + w.restore;
  const int min = job_.min_world_size;
  if (kind < resize_below) {
    const int size = min + Pick(job_.world_size - min + 1);
    Log(absl::StrCat("operator: resize to ", size));
    core_->Resize(size, now_, [](absl::StatusOr<World>) {});
    MaybeCrashAfterReshape();
  } else if (kind < drain_below) {
    const StatusSnapshot status = core_->Status(now_);
    std::vector<std::string> holders;
    for (const WorkerSnapshot& worker : status.workers) {
      if (worker.rank >= 0) holders.push_back(worker.id);
    }
    if (!holders.empty()) {
      const std::string victim = holders[Pick(static_cast<int>(holders.size()))];
      Log(absl::StrCat("operator: drain ", victim));
      core_->Drain(victim, now_, [](absl::StatusOr<World>) {});
      MaybeCrashAfterReshape();
    }
  } else if (kind < save_below) {
    Log("operator: checkpoint save");
    (void)core_->SaveCheckpoint();
  } else if (kind < restore_below) {
    const std::vector<v1::CheckpointRecord> list = core_->checkpoints()->List();
    const std::string id =
        list.empty() || Chance(0.3) ? "latest" : list[Pick(static_cast<int>(list.size()))].id();
    Log(absl::StrCat("operator: restore ", id));
    core_->RestoreCheckpoint(id, now_, [](auto) {});
  } else {
    Log("operator: stop");
    operator_stopped_ = true;
    core_->Stop("operator", now_, [](World) {});
  }
  ScheduleFlush();
}

void Simulation::MaybeCrashAfterReshape() {
  // The mixed profile draws nothing here, so that its seeds keep their scenarios.
  if (weights_.crash_after_reshape == 0 || Pick(100) >= weights_.crash_after_reshape) return;
  After(Uniform(absl::ZeroDuration(), absl::Seconds(2)), [this] { CrashAndRestartCoordinator(); });
}

void Simulation::Partition(const std::vector<std::pair<int, int>>& links,
                           absl::Duration how_long) {
  std::vector<std::pair<int, int>> cut;
  for (auto [a, b] : links) {
    const std::pair<int, int> link{std::min(a, b), std::max(a, b)};
    if (!cut_links_.insert(link).second) continue;
    cut.push_back(link);
    Log(absl::StrCat("the link ", workers_[link.first]->id, " <-/-> ",
                     workers_[link.second]->id, " is cut for ", absl::FormatDuration(how_long)));
  }
  After(how_long, [this, cut] {
    for (const auto& link : cut) {
      if (cut_links_.erase(link) > 0) {
        Log(absl::StrCat("the link ", workers_[link.first]->id, " <-> ",
                         workers_[link.second]->id, " heals"));
      }
    }
  });
}

void Simulation::Heal() {
  Log("faults stop: stopped workers resume, the coordinator runs, enough workers run");
  if (core_ == nullptr) StartCoordinator();
  for (int i = 0; i < static_cast<int>(workers_.size()); ++i) {
    if (workers_[i]->training_stalled) {
      workers_[i]->training_stalled = false;
      workers_[i]->stopped = true;  // resumed below, as a stopped worker: its group steps again
    }
    Resume(i);
  }
  StartEnoughWorkers();
  if (weights_.recount_after_heal) After(3 * kLease, [this] { StartEnoughWorkers(); });
}

void Simulation::StartEnoughWorkers() {
  // Under heal_to_min_world, a world that has trained in this run re-forms with the workers it
  // has, and one that has not forms with as many as the operators' target, standbys included
  // (a coordinator that took back no world starts a new run, and so does one restarted after an
  // operator's stop).
  int enough = job_.world_size;
  if (weights_.heal_to_min_world && core_ != nullptr) {
    enough = run_trained_ && !operator_stopped_
                 ? job_.min_world_size
                 : core_->Status(now_).world.expected_world_size;
  }
  int live = 0;
  for (const auto& worker : workers_) live += worker->alive ? 1 : 0;
  for (int i = 0; i < static_cast<int>(workers_.size()) && live < enough; ++i) {
    if (!workers_[i]->alive && !workers_[i]->exited) {
      StartProcess(i);
      ++live;
    }
  }
  while (live < enough) {
    StartProcess(AddWorker(absl::StrCat("w", next_worker_id_++)));
    ++live;
  }
}

// --- Properties ---------------------------------------------------------------------------------

void Simulation::CheckInvariants() {
  // The phase is kept, not derived: it must still agree with the membership and the
  // re-formation in flight.
  if (core_ != nullptr) {
    const World world = core_->world().world();
    if (Trains(world.state) && world.world_size != world.ranks) {
      failure_.Set(absl::StrCat("the job is ", JobStateName(world.state), " with ",
                                world.world_size, " of ", world.ranks, " ranks held"));
    }
    if (world.state == JobState::kForming && world.ranks > 0 && world.world_size == world.ranks) {
      failure_.Set(absl::StrCat("the job is forming with every one of its ", world.ranks,
                                " ranks held"));
    }
    const std::optional<InFlightReshape> in_flight = core_->elastic().in_flight();
    if (world.state == JobState::kReshaping &&
        (!in_flight.has_value() || in_flight->generation != world.generation)) {
      failure_.Set(absl::StrCat("the job is reshaping at generation ", world.generation,
                                " without a re-formation in flight there"));
    }
    if (world.state == JobState::kFailed &&
        failed_leaves_sent_ <= core_options_.world.max_worker_failures) {
      failure_.Set(absl::StrCat("the job failed after ", failed_leaves_sent_,
                                " failed workers (the limit is ",
                                core_options_.world.max_worker_failures, ")"));
    }
  }
  if (storage_.overwritten().has_value()) {
    failure_.Set(absl::StrCat("committed checkpoint ", *storage_.overwritten(), " was written again"));
  }
  // A committed checkpoint says what its ranks saved: their optimizer's class and state, and
  // where rank 0's extras are.
  for (const auto& [dir, json] : storage_.manifests()) {
    if (!manifests_checked_.insert(dir).second) continue;
    absl::StatusOr<CheckpointManifest> manifest = CheckpointManifestFromJson(json, dir);
    if (!manifest.ok()) {
      failure_.Set(absl::StrCat("committed checkpoint ", dir, " does not read back: ",
                                manifest.status().message()));
      continue;
    }
    const bool extras = job_.optimizer.kind == OptimizerKind::kTorch;
    if (StateKindOf(manifest->optimizer) != saved_state_ ||
        manifest->state_names != saved_state_.names ||
        manifest->shards[0].extras.size() != (extras ? 1u : 0u)) {
      failure_.Set(absl::StrCat("committed checkpoint ", dir, " holds ",
                                manifest->optimizer.torch_class, " state [",
                                absl::StrJoin(manifest->state_names, ", "), "] with ",
                                manifest->shards[0].extras.size(), " extras on rank 0; its ranks "
                                "saved ", saved_state_.torch_class, " [",
                                absl::StrJoin(saved_state_.names, ", "), "]"));
    }
  }
  // A committed checkpoint leaves only by retention or an operator's delete.
  for (; removals_checked_ < storage_.removals().size(); ++removals_checked_) {
    const SimCheckpointStorage::Removal& removal = storage_.removals()[removals_checked_];
    if (removal.why.rfind("keeping the last", 0) != 0 && removal.why != "deleted by an operator") {
      failure_.Set(absl::StrCat("committed checkpoint ", removal.dir, " was removed: ",
                                removal.why));
    }
    removed_.insert(removal.dir);
  }
  if (core_ == nullptr) return;
  const World world = core_->world().world();
  if (world.generation < max_generation_told_) {
    failure_.Set(absl::StrCat("the coordinator is at generation ", world.generation,
                              " but a worker was told generation ", max_generation_told_,
                              ": a generation would be reused"));
  }
  const CheckpointManager* checkpoints = core_->checkpoints();
  // The catalog changes only by commits, retention and deletes, also across restarts.
  std::map<std::string, std::string> listed;  // id -> dir
  for (const v1::CheckpointRecord& record : checkpoints->List()) {
    listed[record.id()] = record.dir();
    if (!storage_.IsCommitted(record.dir())) {
      failure_.Set(absl::StrCat("committed checkpoint ", record.id(), " lost its manifest"));
    }
  }
  for (const auto& [id, dir] : catalog_) {
    if (listed.count(id) == 0 && removed_.count(dir) == 0) {
      failure_.Set(absl::StrCat("committed checkpoint ", id, " left the catalog without being "
                                "removed by retention or a delete"));
    }
  }
  committed_ += static_cast<int>(std::count_if(listed.begin(), listed.end(), [&](const auto& e) {
    return catalog_.count(e.first) == 0;
  }));
  catalog_ = std::move(listed);
  const TrainingStartPoint start = checkpoints->start();
  if (start.in_memory) {
    // A memory restore point is one state: every shard of its world, with a holder each.
    const std::optional<MemoryRestorePoint> memory = checkpoints->memory_start();
    if (!memory.has_value() || memory->shards.empty() ||
        static_cast<int>(memory->shards.size()) != memory->shards[0].plan.world_size ||
        memory->holders.size() != memory->shards.size()) {
      failure_.Set(absl::StrCat("the memory restore point ", start.checkpoint_id,
                                " does not list one shard per rank of its world"));
    } else {
      for (size_t rank = 0; rank < memory->shards.size(); ++rank) {
        const SnapshotShard& shard = memory->shards[rank];
        if (shard.id != start.checkpoint_id || shard.step != start.step ||
            static_cast<int>(rank) != shard.rank ||
            shard.record.xxh3 != memory->shards[0].record.xxh3 || memory->holders[rank].empty()) {
          failure_.Set(absl::StrCat("the memory restore point ", start.checkpoint_id,
                                    " lists rank ", rank, "'s shard of ", shard.id,
                                    " (another state, or nobody holding it)"));
        }
      }
    }
  } else if (!start.checkpoint_id.empty() &&
             (catalog_.count(start.checkpoint_id) == 0 || !storage_.IsCommitted(start.dir))) {
    failure_.Set(absl::StrCat("the restore point ", start.checkpoint_id,
                              " is not a committed checkpoint"));
  }
}

void Simulation::CheckDiskEqualsMemory() {
  if (core_ == nullptr || store_.has_pending()) return;
  absl::StatusOr<std::optional<v1::CoordinatorState>> disk =
      MembershipLog::Load(&store_, WorldOptions{}.max_events);
  if (!disk.ok() || !disk->has_value()) {
    failure_.Set(absl::StrCat("the membership journal does not load: ", disk.status().ToString()));
    return;
  }
  const v1::CoordinatorState memory = core_->world().Record();
  if ((*disk)->SerializeAsString() != memory.SerializeAsString()) {
    failure_.Set(absl::StrCat("the membership on disk differs from memory:\ndisk:\n",
                              (*disk)->DebugString(), "memory:\n", memory.DebugString()));
  }
  v1::CheckpointCatalog catalog;
  absl::StatusOr<bool> loaded = store_.Load("checkpoints", &catalog);
  if (loaded.ok() && *loaded &&
      catalog.SerializeAsString() != core_->checkpoints()->Catalog().SerializeAsString()) {
    failure_.Set(absl::StrCat("the checkpoint catalog on disk differs from memory:\ndisk:\n",
                              catalog.DebugString(), "memory:\n",
                              core_->checkpoints()->Catalog().DebugString()));
  }
}

bool Simulation::Settled() {
  if (core_ == nullptr) return false;
  if (!Ended(core_->world().world().state)) return false;
  for (const auto& worker : workers_) {
    if (worker->alive) return false;
  }
  return true;
}

std::string Simulation::Describe() {
  std::string text;
  if (core_ != nullptr) {
    const StatusSnapshot status = core_->Status(now_);
    absl::StrAppend(&text, "coordinator: ", JobStateName(status.world.state), " at generation ",
                    status.world.generation, ", ", status.world.world_size, "/",
                    status.world.ranks, " ranks held, target ", status.world.expected_world_size,
                    ", ", status.world.standby, " standbys; transition: '",
                    status.world.transition, "'\n");
    for (const v1::MembershipEvent& event : core_->world().Events(0)) {
      absl::StrAppend(&text, "  event ", event.sequence(), " g", event.generation(), " ",
                      v1::MembershipEventKind_Name(event.kind()), " ", event.worker_id(), " ",
                      event.detail(), "\n");
    }
  } else {
    absl::StrAppend(&text, "coordinator: down\n");
  }
  for (const auto& worker : workers_) {
    absl::StrAppend(&text, "  ", worker->id, worker->alive ? "" : " (gone)",
                    worker->stopped ? " (stopped)" : "", " gen ",
                    worker->core ? worker->core->world().generation : 0, " rank ",
                    worker->core ? worker->core->rank() : -1, worker->trained ? " trained" : "",
                    worker->session.has_value()
                        ? absl::StrCat(" session g", worker->session->generation, " phase ",
                                       static_cast<int>(worker->session->phase))
                        : "",
                    worker->core && worker->core->paused_generation() > 0
                        ? absl::StrCat(" paused@g", worker->core->paused_generation())
                        : "",
                    worker->exited ? absl::StrCat(" exited: ", worker->exit_reason) : "", "\n");
  }
  return text;
}

SimulationResult Simulation::Run() {
  // The job and the timing of this seed.
  job_.name = "sim";
  job_.world_size = 2 + Pick(4);
  job_.min_world_size = 1 + Pick(job_.world_size);
  model_ = MlpManifest({4, 8, 2});
  if (Chance(0.3)) {
    job_.external_model = true;
    job_.optimizer.kind = OptimizerKind::kTorch;
    saved_state_ = OptimizerStateKind{"sim.Lion", {"exp_avg"}};
  } else {
    job_.widths = {4, 8, 2};
    job_.data_path = "/sim/data.safetensors";  // never read: the simulated ranks only step
    saved_state_ = StateKindOf(job_.optimizer);
  }
  job_.output_dir = "/sim/out";
  job_.seed = options_.seed;
  job_.global_batch = Chance(0.7) ? 60 : 8;  // 60 divides by 1..6; 8 refuses 3, 5, 6
  if (job_.global_batch % job_.world_size != 0 || job_.global_batch % job_.min_world_size != 0) {
    job_.global_batch = 60;
  }
  job_.steps = 150 + Pick(500);
  job_.zero_stage = 2;
  job_.checkpoint_dir = kCheckpointRoot;
  job_.checkpoint_every = std::vector<int64_t>{0, 5, 10, 25}[Pick(4)];
  job_.checkpoint_keep_last = 1 + Pick(4);
  job_.snapshot_every = std::vector<int64_t>{0, 5, 10, 25}[Pick(4)];
  job_.snapshot_replicas = Pick(3);
  step_time_ = Uniform(absl::Milliseconds(10), absl::Milliseconds(40));
  core_options_.world.lease = kLease;
  core_options_.world.reform_grace = std::vector<absl::Duration>{
      absl::ZeroDuration(), absl::Milliseconds(500), absl::Seconds(1), absl::Seconds(3)}[Pick(4)];
  core_options_.world.max_standbys = Pick(3);
  core_options_.progress.floor = absl::Seconds(2);
  if (weights_.standby_at_start) core_options_.world.max_standbys = 1 + Pick(2);
  if (job_.world_size < weights_.least_world_size) {
    job_.world_size = weights_.least_world_size + Pick(6 - weights_.least_world_size);
    job_.min_world_size = 1 + Pick(job_.world_size);
    if (job_.global_batch % job_.world_size != 0 ||
        job_.global_batch % job_.min_world_size != 0) {
      job_.global_batch = 60;
    }
  }
  if (weights_.frequent_disk_checkpoints) {
    job_.checkpoint_every = 5;
    job_.checkpoint_keep_last = 1 + Pick(2);
    job_.snapshot_every = 0;  // restore points on disk, which retention removes
  }
  core_options_.job = job_;
  // A quarter of the seeds make workers' training fail; the job fails beyond the limit.
  inject_failures_ = std::bernoulli_distribution(0.25)(failure_rng_);
  if (inject_failures_) {
    core_options_.world.max_worker_failures =
        std::vector<int>{0, 1, 3}[std::uniform_int_distribution<int>(0, 2)(failure_rng_)];
  }
  reference_hash_ = Mix(job_.seed, 0);
  for (int64_t step = 1; step <= job_.steps; ++step) reference_hash_ = Mix(reference_hash_, step);

  StartCoordinator();
  const int initial = job_.world_size + Pick(2) + (weights_.standby_at_start ? 1 : 0);
  for (int i = 0; i < initial; ++i) {
    const int index = AddWorker(absl::StrCat("w", next_worker_id_++));
    After(Uniform(absl::ZeroDuration(), weights_.last_start), [this, index] { StartProcess(index); });
  }
  faults_end_ = epoch_ + Uniform(absl::Seconds(5), absl::Seconds(40));
  After(Uniform(absl::Milliseconds(500), absl::Seconds(3)), [this] { Fault(); });
  At(faults_end_, [this] { Heal(); });
  // Once faults stop: detection, grace, re-formation and restarts take a few leases each; then
  // the rest of training, paused at most once per re-formation.
  deadline_ = faults_end_ + absl::Seconds(30) + 3 * core_options_.world.reform_grace +
              2 * job_.steps * step_time_;

  while (!queue_.empty() && !failure_.failed()) {
    Event event = queue_.top();
    queue_.pop();
    if (event.when > deadline_) break;
    now_ = event.when;
    event.action();
    ++result_.events;
    CheckInvariants();
    if (now_ > faults_end_ && Settled()) break;
  }
  result_.simulated = now_ - epoch_;
  result_.checkpoints = committed_;
  result_.finished = final_hash_.has_value();
  result_.stopped_by_operator = operator_stopped_;
  if (core_ != nullptr) result_.generations = static_cast<int>(core_->world().world().generation);
  if (!failure_.failed() && !Settled()) {
    failure_.Set(absl::StrCat("liveness: ", absl::FormatDuration(deadline_ - faults_end_),
                              " after the faults stopped the job has neither finished nor "
                              "stopped"));
  }
  result_.job_failed = core_ != nullptr && core_->world().world().state == JobState::kFailed;
  const int max_failures = core_options_.world.max_worker_failures;
  if (!failure_.failed() && failed_leaves_acked_ > max_failures && !operator_stopped_ &&
      !final_hash_.has_value() && !result_.job_failed) {
    failure_.Set(absl::StrCat("the coordinator acknowledged ", failed_leaves_acked_,
                              " workers that failed (more than ", max_failures,
                              ") but the job did not fail"));
  }
  if (!failure_.failed() && !operator_stopped_ && !final_hash_.has_value() &&
      !result_.job_failed) {
    failure_.Set("the job stopped without training to the end, without an operator's stop and "
                 "without failing");
  }
  result_.passed = !failure_.failed();
  if (!result_.passed) {
    result_.failure = absl::StrCat(failure_.message(), "\nat ",
                                   absl::FormatDuration(now_ - epoch_), " (faults until ",
                                   absl::FormatDuration(faults_end_ - epoch_), "); job: ",
                                   job_.world_size, " workers (min ", job_.min_world_size,
                                   "), batch ", job_.global_batch, ", ", job_.steps,
                                   " steps, checkpoint every ", job_.checkpoint_every, ", keep ",
                                   job_.checkpoint_keep_last, "\n", Describe());
  }
  return result_;
}

}  // namespace

std::string ProfileName(Profile profile) {
  for (const auto& [known, name] : kProfileNames) {
    if (known == profile) return std::string(name);
  }
  return "unknown";
}

std::optional<Profile> ParseProfile(absl::string_view name) {
  for (const auto& [profile, known] : kProfileNames) {
    if (known == name) return profile;
  }
  return std::nullopt;
}

std::string ProfileNames() {
  std::vector<absl::string_view> names;
  for (const auto& [profile, name] : kProfileNames) names.push_back(name);
  return absl::StrJoin(names, ", ");
}

SimulationResult RunSimulation(const SimulationOptions& options) {
  return Simulation(options).Run();
}

}  // namespace shard::sim
