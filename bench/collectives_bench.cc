// shard-bench-collectives: collective bus bandwidth through Shard's shared-memory communicator
// (shm) and its TCP rings (tcp, shard::GlooCommunicator), beside raw Gloo's own collectives on
// the TCP communicator's very connections, one thread's memcpy and the loopback TCP limit, all
// measured in the same run, reported like nccl-tests (GB = 1e9 bytes; busbw = algbw x factor).
//
// Ranks are real processes: the parent forks them before any thread exists, and they meet
// through a file-per-key rendezvous store in a private temporary directory (each communicator
// under its own key prefix). Results are checked while measuring: inputs are small integers
// (exact in f32, so every summation order gives the same bits) and the outputs of the timed
// iterations are compared with the closed form; mismatching elements are counted in #wrong.
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/algorithm/container.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/bus_bandwidth.h"
#include "common/cli.h"
#include "common/dtype.h"
#include "common/files.h"
#include "gloo/allgather.h"
#include "gloo/allreduce.h"
#include "gloo/context.h"
#include "gloo/math.h"
#include "worker/dataplane/gloo_communicator.h"
#include "worker/dataplane/key_value_store.h"
#include "worker/dataplane/shm_communicator.h"

namespace shard {
namespace {

using Clock = std::chrono::steady_clock;

// What is measured: our shared-memory communicator, our TCP rings, raw Gloo's collectives.
enum class Impl { kShm, kTcp, kGloo };
constexpr Impl kAllImpls[] = {Impl::kShm, Impl::kTcp, Impl::kGloo};
constexpr int kImplCount = 3;

struct Flags {
  int ranks = 2;
  uint64_t min_bytes = 64 << 10;
  uint64_t max_bytes = 64 << 20;
  int step_factor = 4;
  int warmup = 2;
  int iters = 10;
  uint64_t segment_bytes = GlooOptions().segment_bytes;
  uint64_t shm_slot_bytes = ShmOptions().slot_bytes;
  std::vector<std::string> collective_names = {"all_reduce", "reduce_scatter", "all_gather"};
  std::vector<Collective> collectives;
  std::vector<std::string> impl_names = {"shm", "tcp", "gloo"};
  std::vector<Impl> impls;  // in kAllImpls order
  int memcpy_trials = 5;
  bool skip_loopback = false;
  uint64_t loopback_bytes = 512 << 20;
  int loopback_trials = 3;
  std::string timeout = "60s";
};

// ---------------------------------------------------------------------------------------------
// Rendezvous across processes: one file per key (hex-encoded name) in a directory private to
// this run, written with an atomic rename so a reader sees a whole value or none.

class DirectoryKeyValueStore : public KeyValueStore {
 public:
  explicit DirectoryKeyValueStore(std::string dir) : dir_(std::move(dir)) {}

  absl::Status Set(const std::string& key, const std::string& value) override {
    return WriteFileAtomically(PathOf(key), value);
  }

  absl::StatusOr<std::string> Get(const std::string& key) override {
    absl::StatusOr<std::string> value = ReadFile(PathOf(key));
    if (absl::IsNotFound(value.status())) {
      return absl::NotFoundError(absl::StrCat("key '", key, "' is not set"));
    }
    return value;
  }

  absl::Status Wait(const std::vector<std::string>& keys, absl::Duration timeout) override {
    const absl::Time deadline = absl::Now() + timeout;
    while (true) {
      bool all_set = true;
      for (const std::string& key : keys) {
        if (::access(PathOf(key).c_str(), F_OK) != 0) {
          all_set = false;
          break;
        }
      }
      if (all_set) return absl::OkStatus();
      if (absl::Now() >= deadline) {
        return absl::DeadlineExceededError(absl::StrCat("keys [", absl::StrJoin(keys, ", "),
                                                        "] not all set after ",
                                                        absl::FormatDuration(timeout)));
      }
      absl::SleepFor(absl::Milliseconds(2));
    }
  }

 private:
  std::string PathOf(const std::string& key) const {
    return absl::StrCat(dir_, "/", absl::BytesToHexString(key));
  }

  std::string dir_;
};

// ---------------------------------------------------------------------------------------------
// Processes.

// Waits for every child; after the first one that fails, kills the others (they would only
// wait for it until their timeout). Returns true if all exited with status 0.
bool WaitForChildren(std::vector<pid_t> pids, absl::string_view what) {
  bool ok = true;
  while (!pids.empty()) {
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, 0);
    if (pid < 0) {
      if (errno == EINTR) continue;
      std::fprintf(stderr, "shard-bench-collectives: waitpid: %s\n", std::strerror(errno));
      return false;
    }
    auto it = std::find(pids.begin(), pids.end(), pid);
    if (it == pids.end()) continue;
    pids.erase(it);
    const bool exited_ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
    if (exited_ok) continue;
    if (WIFSIGNALED(status)) {
      std::fprintf(stderr, "shard-bench-collectives: %s process (pid %d) killed by %s\n",
                   std::string(what).c_str(), pid, strsignal(WTERMSIG(status)));
    } else {
      std::fprintf(stderr, "shard-bench-collectives: %s process (pid %d) exited with %d\n",
                   std::string(what).c_str(), pid, WEXITSTATUS(status));
    }
    if (ok) {
      for (pid_t other : pids) ::kill(other, SIGTERM);
    }
    ok = false;
  }
  return ok;
}

// In a child: die with the parent, so an interrupted run leaves no ranks behind.
void DieWithParent(pid_t parent) {
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != parent) std::_Exit(1);
}

[[noreturn]] void ExitChild(int code) {
  std::fflush(stdout);
  std::fflush(stderr);
  std::_Exit(code);
}

// ---------------------------------------------------------------------------------------------
// Loopback TCP: two processes, one 127.0.0.1 connection, each side sending and receiving
// `bytes` at the same time (full duplex). Per-direction bandwidth = bytes / time.

absl::Status SendAll(int fd, const char* data, size_t bytes) {
  while (bytes > 0) {
    const ssize_t n = ::send(fd, data, bytes, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      return absl::UnavailableError(absl::StrCat("send: ", std::strerror(errno)));
    }
    data += n;
    bytes -= static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::Status RecvAll(int fd, char* data, size_t bytes) {
  while (bytes > 0) {
    const ssize_t n = ::recv(fd, data, bytes, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      return absl::UnavailableError(absl::StrCat("recv: ", std::strerror(errno)));
    }
    if (n == 0) return absl::UnavailableError("recv: peer closed the connection");
    data += n;
    bytes -= static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

// One side of the loopback pair; writes each trial's seconds (double) to `result_fd`.
absl::Status LoopbackPeer(int fd, uint64_t bytes, int trials, int result_fd) {
  constexpr size_t kChunk = size_t{64} << 20;
  std::vector<char> out(kChunk, 'x');
  std::vector<char> in(kChunk, 0);
  for (int t = 0; t < trials; ++t) {
    // Start together: each side says it is ready and waits for the other.
    char token = 's';
    if (absl::Status s = SendAll(fd, &token, 1); !s.ok()) return s;
    if (absl::Status s = RecvAll(fd, &token, 1); !s.ok()) return s;
    const Clock::time_point start = Clock::now();
    absl::Status sent;
    std::thread sender([&] {
      for (uint64_t left = bytes; left > 0 && sent.ok();) {
        const size_t n = static_cast<size_t>(std::min<uint64_t>(left, kChunk));
        sent = SendAll(fd, out.data(), n);
        left -= n;
      }
    });
    absl::Status received;
    for (uint64_t left = bytes; left > 0 && received.ok();) {
      const size_t n = static_cast<size_t>(std::min<uint64_t>(left, kChunk));
      received = RecvAll(fd, in.data(), n);
      left -= n;
    }
    sender.join();
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    if (!sent.ok()) return sent;
    if (!received.ok()) return received;
    if (::write(result_fd, &seconds, sizeof(seconds)) != sizeof(seconds)) {
      return absl::InternalError(absl::StrCat("write result: ", std::strerror(errno)));
    }
  }
  return absl::OkStatus();
}

// Forks the two peers; returns the best (over trials) per-direction GB/s, a trial's time being
// the slower side's.
absl::StatusOr<double> MeasureLoopbackTcp(uint64_t bytes, int trials) {
  const int listener = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (listener < 0) return absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = 0;
  socklen_t length = sizeof(address);
  if (::bind(listener, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0 ||
      ::listen(listener, 1) != 0 ||
      ::getsockname(listener, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
    const std::string error = std::strerror(errno);
    ::close(listener);
    return absl::InternalError(absl::StrCat("cannot listen on 127.0.0.1: ", error));
  }
  const pid_t parent = ::getpid();
  std::vector<pid_t> pids;
  std::vector<int> result_fds;
  for (int side = 0; side < 2; ++side) {
    int pipe_fds[2] = {-1, -1};
    std::fflush(stdout);
    std::fflush(stderr);
    const pid_t pid = ::pipe(pipe_fds) == 0 ? ::fork() : -1;
    if (pid < 0) {
      const std::string error = std::strerror(errno);
      for (int fd : {pipe_fds[0], pipe_fds[1], listener}) {
        if (fd >= 0) ::close(fd);
      }
      for (int fd : result_fds) ::close(fd);
      for (pid_t other : pids) ::kill(other, SIGTERM);
      WaitForChildren(pids, "loopback");
      return absl::InternalError(absl::StrCat("cannot start a loopback peer: ", error));
    }
    if (pid == 0) {
      DieWithParent(parent);
      ::close(pipe_fds[0]);
      int fd = -1;
      if (side == 0) {
        fd = ::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
      } else {
        fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd >= 0 &&
            ::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
          ::close(fd);
          fd = -1;
        }
      }
      ::close(listener);
      if (fd < 0) {
        std::fprintf(stderr, "loopback peer %d: cannot connect: %s\n", side,
                     std::strerror(errno));
        ExitChild(1);
      }
      absl::Status measured = LoopbackPeer(fd, bytes, trials, pipe_fds[1]);
      if (!measured.ok()) {
        std::fprintf(stderr, "loopback peer %d: %s\n", side,
                     std::string(measured.message()).c_str());
        ExitChild(1);
      }
      ExitChild(0);
    }
    ::close(pipe_fds[1]);
    pids.push_back(pid);
    result_fds.push_back(pipe_fds[0]);
  }
  ::close(listener);
  const bool ok = WaitForChildren(pids, "loopback");
  std::vector<double> slowest(trials, 0.0);
  bool complete = ok;
  for (int fd : result_fds) {
    for (int t = 0; t < trials; ++t) {
      double seconds = 0;
      if (::read(fd, &seconds, sizeof(seconds)) != sizeof(seconds)) {
        complete = false;
        break;
      }
      slowest[t] = std::max(slowest[t], seconds);
    }
    ::close(fd);
  }
  if (!complete) return absl::UnavailableError("a loopback peer failed");
  const double best = *std::min_element(slowest.begin(), slowest.end());
  return AlgorithmBandwidthGBps(static_cast<double>(bytes), best);
}

// ---------------------------------------------------------------------------------------------
// Memory copy: one thread, `bytes` from one buffer to another (both touched beforehand), the
// best of `trials`; GB/s = bytes copied / time.

double MeasureMemcpyGBps(uint64_t bytes, int trials) {
  std::vector<char> from(bytes, 1);
  std::vector<char> to(bytes, 0);
  double best = std::numeric_limits<double>::infinity();
  for (int t = 0; t < trials; ++t) {
    const Clock::time_point start = Clock::now();
    std::memcpy(to.data(), from.data(), bytes);
    // The copy's result must count as used.
    asm volatile("" : : "r"(to.data()) : "memory");
    best = std::min(best, std::chrono::duration<double>(Clock::now() - start).count());
  }
  return AlgorithmBandwidthGBps(static_cast<double>(bytes), best);
}

// The first "model name" of /proc/cpuinfo.
std::string CpuName() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line)) {
    if (!absl::StartsWith(line, "model name")) continue;
    const size_t colon = line.find(':');
    if (colon != std::string::npos) {
      return std::string(absl::StripAsciiWhitespace(line.substr(colon + 1)));
    }
  }
  return "unknown CPU";
}

// ---------------------------------------------------------------------------------------------
// One descriptor per collective: buffer sizes, data, closed-form check, and how to run it
// through a Communicator (shm, tcp) and, where raw Gloo has it, through gloo:: on the TCP
// communicator's own context.

// Exact in f32 for any rank count we accept, and every partial sum of them is too.
float InputValue(int rank, size_t i) {
  return static_cast<float>((i % 4093 + 1) * static_cast<size_t>(rank + 1));
}

// The sum over `ranks` ranks of InputValue(rank, i).
float SumOfInputs(int ranks, size_t i) {
  return static_cast<float>((i % 4093 + 1) * static_cast<size_t>(ranks) * (ranks + 1) / 2);
}

struct Buffers {
  std::vector<float> send;
  std::vector<float> recv;
};

class CollectiveTest {
 public:
  virtual ~CollectiveTest() = default;
  virtual Collective collective() const = 0;
  // Elements per rank sent, for a message of about `bytes` (nccl-tests' size).
  virtual size_t SendCount(uint64_t bytes, int ranks) const = 0;
  virtual size_t RecvCount(size_t send_count, int ranks) const = 0;
  // The size(B) and count(elems) columns: the buffer the bandwidth is about.
  virtual size_t MessageCount(size_t send_count, int ranks) const = 0;
  // Elements of `rank`'s output that differ from the closed form.
  virtual size_t CountWrong(const std::vector<float>& recv, size_t send_count, int rank,
                            int ranks) const = 0;
  virtual absl::Status Run(Communicator& comm, Buffers& buffers) const = 0;
  // Whether raw Gloo's collectives have this one; RunGloo is only called where they do.
  virtual bool has_gloo() const { return true; }
  // Throws gloo::Exception on failure.
  virtual void RunGloo(const std::shared_ptr<gloo::Context>& context, Buffers& buffers,
                       std::chrono::milliseconds timeout) const = 0;
};

class AllReduceTest : public CollectiveTest {
 public:
  Collective collective() const override { return Collective::kAllReduce; }
  size_t SendCount(uint64_t bytes, int) const override {
    return std::max<size_t>(1, bytes / sizeof(float));
  }
  size_t RecvCount(size_t send_count, int) const override { return send_count; }
  size_t MessageCount(size_t send_count, int) const override { return send_count; }
  size_t CountWrong(const std::vector<float>& recv, size_t, int, int ranks) const override {
    size_t wrong = 0;
    for (size_t i = 0; i < recv.size(); ++i) {
      if (recv[i] != SumOfInputs(ranks, i)) ++wrong;
    }
    return wrong;
  }
  absl::Status Run(Communicator& comm, Buffers& b) const override {
    return comm.AllReduce(b.send.data(), b.recv.data(), b.send.size(), DataType::kFloat32,
                          ReduceOp::kSum);
  }
  void RunGloo(const std::shared_ptr<gloo::Context>& context, Buffers& b,
               std::chrono::milliseconds timeout) const override {
    gloo::AllreduceOptions options(context);
    options.setInput(b.send.data(), b.send.size());
    options.setOutput(b.recv.data(), b.recv.size());
    options.setReduceFunction(
        static_cast<void (*)(void*, const void*, const void*, size_t)>(&gloo::sum<float>));
    options.setTimeout(timeout);
    gloo::allreduce(options);
  }
};

// Every rank sends size() blocks; rank r receives the sum of every rank's block r. The message
// is the scattered input, as in nccl-tests.
class ReduceScatterTest : public CollectiveTest {
 public:
  Collective collective() const override { return Collective::kReduceScatter; }
  size_t SendCount(uint64_t bytes, int ranks) const override {
    return std::max<size_t>(1, bytes / sizeof(float) / ranks) * ranks;
  }
  size_t RecvCount(size_t send_count, int ranks) const override { return send_count / ranks; }
  size_t MessageCount(size_t send_count, int) const override { return send_count; }
  size_t CountWrong(const std::vector<float>& recv, size_t, int rank, int ranks) const override {
    const size_t first = static_cast<size_t>(rank) * recv.size();
    size_t wrong = 0;
    for (size_t i = 0; i < recv.size(); ++i) {
      if (recv[i] != SumOfInputs(ranks, first + i)) ++wrong;
    }
    return wrong;
  }
  absl::Status Run(Communicator& comm, Buffers& b) const override {
    return comm.ReduceScatter(b.send.data(), b.recv.data(), b.recv.size(), DataType::kFloat32,
                              ReduceOp::kSum);
  }
  bool has_gloo() const override { return false; }
  void RunGloo(const std::shared_ptr<gloo::Context>&, Buffers&,
               std::chrono::milliseconds) const override {}
};

class AllGatherTest : public CollectiveTest {
 public:
  Collective collective() const override { return Collective::kAllGather; }
  size_t SendCount(uint64_t bytes, int ranks) const override {
    return std::max<size_t>(1, bytes / sizeof(float) / ranks);
  }
  size_t RecvCount(size_t send_count, int ranks) const override {
    return send_count * ranks;
  }
  size_t MessageCount(size_t send_count, int ranks) const override {
    return send_count * ranks;
  }
  size_t CountWrong(const std::vector<float>& recv, size_t send_count, int,
                    int ranks) const override {
    size_t wrong = 0;
    for (int r = 0; r < ranks; ++r) {
      const float* block = recv.data() + r * send_count;
      for (size_t i = 0; i < send_count; ++i) {
        if (block[i] != InputValue(r, i)) ++wrong;
      }
    }
    return wrong;
  }
  absl::Status Run(Communicator& comm, Buffers& b) const override {
    return comm.AllGather(b.send.data(), b.recv.data(), b.send.size(), DataType::kFloat32);
  }
  void RunGloo(const std::shared_ptr<gloo::Context>& context, Buffers& b,
               std::chrono::milliseconds timeout) const override {
    gloo::AllgatherOptions options(context);
    options.setInput(b.send.data(), b.send.size());
    options.setOutput(b.recv.data(), b.recv.size());
    options.setTimeout(timeout);
    gloo::allgather(options);
  }
};

std::unique_ptr<CollectiveTest> MakeTest(Collective collective) {
  switch (collective) {
    case Collective::kAllReduce: return std::make_unique<AllReduceTest>();
    case Collective::kReduceScatter: return std::make_unique<ReduceScatterTest>();
    case Collective::kAllGather: return std::make_unique<AllGatherTest>();
    default: return nullptr;
  }
}

// ---------------------------------------------------------------------------------------------
// The implementations measured.

absl::string_view ImplName(Impl impl) {
  switch (impl) {
    case Impl::kShm: return "shm";
    case Impl::kTcp: return "tcp";
    case Impl::kGloo: return "gloo";
  }
  return "unknown";
}

absl::StatusOr<Impl> ParseImpl(absl::string_view name) {
  for (Impl impl : kAllImpls) {
    if (name == ImplName(impl)) return impl;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown impl '", name, "'; expected shm, tcp or gloo"));
}

// ---------------------------------------------------------------------------------------------
// The harness, run by every rank.

struct Measurement {
  double seconds = 0;  // per iteration: max over ranks of each rank's mean
  int64_t wrong = 0;   // summed over ranks
};

// Every rank's communicators. `tcp` is always there: it carries the barrier before the timed
// iterations and the statistics after them, whatever is measured, and raw Gloo runs on its
// context and connections.
struct Communicators {
  GlooCommunicator* tcp = nullptr;
  Communicator* shm = nullptr;  // null unless shm is measured
};

absl::StatusOr<Measurement> Measure(const Communicators& comms, const CollectiveTest& test,
                                    Impl impl, Buffers& buffers, const Flags& flags,
                                    std::chrono::milliseconds timeout) {
  GlooCommunicator& control = *comms.tcp;
  auto run_once = [&]() -> absl::Status {
    if (impl == Impl::kShm) return test.Run(*comms.shm, buffers);
    if (impl == Impl::kTcp) return test.Run(control, buffers);
    try {
      test.RunGloo(control.gloo_context(), buffers, timeout);
    } catch (const std::exception& e) {
      return absl::UnavailableError(absl::StrCat("gloo ", CollectiveName(test.collective()),
                                                 " failed: ", e.what()));
    }
    return absl::OkStatus();
  };
  for (int i = 0; i < flags.warmup; ++i) {
    if (absl::Status s = run_once(); !s.ok()) return s;
  }
  // Stale results from the warm-up must not pass the check.
  std::fill(buffers.recv.begin(), buffers.recv.end(), std::numeric_limits<float>::quiet_NaN());
  if (absl::Status s = control.Barrier(); !s.ok()) return s;
  const Clock::time_point start = Clock::now();
  for (int i = 0; i < flags.iters; ++i) {
    if (absl::Status s = run_once(); !s.ok()) return s;
  }
  const Clock::time_point end = Clock::now();
  int64_t wrong = static_cast<int64_t>(
      test.CountWrong(buffers.recv, buffers.send.size(), control.rank(), control.size()));
  int64_t mean_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(end - start).count() /
                    flags.iters;
  if (absl::Status s =
          control.AllReduce(&mean_ns, &mean_ns, 1, DataType::kInt64, ReduceOp::kMax);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = control.AllReduce(&wrong, &wrong, 1, DataType::kInt64, ReduceOp::kSum);
      !s.ok()) {
    return s;
  }
  return Measurement{static_cast<double>(mean_ns) * 1e-9, wrong};
}

std::vector<uint64_t> MessageSizes(const Flags& flags) {
  std::vector<uint64_t> sizes;
  for (uint64_t s = flags.min_bytes; s <= flags.max_bytes; s *= flags.step_factor) {
    sizes.push_back(s);
  }
  return sizes;
}

// Per collective and impl (indexed by Impl).
struct Summary {
  double busbw_sum[kImplCount] = {};
  int rows[kImplCount] = {};
  std::optional<double> busbw_largest[kImplCount];
};

// "-" where either side was not measured.
std::string Ratio(std::optional<double> numerator, std::optional<double> denominator) {
  if (!numerator.has_value() || !denominator.has_value() || *denominator <= 0) return "-";
  return absl::StrFormat("%.2f", *numerator / *denominator);
}

std::string Target(bool met) { return met ? "met" : "NOT met"; }

// The closing lines of one collective, at the largest size: shm against memcpy, TCP and Gloo;
// our TCP ring against loopback TCP and Gloo.
void PrintSummary(const CollectiveTest& test, const Summary& sum, uint64_t largest,
                  double memcpy_gbps, std::optional<double> loopback_gbps) {
  const std::string name(CollectiveName(test.collective()));
  const auto& at = sum.busbw_largest;
  const auto shm = static_cast<int>(Impl::kShm);
  const auto tcp = static_cast<int>(Impl::kTcp);
  const auto gloo = static_cast<int>(Impl::kGloo);
  std::vector<std::string> averages;
  for (Impl impl : kAllImpls) {
    const int i = static_cast<int>(impl);
    if (sum.rows[i] > 0) {
      averages.push_back(
          absl::StrFormat("%s %.3f", ImplName(impl), sum.busbw_sum[i] / sum.rows[i]));
    }
  }
  std::printf("# %s: avg busbw %s GB/s\n", name.c_str(), absl::StrJoin(averages, ", ").c_str());
  if (at[shm].has_value()) {
    const double x = *at[shm] / memcpy_gbps;
    std::printf(
        "# %s at %llu B: shm busbw %.3f GB/s = %.2fx memcpy (%.3f GB/s) [target >= 0.5x "
        "memcpy: %s]; shm/tcp %s, shm/gloo %s\n",
        name.c_str(), static_cast<unsigned long long>(largest), *at[shm], x, memcpy_gbps,
        Target(x >= 0.5).c_str(), Ratio(at[shm], at[tcp]).c_str(),
        Ratio(at[shm], at[gloo]).c_str());
  }
  if (at[tcp].has_value()) {
    std::string loopback = "loopback TCP not measured";
    if (loopback_gbps.has_value()) {
      const double x = *at[tcp] / *loopback_gbps;
      loopback = absl::StrFormat("%.2fx loopback TCP per direction (%.3f GB/s)", x,
                                 *loopback_gbps);
      if (test.collective() == Collective::kAllReduce) {
        absl::StrAppend(&loopback, " [target >= 0.70x: ", Target(x >= 0.7), "]");
      }
    }
    std::string versus_gloo = "tcp/gloo -";
    if (at[gloo].has_value()) {
      versus_gloo = absl::StrCat("tcp/gloo ", Ratio(at[tcp], at[gloo]),
                                 " [target >= 1: ", Target(*at[tcp] >= *at[gloo]), "]");
    }
    std::printf("# %s at %llu B: tcp busbw %.3f GB/s = %s; %s\n", name.c_str(),
                static_cast<unsigned long long>(largest), *at[tcp], loopback.c_str(),
                versus_gloo.c_str());
  }
}

// Returns the process exit code.
int RunRank(int rank, const Flags& flags, const std::string& store_dir, double memcpy_gbps,
            std::optional<double> loopback_gbps) {
  const bool print = rank == 0;
  DirectoryKeyValueStore store(store_dir);
  GlooOptions options;
  options.rank = rank;
  options.size = flags.ranks;
  options.hostname = "127.0.0.1";
  options.timeout = ParsedDuration(flags.timeout);
  options.segment_bytes = flags.segment_bytes;
  options.key_prefix = "gloo/";
  absl::StatusOr<std::unique_ptr<GlooCommunicator>> tcp = CreateGlooCommunicator(&store, options);
  if (!tcp.ok()) {
    std::fprintf(stderr, "rank %d: %s\n", rank, std::string(tcp.status().message()).c_str());
    return 1;
  }
  Communicators comms{tcp->get(), nullptr};
  std::unique_ptr<Communicator> shm;
  if (absl::c_linear_search(flags.impls, Impl::kShm)) {
    ShmOptions shm_options;
    shm_options.rank = rank;
    shm_options.size = flags.ranks;
    shm_options.timeout = options.timeout;
    shm_options.key_prefix = "shm/";
    shm_options.slot_bytes = flags.shm_slot_bytes;
    absl::StatusOr<std::unique_ptr<Communicator>> created =
        CreateShmCommunicator(&store, shm_options);
    if (!created.ok()) {
      std::fprintf(stderr, "rank %d: %s\n", rank,
                   std::string(created.status().message()).c_str());
      return 1;
    }
    shm = *std::move(created);
    comms.shm = shm.get();
  }
  const auto timeout = std::chrono::milliseconds(absl::ToInt64Milliseconds(options.timeout));

  if (print) {
    std::printf("#\n# %12s %14s %5s %15s %6s %11s %12s %12s %8s\n", "size(B)", "count(elems)",
                "type", "collective", "impl", "time(us)", "algbw(GB/s)", "busbw(GB/s)",
                "#wrong");
    std::fflush(stdout);
  }
  std::vector<std::unique_ptr<CollectiveTest>> tests;
  for (Collective c : flags.collectives) tests.push_back(MakeTest(c));
  std::vector<Summary> summaries(tests.size());
  int64_t total_wrong = 0;
  const std::vector<uint64_t> sizes = MessageSizes(flags);
  for (size_t s = 0; s < sizes.size(); ++s) {
    for (size_t t = 0; t < tests.size(); ++t) {
      const CollectiveTest& test = *tests[t];
      const size_t send_count = test.SendCount(sizes[s], flags.ranks);
      Buffers buffers;
      buffers.send.resize(send_count);
      for (size_t i = 0; i < send_count; ++i) buffers.send[i] = InputValue(rank, i);
      buffers.recv.resize(test.RecvCount(send_count, flags.ranks));
      const size_t count = test.MessageCount(send_count, flags.ranks);
      const double bytes = static_cast<double>(count * sizeof(float));
      const std::string row_start = absl::StrFormat(
          "  %12.0f %14zu %5s %15s", bytes, count, DataTypeName(DataType::kFloat32),
          CollectiveName(test.collective()));
      for (Impl impl : flags.impls) {
        if (impl == Impl::kGloo && !test.has_gloo()) {
          if (print) {
            std::printf("%s %6s %11s %12s %12s %8s\n", row_start.c_str(), "gloo", "-", "-", "-",
                        "-");
          }
          continue;
        }
        absl::StatusOr<Measurement> m = Measure(comms, test, impl, buffers, flags, timeout);
        if (!m.ok()) {
          std::fprintf(stderr, "rank %d: %s %s at %.0f B: %s\n", rank,
                       std::string(CollectiveName(test.collective())).c_str(),
                       std::string(ImplName(impl)).c_str(), bytes,
                       std::string(m.status().message()).c_str());
          return 1;
        }
        const double algbw = AlgorithmBandwidthGBps(bytes, m->seconds);
        const double busbw = BusBandwidthGBps(test.collective(), flags.ranks, bytes, m->seconds);
        const int i = static_cast<int>(impl);
        summaries[t].busbw_sum[i] += busbw;
        summaries[t].rows[i] += 1;
        if (s + 1 == sizes.size()) summaries[t].busbw_largest[i] = busbw;
        total_wrong += m->wrong;
        if (print) {
          std::printf("%s %6s %11.1f %12.3f %12.3f %8lld\n", row_start.c_str(),
                      std::string(ImplName(impl)).c_str(), m->seconds * 1e6, algbw, busbw,
                      static_cast<long long>(m->wrong));
          std::fflush(stdout);
        }
      }
    }
  }
  if (print) {
    std::printf("#\n");
    for (size_t t = 0; t < tests.size(); ++t) {
      PrintSummary(*tests[t], summaries[t], sizes.back(), memcpy_gbps, loopback_gbps);
    }
    std::printf("# total #wrong: %lld\n", static_cast<long long>(total_wrong));
    std::fflush(stdout);
  }
  return total_wrong == 0 ? 0 : 1;
}

// ---------------------------------------------------------------------------------------------

int Main(int argc, char** argv) {
  CLI::App app{
      "shard-bench-collectives: collective bus bandwidth through Shard's communicators, "
      "shared memory (impl shm: CreateShmCommunicator) and TCP (impl tcp: "
      "shard::GlooCommunicator, our pipelined rings), next to raw Gloo's own collectives "
      "(impl gloo: gloo::allreduce / gloo::allgather on the same gloo::Context and TCP "
      "connections; it has no reduce-scatter here) and next to two limits measured in the same "
      "run: one thread's memcpy of the largest size, and raw loopback TCP (two processes, one "
      "127.0.0.1 connection, both directions at once; reported per direction).\n"
      "Ranks are separate processes on this host. For every message size, collective and impl: "
      "warm-up iterations, a barrier, then timed iterations; time is the slowest rank's mean; "
      "outputs are checked against the closed form (#wrong counts mismatching f32 elements, "
      "summed over ranks). Columns as nccl-tests: size(B) is the whole buffer the bandwidth "
      "is about (all-reduce: the buffer; reduce-scatter: the scattered input; all-gather: the "
      "gathered output), algbw = size/time, busbw = algbw x 2(n-1)/n (all-reduce) or (n-1)/n "
      "(reduce-scatter, all-gather); GB = 1e9 B. Targets at the largest size: shm busbw >= "
      "0.5x memcpy; tcp busbw >= raw Gloo's, and tcp all-reduce >= 0.7x loopback TCP. "
      "Exits non-zero if a process fails or any element is wrong.",
      "shard-bench-collectives"};
  Flags flags;
  app.add_option("-n,--ranks", flags.ranks, "number of ranks (processes)")
      ->capture_default_str()
      ->check(CLI::Range(2, 64));
  app.add_option("-b,--min-bytes", flags.min_bytes, "smallest message size (e.g. 65536, 64KiB)")
      ->capture_default_str()
      ->transform(CLI::AsSizeValue(false));
  app.add_option("-e,--max-bytes", flags.max_bytes, "largest message size (e.g. 64MiB)")
      ->capture_default_str()
      ->transform(CLI::AsSizeValue(false));
  app.add_option("-f,--step-factor", flags.step_factor, "multiply the size by this each step")
      ->capture_default_str()
      ->check(CLI::Range(2, 1024));
  app.add_option("-w,--warmup", flags.warmup, "untimed iterations per size, collective, impl")
      ->capture_default_str()
      ->check(CLI::Range(0, 1000000));
  app.add_option("-i,--iters", flags.iters, "timed iterations per size, collective, impl")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000000));
  app.add_option("--segment-bytes", flags.segment_bytes,
                 "GlooOptions::segment_bytes: pipelining granularity of our rings (raw Gloo "
                 "keeps its own 1 MiB)")
      ->capture_default_str()
      ->transform(CLI::AsSizeValue(false));
  app.add_option("--shm-slot-bytes", flags.shm_slot_bytes,
                 "ShmOptions::slot_bytes: one round's data per rank in shared memory")
      ->capture_default_str()
      ->transform(CLI::AsSizeValue(false));
  app.add_option("-c,--collectives", flags.collective_names,
                 "comma-separated: all_reduce, reduce_scatter, all_gather")
      ->delimiter(',')
      ->capture_default_str();
  app.add_option("--impls", flags.impl_names, "comma-separated: shm, tcp, gloo")
      ->delimiter(',')
      ->capture_default_str();
  app.add_option("--timeout", flags.timeout, "connect and per-collective timeout")
      ->capture_default_str()
      ->check(DurationValidator());
  app.add_option("--memcpy-trials", flags.memcpy_trials, "memcpy trials (best kept)")
      ->capture_default_str()
      ->check(CLI::Range(1, 100));
  app.add_flag("--skip-loopback", flags.skip_loopback, "do not measure loopback TCP");
  app.add_option("--loopback-bytes", flags.loopback_bytes,
                 "bytes each way per loopback TCP trial")
      ->capture_default_str()
      ->transform(CLI::AsSizeValue(false));
  app.add_option("--loopback-trials", flags.loopback_trials, "loopback TCP trials (best kept)")
      ->capture_default_str()
      ->check(CLI::Range(1, 100));
  if (std::optional<int> exit_code = ParseCommandLine(app, argc, argv)) return *exit_code;

  for (const std::string& name : flags.collective_names) {
    absl::StatusOr<Collective> c = ParseCollective(name);
    if (c.ok() && MakeTest(*c) == nullptr) {
      c = absl::InvalidArgumentError(absl::StrCat(
          "collective '", name, "' is not measured here; use all_reduce, reduce_scatter, "
          "all_gather"));
    }
    if (!c.ok()) {
      std::fprintf(stderr, "shard-bench-collectives: %s\n", std::string(c.status().message()).c_str());
      return 2;
    }
    flags.collectives.push_back(*c);
  }
  for (const std::string& name : flags.impl_names) {
    absl::StatusOr<Impl> impl = ParseImpl(name);
    if (!impl.ok()) {
      std::fprintf(stderr, "shard-bench-collectives: %s\n",
                   std::string(impl.status().message()).c_str());
      return 2;
    }
  }
  // Measured in a fixed order, each once.
  for (Impl impl : kAllImpls) {
    if (absl::c_linear_search(flags.impl_names, ImplName(impl))) flags.impls.push_back(impl);
  }
  if (flags.min_bytes < sizeof(float) || flags.max_bytes < flags.min_bytes ||
      flags.segment_bytes < sizeof(float) || flags.shm_slot_bytes < 64 ||
      flags.loopback_bytes == 0) {
    std::fprintf(stderr,
                 "shard-bench-collectives: need 4 <= --min-bytes <= --max-bytes, "
                 "--segment-bytes >= 4, --shm-slot-bytes >= 64 and --loopback-bytes > 0\n");
    return 2;
  }

  std::printf(
      "# shard-bench-collectives: %d ranks (processes) on 127.0.0.1, f32 sum, out-of-place, "
      "warmup %d, iters %d, impls %s, tcp segment_bytes %llu, shm slot_bytes %llu x depth %d\n",
      flags.ranks, flags.warmup, flags.iters,
      absl::StrJoin(flags.impls, ",",
                    [](std::string* out, Impl impl) { absl::StrAppend(out, ImplName(impl)); })
          .c_str(),
      static_cast<unsigned long long>(flags.segment_bytes),
      static_cast<unsigned long long>(flags.shm_slot_bytes), ShmOptions().depth);
  std::printf("# CPU: %s, %u logical CPUs\n", CpuName().c_str(),
              std::thread::hardware_concurrency());
  const double memcpy_gbps = MeasureMemcpyGBps(flags.max_bytes, flags.memcpy_trials);
  std::printf("# memcpy, one thread: %.3f GB/s (%llu B, best of %d)\n", memcpy_gbps,
              static_cast<unsigned long long>(flags.max_bytes), flags.memcpy_trials);
  std::optional<double> loopback_gbps;
  bool ok = true;
  if (!flags.skip_loopback) {
    absl::StatusOr<double> measured =
        MeasureLoopbackTcp(flags.loopback_bytes, flags.loopback_trials);
    if (measured.ok()) {
      loopback_gbps = *measured;
      std::printf(
          "# loopback TCP, full duplex on one 127.0.0.1 connection: %.3f GB/s per direction "
          "(%llu B each way, best of %d)\n",
          *measured, static_cast<unsigned long long>(flags.loopback_bytes),
          flags.loopback_trials);
    } else {
      std::fprintf(stderr, "shard-bench-collectives: loopback TCP: %s\n",
                   std::string(measured.status().message()).c_str());
      ok = false;
    }
  }
  std::fflush(stdout);

  const char* tmp = std::getenv("TMPDIR");
  std::string pattern = absl::StrCat(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp",
                                     "/shard-bench-collectives.XXXXXX");
  std::vector<char> dir_buffer(pattern.begin(), pattern.end());
  dir_buffer.push_back('\0');
  if (::mkdtemp(dir_buffer.data()) == nullptr) {
    std::fprintf(stderr, "shard-bench-collectives: cannot create a temporary directory %s: %s\n",
                 pattern.c_str(), std::strerror(errno));
    return 1;
  }
  const std::string store_dir = dir_buffer.data();

  const pid_t parent = ::getpid();
  std::vector<pid_t> pids;
  for (int rank = 0; rank < flags.ranks; ++rank) {
    std::fflush(stdout);
    std::fflush(stderr);
    const pid_t pid = ::fork();
    if (pid < 0) {
      std::fprintf(stderr, "shard-bench-collectives: fork: %s\n", std::strerror(errno));
      for (pid_t other : pids) ::kill(other, SIGTERM);
      WaitForChildren(pids, "rank");
      ok = false;
      pids.clear();
      break;
    }
    if (pid == 0) {
      DieWithParent(parent);
      ExitChild(RunRank(rank, flags, store_dir, memcpy_gbps, loopback_gbps));
    }
    pids.push_back(pid);
  }
  if (!pids.empty() && !WaitForChildren(pids, "rank")) ok = false;
  std::error_code ignored;
  std::filesystem::remove_all(store_dir, ignored);
  return ok ? 0 : 1;
}

}  // namespace
}  // namespace shard

int main(int argc, char** argv) { return shard::Main(argc, argv); }
