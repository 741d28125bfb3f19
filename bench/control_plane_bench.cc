// shard-bench-control-plane: the coordinator's control plane at scale (issue 6), against the
// product's targets. Starts a real shard-coordinator process (a job of N workers whose
// min_world_size is N-1) and simulates N workers (default 1000) from this one process with gRPC's
// callback API over a few channels: no thread per worker. Phases, in order:
//
//   formation    every worker joins at once (or --join-rate per second), then long-polls its
//                heartbeat as shard-worker does (worker/agent.cc: one heartbeat always pending,
//                wait = the heartbeat interval the join reply gives, a quarter lease, sent again
//                as soon as it is answered). Measured: first join sent -> a reply shows the world
//                RUNNING with N workers (join-to-world-formed), -> every worker has seen it; the
//                coordinator's CPU-seconds over that; the generation the world formed at (must be
//                the first, 1); the size of the state directory's files (the membership journal).
//   longpoll     the same long-polls for --seconds on the formed world: the coordinator's CPU as
//                a fraction of one core, heartbeats/s, latencies.
//   paced,       optional (--modes): wait_ms = 0 once per interval per worker, spread evenly; and
//   saturate     wait_ms = 0 as fast as the coordinator answers (--max-in-flight pending): its
//                heartbeat capacity.
//   reformation  the holder of rank 0 stops heartbeating (dies); the survivors re-form after
//                --reform-grace. Measured: its lease's expiry (a lease after its last heartbeat
//                was sent) -> every survivor has seen the world RUNNING with N-1 workers, and the
//                coordinator's CPU-seconds over that (raw: the re-formation's answers replace the
//                held polls' expiry answers, so the steady rate is shown beside it, not
//                subtracted). The survivors must all see the same new generation.
//
// Checks (exit 1 if one fails): no errors, no worker lost, no answer at another generation or
// state outside the re-formation, no worker silent for a lease, the formed generation, the
// re-formed generation and world size, and the coordinator's own status at the end (GetStatus:
// N-1 live members and the victim dead). The product's targets are reported beside each figure
// (met or missed) but do not fail the run: a shared machine's load can inflate wall times.
//
// The state directory is on a real disk by default (a fresh directory under /var/tmp): the
// membership is a journal appended to and fsynced in groups by the coordinator's writer thread
// (server/store/state_store.h), so the disk's fsync is part of every acknowledged join. The
// filesystem and device that hold it are printed. The client runs on the same machine as the
// coordinator and competes with it for the cores: CPU-seconds are the robust figures, wall
// times and rates are a lower bound for a coordinator with the machine to itself.
#include <signal.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bench/harness.h"
#include "common/cli.h"
#include "common/dtype.h"
#include "common/files.h"
#include "common/safetensors.h"
#include "common/status_macros.h"
#include "common/signal_watcher.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "google/protobuf/util/json_util.h"
#include "grpcpp/support/channel_arguments.h"
#include "proto/control_convert.h"
#include "proto/unary_call.h"
#include "shard/v1/coordinator.grpc.pb.h"
#include "shard/v1/job.pb.h"
#include "tests/support/process.h"

namespace shard {
namespace {

// ---------------------------------------------------------------------------------------------
// The coordinator process and what /proc says about it
// ---------------------------------------------------------------------------------------------

// CPU-seconds process `pid` has used, all its threads (living or gone), to the nanosecond: its
// CPU-time clock. /proc/PID/stat counts in clock ticks (10 ms), too coarse for a re-formation
// that takes tens of milliseconds.
std::optional<double> CpuSeconds(pid_t pid) {
  clockid_t clock;
  timespec now {};
  if (::clock_getcpuclockid(pid, &clock) != 0 || ::clock_gettime(clock, &now) != 0) {
    return std::nullopt;
  }
  return static_cast<double>(now.tv_sec) + static_cast<double>(now.tv_nsec) * 1e-9;
}

// The filesystem that holds `path`, from the longest mount point above it in /proc/self/mounts:
// its type and device (e.g. "ext4 on /dev/vda, mounted at /"); tmpfs has no disk behind fsync.
struct Filesystem {
  std::string type = "unknown";
  std::string device;
  std::string mount;
  std::string Describe() const {
    return absl::StrCat(type, " on ", device, ", mounted at ", mount);
  }
};

Filesystem FilesystemOf(const std::string& path) {
  std::error_code error;
  const std::string absolute = std::filesystem::canonical(path, error).string();
  Filesystem found;
  std::ifstream in("/proc/self/mounts");
  std::string device, mount, type, rest;
  while (in >> device >> mount >> type && std::getline(in, rest)) {
    const bool above = mount == "/" || absolute == mount || absl::StartsWith(absolute, mount + "/");
    if (above && mount.size() >= found.mount.size()) found = {type, device, mount};
  }
  return found;
}

// A "Key:   1234 kB" line of /proc/PID/status, in KiB (-1 if absent).
int64_t StatusKib(pid_t pid, absl::string_view key) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(in, line)) {
    if (!absl::StartsWith(line, absl::StrCat(key, ":"))) continue;
    std::istringstream fields(line.substr(key.size() + 1));
    int64_t kib = -1;
    fields >> kib;
    return kib;
  }
  return -1;
}

std::string Tail(const std::string& text, size_t bytes) {
  return text.size() <= bytes ? text : text.substr(text.size() - bytes);
}

// How a process that Process::Wait saw end ended.
std::string Ended(int exit_code) {
  return exit_code > 128 ? absl::StrCat("was killed by signal ", exit_code - 128)
                         : absl::StrCat("exited with status ", exit_code);
}

// The running coordinator's pid, -1 when there is none: what a SIGINT/SIGTERM of this benchmark
// kills before it exits (its Process kills it on every other way out, and it gets SIGKILL if
// this process dies of anything else).
std::atomic<pid_t> running_coordinator{-1};

// Starts shard-coordinator `binary` with `args`, logging to `log_file`, and waits until it has
// written its port to `port_file`.
absl::StatusOr<testing::Process> StartCoordinator(const std::string& binary,
                                                  const std::vector<std::string>& args,
                                                  const std::string& port_file,
                                                  const std::string& log_file, int* port,
                                                  absl::Duration timeout) {
  if (::access(binary.c_str(), X_OK) != 0) {
    return absl::NotFoundError(absl::StrCat(
        "no shard-coordinator binary at ", binary,
        "; build it (scripts/build.sh --target shard-coordinator) or pass --coordinator-binary"));
  }
  std::vector<std::string> argv = {binary};
  argv.insert(argv.end(), args.begin(), args.end());
  absl::StatusOr<testing::Process> process = testing::Process::Start(argv, log_file);
  if (!process.ok()) return process.status();
  running_coordinator.store(process->pid());
  const absl::Time give_up = absl::Now() + timeout;
  while (true) {
    std::ifstream in(port_file);
    if (in >> *port && *port > 0) return process;
    if (process->Exited()) {
      running_coordinator.store(-1);
      return absl::UnavailableError(absl::StrCat(
          "shard-coordinator ", Ended(*process->Wait(absl::ZeroDuration())),
          " before serving; its log ends with:\n", Tail(process->Log(), 2000)));
    }
    if (absl::Now() > give_up) {
      return absl::DeadlineExceededError(absl::StrCat(
          "shard-coordinator did not write its port to ", port_file, " within ",
          absl::FormatDuration(timeout), "; its log ends with:\n", Tail(process->Log(), 2000)));
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
}

// SIGTERM (the coordinator asks its workers to stop and exits once none is live), then SIGKILL
// if it has not exited within `grace`. Says how it ended.
std::string StopCoordinator(testing::Process& coordinator, absl::Duration grace) {
  coordinator.Signal(SIGTERM);
  std::optional<int> exit_code = coordinator.Wait(grace);
  std::string how;
  if (!exit_code.has_value()) {
    coordinator.Signal(SIGKILL);
    exit_code = coordinator.Wait(absl::Seconds(10));
    how = " (SIGKILL after SIGTERM)";
  }
  running_coordinator.store(-1);
  return (exit_code.has_value() ? Ended(*exit_code) : "did not end") + how;
}

// Idle CPU seconds of the whole machine, all cores (idle + iowait on the first line of
// /proc/stat). Busy time is derived from it: with a tickless kernel the idle time is exact while
// user and system time are sampled at each tick and miss short bursts of work.
double MachineIdleSeconds() {
  std::ifstream in("/proc/stat");
  std::string cpu;
  int64_t user = 0, nice = 0, system = 0, idle = 0, iowait = 0;
  in >> cpu >> user >> nice >> system >> idle >> iowait;
  return static_cast<double>(idle + iowait) / static_cast<double>(sysconf(_SC_CLK_TCK));
}

// CPU seconds of the coordinator and of this client, idle seconds of the whole machine, and the
// wall time they were taken at.
struct Usage {
  absl::Time at;
  double coordinator_cpu_s = 0;
  double client_cpu_s = 0;
  double machine_idle_s = 0;
};

Usage Sample(pid_t coordinator) {
  Usage usage;
  usage.at = absl::Now();
  usage.coordinator_cpu_s = CpuSeconds(coordinator).value_or(NAN);
  usage.client_cpu_s = CpuSeconds(::getpid()).value_or(NAN);
  usage.machine_idle_s = MachineIdleSeconds();
  return usage;
}

// ---------------------------------------------------------------------------------------------
// Measurements
// ---------------------------------------------------------------------------------------------

// The answers of one phase's calls. Thread-safe: gRPC's callback threads record into it.
class Recorder {
 public:
  // Calls sent after `end` are still checked but no longer count toward the phase's rate (a
  // call sent before it counts even when answered after it: long-polls are held).
  void CloseWindow(absl::Time end) {
    absl::MutexLock lock(&mu_);
    window_end_ = end;
  }

  void Ok(absl::Time sent, absl::Time answered, bool world_moved) {
    absl::MutexLock lock(&mu_);
    latency_ms_.push_back(static_cast<float>(absl::ToDoubleMilliseconds(answered - sent)));
    ++ok_;
    if (sent <= window_end_) ++ok_in_window_;
    if (world_moved) ++world_moved_;
  }

  void Error(const grpc::Status& status, const std::string& worker_id) {
    absl::MutexLock lock(&mu_);
    ++errors_;
    ++codes_[status.error_code()];
    if (first_error_.empty()) {
      first_error_ = absl::StrCat(worker_id, ": code ", status.error_code(), ": ",
                                  status.error_message());
    }
  }

  // The worker was declared dead or taken over (NOT_FOUND, FAILED_PRECONDITION).
  void Lost() {
    absl::MutexLock lock(&mu_);
    ++lost_;
  }

  void Late() {
    absl::MutexLock lock(&mu_);
    ++late_;
  }

  // The longest time between two answered heartbeats of one worker.
  void Gap(absl::Duration gap) {
    absl::MutexLock lock(&mu_);
    max_gap_ = std::max(max_gap_, gap);
  }

  struct Summary {
    int64_t ok = 0, ok_in_window = 0, errors = 0, lost = 0, late = 0, world_moved = 0;
    bench::Stats latency;
    double max_gap_ms = 0;
    std::string first_error;
    std::map<int, int64_t> codes;
  };
  Summary Summarize() const {
    absl::MutexLock lock(&mu_);
    Summary s;
    s.ok = ok_;
    s.ok_in_window = ok_in_window_;
    s.errors = errors_;
    s.lost = lost_;
    s.late = late_;
    s.world_moved = world_moved_;
    s.latency = bench::Summarize(std::vector<double>(latency_ms_.begin(), latency_ms_.end()));
    s.max_gap_ms = absl::ToDoubleMilliseconds(max_gap_);
    s.first_error = first_error_;
    s.codes = codes_;
    return s;
  }

 private:
  mutable absl::Mutex mu_;
  absl::Time window_end_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
  std::vector<float> latency_ms_ ABSL_GUARDED_BY(mu_);
  int64_t ok_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t ok_in_window_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t errors_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t lost_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t late_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t world_moved_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Duration max_gap_ ABSL_GUARDED_BY(mu_);
  std::string first_error_ ABSL_GUARDED_BY(mu_);
  std::map<int, int64_t> codes_ ABSL_GUARDED_BY(mu_);
};

// Runs functions at given times on one thread: paced heartbeats and retries.
class Timers {
 public:
  Timers() : thread_([this] { Loop(); }) {}
  ~Timers() {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
      wake_.Signal();
    }
    thread_.join();
  }

  void At(absl::Time due, std::function<void()> fn) {
    absl::MutexLock lock(&mu_);
    const bool earliest = queue_.empty() || due < queue_.begin()->first;
    queue_.emplace(due, std::move(fn));
    if (earliest) wake_.Signal();
  }

  // Runs everything pending now (their functions see that their phase is over).
  void RunPendingNow() {
    absl::MutexLock lock(&mu_);
    flush_ = true;
    wake_.Signal();
  }

 private:
  void Loop() {
    absl::MutexLock lock(&mu_);
    while (!stop_) {
      if (queue_.empty()) {
        flush_ = false;
        wake_.Wait(&mu_);
        continue;
      }
      const absl::Time now = absl::Now();
      if (!flush_ && queue_.begin()->first > now) {
        wake_.WaitWithDeadline(&mu_, queue_.begin()->first);
        continue;
      }
      std::vector<std::function<void()>> ready;
      while (!queue_.empty() && (flush_ || queue_.begin()->first <= now)) {
        ready.push_back(std::move(queue_.extract(queue_.begin()).mapped()));
      }
      flush_ = false;
      mu_.Unlock();
      for (std::function<void()>& fn : ready) fn();
      mu_.Lock();
    }
  }

  absl::Mutex mu_;
  absl::CondVar wake_;
  std::multimap<absl::Time, std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool flush_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

// ---------------------------------------------------------------------------------------------
// The simulated workers
// ---------------------------------------------------------------------------------------------

struct SimWorker {
  std::string id;
  uint64_t incarnation = 0;
  v1::Coordinator::Stub* stub = nullptr;
  // What the worker knows of the world. Answers are handled on whichever gRPC thread runs the
  // callback (and saturate may have two calls of one worker in flight), hence atomics.
  std::atomic<int64_t> known_generation{0};
  std::atomic<int> known_state{v1::JOB_STATE_UNSPECIFIED};
  std::atomic<int> rank{-1};               // as its join reply said
  std::atomic<bool> informed{false};       // has seen the formed world
  std::atomic<bool> reformed{false};       // has seen the world re-formed without the victim
  std::atomic<bool> dead{false};           // the re-formation's victim: heartbeats no more
  std::atomic<int64_t> last_answer_us{0};  // last answered heartbeat or join (unix us)
  std::atomic<int64_t> last_sent_us{0};    // last heartbeat sent (unix us)
};

// One phase's measurements: the calls answered while it records, and CPU use around it.
struct Phase {
  std::string name;
  bool world_may_move = false;  // the re-formation: answers at a new generation are expected
  Recorder calls;
  Usage before, after;
};

// Call chains (a worker's sequence of heartbeats, or a saturation slot). Each counts in `count`
// until it sees `stopping`; they are over when none is left.
struct Chains {
  std::atomic<bool> stopping{false};
  absl::Mutex mu;
  int count ABSL_GUARDED_BY(mu) = 0;
};

struct Options {
  int workers = 1000;
  int channels = 16;
  double seconds = 10;
  absl::Duration lease = absl::Seconds(10);
  int max_in_flight = 256;
  double join_rate = 0;  // joins/s; 0: all at once
  absl::Duration rpc_timeout = absl::Seconds(30);
  absl::Duration form_timeout = absl::Seconds(60);
};

class Fleet {
 public:
  Fleet(const Options& options, const std::string& address)
      : options_(options), address_(address) {
    for (int c = 0; c < options.channels; ++c) {
      grpc::ChannelArguments args;
      // Without this, channels with equal arguments share one TCP connection.
      args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
      channels_.push_back(
          grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args));
      stubs_.push_back(v1::Coordinator::NewStub(channels_.back()));
    }
    std::mt19937_64 random(std::random_device{}());
    for (int w = 0; w < options.workers; ++w) {
      auto worker = std::make_unique<SimWorker>();
      worker->id = absl::StrFormat("sim-%05d", w + 1);
      worker->incarnation = random() | 1;
      worker->stub = stubs_[w % stubs_.size()].get();
      workers_.push_back(std::move(worker));
    }
    admin_ = v1::Admin::NewStub(
        grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  }

  // Connects every channel before anything is timed.
  absl::Status Connect(absl::Duration timeout) {
    const auto deadline = absl::ToChronoTime(absl::Now() + timeout);
    for (auto& channel : channels_) {
      if (!channel->WaitForConnected(deadline)) {
        return absl::UnavailableError(absl::StrCat("cannot connect to the coordinator at ",
                                                   address_, " within ",
                                                   absl::FormatDuration(timeout)));
      }
    }
    return absl::OkStatus();
  }

  int size() const { return static_cast<int>(workers_.size()); }
  SimWorker& worker(int w) { return *workers_[w]; }
  // How often workers heartbeat: what the join replies say (a quarter lease).
  int64_t interval_ms() const { return interval_ms_.load(); }
  void set_interval_ms(int64_t interval_ms) {
    interval_ms_.store(std::max<int64_t>(1, interval_ms));
  }

  using JoinDone =
      std::function<void(const grpc::Status&, const v1::JoinResponse&, absl::Time sent)>;
  void Join(int w, JoinDone done) {
    SimWorker& worker = *workers_[w];
    auto call = std::make_shared<Call<v1::JoinRequest, v1::JoinResponse>>();
    call->request.set_worker_id(worker.id);
    call->request.set_host("127.0.0.1");
    call->request.set_device("cpu");
    call->request.add_capabilities("gloo");
    call->request.set_incarnation(worker.incarnation);
    call->context.set_deadline(absl::ToChronoTime(absl::Now() + options_.rpc_timeout));
    call->sent = absl::Now();
    worker.stub->async()->Join(&call->context, &call->request, &call->response,
                               [call, done = std::move(done)](grpc::Status status) {
                                 done(status, call->response, call->sent);
                               });
  }

  using HeartbeatDone =
      std::function<void(const grpc::Status&, const v1::HeartbeatResponse&, absl::Time sent)>;
  void Heartbeat(int w, int64_t wait_ms, HeartbeatDone done) {
    SimWorker& worker = *workers_[w];
    auto call = std::make_shared<Call<v1::HeartbeatRequest, v1::HeartbeatResponse>>();
    call->request.set_worker_id(worker.id);
    call->request.set_incarnation(worker.incarnation);
    call->request.set_known_generation(worker.known_generation.load());
    call->request.set_known_state(static_cast<v1::JobState>(worker.known_state.load()));
    call->request.set_wait_ms(wait_ms);
    call->context.set_deadline(
        absl::ToChronoTime(absl::Now() + absl::Milliseconds(wait_ms) + options_.rpc_timeout));
    call->sent = absl::Now();
    worker.last_sent_us.store(absl::ToUnixMicros(call->sent));
    worker.stub->async()->Heartbeat(&call->context, &call->request, &call->response,
                                    [call, done = std::move(done)](grpc::Status status) {
                                      done(status, call->response, call->sent);
                                    });
  }

  absl::StatusOr<v1::GetStatusResponse> GetStatus(absl::Duration* took) {
    grpc::ClientContext context;
    const absl::Time start = absl::Now();
    absl::StatusOr<v1::GetStatusResponse> response =
        UnaryCall(context, *admin_, &v1::Admin::Stub::GetStatus, v1::GetStatusRequest(),
                  options_.rpc_timeout, absl::StrCat("GetStatus at ", address_));
    *took = absl::Now() - start;
    return response;
  }

  // The membership history the coordinator keeps (its last 1,000 events).
  absl::StatusOr<v1::ListEventsResponse> ListEvents() {
    grpc::ClientContext context;
    return UnaryCall(context, *admin_, &v1::Admin::Stub::ListEvents, v1::ListEventsRequest(),
                     options_.rpc_timeout, absl::StrCat("ListEvents at ", address_));
  }

 private:
  template <typename Request, typename Response>
  struct Call {
    grpc::ClientContext context;
    Request request;
    Response response;
    absl::Time sent;
  };

  const Options options_;
  const std::string address_;
  std::atomic<int64_t> interval_ms_{
      std::max<int64_t>(1, absl::ToInt64Milliseconds(options_.lease / 4))};
  std::vector<std::shared_ptr<grpc::Channel>> channels_;
  std::vector<std::unique_ptr<v1::Coordinator::Stub>> stubs_;
  std::vector<std::unique_ptr<SimWorker>> workers_;
  std::unique_ptr<v1::Admin::Stub> admin_;
};

bool IsLoss(const grpc::Status& status) {
  return status.error_code() == grpc::StatusCode::NOT_FOUND ||
         status.error_code() == grpc::StatusCode::FAILED_PRECONDITION;
}

// ---------------------------------------------------------------------------------------------
// The benchmark
// ---------------------------------------------------------------------------------------------

struct FormationResult {
  bool formed = false;
  int64_t generation = 0;
  double formed_ms = 0;        // first join sent -> a reply shows RUNNING with N workers
  double all_informed_ms = 0;  // first join sent -> every worker has seen it
  int informed = 0;
  int joins_ok = 0;
  double last_join_ms = 0;     // first join sent -> last join answered
  Recorder::Summary joins;
  Recorder::Summary heartbeats;
  Usage before, after;
};

struct ReformResult {
  bool reformed = false;
  std::string victim;
  int victim_rank = -1;
  int survivors = 0;                   // workers that saw the re-formed world
  std::map<int64_t, int> generations;  // generation of the re-formed world -> survivors told
  absl::Time lease_expired;            // a lease after the victim's last heartbeat was sent
  double expiry_to_reformed_ms = 0;    // -> every survivor has seen the re-formed world
  Recorder::Summary heartbeats;
  Usage at_expiry, at_reformed;
};

class Bench {
 public:
  Bench(const Options& options, Fleet* fleet, pid_t coordinator)
      : options_(options), fleet_(fleet), coordinator_(coordinator) {}

  // Every worker joins, then long-polls its heartbeat as shard-worker does until Finish.
  // Measured until every worker has seen the world running.
  FormationResult Form() {
    Phase* phase = NewPhase("formation");
    recording_.store(phase);
    FormationResult result;
    const int n = fleet_->size();
    Chains* chains = NewChains(n);
    longpolls_ = chains;
    phase->before = Sample(coordinator_);
    first_join_ = absl::Now();
    for (int w = 0; w < n; ++w) {
      if (options_.join_rate <= 0) {
        Join(chains, w);
        continue;
      }
      // A ramp: worker w joins w / rate seconds after the first.
      timers_.At(first_join_ + absl::Seconds(w / options_.join_rate), [this, chains, w] {
        if (chains->stopping.load()) return EndChain(chains);
        Join(chains, w);
      });
    }
    // Formed when every worker has seen the world running, or impossible once a join failed.
    {
      absl::MutexLock lock(&mu_);
      auto settled = [this, n]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return informed_ == n || (joins_answered_ == n && join_errors_ > 0) || phase_failed_;
      };
      mu_.AwaitWithTimeout(absl::Condition(&settled), options_.form_timeout);
      result.formed = formed_at_ != absl::InfinitePast();
      result.generation = formed_generation_.load();
      result.informed = informed_;
      if (result.formed) result.formed_ms = absl::ToDoubleMilliseconds(formed_at_ - first_join_);
      if (informed_ == n) {
        result.all_informed_ms = absl::ToDoubleMilliseconds(all_informed_at_ - first_join_);
      }
      result.last_join_ms = absl::ToDoubleMilliseconds(last_join_answer_ - first_join_);
    }
    phase->after = Sample(coordinator_);
    result.joins = joins_.Summarize();
    result.joins_ok = static_cast<int>(result.joins.ok);
    result.heartbeats = phase->calls.Summarize();
    result.before = phase->before;
    result.after = phase->after;
    return result;
  }

  // The formed world's long-polls for --seconds: the steady state.
  Phase* Steady() {
    Phase* phase = NewPhase("longpoll");
    phase->before = Sample(coordinator_);
    recording_.store(phase);
    absl::SleepFor(absl::Seconds(options_.seconds));
    phase->after = Sample(coordinator_);
    phase->calls.CloseWindow(phase->after.at);
    return phase;
  }

  // One extra heartbeat phase of --seconds instead of the long-polls: paced or saturate.
  Phase* Run(const std::string& mode) {
    if (longpolls_ != nullptr) Drain(longpolls_, "longpoll");
    longpolls_ = nullptr;
    Phase* phase = NewPhase(mode);
    recording_.store(phase);
    const int n = fleet_->size();
    phase->before = Sample(coordinator_);
    if (mode == "paced") {
      Chains* chains = NewChains(n);
      // Spread evenly over one interval, as independent workers' timers are.
      const absl::Duration interval = absl::Milliseconds(fleet_->interval_ms());
      for (int w = 0; w < n; ++w) Paced(phase, chains, w, phase->before.at + interval * w / n);
      Sleep(phase, chains);
    } else {
      const int slots = std::min(options_.max_in_flight, n);
      Chains* chains = NewChains(slots);
      for (int s = 0; s < slots; ++s) Saturate(phase, chains);
      Sleep(phase, chains);
    }
    return phase;
  }

  // The holder of rank 0 stops heartbeating (its process died) while the others long-poll.
  // Measured from its lease's expiry until every survivor has seen the world re-formed without
  // it. Returns once they have, or after the lease and --form-timeout.
  ReformResult Reform() {
    Phase* phase = NewPhase("reformation");
    phase->world_may_move = true;
    recording_.store(phase);
    const int n = fleet_->size();
    // After paced or saturate, the long-polls start again.
    if (longpolls_ == nullptr) {
      longpolls_ = NewChains(n);
      for (int w = 0; w < n; ++w) LongPoll(longpolls_, w);
    }
    int victim = 0;
    for (int w = 0; w < n; ++w) {
      if (fleet_->worker(w).rank.load() == 0) victim = w;
    }
    ReformResult result;
    result.victim = fleet_->worker(victim).id;
    result.victim_rank = fleet_->worker(victim).rank.load();
    {
      absl::MutexLock lock(&mu_);
      reform_size_ = n - 1;
    }
    fleet_->worker(victim).dead.store(true);
    {
      absl::MutexLock lock(&mu_);
      auto settled = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return (reformed_ == reform_size_ && expiry_sampled_) || phase_failed_;
      };
      mu_.AwaitWithTimeout(absl::Condition(&settled),
                           options_.lease + absl::Milliseconds(fleet_->interval_ms()) +
                               options_.form_timeout);
      result.survivors = reformed_;
      result.generations = reform_generations_;
      result.lease_expired = lease_expired_;
      result.reformed = reformed_ == reform_size_ && expiry_sampled_;
      if (result.reformed) {
        result.expiry_to_reformed_ms = absl::ToDoubleMilliseconds(reformed_at_ - lease_expired_);
        result.at_expiry = at_expiry_;
        result.at_reformed = at_reformed_;
      }
    }
    result.heartbeats = phase->calls.Summarize();
    return result;
  }

  // Ends the long-polls and waits until their last calls are answered.
  void Finish() {
    if (longpolls_ != nullptr) Drain(longpolls_, "longpoll");
    longpolls_ = nullptr;
  }

 private:
  Phase* NewPhase(const std::string& name) {
    phases_.push_back(std::make_unique<Phase>());
    phases_.back()->name = name;
    return phases_.back().get();
  }

  Chains* NewChains(int count) {
    chains_.push_back(std::make_unique<Chains>());
    absl::MutexLock lock(&chains_.back()->mu);
    chains_.back()->count = count;
    return chains_.back().get();
  }

  void EndChain(Chains* chains) {
    absl::MutexLock lock(&chains->mu);
    --chains->count;
  }

  // Stops the chains and waits until their last call is answered.
  void Drain(Chains* chains, const std::string& name) {
    chains->stopping.store(true);
    timers_.RunPendingNow();
    absl::MutexLock lock(&chains->mu);
    auto idle = [chains]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(chains->mu) {
      return chains->count == 0;
    };
    if (!chains->mu.AwaitWithTimeout(absl::Condition(&idle),
                                     options_.rpc_timeout + options_.lease)) {
      std::fprintf(stderr, "shard-bench-control-plane: %d %s call chains did not end\n",
                   chains->count, name.c_str());
    }
  }

  // A paced or saturate phase: --seconds, then its chains drain.
  void Sleep(Phase* phase, Chains* chains) {
    absl::SleepFor(absl::Seconds(options_.seconds));
    phase->after = Sample(coordinator_);
    phase->calls.CloseWindow(phase->after.at);
    Drain(chains, phase->name);
  }

  // One worker's join; once answered, it long-polls its heartbeat as shard-worker does.
  void Join(Chains* chains, int w) {
    fleet_->Join(w, [this, chains, w](const grpc::Status& status,
                                      const v1::JoinResponse& response, absl::Time sent) {
      const absl::Time now = absl::Now();
      SimWorker& worker = fleet_->worker(w);
      {
        absl::MutexLock lock(&mu_);
        ++joins_answered_;
        if (!status.ok()) ++join_errors_;
        last_join_answer_ = std::max(last_join_answer_, now);
      }
      if (!status.ok()) {
        joins_.Error(status, worker.id);
        EndChain(chains);
        return;
      }
      joins_.Ok(sent, now, false);
      fleet_->set_interval_ms(response.heartbeat_interval_ms());
      worker.rank.store(response.rank());
      worker.last_answer_us.store(absl::ToUnixMicros(now));
      Observe(w, response.world(), now);
      LongPoll(chains, w);  // as shard-worker: heartbeat from the moment it has joined
    });
  }

  // What a worker learns from an answer; marks the world formed (or re-formed without the
  // victim) and the worker told.
  void Observe(int w, const v1::WorldView& world, absl::Time now) {
    SimWorker& worker = fleet_->worker(w);
    worker.known_generation.store(world.generation());
    worker.known_state.store(world.state());
    if (!Trains(FromProto(world.state()))) return;
    const int n = fleet_->size();
    if (world.world_size() == n) {
      // Once told, nothing to record: no lock on every later heartbeat.
      if (worker.informed.load()) return;
      absl::MutexLock lock(&mu_);
      if (formed_at_ == absl::InfinitePast()) {
        formed_at_ = now;
        formed_generation_.store(world.generation());
      }
      if (!worker.informed.exchange(true) && ++informed_ == n) all_informed_at_ = now;
      return;
    }
    if (world.world_size() != n - 1 || worker.reformed.load()) return;
    absl::MutexLock lock(&mu_);
    if (reform_size_ == 0 || worker.reformed.exchange(true)) return;
    ++reform_generations_[world.generation()];
    if (++reformed_ == reform_size_) {
      reformed_at_ = now;
      at_reformed_ = Sample(coordinator_);
    }
  }

  // Records an answered heartbeat; false when the worker's chain must end.
  bool Answered(Phase* phase, int w, const grpc::Status& status,
                const v1::HeartbeatResponse& response, absl::Time sent) {
    const absl::Time now = absl::Now();
    SimWorker& worker = fleet_->worker(w);
    if (!status.ok()) {
      phase->calls.Error(status, worker.id);
      if (IsLoss(status)) {
        // Declared dead or taken over: shard-worker would join again, bumping the
        // generation. The benchmark counts it as a failure and stops this worker.
        phase->calls.Lost();
        absl::MutexLock lock(&mu_);
        phase_failed_ = true;
        return false;
      }
      return true;
    }
    const int64_t formed = formed_generation_.load();
    const bool moved = !phase->world_may_move && formed >= 0 &&
                       (response.world().generation() != formed ||
                        !Trains(FromProto(response.world().state())));
    phase->calls.Ok(sent, now, moved);
    const int64_t now_us = absl::ToUnixMicros(now);
    const int64_t last = worker.last_answer_us.exchange(now_us);
    if (last > 0) phase->calls.Gap(absl::Microseconds(now_us - last));
    Observe(w, response.world(), now);
    return true;
  }

  // shard-worker's loop: one long-poll pending, sent again as soon as it is answered (after an
  // interval on a transient error). Answers count toward the phase recording now.
  void LongPoll(Chains* chains, int w) {
    if (chains->stopping.load()) return EndChain(chains);
    if (fleet_->worker(w).dead.load()) return Die(chains, w);
    fleet_->Heartbeat(w, fleet_->interval_ms(),
                      [this, chains, w](const grpc::Status& status,
                                        const v1::HeartbeatResponse& response, absl::Time sent) {
                        if (!Answered(recording_.load(), w, status, response, sent)) {
                          return EndChain(chains);
                        }
                        if (status.ok() || chains->stopping.load()) return LongPoll(chains, w);
                        timers_.At(absl::Now() + absl::Milliseconds(fleet_->interval_ms()),
                                   [this, chains, w] { LongPoll(chains, w); });
                      });
  }

  // The victim's chain ends. The coordinator renewed its lease when its last heartbeat arrived,
  // just after it was sent: the lease runs out a lease after that, and the coordinator's CPU is
  // sampled then.
  void Die(Chains* chains, int w) {
    const absl::Time expiry =
        absl::FromUnixMicros(fleet_->worker(w).last_sent_us.load()) + options_.lease;
    {
      absl::MutexLock lock(&mu_);
      lease_expired_ = expiry;
    }
    timers_.At(expiry, [this] {
      const Usage usage = Sample(coordinator_);
      absl::MutexLock lock(&mu_);
      at_expiry_ = usage;
      expiry_sampled_ = true;
    });
    EndChain(chains);
  }

  // wait_ms = 0 once per interval, due at `due`; late if the previous answer came after it.
  void Paced(Phase* phase, Chains* chains, int w, absl::Time due) {
    if (chains->stopping.load()) return EndChain(chains);
    timers_.At(due, [this, phase, chains, w, due] {
      if (chains->stopping.load()) return EndChain(chains);
      fleet_->Heartbeat(w, 0,
                        [this, phase, chains, w, due](const grpc::Status& status,
                                                      const v1::HeartbeatResponse& response,
                                                      absl::Time sent) {
                          if (!Answered(phase, w, status, response, sent)) {
                            return EndChain(chains);
                          }
                          absl::Time next = due + absl::Milliseconds(fleet_->interval_ms());
                          const absl::Time now = absl::Now();
                          if (next < now) {
                            phase->calls.Late();
                            next = now;
                          }
                          Paced(phase, chains, w, next);
                        });
    });
  }

  // wait_ms = 0 as fast as answered; workers round-robin so every lease is renewed.
  void Saturate(Phase* phase, Chains* chains) {
    if (chains->stopping.load()) return EndChain(chains);
    const int w = static_cast<int>(next_worker_.fetch_add(1) % fleet_->size());
    fleet_->Heartbeat(w, 0,
                      [this, phase, chains, w](const grpc::Status& status,
                                               const v1::HeartbeatResponse& response,
                                               absl::Time sent) {
                        if (!Answered(phase, w, status, response, sent)) return EndChain(chains);
                        Saturate(phase, chains);
                      });
  }

  const Options options_;
  Fleet* const fleet_;
  const pid_t coordinator_;
  std::vector<std::unique_ptr<Phase>> phases_;
  std::vector<std::unique_ptr<Chains>> chains_;
  std::atomic<Phase*> recording_{nullptr};  // where long-poll answers are recorded
  Chains* longpolls_ = nullptr;             // while the workers long-poll
  std::atomic<uint64_t> next_worker_{0};
  absl::Time first_join_;
  Recorder joins_;
  std::atomic<int64_t> formed_generation_{-1};  // -1 until the world formed

  absl::Mutex mu_;
  absl::Time formed_at_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  int informed_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time all_informed_at_ ABSL_GUARDED_BY(mu_);
  int joins_answered_ ABSL_GUARDED_BY(mu_) = 0;
  int join_errors_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time last_join_answer_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  bool phase_failed_ ABSL_GUARDED_BY(mu_) = false;
  int reform_size_ ABSL_GUARDED_BY(mu_) = 0;  // N-1 once the victim is chosen
  int reformed_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<int64_t, int> reform_generations_ ABSL_GUARDED_BY(mu_);
  absl::Time lease_expired_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  absl::Time reformed_at_ ABSL_GUARDED_BY(mu_);
  bool expiry_sampled_ ABSL_GUARDED_BY(mu_) = false;
  Usage at_expiry_ ABSL_GUARDED_BY(mu_);
  Usage at_reformed_ ABSL_GUARDED_BY(mu_);
  // Last: destroyed first, so no timer fires into the phases and counters above.
  Timers timers_;
};

// CPU use over a window: CPU-seconds and percent of one core for the coordinator and for this
// client, and how busy the whole machine was (percent of all its cores).
struct CpuUse {
  double wall_s = 0;
  double coordinator_cpu_s = 0;
  double coordinator_core_percent = 0;
  double client_cpu_s = 0;
  double client_core_percent = 0;
  double machine_percent = 0;
};

CpuUse CpuOver(const Usage& before, const Usage& after) {
  const double wall = std::max(1e-9, absl::ToDoubleSeconds(after.at - before.at));
  const double coordinator = after.coordinator_cpu_s - before.coordinator_cpu_s;
  const double client = after.client_cpu_s - before.client_cpu_s;
  const double idle = after.machine_idle_s - before.machine_idle_s;
  const double cores = std::max(1u, std::thread::hardware_concurrency());
  return {.wall_s = wall,
          .coordinator_cpu_s = coordinator,
          .coordinator_core_percent = 100 * coordinator / wall,
          .client_cpu_s = client,
          .client_core_percent = 100 * client / wall,
          .machine_percent = std::max(0.0, 100 * (1 - idle / (wall * cores)))};
}

// A record's extras for the CPU used while it was measured.
void AddCpu(bench::Record& record, const CpuUse& cpu) {
  record.Extra("wall_s", cpu.wall_s)
      .Extra("coordinator_cpu_s", cpu.coordinator_cpu_s)
      .Extra("coordinator_core_percent", cpu.coordinator_core_percent)
      .Extra("client_cpu_s", cpu.client_cpu_s)
      .Extra("client_core_percent", cpu.client_core_percent)
      .Extra("machine_percent", cpu.machine_percent);
}

// A record's note for the first error of its calls, with every error code's count.
std::string FirstError(const Recorder::Summary& calls) {
  if (calls.first_error.empty()) return "";
  std::vector<std::string> parts;
  for (const auto& [code, count] : calls.codes) {
    parts.push_back(absl::StrCat(count, " x ", absl::StatusCodeToString(
                                                   static_cast<absl::StatusCode>(code))));
  }
  return absl::StrCat("first error: ", calls.first_error, " (", absl::StrJoin(parts, ", "), ")");
}

// The machine's load averages over 1, 5 and 15 minutes (the first three fields of /proc/loadavg):
// the machine is shared, and its load inflates wall times.
std::string LoadAverage() {
  std::ifstream in("/proc/loadavg");
  std::string one, five, fifteen;
  in >> one >> five >> fifteen;
  return absl::StrCat(one, " ", five, " ", fifteen);
}

// The regular files of `dir` and their sizes in bytes.
std::map<std::string, int64_t> FilesIn(const std::string& dir) {
  std::map<std::string, int64_t> files;
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(dir, error)) {
    std::error_code size_error;
    if (!entry.is_regular_file(size_error)) continue;
    const uintmax_t size = entry.file_size(size_error);
    files[entry.path().filename().string()] = size_error ? -1 : static_cast<int64_t>(size);
  }
  return files;
}

std::string Describe(const std::map<std::string, int64_t>& files) {
  std::vector<std::string> parts;
  for (const auto& [name, bytes] : files) parts.push_back(absl::StrCat(name, " ", bytes));
  return absl::StrJoin(parts, ", ");
}

struct Setup {
  std::string binary;        // shard-coordinator
  std::string lease;         // as given, passed to the coordinator
  std::string reform_grace;  // likewise
  std::string log_level;     // the coordinator's
  std::string scratch;       // holds the job, the state directory, the port file and the log
  std::vector<std::string> modes;
  bench::Output output;
};

// The job the coordinator runs. Only a job spec sets min_world_size, here N-1 so that the
// survivors of one death re-form without a replacement. Nothing trains (the simulated workers
// never ask for a plan), so the model and the data are the smallest valid ones.
absl::StatusOr<std::string> WriteJob(const std::string& dir, int workers) {
  const std::string data = dir + "/data.safetensors";
  const std::vector<float> x = {0, 0};
  const std::vector<int64_t> y = {0};
  SHARD_RETURN_IF_ERROR(WriteSafetensors(
      data, {{"x", DataType::kFloat32, {1, 2}}, {"y", DataType::kInt64, {1}}},
      {x.data(), y.data()}));
  v1::JobSpec spec;
  spec.set_name("bench");
  spec.set_world_size(workers);
  spec.set_min_world_size(workers - 1);
  spec.mutable_model()->mutable_mlp()->add_widths(2);
  spec.mutable_model()->mutable_mlp()->add_widths(2);
  spec.mutable_data()->set_path(data);
  spec.mutable_optimizer()->set_name("sgd");
  spec.mutable_optimizer()->set_lr(0.1);
  spec.set_global_batch(int64_t{workers} * (workers - 1));  // divides over N and N-1
  spec.set_steps(1);
  spec.set_output_dir(dir + "/output");
  std::string json;
  if (const auto printed = google::protobuf::util::MessageToJsonString(spec, &json);
      !printed.ok()) {
    return absl::InternalError(absl::StrCat("cannot write the benchmark's job spec: ",
                                            printed.message().as_string()));
  }
  const std::string path = dir + "/job.json";
  SHARD_RETURN_IF_ERROR(WriteFileAtomically(path, json));
  return path;
}

// Runs the benchmark against a coordinator it starts and stops; reports the results. Returns
// whether every check passed.
absl::StatusOr<bool> Benchmark(const Options& options, const Setup& setup) {
  const std::string state_dir = setup.scratch + "/state";
  const std::string port_file = setup.scratch + "/port";
  const std::string load_before = LoadAverage();
  SHARD_ASSIGN_OR_RETURN(const std::string job, WriteJob(setup.scratch, options.workers));
  int port = 0;
  SHARD_ASSIGN_OR_RETURN(
      testing::Process coordinator,
      StartCoordinator(setup.binary,
                       {"--listen", "127.0.0.1:0", "--port-file", port_file, "--job", job,
                        "--lease", setup.lease, "--reform-grace", setup.reform_grace,
                        "--state-dir", state_dir, "--log-level", setup.log_level},
                       port_file, setup.scratch + "/coordinator.log", &port, absl::Seconds(30)));
  const pid_t pid = coordinator.pid();
  Fleet fleet(options, absl::StrCat("127.0.0.1:", port));
  SHARD_RETURN_IF_ERROR(fleet.Connect(absl::Seconds(10)));
  const Filesystem filesystem = FilesystemOf(state_dir);
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  const int n = options.workers;
  bench::Report report("shard-bench-control-plane", setup.output);
  report.Note(absl::StrFormat(
      "%d simulated workers on %d gRPC channels from one client process against "
      "shard-coordinator pid %d (job of %d workers, min_world_size %d; lease %s, heartbeat "
      "interval %lld ms, reform grace %s)",
      n, options.channels, pid, n, n - 1, setup.lease, static_cast<long long>(fleet.interval_ms()),
      setup.reform_grace));
  report.Note(absl::StrCat(
      "state dir ", state_dir, " on ", filesystem.Describe(),
      filesystem.type == "tmpfs" ? " (NOT a disk: the targets are for disk-backed state)" : "",
      "; joins ", options.join_rate > 0 ? absl::StrCat(options.join_rate, "/s") : "all at once"));
  report.Note(absl::StrFormat(
      "load average before (1, 5, 15 min): %s; client and coordinator share this machine's %u "
      "cores: CPU-seconds are the robust figures, wall times and rates a lower bound",
      load_before, cores));
  report.Note("formation: first join sent -> a reply shows the world RUNNING with every worker "
              "(its time), -> every worker has seen it; join: each join's latency; heartbeat: "
              "each answered heartbeat's latency per phase (longpoll as shard-worker; paced, "
              "saturate: --modes); reformation: the victim's lease expiry -> every survivor has "
              "seen the re-formed world; extras: the coordinator's CPU and the calls' counts");
  report.Set("setup", {{"workers", n},
                       {"channels", options.channels},
                       {"lease_ms", absl::ToInt64Milliseconds(options.lease)},
                       {"reform_grace", setup.reform_grace},
                       {"heartbeat_interval_ms", fleet.interval_ms()},
                       {"join_rate", options.join_rate},
                       {"state_dir", state_dir},
                       {"state_dir_filesystem", {{"type", filesystem.type},
                                                 {"device", filesystem.device},
                                                 {"mount", filesystem.mount}}},
                       {"cores", cores},
                       {"loadavg_before", load_before}});
  std::vector<std::string> failures;
  const std::string joins =
      options.join_rate > 0 ? absl::StrCat(options.join_rate, " joins/s") : "joins at once";

  // Formation.
  Bench bench(options, &fleet, pid);
  const FormationResult formed = bench.Form();
  const std::map<std::string, int64_t> formed_files = FilesIn(state_dir);
  const int64_t journal_bytes =
      formed_files.count("membership.log") > 0 ? formed_files.at("membership.log") : -1;
  const double joins_per_s =
      formed.last_join_ms > 0 ? formed.joins_ok / formed.last_join_ms * 1e3 : 0;
  bench::Record formation({.op = "formation", .impl = joins, .count = n, .ranks = n},
                          bench::Summarize({formed.formed_ms}));
  formation.Extra("generation", static_cast<double>(formed.generation))
      .Extra("join_to_all_informed_ms", formed.all_informed_ms)
      .Extra("workers_informed", formed.informed)
      .Extra("heartbeats_ok", static_cast<double>(formed.heartbeats.ok))
      .Extra("heartbeat_errors", static_cast<double>(formed.heartbeats.errors))
      .Extra("workers_lost", static_cast<double>(formed.heartbeats.lost))
      .Extra("journal_bytes", static_cast<double>(journal_bytes))
      .Note(FirstError(formed.heartbeats));
  AddCpu(formation, CpuOver(formed.before, formed.after));
  // The two points (1,000 in 1 s, 10,000 in 10 s) as a rule: 1 s per 1,000, at least 1 s.
  const int form_target_ms = std::max(1000, n);
  if (formed.formed) {
    formation.Compare("time_ms", absl::StrCat("target ", form_target_ms, " ms (1 s per 1,000)"),
                      form_target_ms, bench::Below(1));
  }
  report.Add(formation);
  report.Add(bench::Record({.op = "join", .impl = joins, .count = n, .ranks = n},
                           formed.joins.latency)
                 .Extra("joins_ok", formed.joins_ok)
                 .Extra("join_errors", static_cast<double>(formed.joins.errors))
                 .Extra("joins_per_s", joins_per_s)
                 .Extra("last_join_answered_ms", formed.last_join_ms)
                 .Note(FirstError(formed.joins)));
  report.Note(absl::StrCat("state dir once formed (bytes): ", Describe(formed_files)));
  report.Set("state_files_formed", formed_files);
  if (!formed.formed || formed.informed != n) {
    failures.push_back(absl::StrCat("the world did not form: ", formed.joins_ok, "/", n,
                                    " joins answered, ", formed.informed,
                                    " workers saw it running"));
  } else if (formed.generation != 1) {
    failures.push_back(absl::StrCat("the world formed at generation ", formed.generation,
                                    ", not the first (1): joins ended generations"));
  }
  if (formed.joins.errors > 0 || formed.heartbeats.lost > 0) {
    failures.push_back(absl::StrCat("formation: ", formed.joins.errors, " join errors, ",
                                    formed.heartbeats.lost,
                                    " workers lost (declared dead or taken over: NOT_FOUND or "
                                    "FAILED_PRECONDITION on heartbeat)"));
  }

  // Heartbeats: the steady long-polls, then the extra phases asked for.
  double steady_core_fraction = NAN;
  // What N real workers need: one heartbeat each per interval, against the measured capacity.
  const double needed = n * 1e3 / static_cast<double>(fleet.interval_ms());
  if (failures.empty()) {
    std::vector<std::string> modes = {"longpoll"};
    modes.insert(modes.end(), setup.modes.begin(), setup.modes.end());
    for (const std::string& mode : modes) {
      Phase* phase = mode == "longpoll" ? bench.Steady() : bench.Run(mode);
      const Recorder::Summary s = phase->calls.Summarize();
      const CpuUse cpu = CpuOver(phase->before, phase->after);
      const double rate = s.ok_in_window / cpu.wall_s;
      // The coordinator's CPU per answered heartbeat (its fixed housekeeping included), and
      // what one heartbeat per worker per interval would cost at that price. After formation
      // the long-polls come in herds (every worker was told at once), so a window holds a whole
      // number of herds; this projection does not depend on where the window falls.
      const double cpu_per_heartbeat_s =
          s.ok > 0 ? cpu.coordinator_cpu_s / static_cast<double>(s.ok) : NAN;
      const double projected_core_percent =
          100 * cpu_per_heartbeat_s * n * 1e3 / static_cast<double>(fleet.interval_ms());
      bench::Record record({.op = "heartbeat", .impl = mode, .count = n, .ranks = n}, s.latency);
      record.Extra("answered", static_cast<double>(s.ok))
          .Extra("heartbeats_per_s", rate)
          .Extra("errors", static_cast<double>(s.errors))
          .Extra("workers_lost", static_cast<double>(s.lost))
          .Extra("world_moved", static_cast<double>(s.world_moved))
          .Extra("max_gap_ms", s.max_gap_ms)
          .Extra("late", static_cast<double>(s.late));
      AddCpu(record, cpu);
      record.Extra("coordinator_cpu_us_per_heartbeat", 1e6 * cpu_per_heartbeat_s)
          .Extra("coordinator_core_percent_at_one_per_interval", projected_core_percent)
          .Extra("coordinator_rss_mib", StatusKib(pid, "VmRSS") / 1024.0)
          .Note(FirstError(s));
      if (mode == "longpoll") {
        steady_core_fraction = cpu.coordinator_core_percent / 100;
        record.Compare("coordinator_core_percent",
                       options.lease == absl::Seconds(10)
                           ? "target 50% (10,000 at a 10s lease)"
                           : "target 50% (stated for a 10s lease)",
                       50, bench::Below(1));
      }
      if (mode == "saturate") {
        record.Compare("heartbeats_per_s", "needed: one per worker per interval", needed);
      }
      report.Add(record);
      if (s.errors > 0 || s.world_moved > 0) {
        failures.push_back(absl::StrCat(mode, ": ", s.errors, " errors (", s.lost,
                                        " workers lost), ", s.world_moved,
                                        " answers at another generation or state"));
      }
      if (s.max_gap_ms >= absl::ToDoubleMilliseconds(options.lease)) {
        failures.push_back(absl::StrCat(mode, ": a worker went ", s.max_gap_ms,
                                        " ms between answered heartbeats, more than the lease"));
      }
    }
  }

  // Re-formation after one death.
  std::optional<ReformResult> reform;
  if (failures.empty()) {
    report.Note(absl::StrCat("reformation: one worker stops heartbeating; the survivors re-form "
                             "after the lease and the grace (", setup.reform_grace, ")"));
    reform = bench.Reform();
    const CpuUse cpu = CpuOver(reform->at_expiry, reform->at_reformed);
    // Not net of the steady rate: the re-formation's answers take the place of the held polls'
    // expiry answers over the window rather than adding to them, so subtracting the steady rate
    // would take away work that did not happen (it goes negative once contention stretches the
    // window). The raw figure is an upper bound; the steady rate over the window is context.
    const double steady_cpu_s = steady_core_fraction * cpu.wall_s;
    int64_t reformed_generation = -1;
    if (reform->generations.size() == 1) reformed_generation = reform->generations.begin()->first;
    // The coordinator's own account, to the millisecond: when it declared the victim dead and
    // when the survivors' world formed.
    double dead_ms = NAN, world_formed_ms = NAN;
    if (absl::StatusOr<v1::ListEventsResponse> events = fleet.ListEvents(); events.ok()) {
      const double expiry_ms = absl::ToDoubleMilliseconds(reform->lease_expired - absl::UnixEpoch());
      for (const v1::Event& event : events->events()) {
        if (event.kind() == "dead" && event.worker_id() == reform->victim) {
          dead_ms = static_cast<double>(event.unix_ms()) - expiry_ms;
        }
        if (event.kind() == "world_formed" && event.generation() == reformed_generation) {
          world_formed_ms = static_cast<double>(event.unix_ms()) - expiry_ms;
        }
      }
    } else {
      failures.push_back(std::string(events.status().message()));
    }
    bench::Record record({.op = "reformation", .impl = "one death", .count = n - 1, .ranks = n},
                         bench::Summarize({reform->expiry_to_reformed_ms}));
    record.Extra("survivors_informed", reform->survivors)
        .Extra("generation", static_cast<double>(reformed_generation))
        .Extra("coordinator_dead_event_after_expiry_ms", dead_ms)
        .Extra("coordinator_world_formed_event_after_expiry_ms", world_formed_ms)
        .Extra("steady_rate_cpu_s_over_window", steady_cpu_s);
    AddCpu(record, cpu);
    record.Extra("heartbeats_ok", static_cast<double>(reform->heartbeats.ok))
        .Extra("heartbeat_errors", static_cast<double>(reform->heartbeats.errors))
        .Extra("workers_lost", static_cast<double>(reform->heartbeats.lost))
        .Extra("max_gap_ms", reform->heartbeats.max_gap_ms)
        .Note(absl::StrCat("victim ", reform->victim, " (rank ", reform->victim_rank, ")",
                           reform->heartbeats.first_error.empty() ? "" : "; ",
                           FirstError(reform->heartbeats)));
    if (reform->reformed) {
      record.Compare("coordinator_cpu_s", "target 1 s", 1, bench::Below(1));
    }
    report.Add(record);
    if (!reform->reformed) {
      failures.push_back(absl::StrCat("re-formation: ", reform->survivors, "/", n - 1,
                                      " survivors saw the world RUNNING with ", n - 1,
                                      " workers within the lease and --form-timeout"));
    }
    if (reform->generations.size() > 1 || reformed_generation != formed.generation + 1) {
      std::vector<std::string> seen;
      for (const auto& [generation, told] : reform->generations) {
        seen.push_back(absl::StrCat(told, " at generation ", generation));
      }
      failures.push_back(absl::StrCat("re-formation: survivors saw ", absl::StrJoin(seen, ", "),
                                      "; all must see generation ", formed.generation + 1));
    }
    if (reform->heartbeats.errors > 0) {
      failures.push_back(absl::StrCat("re-formation: ", reform->heartbeats.errors,
                                      " heartbeat errors (", reform->heartbeats.lost,
                                      " workers lost)"));
    }
    if (reform->heartbeats.max_gap_ms >= absl::ToDoubleMilliseconds(options.lease)) {
      failures.push_back(absl::StrCat("re-formation: a worker went ", reform->heartbeats.max_gap_ms,
                                      " ms between answered heartbeats, more than the lease"));
    }
  }
  bench.Finish();

  // The coordinator's own view: every survivor live at the re-formed generation, the victim dead
  // (or all N live at the formed one, when the run stopped before the re-formation).
  const int expect_members = reform.has_value() ? n - 1 : n;
  const int expect_dead = reform.has_value() ? 1 : 0;
  const int64_t expect_generation = reform.has_value() ? formed.generation + 1 : formed.generation;
  absl::Duration status_took;
  absl::StatusOr<v1::GetStatusResponse> status = fleet.GetStatus(&status_took);
  if (status.ok()) {
    int members = 0, dead = 0, departed = 0;
    int64_t oldest_ms = 0;
    for (const v1::WorkerStatus& worker : status->workers()) {
      if (worker.rank() >= 0) {
        ++members;
        oldest_ms = std::max(oldest_ms, worker.last_heartbeat_ms_ago());
      } else {
        ++departed;
      }
      if (worker.state() == v1::WORKER_STATE_DEAD) ++dead;
    }
    report.Set("check", {{"state", v1::JobState_Name(status->world().state())},
                         {"generation", status->world().generation()},
                         {"world_size", status->world().world_size()},
                         {"live_members", members},
                         {"dead", dead},
                         {"departed", departed},
                         {"oldest_heartbeat_ms_ago", oldest_ms},
                         {"get_status_ms", absl::ToDoubleMilliseconds(status_took)}});
    report.Note(absl::StrFormat(
        "GetStatus (%.1f ms): %s at generation %lld with %d workers, %d live, %d dead, %d "
        "departed, oldest heartbeat %lld ms ago",
        absl::ToDoubleMilliseconds(status_took), v1::JobState_Name(status->world().state()),
        static_cast<long long>(status->world().generation()), status->world().world_size(),
        members, dead, departed, static_cast<long long>(oldest_ms)));
    if (members != expect_members || dead != expect_dead || departed != expect_dead ||
        status->world().world_size() != expect_members) {
      failures.push_back(absl::StrCat("GetStatus: ", members, " live members (world size ",
                                      status->world().world_size(), "), ", dead, " dead, ",
                                      departed, " departed; expected ", expect_members,
                                      " live and ", expect_dead, " dead"));
    }
    if (status->world().generation() != expect_generation ||
        !Trains(FromProto(status->world().state()))) {
      failures.push_back(absl::StrCat("GetStatus: the world is ",
                                      v1::JobState_Name(status->world().state()),
                                      " at generation ", status->world().generation(),
                                      "; expected RUNNING at ", expect_generation));
    }
  } else {
    failures.push_back(std::string(status.status().message()));
  }

  const int64_t hwm_kib = StatusKib(pid, "VmHWM");
  const double total_cpu = CpuSeconds(pid).value_or(NAN);
  const std::map<std::string, int64_t> final_files = FilesIn(state_dir);
  const std::string load_after = LoadAverage();
  if (coordinator.Exited()) failures.push_back("the coordinator exited during the run");
  report.Set("coordinator", {{"peak_rss_mib", hwm_kib / 1024.0},
                             {"cpu_s_total", total_cpu},
                             {"state_files", final_files}});
  report.Set("loadavg_after", load_after);
  report.Note(absl::StrFormat("coordinator: peak RSS (VmHWM) %.1f MiB, %.2f CPU-seconds in all; "
                              "state dir %s (bytes)",
                              hwm_kib / 1024.0, total_cpu, Describe(final_files)));
  report.Note(absl::StrCat("load average after (1, 5, 15 min): ", load_after));
  const bool passed = failures.empty();
  report.Set("passed", passed);
  report.Set("failures", failures);
  report.Note(passed ? "PASS" : "FAIL");
  for (const std::string& failure : failures) report.Note(absl::StrCat("  ", failure));
  // SIGTERM: the coordinator stops the job and exits once no worker is live; the simulated
  // workers no longer heartbeat, so that is when their leases run out.
  const absl::Time stopping = absl::Now();
  const std::string ended = StopCoordinator(coordinator, options.lease + absl::Seconds(5));
  report.Note(absl::StrFormat("coordinator %s %.1f s after SIGTERM", ended,
                              absl::ToDoubleSeconds(absl::Now() - stopping)));
  if (!report.Finish()) return absl::InternalError("cannot write the results");
  return passed;
}

}  // namespace
}  // namespace shard

int main(int argc, char** argv) {
  CLI::App app{
      "shard-bench-control-plane: the coordinator's control plane at scale, against the product's "
      "targets. Starts a real shard-coordinator (a job of N workers, min_world_size N-1, its "
      "state on --dir) and simulates N workers from this process with gRPC's callback API: "
      "formation (join-to-world-formed, the coordinator's CPU, the generation formed at, the "
      "journal's size), heartbeats long-polled as shard-worker does for --seconds (the "
      "coordinator's CPU as a fraction of a core), optional extra heartbeat phases (--modes), "
      "and a re-formation after one worker dies (lease expiry to every survivor told, the "
      "coordinator's CPU). Exit 1 if a check fails: errors, a worker declared dead or told "
      "another generation, the formed or re-formed generation or world size.",
      "shard-bench-control-plane"};
  shard::Options options;
  shard::Setup setup;
  setup.lease = "10s";  // shard-coordinator's default
  setup.reform_grace = "100ms";
  setup.log_level = "info";
  std::string rpc_timeout = "30s";
  std::string form_timeout = "60s";
  std::string modes;
  // A real disk: /dev/shm or a tmpfs /tmp would leave fsync out of every join.
  std::string dir = "/var/tmp";
  bool keep = false;
  app.add_option("--workers", options.workers,
                 "simulated workers (the job's world size; the survivors of one death re-form)")
      ->capture_default_str()
      ->check(CLI::Range(2, 100000));
  app.add_option("--seconds", options.seconds, "length of each heartbeat phase")
      ->capture_default_str()
      ->check(CLI::Range(0.1, 3600.0));
  app.add_option("--lease", setup.lease,
                 "the coordinator's --lease; workers heartbeat every quarter lease")
      ->capture_default_str()
      ->check(shard::DurationValidator());
  app.add_option("--reform-grace", setup.reform_grace,
                 "the coordinator's --reform-grace: how long it waits for a replacement before "
                 "the survivors re-form (small, so the benchmark does not wait; 30s by default "
                 "in production)")
      ->capture_default_str()
      ->check(shard::DurationValidator());
  app.add_option("--modes", modes,
                 "extra heartbeat phases after the long-poll one, in order: paced (wait_ms 0 every "
                 "interval), saturate (wait_ms 0 as fast as answered: the capacity)")
      ->capture_default_str();
  app.add_option("--channels", options.channels,
                 "gRPC channels (TCP connections) the simulated workers share")
      ->capture_default_str()
      ->check(CLI::Range(1, 4096));
  app.add_option("--max-in-flight", options.max_in_flight, "saturate: heartbeats pending at once")
      ->capture_default_str()
      ->check(CLI::Range(1, 100000));
  app.add_option("--rpc-timeout", rpc_timeout, "deadline of every call (beyond its wait)")
      ->capture_default_str()
      ->check(shard::DurationValidator());
  app.add_option("--form-timeout", form_timeout,
                 "give up if the world has not formed (or re-formed, after the lease) by then")
      ->capture_default_str()
      ->check(shard::DurationValidator());
  app.add_option("--dir", dir,
                 "where a fresh directory for the job, the coordinator's state and its log is "
                 "made. The coordinator fsyncs its membership journal before acknowledging a "
                 "join, so this disk is part of the formation; the targets are for a real disk "
                 "(tmpfs such as /dev/shm measures the coordinator's CPU alone)")
      ->capture_default_str();
  app.add_option("--join-rate", options.join_rate,
                 "joins per second, spread evenly (a ramp); 0: all workers join at once")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1e6));
  app.add_option("--coordinator-binary", setup.binary,
                 "shard-coordinator to start (default: the one next to this binary)");
  app.add_option("--coordinator-log-level", setup.log_level, "the coordinator's --log-level")
      ->capture_default_str();
  app.add_flag("--keep", keep, "keep the job, the state directory and the coordinator's log");
  shard::bench::AddOutputOptions(app, &setup.output);
  if (std::optional<int> exit_code = shard::ParseCommandLine(app, argc, argv)) return *exit_code;
  options.lease = shard::ParsedDuration(setup.lease);
  options.rpc_timeout = shard::ParsedDuration(rpc_timeout);
  options.form_timeout = shard::ParsedDuration(form_timeout);
  for (absl::string_view mode : absl::StrSplit(modes, ',', absl::SkipEmpty())) {
    if (mode != "paced" && mode != "saturate") {
      std::fprintf(stderr, "shard-bench-control-plane: unknown mode '%s' in --modes (paced, "
                   "saturate; the long-poll phase always runs)\n", std::string(mode).c_str());
      return 2;
    }
    setup.modes.emplace_back(mode);
  }
  if (setup.binary.empty()) {
    setup.binary =
        (std::filesystem::read_symlink("/proc/self/exe").parent_path() / "shard-coordinator")
            .string();
  }
  setup.scratch = (std::filesystem::path(dir) / "shard-bench-control-plane-XXXXXX").string();
  if (::mkdtemp(setup.scratch.data()) == nullptr) {
    std::fprintf(stderr, "shard-bench-control-plane: cannot make a directory under %s: %s; pass "
                 "--dir with a writable directory on a disk\n", dir.c_str(), std::strerror(errno));
    return 1;
  }
  // Interrupted or timed out (scripts/bench-control-plane.sh bounds the run): kill the
  // coordinator, remove its directory, exit.
  shard::SignalWatcher signals([&setup, keep](int signal, int /*count*/) {
    if (const pid_t pid = shard::running_coordinator.load(); pid > 0) ::kill(pid, SIGKILL);
    std::fprintf(stderr, "shard-bench-control-plane: %s: killed the coordinator\n",
                 strsignal(signal));
    if (!keep) {
      std::error_code ignored;
      std::filesystem::remove_all(setup.scratch, ignored);
    }
    std::_Exit(128 + signal);
  });
  const absl::StatusOr<bool> passed = shard::Benchmark(options, setup);
  if (!passed.ok()) {
    std::fprintf(stderr, "shard-bench-control-plane: %s\n",
                 std::string(passed.status().message()).c_str());
  }
  if (keep || !passed.ok() || !*passed) {
    std::fprintf(stderr, "shard-bench-control-plane: the job, the state directory and the "
                 "coordinator's log are kept in %s\n", setup.scratch.c_str());
  } else {
    std::filesystem::remove_all(setup.scratch);
  }
  return passed.ok() && *passed ? 0 : 1;
}
