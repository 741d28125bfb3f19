// shard-bench-control-plane: the coordinator's control plane at scale (issue 6). Starts a real
// shard-coordinator process with --world-size N and simulates N workers (default 1000) from this
// one process with gRPC's callback API over a few channels: no thread per worker.
//
//   formation  every worker joins at once (or --join-rate per second), then long-polls its
//              heartbeat as shard-worker does;
//              measured: first join sent -> a reply shows the world RUNNING with N workers
//              (join-to-world-formed), -> every worker has seen it, and the join latencies.
//   longpoll   what shard-worker does: one heartbeat always pending, wait_ms = the heartbeat
//              interval (a quarter lease), sent again as soon as it is answered.
//   paced      wait_ms = 0, one heartbeat per worker per interval (the rate at which real workers
//              renew their lease: one per 2.5 s per worker with the default 10s lease, so 400/s
//              for 1000 workers), spread evenly.
//   saturate   wait_ms = 0 as fast as the coordinator answers, --max-in-flight pending, workers
//              round-robin: the coordinator's heartbeat capacity.
//
// Each heartbeat phase lasts --seconds. For every phase: answered heartbeats/s, latency p50/p99/
// max, errors (must be 0), answers showing another generation (must be 0), the longest time
// between two answered heartbeats of one worker (must stay under the lease), and the CPU of the
// coordinator process (utime+stime from /proc/PID/stat) and of this client. At the end the Admin
// GetStatus RPC must show all N workers live at the generation the world formed at.
//
// The client runs on the same machine as the coordinator and competes with it for the cores, so
// the throughput figures are a lower bound for a coordinator with the machine to itself.
//
// The coordinator rewrites and fsyncs its whole membership record (every member) on each join,
// holding the world's lock. The state directory therefore goes on tmpfs (/dev/shm) by default,
// which measures the coordinator's CPU; --dir on a real disk adds the disk's fsync to every join
// (docs/control-plane.md has both, and where a real disk stops 1000 workers forming at once).
#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <linux/magic.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/wait.h>
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
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/cli.h"
#include "common/signal_watcher.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"
#include "nlohmann/json.hpp"
#include "proto/unary_call.h"
#include "shard/v1/coordinator.grpc.pb.h"

namespace shard {
namespace {

// ---------------------------------------------------------------------------------------------
// The coordinator process and what /proc says about it
// ---------------------------------------------------------------------------------------------

// utime + stime of process `pid` in seconds (fields 14 and 15 of /proc/PID/stat).
std::optional<double> CpuSeconds(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/stat"));
  const std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  // The command name (field 2) is in parentheses and may hold spaces: count from the last ')'.
  const size_t close = stat.rfind(')');
  if (close == std::string::npos || close + 2 >= stat.size()) return std::nullopt;
  const std::vector<absl::string_view> fields =
      absl::StrSplit(absl::string_view(stat).substr(close + 2), ' ');
  int64_t utime = 0, stime = 0;  // fields[0] is field 3
  if (fields.size() < 13 || !absl::SimpleAtoi(fields[11], &utime) ||
      !absl::SimpleAtoi(fields[12], &stime)) {
    return std::nullopt;
  }
  return static_cast<double>(utime + stime) / static_cast<double>(sysconf(_SC_CLK_TCK));
}

// What holds `path`: tmpfs (no disk behind fsync) or a disk's filesystem.
std::string FilesystemOf(const std::string& path) {
  struct statfs fs {};
  if (::statfs(path.c_str(), &fs) != 0) return "unknown";
  if (static_cast<uint64_t>(fs.f_type) == TMPFS_MAGIC) return "tmpfs";
  return absl::StrFormat("disk (filesystem type 0x%x)", static_cast<uint64_t>(fs.f_type));
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

std::string Tail(const std::string& path, size_t bytes) {
  std::ifstream in(path);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return text.size() <= bytes ? text : text.substr(text.size() - bytes);
}

// The running coordinator's pid, -1 when there is none: what a SIGINT/SIGTERM of this benchmark
// kills before it exits (PR_SET_PDEATHSIG covers the benchmark dying of anything else).
std::atomic<pid_t> running_coordinator{-1};

// A shard-coordinator child process. Stopped (SIGTERM, then SIGKILL) when destroyed, so every
// error path of the benchmark cleans it up; it also gets SIGKILL if this process dies first.
class CoordinatorProcess {
 public:
  static absl::StatusOr<std::unique_ptr<CoordinatorProcess>> Start(
      const std::string& binary, const std::vector<std::string>& args,
      const std::string& port_file, const std::string& log_file, absl::Duration timeout) {
    if (::access(binary.c_str(), X_OK) != 0) {
      return absl::NotFoundError(absl::StrCat(
          "no shard-coordinator binary at ", binary,
          "; build it (scripts/build.sh --target shard-coordinator) or pass --coordinator-binary"));
    }
    std::vector<std::string> argv_storage = {binary};
    argv_storage.insert(argv_storage.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (std::string& arg : argv_storage) argv.push_back(arg.data());
    argv.push_back(nullptr);
    const pid_t parent = ::getpid();
    const pid_t pid = ::fork();
    if (pid < 0) return absl::InternalError(absl::StrCat("fork: ", std::strerror(errno)));
    if (pid == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) ::_exit(1);
      const int log = ::open(log_file.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      if (log >= 0) {
        ::dup2(log, STDOUT_FILENO);
        ::dup2(log, STDERR_FILENO);
        ::close(log);
      }
      ::execv(binary.c_str(), argv.data());
      std::fprintf(stderr, "exec %s: %s\n", binary.c_str(), std::strerror(errno));
      ::_exit(127);
    }
    running_coordinator.store(pid);
    auto process = std::unique_ptr<CoordinatorProcess>(new CoordinatorProcess(pid, log_file));
    const absl::Time give_up = absl::Now() + timeout;
    while (true) {
      std::ifstream in(port_file);
      if (int port = 0; in >> port && port > 0) {
        process->port_ = port;
        return process;
      }
      if (std::optional<std::string> ended = process->Reap(/*block=*/false)) {
        return absl::UnavailableError(absl::StrCat("shard-coordinator ", *ended,
                                                   " before serving; its log ends with:\n",
                                                   Tail(log_file, 2000)));
      }
      if (absl::Now() > give_up) {
        return absl::DeadlineExceededError(absl::StrCat(
            "shard-coordinator did not write its port to ", port_file, " within ",
            absl::FormatDuration(timeout), "; its log ends with:\n", Tail(log_file, 2000)));
      }
      absl::SleepFor(absl::Milliseconds(10));
    }
  }

  ~CoordinatorProcess() { Stop(absl::Seconds(10)); }
  CoordinatorProcess(const CoordinatorProcess&) = delete;
  CoordinatorProcess& operator=(const CoordinatorProcess&) = delete;

  pid_t pid() const { return pid_; }
  int port() const { return port_; }
  bool running() { return pid_ > 0 && !Reap(/*block=*/false).has_value(); }

  // SIGTERM (the coordinator asks its workers to stop and exits once none is live), then
  // SIGKILL if it has not exited within `grace`. Says how it ended.
  std::string Stop(absl::Duration grace) {
    if (pid_ <= 0) return ended_;
    ::kill(pid_, SIGTERM);
    const absl::Time give_up = absl::Now() + grace;
    while (absl::Now() < give_up) {
      if (std::optional<std::string> ended = Reap(/*block=*/false)) return *ended;
      absl::SleepFor(absl::Milliseconds(20));
    }
    ::kill(pid_, SIGKILL);
    return Reap(/*block=*/true).value_or("killed") + " (SIGKILL after SIGTERM)";
  }

 private:
  CoordinatorProcess(pid_t pid, std::string log_file) : pid_(pid), log_file_(std::move(log_file)) {}

  // How the child ended, once it has (reaped); nullopt while it runs.
  std::optional<std::string> Reap(bool block) {
    if (pid_ <= 0) return ended_;
    int status = 0;
    const pid_t reaped = ::waitpid(pid_, &status, block ? 0 : WNOHANG);
    if (reaped != pid_) return std::nullopt;
    running_coordinator.store(-1);
    pid_ = -1;
    ended_ = WIFEXITED(status) ? absl::StrCat("exited with status ", WEXITSTATUS(status))
                               : absl::StrCat("was killed by signal ", WTERMSIG(status));
    return ended_;
  }

  pid_t pid_;
  std::string log_file_;
  int port_ = 0;
  std::string ended_;
};

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

struct Percentiles {
  double p50 = 0, p99 = 0, max = 0;
};

Percentiles PercentilesOf(std::vector<float> values) {
  Percentiles out;
  if (values.empty()) return out;
  std::sort(values.begin(), values.end());
  auto at = [&](double q) {
    return values[std::min(values.size() - 1, static_cast<size_t>(q * values.size()))];
  };
  out.p50 = at(0.50);
  out.p99 = at(0.99);
  out.max = values.back();
  return out;
}

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

  void Error(const grpc::Status& status, const std::string& worker_id, absl::Time sent,
             absl::Time answered) {
    absl::MutexLock lock(&mu_);
    error_latency_ms_.push_back(static_cast<float>(absl::ToDoubleMilliseconds(answered - sent)));
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
    Percentiles latency_ms;
    Percentiles error_latency_ms;
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
    s.latency_ms = PercentilesOf(latency_ms_);
    s.error_latency_ms = PercentilesOf(error_latency_ms_);
    s.max_gap_ms = absl::ToDoubleMilliseconds(max_gap_);
    s.first_error = first_error_;
    s.codes = codes_;
    return s;
  }

 private:
  mutable absl::Mutex mu_;
  absl::Time window_end_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
  std::vector<float> latency_ms_ ABSL_GUARDED_BY(mu_);
  std::vector<float> error_latency_ms_ ABSL_GUARDED_BY(mu_);
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
  std::atomic<bool> informed{false};       // has seen the formed world
  std::atomic<int64_t> last_answer_us{0};  // last answered heartbeat or join (unix us)
};

// One phase's calls. Chains (a worker's sequence of heartbeats, or a saturation slot) hold
// `chains` until they see `stopping`; the phase is over when none is left.
struct Phase {
  std::string name;
  Recorder calls;
  std::atomic<bool> stopping{false};
  absl::Mutex mu;
  int chains ABSL_GUARDED_BY(mu) = 0;
  Usage before, after;
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

class Bench {
 public:
  Bench(const Options& options, Fleet* fleet, pid_t coordinator)
      : options_(options), fleet_(fleet), coordinator_(coordinator) {}

  FormationResult Form() {
    Phase* phase = NewPhase("formation");
    FormationResult result;
    const int n = fleet_->size();
    phase->before = Sample(coordinator_);
    first_join_ = absl::Now();
    {
      absl::MutexLock lock(&phase->mu);
      phase->chains = n;
    }
    for (int w = 0; w < n; ++w) {
      if (options_.join_rate <= 0) {
        Join(phase, w);
        continue;
      }
      // A ramp: worker w joins w / rate seconds after the first.
      timers_.At(first_join_ + absl::Seconds(w / options_.join_rate), [this, phase, w] {
        if (phase->stopping.load()) return EndChain(phase);
        Join(phase, w);
      });
    }
    // Formed when every worker has seen the world running, or impossible once a join failed.
    {
      absl::MutexLock lock(&formation_mu_);
      auto settled = [this, n]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(formation_mu_) {
        return informed_ == n || (joins_answered_ == n && join_errors_ > 0) || phase_failed_;
      };
      formation_mu_.AwaitWithTimeout(absl::Condition(&settled), options_.form_timeout);
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
    Drain(phase);
    result.joins = joins_.Summarize();
    result.joins_ok = static_cast<int>(result.joins.ok);
    result.heartbeats = phase->calls.Summarize();
    result.before = phase->before;
    result.after = phase->after;
    return result;
  }

  // One heartbeat phase of `seconds`; `mode` is longpoll, paced or saturate.
  Phase* Run(const std::string& mode) {
    Phase* phase = NewPhase(mode);
    const int n = fleet_->size();
    phase->before = Sample(coordinator_);
    if (mode == "longpoll") {
      {
        absl::MutexLock lock(&phase->mu);
        phase->chains = n;
      }
      for (int w = 0; w < n; ++w) LongPoll(phase, w);
    } else if (mode == "paced") {
      {
        absl::MutexLock lock(&phase->mu);
        phase->chains = n;
      }
      // Spread evenly over one interval, as independent workers' timers are.
      const absl::Duration interval = absl::Milliseconds(fleet_->interval_ms());
      for (int w = 0; w < n; ++w) Paced(phase, w, phase->before.at + interval * w / n);
    } else {
      const int slots = std::min(options_.max_in_flight, n);
      {
        absl::MutexLock lock(&phase->mu);
        phase->chains = slots;
      }
      for (int s = 0; s < slots; ++s) Saturate(phase);
    }
    absl::SleepFor(absl::Seconds(options_.seconds));
    phase->after = Sample(coordinator_);
    phase->calls.CloseWindow(phase->after.at);
    Drain(phase);
    return phase;
  }

 private:
  Phase* NewPhase(const std::string& name) {
    phases_.push_back(std::make_unique<Phase>());
    phases_.back()->name = name;
    return phases_.back().get();
  }

  void EndChain(Phase* phase) {
    absl::MutexLock lock(&phase->mu);
    --phase->chains;
  }

  // One worker's join; once answered, it long-polls its heartbeat as shard-worker does.
  void Join(Phase* phase, int w) {
    fleet_->Join(w, [this, phase, w](const grpc::Status& status,
                                     const v1::JoinResponse& response, absl::Time sent) {
      const absl::Time now = absl::Now();
      SimWorker& worker = fleet_->worker(w);
      {
        absl::MutexLock lock(&formation_mu_);
        ++joins_answered_;
        if (!status.ok()) ++join_errors_;
        last_join_answer_ = std::max(last_join_answer_, now);
      }
      if (!status.ok()) {
        joins_.Error(status, worker.id, sent, now);
        EndChain(phase);
        return;
      }
      joins_.Ok(sent, now, false);
      fleet_->set_interval_ms(response.heartbeat_interval_ms());
      worker.last_answer_us.store(absl::ToUnixMicros(now));
      Observe(w, response.world(), now);
      LongPoll(phase, w);  // as shard-worker: heartbeat from the moment it has joined
    });
  }

  // Stops the phase and waits until its last call is answered.
  void Drain(Phase* phase) {
    phase->stopping.store(true);
    timers_.RunPendingNow();
    absl::MutexLock lock(&phase->mu);
    auto idle = [phase]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(phase->mu) { return phase->chains == 0; };
    if (!phase->mu.AwaitWithTimeout(absl::Condition(&idle),
                                    options_.rpc_timeout + options_.lease)) {
      std::fprintf(stderr, "shard-bench-control-plane: %d %s call chains did not end\n",
                   phase->chains, phase->name.c_str());
    }
  }

  // What a worker learns from an answer; marks the world formed and the worker informed.
  void Observe(int w, const v1::WorldView& world, absl::Time now) {
    SimWorker& worker = fleet_->worker(w);
    worker.known_generation.store(world.generation());
    worker.known_state.store(world.state());
    if (world.state() != v1::JOB_STATE_RUNNING || world.world_size() != fleet_->size()) return;
    // Once formed and told, nothing to record: no lock on every later heartbeat.
    if (worker.informed.load() && formed_generation_.load() >= 0) return;
    absl::MutexLock lock(&formation_mu_);
    if (formed_at_ == absl::InfinitePast()) {
      formed_at_ = now;
      formed_generation_.store(world.generation());
    }
    if (!worker.informed.exchange(true) && ++informed_ == fleet_->size()) all_informed_at_ = now;
  }

  // Records an answered heartbeat; false when the worker's chain must end.
  bool Answered(Phase* phase, int w, const grpc::Status& status,
                const v1::HeartbeatResponse& response, absl::Time sent) {
    const absl::Time now = absl::Now();
    SimWorker& worker = fleet_->worker(w);
    if (!status.ok()) {
      phase->calls.Error(status, worker.id, sent, now);
      if (IsLoss(status)) {
        // Declared dead or taken over: shard-worker would join again, bumping the
        // generation. The benchmark counts it as a failure and stops this worker.
        phase->calls.Lost();
        absl::MutexLock lock(&formation_mu_);
        phase_failed_ = true;
        return false;
      }
      return true;
    }
    const int64_t formed = formed_generation_.load();
    const bool moved = formed >= 0 && (response.world().generation() != formed ||
                                       response.world().state() != v1::JOB_STATE_RUNNING);
    phase->calls.Ok(sent, now, moved);
    const int64_t now_us = absl::ToUnixMicros(now);
    const int64_t last = worker.last_answer_us.exchange(now_us);
    if (last > 0) phase->calls.Gap(absl::Microseconds(now_us - last));
    Observe(w, response.world(), now);
    return true;
  }

  // shard-worker's loop: one long-poll pending, sent again as soon as it is answered (after an
  // interval on a transient error).
  void LongPoll(Phase* phase, int w) {
    if (phase->stopping.load()) return EndChain(phase);
    fleet_->Heartbeat(w, fleet_->interval_ms(),
                      [this, phase, w](const grpc::Status& status,
                                       const v1::HeartbeatResponse& response, absl::Time sent) {
                        if (!Answered(phase, w, status, response, sent)) return EndChain(phase);
                        if (status.ok() || phase->stopping.load()) return LongPoll(phase, w);
                        timers_.At(absl::Now() + absl::Milliseconds(fleet_->interval_ms()),
                                   [this, phase, w] { LongPoll(phase, w); });
                      });
  }

  // wait_ms = 0 once per interval, due at `due`; late if the previous answer came after it.
  void Paced(Phase* phase, int w, absl::Time due) {
    if (phase->stopping.load()) return EndChain(phase);
    timers_.At(due, [this, phase, w, due] {
      if (phase->stopping.load()) return EndChain(phase);
      fleet_->Heartbeat(w, 0,
                        [this, phase, w, due](const grpc::Status& status,
                                              const v1::HeartbeatResponse& response,
                                              absl::Time sent) {
                          if (!Answered(phase, w, status, response, sent)) return EndChain(phase);
                          absl::Time next = due + absl::Milliseconds(fleet_->interval_ms());
                          const absl::Time now = absl::Now();
                          if (next < now) {
                            phase->calls.Late();
                            next = now;
                          }
                          Paced(phase, w, next);
                        });
    });
  }

  // wait_ms = 0 as fast as answered; workers round-robin so every lease is renewed.
  void Saturate(Phase* phase) {
    if (phase->stopping.load()) return EndChain(phase);
    const int w = static_cast<int>(next_worker_.fetch_add(1) % fleet_->size());
    fleet_->Heartbeat(w, 0,
                      [this, phase, w](const grpc::Status& status,
                                       const v1::HeartbeatResponse& response, absl::Time sent) {
                        if (!Answered(phase, w, status, response, sent)) return EndChain(phase);
                        Saturate(phase);
                      });
  }

  const Options options_;
  Fleet* const fleet_;
  const pid_t coordinator_;
  std::vector<std::unique_ptr<Phase>> phases_;
  std::atomic<uint64_t> next_worker_{0};
  absl::Time first_join_;
  Recorder joins_;
  std::atomic<int64_t> formed_generation_{-1};  // -1 until the world formed

  absl::Mutex formation_mu_;
  absl::Time formed_at_ ABSL_GUARDED_BY(formation_mu_) = absl::InfinitePast();
  int informed_ ABSL_GUARDED_BY(formation_mu_) = 0;
  absl::Time all_informed_at_ ABSL_GUARDED_BY(formation_mu_);
  int joins_answered_ ABSL_GUARDED_BY(formation_mu_) = 0;
  int join_errors_ ABSL_GUARDED_BY(formation_mu_) = 0;
  absl::Time last_join_answer_ ABSL_GUARDED_BY(formation_mu_) = absl::InfinitePast();
  bool phase_failed_ ABSL_GUARDED_BY(formation_mu_) = false;
  // Last: destroyed first, so no timer fires into the phases and counters above.
  Timers timers_;
};

// CPU use over a window: CPU-seconds and percent of one core for the coordinator and for this
// client, and how busy the whole machine was (percent of all its cores).
nlohmann::json CpuJson(const Usage& before, const Usage& after) {
  const double wall = std::max(1e-9, absl::ToDoubleSeconds(after.at - before.at));
  const double coordinator = after.coordinator_cpu_s - before.coordinator_cpu_s;
  const double client = after.client_cpu_s - before.client_cpu_s;
  const double idle = after.machine_idle_s - before.machine_idle_s;
  const double cores = std::max(1u, std::thread::hardware_concurrency());
  return {{"wall_s", wall},
          {"coordinator_cpu_s", coordinator},
          {"coordinator_core_percent", 100 * coordinator / wall},
          {"client_cpu_s", client},
          {"client_core_percent", 100 * client / wall},
          {"machine_percent", std::max(0.0, 100 * (1 - idle / (wall * cores)))}};
}

nlohmann::json LatencyJson(const Percentiles& p) {
  return {{"p50_ms", p.p50}, {"p99_ms", p.p99}, {"max_ms", p.max}};
}

std::string Codes(const std::map<int, int64_t>& codes) {
  std::vector<std::string> parts;
  for (const auto& [code, count] : codes) {
    parts.push_back(absl::StrCat(count, " x ", absl::StatusCodeToString(
                                                   static_cast<absl::StatusCode>(code))));
  }
  return absl::StrJoin(parts, ", ");
}

struct Setup {
  std::string binary;      // shard-coordinator
  std::string lease;       // as given, passed to the coordinator
  std::string log_level;   // the coordinator's
  std::string scratch;     // holds the state directory, the port file and the log
  std::vector<std::string> modes;
  bool json = false;
};

// Runs the benchmark against a coordinator it starts and stops; prints the results. Returns
// whether every check passed.
absl::StatusOr<bool> Benchmark(const Options& options, const Setup& setup) {
  const std::string state_dir = setup.scratch + "/state";
  const std::string port_file = setup.scratch + "/port";
  absl::StatusOr<std::unique_ptr<CoordinatorProcess>> coordinator = CoordinatorProcess::Start(
      setup.binary,
      {"--listen", "127.0.0.1:0", "--port-file", port_file, "--world-size",
       std::to_string(options.workers), "--lease", setup.lease, "--state-dir", state_dir,
       "--log-level", setup.log_level},
      port_file, setup.scratch + "/coordinator.log", absl::Seconds(30));
  if (!coordinator.ok()) return coordinator.status();
  const pid_t pid = (*coordinator)->pid();
  Fleet fleet(options, absl::StrCat("127.0.0.1:", (*coordinator)->port()));
  if (absl::Status connected = fleet.Connect(absl::Seconds(10)); !connected.ok()) {
    return connected;
  }
  const bool text = !setup.json;
  const std::string filesystem = FilesystemOf(setup.scratch);
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  if (text) {
    std::printf("# %d simulated workers on %d gRPC channels from one client process against "
                "shard-coordinator pid %d (lease %s, heartbeat interval %lld ms)\n",
                options.workers, options.channels, pid, setup.lease.c_str(),
                static_cast<long long>(fleet.interval_ms()));
    std::printf("# state dir %s on %s; joins %s\n", state_dir.c_str(), filesystem.c_str(),
                options.join_rate > 0 ? absl::StrCat(options.join_rate, "/s").c_str()
                                      : "all at once");
    std::printf("# client and coordinator share this machine's %u cores: the rates are a lower "
                "bound for a coordinator with the machine to itself\n", cores);
    std::fflush(stdout);
  }
  nlohmann::json out = {{"workers", options.workers},
                        {"channels", options.channels},
                        {"lease_ms", absl::ToInt64Milliseconds(options.lease)},
                        {"heartbeat_interval_ms", fleet.interval_ms()},
                        {"join_rate", options.join_rate},
                        {"state_dir_filesystem", filesystem},
                        {"cores", cores}};
  std::vector<std::string> failures;

  // Formation.
  Bench bench(options, &fleet, pid);
  const FormationResult formed = bench.Form();
  const double joins_per_s =
      formed.last_join_ms > 0 ? formed.joins_ok / formed.last_join_ms * 1e3 : 0;
  const nlohmann::json form_cpu = CpuJson(formed.before, formed.after);
  out["formation"] = {{"formed", formed.formed},
                      {"generation", formed.generation},
                      {"join_to_world_formed_ms", formed.formed_ms},
                      {"join_to_all_informed_ms", formed.all_informed_ms},
                      {"workers_informed", formed.informed},
                      {"joins_ok", formed.joins_ok},
                      {"join_errors", formed.joins.errors},
                      {"last_join_answered_ms", formed.last_join_ms},
                      {"joins_per_s", joins_per_s},
                      {"join_latency", LatencyJson(formed.joins.latency_ms)},
                      {"heartbeats_ok", formed.heartbeats.ok},
                      {"heartbeat_errors", formed.heartbeats.errors},
                      {"heartbeat_latency", LatencyJson(formed.heartbeats.latency_ms)},
                      {"workers_lost", formed.heartbeats.lost},
                      {"cpu", form_cpu}};
  if (!formed.joins.first_error.empty()) {
    out["formation"]["first_join_error"] = formed.joins.first_error;
  }
  if (!formed.heartbeats.first_error.empty()) {
    out["formation"]["first_heartbeat_error"] = formed.heartbeats.first_error;
  }
  if (text) {
    std::printf("\nformation: %d joins sent %s, then shard-worker's long-poll heartbeats\n",
                options.workers,
                options.join_rate > 0 ? absl::StrCat("at ", options.join_rate, "/s").c_str()
                                      : "at once");
    std::printf("  join-to-world-formed      %9.1f ms  (first join sent -> a reply shows RUNNING "
                "with %d workers, generation %lld)\n",
                formed.formed_ms, options.workers, static_cast<long long>(formed.generation));
    std::printf("  join-to-all-informed      %9.1f ms  (-> every worker has seen it: %d/%d)\n",
                formed.all_informed_ms, formed.informed, options.workers);
    std::printf("  joins                     %9d ok, %lld errors, %.0f joins/s; latency p50 %.1f "
                "ms, p99 %.1f ms, max %.1f ms\n",
                formed.joins_ok, static_cast<long long>(formed.joins.errors), joins_per_s,
                formed.joins.latency_ms.p50, formed.joins.latency_ms.p99,
                formed.joins.latency_ms.max);
    std::printf("  heartbeats while forming  %9lld ok, %lld errors, %lld workers lost; latency "
                "(held up to %lld ms) p50 %.1f ms, p99 %.1f ms, max %.1f ms\n",
                static_cast<long long>(formed.heartbeats.ok),
                static_cast<long long>(formed.heartbeats.errors),
                static_cast<long long>(formed.heartbeats.lost),
                static_cast<long long>(fleet.interval_ms()), formed.heartbeats.latency_ms.p50,
                formed.heartbeats.latency_ms.p99, formed.heartbeats.latency_ms.max);
    std::printf("  CPU over %.2f s           coordinator %.2f s (%.0f%% of a core), client %.0f%% "
                "of a core, machine %.0f%% of %u cores\n",
                form_cpu["wall_s"].get<double>(), form_cpu["coordinator_cpu_s"].get<double>(),
                form_cpu["coordinator_core_percent"].get<double>(),
                form_cpu["client_core_percent"].get<double>(),
                form_cpu["machine_percent"].get<double>(), cores);
    if (!formed.joins.first_error.empty()) {
      std::printf("  first join error: %s (%s)\n", formed.joins.first_error.c_str(),
                  Codes(formed.joins.codes).c_str());
    }
    if (!formed.heartbeats.first_error.empty()) {
      std::printf("  first heartbeat error: %s (%s); failed heartbeats were answered after p50 "
                  "%.1f ms, max %.1f ms\n",
                  formed.heartbeats.first_error.c_str(), Codes(formed.heartbeats.codes).c_str(),
                  formed.heartbeats.error_latency_ms.p50, formed.heartbeats.error_latency_ms.max);
    }
    std::fflush(stdout);
  }
  if (!formed.formed || formed.informed != options.workers) {
    failures.push_back(absl::StrCat("the world did not form: ", formed.joins_ok, "/",
                                    options.workers, " joins answered, ", formed.informed,
                                    " workers saw it running"));
  }
  if (formed.joins.errors > 0 || formed.heartbeats.lost > 0) {
    failures.push_back(absl::StrCat("formation: ", formed.joins.errors, " join errors, ",
                                    formed.heartbeats.lost,
                                    " workers lost (declared dead or taken over: NOT_FOUND or FAILED_PRECONDITION on heartbeat)"));
  }

  // Heartbeat phases, only on a formed world.
  nlohmann::json rows = nlohmann::json::array();
  if (failures.empty()) {
    if (text) {
      std::printf("\n%-9s %6s %9s %11s %7s %7s %7s %6s %6s %7s %5s %9s %7s %7s %8s\n", "phase",
                  "secs", "answered", "heartbeat/s", "p50_ms", "p99_ms", "max_ms", "errors",
                  "moved", "max_gap", "late", "coord_cpu", "coord%", "client%", "machine%");
      std::fflush(stdout);
    }
    for (const std::string& mode : setup.modes) {
      Phase* phase = bench.Run(mode);
      const Recorder::Summary s = phase->calls.Summarize();
      const nlohmann::json cpu = CpuJson(phase->before, phase->after);
      const double rate = s.ok_in_window / cpu["wall_s"].get<double>();
      rows.push_back({{"mode", mode},
                      {"answered", s.ok},
                      {"heartbeats_per_s", rate},
                      {"latency", LatencyJson(s.latency_ms)},
                      {"errors", s.errors},
                      {"workers_lost", s.lost},
                      {"world_moved", s.world_moved},
                      {"max_gap_ms", s.max_gap_ms},
                      {"late", s.late},
                      {"cpu", cpu},
                      {"coordinator_rss_mib", StatusKib(pid, "VmRSS") / 1024.0}});
      if (!s.first_error.empty()) rows.back()["first_error"] = s.first_error;
      if (text) {
        std::printf("%-9s %6.1f %9lld %11.0f %7.2f %7.2f %7.1f %6lld %6lld %7.0f %5lld %9.2f "
                    "%6.0f%% %6.0f%% %7.0f%%\n",
                    mode.c_str(), cpu["wall_s"].get<double>(), static_cast<long long>(s.ok), rate,
                    s.latency_ms.p50, s.latency_ms.p99, s.latency_ms.max,
                    static_cast<long long>(s.errors), static_cast<long long>(s.world_moved),
                    s.max_gap_ms, static_cast<long long>(s.late),
                    cpu["coordinator_cpu_s"].get<double>(),
                    cpu["coordinator_core_percent"].get<double>(),
                    cpu["client_core_percent"].get<double>(),
                    cpu["machine_percent"].get<double>());
        if (!s.first_error.empty()) {
          std::printf("          first error: %s (%s)\n", s.first_error.c_str(),
                      Codes(s.codes).c_str());
        }
        std::fflush(stdout);
      }
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
  out["phases"] = rows;
  // What N real workers need: one heartbeat each per interval, against the measured capacity.
  const double needed = options.workers * 1e3 / static_cast<double>(fleet.interval_ms());
  out["heartbeats_needed_per_s"] = needed;
  for (const nlohmann::json& row : rows) {
    if (row["mode"] != "saturate") continue;
    const double capacity = row["heartbeats_per_s"].get<double>();
    out["saturate_headroom"] = capacity / needed;
    if (text) {
      std::printf("%d workers need %.0f heartbeats/s (one per %lld ms interval); saturate answered "
                  "%.0f/s: %.1fx that\n",
                  options.workers, needed, static_cast<long long>(fleet.interval_ms()), capacity,
                  capacity / needed);
    }
  }

  // The coordinator's own view: all N live, at the generation the world formed at.
  absl::Duration status_took;
  absl::StatusOr<v1::GetStatusResponse> status = fleet.GetStatus(&status_took);
  nlohmann::json check;
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
    check = {{"state", v1::JobState_Name(status->world().state())},
             {"generation", status->world().generation()},
             {"formed_generation", formed.generation},
             {"live_members", members},
             {"dead", dead},
             {"departed", departed},
             {"oldest_heartbeat_ms_ago", oldest_ms},
             {"get_status_ms", absl::ToDoubleMilliseconds(status_took)}};
    if (members != options.workers || dead > 0 || departed > 0) {
      failures.push_back(absl::StrCat("GetStatus: ", members, "/", options.workers,
                                      " live members, ", dead, " dead, ", departed, " departed"));
    }
    if (status->world().generation() != formed.generation ||
        status->world().state() != v1::JOB_STATE_RUNNING) {
      failures.push_back(absl::StrCat("GetStatus: the world is ",
                                      v1::JobState_Name(status->world().state()),
                                      " at generation ", status->world().generation(),
                                      "; it formed at generation ", formed.generation));
    }
    if (text) {
      std::printf("\nGetStatus (%.1f ms): %s at generation %lld (formed at %lld), %d/%d live, %d "
                  "dead, %d departed, oldest heartbeat %lld ms ago\n",
                  absl::ToDoubleMilliseconds(status_took),
                  v1::JobState_Name(status->world().state()).c_str(),
                  static_cast<long long>(status->world().generation()),
                  static_cast<long long>(formed.generation), members, options.workers, dead,
                  departed, static_cast<long long>(oldest_ms));
    }
  } else {
    failures.push_back(std::string(status.status().message()));
  }
  out["check"] = check;

  const int64_t hwm_kib = StatusKib(pid, "VmHWM");
  const double total_cpu = CpuSeconds(pid).value_or(NAN);
  std::error_code size_error;
  const uintmax_t membership_bytes =
      std::filesystem::file_size(state_dir + "/membership.json", size_error);
  if (!(*coordinator)->running()) failures.push_back("the coordinator exited during the run");
  out["coordinator"] = {
      {"peak_rss_mib", hwm_kib / 1024.0},
      {"cpu_s_total", total_cpu},
      {"membership_json_bytes", size_error ? -1 : static_cast<int64_t>(membership_bytes)}};
  const bool passed = failures.empty();
  out["passed"] = passed;
  out["failures"] = failures;
  if (text) {
    std::printf("coordinator: peak RSS (VmHWM) %.1f MiB, %.2f CPU-seconds in all, "
                "membership.json %lld bytes\n",
                hwm_kib / 1024.0, total_cpu,
                size_error ? -1LL : static_cast<long long>(membership_bytes));
    std::printf("%s\n", passed ? "PASS" : "FAIL");
    for (const std::string& failure : failures) std::printf("  %s\n", failure.c_str());
  } else {
    std::printf("%s\n", out.dump(2).c_str());
  }
  std::fflush(stdout);
  // SIGTERM: the coordinator stops the job and exits once no worker is live; the simulated
  // workers no longer heartbeat, so that is when their leases run out.
  const absl::Time stopping = absl::Now();
  const std::string ended = (*coordinator)->Stop(options.lease + absl::Seconds(5));
  if (text) {
    std::printf("coordinator %s %.1f s after SIGTERM\n", ended.c_str(),
                absl::ToDoubleSeconds(absl::Now() - stopping));
  }
  return passed;
}

}  // namespace
}  // namespace shard

int main(int argc, char** argv) {
  CLI::App app{
      "shard-bench-control-plane: the coordinator's control plane at scale. Starts a real "
      "shard-coordinator (--world-size N) and simulates N workers from this process with gRPC's "
      "callback API: join-to-world-formed time and join latency, then heartbeats for --seconds in "
      "each mode (longpoll: as shard-worker, wait = a quarter lease; paced: wait_ms 0 every "
      "quarter lease; saturate: wait_ms 0 as fast as answered): heartbeats/s, latency, errors, "
      "the coordinator's CPU and peak RSS. Exit 1 if the world does not form, a worker is "
      "declared dead or the generation moves.",
      "shard-bench-control-plane"};
  shard::Options options;
  shard::Setup setup;
  setup.lease = "10s";  // shard-coordinator's default
  setup.log_level = "info";
  std::string rpc_timeout = "30s";
  std::string form_timeout = "60s";
  std::string modes = "longpoll,paced,saturate";
  // tmpfs where there is one: see --dir.
  std::string dir = std::filesystem::is_directory("/dev/shm") && ::access("/dev/shm", W_OK) == 0
                        ? "/dev/shm"
                        : "/tmp";
  bool keep = false;
  app.add_option("--workers", options.workers, "simulated workers (the coordinator's world size)")
      ->capture_default_str()
      ->check(CLI::Range(1, 100000));
  app.add_option("--seconds", options.seconds, "length of each heartbeat phase")
      ->capture_default_str()
      ->check(CLI::Range(0.1, 3600.0));
  app.add_option("--lease", setup.lease,
                 "the coordinator's --lease; workers heartbeat every quarter lease")
      ->capture_default_str()
      ->check(shard::DurationValidator());
  app.add_option("--modes", modes, "heartbeat phases to run, in order: longpoll, paced, saturate")
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
  app.add_option("--form-timeout", form_timeout, "give up if the world has not formed by then")
      ->capture_default_str()
      ->check(shard::DurationValidator());
  app.add_option("--dir", dir,
                 "where the coordinator's temporary state directory is made. The coordinator "
                 "rewrites and fsyncs its whole membership record on every join, so this disk is "
                 "part of the join time: the default, tmpfs, measures the coordinator's CPU; pass "
                 "a directory on a real disk to measure with its fsync (docs/control-plane.md)")
      ->capture_default_str();
  app.add_option("--join-rate", options.join_rate,
                 "joins per second, spread evenly (a ramp); 0: all workers join at once")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1e6));
  app.add_option("--coordinator-binary", setup.binary,
                 "shard-coordinator to start (default: the one next to this binary)");
  app.add_option("--coordinator-log-level", setup.log_level, "the coordinator's --log-level")
      ->capture_default_str();
  app.add_flag("--keep", keep, "keep the state directory and the coordinator's log");
  app.add_flag("--json", setup.json, "print the results as one JSON object instead of tables");
  if (std::optional<int> exit_code = shard::ParseCommandLine(app, argc, argv)) return *exit_code;
  options.lease = shard::ParsedDuration(setup.lease);
  options.rpc_timeout = shard::ParsedDuration(rpc_timeout);
  options.form_timeout = shard::ParsedDuration(form_timeout);
  for (absl::string_view mode : absl::StrSplit(modes, ',', absl::SkipEmpty())) {
    if (mode != "longpoll" && mode != "paced" && mode != "saturate") {
      std::fprintf(stderr, "shard-bench-control-plane: unknown mode '%s' in --modes (longpoll, "
                   "paced, saturate)\n", std::string(mode).c_str());
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
    std::fprintf(stderr, "shard-bench-control-plane: cannot make a directory under %s: %s\n",
                 dir.c_str(), std::strerror(errno));
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
    std::fprintf(stderr, "shard-bench-control-plane: the state directory and the coordinator's "
                 "log are kept in %s\n", setup.scratch.c_str());
  } else {
    std::filesystem::remove_all(setup.scratch);
  }
  return passed.ok() && *passed ? 0 : 1;
}
