// shard-bench-collectives: collective bus bandwidth through Shard's shared-memory communicator
// (shm: buffers the peers read in place, as the engine's buckets; shm-copy: private buffers,
// copied through the communicator's slots) and its TCP rings (tcp, shard::GlooCommunicator),
// beside raw Gloo's own collectives on the TCP communicator's very connections, one thread's
// memcpy, every rank's memcpy at once and the loopback TCP limit, all measured in the same run,
// reported like nccl-tests (GB = 1e9 bytes; busbw = algbw x factor).
//
// Ranks are real processes: this program started again (tests/support/process.h) with the
// run's own flags and hidden ones that make it a rank; they meet through a file-per-key
// rendezvous store in a private temporary directory (each communicator under its own key
// prefix), and rank 0 writes what they measured there for the first process, which reports it
// (bench/harness.h). Results are checked while measuring: inputs are small integers (exact in
// f32, so every summation order gives the same bits) and the outputs of the timed iterations
// are compared with the closed form; mismatching elements are counted in #wrong.
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/algorithm/container.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bench/harness.h"
#include "common/bus_bandwidth.h"
#include "common/cli.h"
#include "common/dtype.h"
#include "common/files.h"
#include "gloo/allgather.h"
#include "gloo/allreduce.h"
#include "gloo/context.h"
#include "gloo/math.h"
#include "nlohmann/json.hpp"
#include "tests/support/process.h"
#include "worker/dataplane/gloo_communicator.h"
#include "worker/dataplane/key_value_store.h"
#include "worker/dataplane/shm_communicator.h"

namespace shard {
namespace {

using Clock = std::chrono::steady_clock;
using testing::Process;

// What is measured: our shared-memory communicator on shared buffers and on private ones, our
// TCP rings, raw Gloo's collectives.
enum class Impl { kShm, kShmCopy, kTcp, kGloo };
constexpr Impl kAllImpls[] = {Impl::kShm, Impl::kShmCopy, Impl::kTcp, Impl::kGloo};

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
  std::vector<std::string> impl_names = {"shm", "shm-copy", "tcp", "gloo"};
  std::vector<Impl> impls;  // in kAllImpls order
  int memcpy_trials = 5;
  bool in_place = false;
  bool skip_loopback = false;
  uint64_t loopback_bytes = 512 << 20;
  int loopback_trials = 3;
  std::string timeout = "60s";
  // Given (hidden flags) to the processes the first one starts: a rank, or the far side of the
  // loopback pair, and where it writes what it measured.
  int rank = -1;
  int loopback_port = 0;
  std::string store;    // the rendezvous directory
  std::string results;
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
// Loopback TCP: two processes, one 127.0.0.1 connection, each side sending and receiving
// `bytes` at the same time (full duplex). Per-direction bandwidth = bytes / time.

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


// One side of the loopback pair: each trial's seconds.
absl::StatusOr<std::vector<double>> LoopbackPeer(int fd, uint64_t bytes, int trials) {
  constexpr size_t kChunk = size_t{64} << 20;
  std::vector<char> out(kChunk, 'x');
  std::vector<char> in(kChunk, 0);
  std::vector<double> seconds;
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
    seconds.push_back(std::chrono::duration<double>(Clock::now() - start).count());
    if (!sent.ok()) return sent;
    if (!received.ok()) return received;
  }
  return seconds;
}

// The far side, in a process of its own: connects to the first process's listener and writes
// each trial's seconds to --results, one a line. Returns the exit code.
int RunLoopbackPeer(const Flags& flags) {
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = htons(static_cast<uint16_t>(flags.loopback_port));
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0 || ::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
    std::fprintf(stderr, "loopback peer: cannot connect: %s\n", std::strerror(errno));
    return 1;
  }
  absl::StatusOr<std::vector<double>> seconds =
      LoopbackPeer(fd, flags.loopback_bytes, flags.loopback_trials);
  ::close(fd);
  if (!seconds.ok()) {
    std::fprintf(stderr, "loopback peer: %s\n", std::string(seconds.status().message()).c_str());
    return 1;
  }
  std::ofstream out(flags.results);
  for (double s : *seconds) out << absl::StrFormat("%.17g\n", s);
  out.close();
  return out ? 0 : 1;
}

// `run` (this program and the run's own arguments) with `extra` ones after them.
std::vector<std::string> Again(const std::vector<std::string>& run,
                               const std::vector<std::string>& extra) {
  std::vector<std::string> argv = run;
  argv.insert(argv.end(), extra.begin(), extra.end());
  return argv;
}

// Milliseconds of each trial, the slower side's: this process is one side of the connection, a
// process it starts (this program again) the other; their files go to `dir`.
absl::StatusOr<std::vector<double>> MeasureLoopbackTcp(const Flags& flags,
                                                       const std::vector<std::string>& run,
                                                       const std::string& dir) {
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
  const std::string results = dir + "/loopback";
  absl::StatusOr<Process> peer = Process::Start(
      Again(run, {"--loopback-peer", absl::StrCat(ntohs(address.sin_port)), "--results", results}),
      dir + "/loopback.log");
  if (!peer.ok()) {
    ::close(listener);
    return peer.status();
  }
  // Accept, unless the peer ends (or the connect timeout passes) first.
  const absl::Time give_up = absl::Now() + ParsedDuration(flags.timeout);
  pollfd ready = {listener, POLLIN, 0};
  while (::poll(&ready, 1, 50) <= 0 && !peer->Exited() && absl::Now() < give_up) {
  }
  const int fd =
      (ready.revents & POLLIN) ? ::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC) : -1;
  ::close(listener);
  if (fd < 0) {
    return absl::UnavailableError(
        absl::StrCat("the loopback peer did not connect; its log:\n", peer->Log()));
  }
  absl::StatusOr<std::vector<double>> mine =
      LoopbackPeer(fd, flags.loopback_bytes, flags.loopback_trials);
  ::close(fd);
  const std::optional<int> exit_code = peer->Wait(ParsedDuration(flags.timeout));
  if (!mine.ok()) return mine.status();
  std::vector<double> theirs;
  std::ifstream in(results);
  for (double s = 0; in >> s;) theirs.push_back(s);
  if (exit_code != 0 || theirs.size() != mine->size()) {
    return absl::UnavailableError(
        absl::StrCat("the loopback peer failed; its log:\n", peer->Log()));
  }
  std::vector<double> slower_ms;
  for (size_t t = 0; t < theirs.size(); ++t) {
    slower_ms.push_back(std::max((*mine)[t], theirs[t]) * 1e3);
  }
  return slower_ms;
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

// Floats in whole pages of an anonymous mapping of their own, as the engine's buckets: what the
// shared-memory communicator can share (Communicator::ShareHostBuffer).
class PageArray {
 public:
  explicit PageArray(size_t count) : count_(count) {
    const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
    bytes_ = std::max<size_t>(1, (count * sizeof(float) + page - 1) / page) * page;
    void* data =
        ::mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (data == MAP_FAILED) {
      std::fprintf(stderr, "cannot map %zu bytes: %s\n", bytes_, std::strerror(errno));
      std::exit(1);
    }
    data_ = static_cast<float*>(data);
  }
  PageArray(const PageArray&) = delete;
  PageArray& operator=(const PageArray&) = delete;
  ~PageArray() { ::munmap(data_, bytes_); }

  float* data() const { return data_; }
  size_t size() const { return count_; }
  size_t mapped_bytes() const { return bytes_; }
  float* begin() const { return data_; }
  float* end() const { return data_ + count_; }
  float& operator[](size_t i) const { return data_[i]; }

 private:
  float* data_ = nullptr;
  size_t count_ = 0;
  size_t bytes_ = 0;
};

// A rank's arrays and the views a collective runs on: out of place, `in` is `send` and `out` is
// `recv`; in place (--in-place, nccl-tests' in-place columns, as the engine runs on its
// buckets) the input lies in the output: all-reduce on `recv` alone, reduce-scatter into the
// rank's block of `send`, all-gather from the rank's block of `recv`.
struct Buffers {
  Buffers(size_t send_count, size_t recv_count) : send(send_count), recv(recv_count) {}
  PageArray send;
  PageArray recv;
  float* in = nullptr;
  size_t in_count = 0;
  float* out = nullptr;
  size_t out_count = 0;
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
  // Sets the views of `b` for `rank`, out of place or in place.
  virtual void Place(Buffers& b, int rank, bool in_place) const = 0;
  // Elements of `rank`'s output (b.out) that differ from the closed form.
  virtual size_t CountWrong(const Buffers& b, int rank, int ranks) const = 0;
  virtual absl::Status Run(Communicator& comm, Buffers& b) const = 0;
  // Whether raw Gloo's collectives have this one; RunGloo is only called where they do.
  virtual bool has_gloo() const { return true; }
  // Throws gloo::Exception on failure.
  virtual void RunGloo(const std::shared_ptr<gloo::Context>& context, Buffers& buffers,
                       std::chrono::milliseconds timeout) const = 0;
};

void FillInput(Buffers& b, int rank) {
  for (size_t i = 0; i < b.in_count; ++i) b.in[i] = InputValue(rank, i);
}

class AllReduceTest : public CollectiveTest {
 public:
  Collective collective() const override { return Collective::kAllReduce; }
  size_t SendCount(uint64_t bytes, int) const override {
    return std::max<size_t>(1, bytes / sizeof(float));
  }
  size_t RecvCount(size_t send_count, int) const override { return send_count; }
  size_t MessageCount(size_t send_count, int) const override { return send_count; }
  void Place(Buffers& b, int, bool in_place) const override {
    b.in = in_place ? b.recv.data() : b.send.data();
    b.in_count = b.send.size();
    b.out = b.recv.data();
    b.out_count = b.recv.size();
  }
  size_t CountWrong(const Buffers& b, int, int ranks) const override {
    size_t wrong = 0;
    for (size_t i = 0; i < b.out_count; ++i) {
      if (b.out[i] != SumOfInputs(ranks, i)) ++wrong;
    }
    return wrong;
  }
  absl::Status Run(Communicator& comm, Buffers& b) const override {
    return comm.AllReduce(b.in, b.out, b.in_count, DataType::kFloat32, ReduceOp::kSum);
  }
  void RunGloo(const std::shared_ptr<gloo::Context>& context, Buffers& b,
               std::chrono::milliseconds timeout) const override {
    gloo::AllreduceOptions options(context);
    options.setInput(b.in, b.in_count);
    options.setOutput(b.out, b.out_count);
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
  void Place(Buffers& b, int rank, bool in_place) const override {
    b.in = b.send.data();
    b.in_count = b.send.size();
    b.out = in_place ? b.send.data() + rank * b.recv.size() : b.recv.data();
    b.out_count = b.recv.size();
  }
  size_t CountWrong(const Buffers& b, int rank, int ranks) const override {
    const size_t first = static_cast<size_t>(rank) * b.out_count;
    size_t wrong = 0;
    for (size_t i = 0; i < b.out_count; ++i) {
      if (b.out[i] != SumOfInputs(ranks, first + i)) ++wrong;
    }
    return wrong;
  }
  absl::Status Run(Communicator& comm, Buffers& b) const override {
    return comm.ReduceScatter(b.in, b.out, b.out_count, DataType::kFloat32, ReduceOp::kSum);
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
  void Place(Buffers& b, int rank, bool in_place) const override {
    b.in = in_place ? b.recv.data() + rank * b.send.size() : b.send.data();
    b.in_count = b.send.size();
    b.out = b.recv.data();
    b.out_count = b.recv.size();
  }
  size_t CountWrong(const Buffers& b, int, int ranks) const override {
    size_t wrong = 0;
    for (int r = 0; r < ranks; ++r) {
      const float* block = b.out + r * b.in_count;
      for (size_t i = 0; i < b.in_count; ++i) {
        if (block[i] != InputValue(r, i)) ++wrong;
      }
    }
    return wrong;
  }
  absl::Status Run(Communicator& comm, Buffers& b) const override {
    return comm.AllGather(b.in, b.out, b.in_count, DataType::kFloat32);
  }
  void RunGloo(const std::shared_ptr<gloo::Context>& context, Buffers& b,
               std::chrono::milliseconds timeout) const override {
    gloo::AllgatherOptions options(context);
    options.setInput(b.in, b.in_count);
    options.setOutput(b.out, b.out_count);
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
    case Impl::kShmCopy: return "shm-copy";
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
      absl::StrCat("unknown impl '", name, "'; expected shm, shm-copy, tcp or gloo"));
}

// ---------------------------------------------------------------------------------------------
// Measuring, on every rank.

struct Measurement {
  double seconds = 0;  // per iteration: max over ranks of each rank's mean
  int64_t wrong = 0;   // summed over ranks
};

// Every rank's communicators. `tcp` is always there: it carries the barrier before the timed
// iterations and the statistics after them, whatever is measured, and raw Gloo runs on its
// context and connections.
struct Communicators {
  GlooCommunicator* tcp = nullptr;
  Communicator* shm = nullptr;  // null unless shm or shm-copy is measured
};

absl::StatusOr<Measurement> Measure(const Communicators& comms, const CollectiveTest& test,
                                    Impl impl, Buffers& buffers, const Flags& flags,
                                    std::chrono::milliseconds timeout) {
  GlooCommunicator& control = *comms.tcp;
  // shm: both buffers shared with the peers for this measurement, as the engine shares its
  // buckets; shm-copy: the same communicator on the private buffers.
  std::vector<std::unique_ptr<SharedHostBuffer>> shared;
  if (impl == Impl::kShm) {
    for (const PageArray* array : {&buffers.send, &buffers.recv}) {
      absl::StatusOr<std::unique_ptr<SharedHostBuffer>> share =
          comms.shm->ShareHostBuffer(array->data(), array->mapped_bytes());
      if (!share.ok()) return share.status();
      shared.push_back(*std::move(share));
    }
  }
  auto run_once = [&]() -> absl::Status {
    if (impl == Impl::kShm || impl == Impl::kShmCopy) return test.Run(*comms.shm, buffers);
    if (impl == Impl::kTcp) return test.Run(control, buffers);
    try {
      test.RunGloo(control.gloo_context(), buffers, timeout);
    } catch (const std::exception& e) {
      return absl::UnavailableError(absl::StrCat("gloo ", CollectiveName(test.collective()),
                                                 " failed: ", e.what()));
    }
    return absl::OkStatus();
  };
  FillInput(buffers, control.rank());
  for (int i = 0; i < flags.warmup; ++i) {
    if (absl::Status s = run_once(); !s.ok()) return s;
  }
  // Stale results from the warm-up must not pass the check. In place, the timed iterations
  // feed their outputs back in: the check is of one more run on fresh inputs.
  if (!flags.in_place) {
    std::fill(buffers.recv.begin(), buffers.recv.end(), std::numeric_limits<float>::quiet_NaN());
  }
  if (absl::Status s = control.Barrier(); !s.ok()) return s;
  const Clock::time_point start = Clock::now();
  for (int i = 0; i < flags.iters; ++i) {
    if (absl::Status s = run_once(); !s.ok()) return s;
  }
  const Clock::time_point end = Clock::now();
  if (flags.in_place) {
    FillInput(buffers, control.rank());
    if (absl::Status s = run_once(); !s.ok()) return s;
  }
  int64_t wrong =
      static_cast<int64_t>(test.CountWrong(buffers, control.rank(), control.size()));
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

// Every rank copying the largest size at once, between two buffers touched beforehand: for
// each of --memcpy-trials copies started together (a barrier), the time from the first rank's
// start to the last rank's end (one clock for every process of the host). The best trial is
// the copy bandwidth each rank gets while all of them copy. A collective in shared memory is
// copies and sums that every rank does at once, so where the ranks share the memory bandwidth
// or the cores, this, not one thread's memcpy on an idle machine, is the most it can move.
absl::StatusOr<std::vector<double>> MeasureConcurrentMemcpy(GlooCommunicator& control,
                                                            const Flags& flags) {
  std::vector<char> from(flags.max_bytes, 1);
  std::vector<char> to(flags.max_bytes, 0);
  std::memcpy(to.data(), from.data(), flags.max_bytes);  // warm-up
  auto ns = [](Clock::time_point t) {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
  };
  std::vector<double> trials_ms;
  for (int trial = 0; trial < flags.memcpy_trials; ++trial) {
    if (absl::Status s = control.Barrier(); !s.ok()) return s;
    const Clock::time_point start = Clock::now();
    std::memcpy(to.data(), from.data(), flags.max_bytes);
    asm volatile("" : : "r"(to.data()) : "memory");  // the copy's result counts as used
    // The latest end and the earliest start (as the latest of its negation).
    int64_t span[2] = {ns(Clock::now()), -ns(start)};
    if (absl::Status s = control.AllReduce(span, span, 2, DataType::kInt64, ReduceOp::kMax);
        !s.ok()) {
      return s;
    }
    trials_ms.push_back(static_cast<double>(span[0] + span[1]) * 1e-6);
  }
  return trials_ms;
}

std::vector<uint64_t> MessageSizes(const Flags& flags) {
  std::vector<uint64_t> sizes;
  for (uint64_t s = flags.min_bytes; s <= flags.max_bytes; s *= flags.step_factor) {
    sizes.push_back(s);
  }
  return sizes;
}


// A rank, in a process of its own: every size, collective and impl measured with the other
// ranks; rank 0 writes each size and collective's measurements to --results as one JSON line
// (flushed, the first process reads them as they come). Returns the exit code: 1 if a
// collective failed or any element was wrong.
int RunRank(const Flags& flags) {
  const int rank = flags.rank;
  DirectoryKeyValueStore store(flags.store);
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
  if (absl::c_linear_search(flags.impls, Impl::kShm) ||
      absl::c_linear_search(flags.impls, Impl::kShmCopy)) {
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

  std::ofstream results;
  if (rank == 0) results.open(flags.results);
  absl::StatusOr<std::vector<double>> concurrent = MeasureConcurrentMemcpy(*comms.tcp, flags);
  if (!concurrent.ok()) {
    std::fprintf(stderr, "rank %d: memcpy on every rank at once: %s\n", rank,
                 std::string(concurrent.status().message()).c_str());
    return 1;
  }
  if (rank == 0) {
    results << nlohmann::json{{"memcpy_at_once_ms", *concurrent}}.dump() << std::endl;
  }
  std::vector<std::unique_ptr<CollectiveTest>> tests;
  for (Collective c : flags.collectives) tests.push_back(MakeTest(c));
  int64_t total_wrong = 0;
  const std::vector<uint64_t> sizes = MessageSizes(flags);
  for (size_t s = 0; s < sizes.size(); ++s) {
    for (const std::unique_ptr<CollectiveTest>& test : tests) {
      const size_t send_count = test->SendCount(sizes[s], flags.ranks);
      Buffers buffers(send_count, test->RecvCount(send_count, flags.ranks));
      test->Place(buffers, rank, flags.in_place);
      const size_t count = test->MessageCount(send_count, flags.ranks);
      nlohmann::json measured = nlohmann::json::array();
      for (Impl impl : flags.impls) {
        if (impl == Impl::kGloo && (!test->has_gloo() || flags.in_place)) continue;
        absl::StatusOr<Measurement> m = Measure(comms, *test, impl, buffers, flags, timeout);
        if (!m.ok()) {
          std::fprintf(stderr, "rank %d: %s %s at %zu B: %s\n", rank,
                       std::string(CollectiveName(test->collective())).c_str(),
                       std::string(ImplName(impl)).c_str(), count * sizeof(float),
                       std::string(m.status().message()).c_str());
          return 1;
        }
        total_wrong += m->wrong;
        measured.push_back(
            {{"impl", std::string(ImplName(impl))}, {"seconds", m->seconds}, {"wrong", m->wrong}});
      }
      if (rank == 0) {
        results << nlohmann::json{{"collective", std::string(CollectiveName(test->collective()))},
                                  {"count", count},
                                  {"largest", s + 1 == sizes.size()},
                                  {"measured", measured}}
                       .dump()
                << std::endl;
      }
    }
  }
  return total_wrong == 0 ? 0 : 1;
}

// ---------------------------------------------------------------------------------------------
// The first process: the limits, the ranks, the report.

// What rank 0 wrote, reported as it comes: a record per impl, and at the largest size each
// impl's busbw against the limits measured in the same run and against the other impls.
class Results {
 public:
  Results(bench::Report* report, const Flags& flags, double memcpy_gbps,
          std::optional<double> loopback_gbps)
      : report_(report),
        flags_(flags),
        memcpy_gbps_(memcpy_gbps),
        loopback_gbps_(loopback_gbps) {}

  // Reports the whole lines written to `path` since the last call.
  void Read(const std::string& path) {
    std::ifstream in(path);
    in.seekg(static_cast<std::streamoff>(consumed_));
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const size_t end = text.rfind('\n');
    if (end == std::string::npos) return;
    consumed_ += end + 1;
    for (absl::string_view line : absl::StrSplit(text.substr(0, end), '\n')) {
      Add(nlohmann::json::parse(line));
    }
  }

  // The closing notes: each collective's average busbw per impl, and every wrong element.
  void Close() {
    for (Collective c : flags_.collectives) {
      std::vector<std::string> averages;
      for (Impl impl : flags_.impls) {
        const auto it = busbw_.find({c, impl});
        if (it == busbw_.end()) continue;
        averages.push_back(absl::StrFormat("%s %.3f", ImplName(impl),
                                           it->second.first / it->second.second));
      }
      if (averages.empty()) continue;  // the ranks failed before measuring it
      report_->Note(absl::StrFormat("%s: avg busbw %s GB/s", CollectiveName(c),
                                    absl::StrJoin(averages, ", ")));
    }
    report_->Note(absl::StrCat("total #wrong: ", wrong_));
  }

 private:
  void Add(const nlohmann::json& line) {
    if (line.contains("memcpy_at_once_ms")) {
      const bench::Record at_once(
          {.op = "memcpy",
           .impl = absl::StrCat(flags_.ranks, " ranks at once"),
           .bytes = static_cast<int64_t>(flags_.max_bytes),
           .ranks = flags_.ranks,
           .stat = bench::Statistic::kBest},
          bench::Summarize(line["memcpy_at_once_ms"].get<std::vector<double>>()));
      memcpy_at_once_gbps_ = at_once.algbw_gbps().value_or(0);
      report_->Add(at_once);
      return;
    }
    const Collective c = *ParseCollective(line["collective"].get<std::string>());
    const int64_t count = line["count"].get<int64_t>();
    std::map<Impl, bench::Record> records;
    for (const nlohmann::json& m : line["measured"]) {
      const Impl impl = *ParseImpl(m["impl"].get<std::string>());
      bench::Record record({.op = std::string(CollectiveName(c)),
                            .impl = std::string(ImplName(impl)),
                            .bytes = count * static_cast<int64_t>(sizeof(float)),
                            .count = count,
                            .dtype = std::string(DataTypeName(DataType::kFloat32)),
                            .ranks = flags_.ranks,
                            .warmup = flags_.warmup,
                            .iters = flags_.iters,
                            .stat = bench::Statistic::kMean,
                            .bus_factor = BusBandwidthFactor(c, flags_.ranks)},
                           bench::Summarize({m["seconds"].get<double>() * 1e3}));
      record.Wrong(m["wrong"].get<int64_t>());
      wrong_ += m["wrong"].get<int64_t>();
      auto& [sum, rows] = busbw_[{c, impl}];
      sum += record.busbw_gbps().value_or(0);
      rows += 1;
      records.emplace(impl, std::move(record));
    }
    if (line["largest"].get<bool>()) Compare(c, records);
    for (const auto& [impl, record] : records) report_->Add(record);
  }

  // shm busbw >= 0.5x memcpy; tcp busbw >= raw Gloo's, and tcp all-reduce >= 0.7x loopback TCP.
  void Compare(Collective c, std::map<Impl, bench::Record>& records) {
    auto busbw = [&](Impl impl) {
      const auto it = records.find(impl);
      return it == records.end() ? 0.0 : it->second.busbw_gbps().value_or(0);
    };
    if (auto shm = records.find(Impl::kShm); shm != records.end()) {
      shm->second.Compare("busbw_gbps", "memcpy", memcpy_gbps_, bench::AtLeast(0.5))
          .Compare("busbw_gbps", "memcpy at once", memcpy_at_once_gbps_)
          .Compare("busbw_gbps", "shm-copy", busbw(Impl::kShmCopy))
          .Compare("busbw_gbps", "tcp", busbw(Impl::kTcp))
          .Compare("busbw_gbps", "gloo", busbw(Impl::kGloo));
    }
    if (auto copy = records.find(Impl::kShmCopy); copy != records.end()) {
      copy->second.Compare("busbw_gbps", "memcpy", memcpy_gbps_)
          .Compare("busbw_gbps", "tcp", busbw(Impl::kTcp));
    }
    if (auto tcp = records.find(Impl::kTcp); tcp != records.end()) {
      const bench::Target loopback_target =
          c == Collective::kAllReduce ? bench::AtLeast(0.7) : bench::Target{};
      tcp->second
          .Compare("busbw_gbps", "loopback TCP", loopback_gbps_.value_or(0), loopback_target)
          .Compare("busbw_gbps", "gloo", busbw(Impl::kGloo), bench::AtLeast(1));
    }
  }

  bench::Report* report_;
  const Flags& flags_;
  const double memcpy_gbps_;
  const std::optional<double> loopback_gbps_;
  double memcpy_at_once_gbps_ = 0;  // each rank's, all copying at once (the ranks measure it)
  size_t consumed_ = 0;
  std::map<std::pair<Collective, Impl>, std::pair<double, int>> busbw_;  // sum, rows
  int64_t wrong_ = 0;
};

// Starts the ranks (this program again, `run`, logging to `dir`), reports what they measure as
// they go, and waits for them all; after the first one that fails, stops the others (they would
// only wait for it until their timeout). Returns whether all exited with status 0.
bool RunRanks(const Flags& flags, const std::vector<std::string>& run, const std::string& dir,
              Results& results) {
  const std::string path = dir + "/results";
  std::vector<Process> ranks;
  for (int rank = 0; rank < flags.ranks; ++rank) {
    absl::StatusOr<Process> started = Process::Start(
        Again(run, {"--rank", absl::StrCat(rank), "--store", dir, "--results", path}),
        absl::StrCat(dir, "/rank-", rank, ".log"));
    if (!started.ok()) {
      std::fprintf(stderr, "shard-bench-collectives: %s\n",
                   std::string(started.status().message()).c_str());
      return false;  // the ranks started so far are killed with their Process
    }
    ranks.push_back(*std::move(started));
  }
  bool ok = true;
  std::vector<bool> reported(ranks.size(), false);
  for (bool running = true; running;) {
    results.Read(path);
    running = false;
    for (size_t r = 0; r < ranks.size(); ++r) {
      if (!ranks[r].Exited()) {
        running = true;
        continue;
      }
      const int code = *ranks[r].Wait(absl::ZeroDuration());
      if (code == 0 || reported[r]) continue;
      reported[r] = true;
      std::fprintf(stderr, "shard-bench-collectives: rank %zu (pid %d) exited with %d%s\n", r,
                   ranks[r].pid(), code,
                   ok ? absl::StrCat("; its log:\n", ranks[r].Log()).c_str() : "");
      if (ok) {
        for (Process& other : ranks) other.Signal(SIGTERM);
      }
      ok = false;
    }
    if (running) absl::SleepFor(absl::Milliseconds(20));
  }
  results.Read(path);
  return ok;
}

// ---------------------------------------------------------------------------------------------

int Main(int argc, char** argv) {
  CLI::App app{
      "shard-bench-collectives: collective bus bandwidth through Shard's communicators, "
      "shared memory (impl shm: CreateShmCommunicator on buffers shared with the peers, which "
      "read them in place, as the engine's buckets; impl shm-copy: the same on private "
      "buffers, copied through its slots) and TCP (impl tcp: "
      "shard::GlooCommunicator, our pipelined rings), next to raw Gloo's own collectives "
      "(impl gloo: gloo::allreduce / gloo::allgather on the same gloo::Context and TCP "
      "connections; it has no reduce-scatter here) and next to three limits measured in the "
      "same run: one thread's memcpy of the largest size; every rank's memcpy of it at once "
      "(\"memcpy N ranks at once\": the bandwidth each rank gets while all copy, which bounds a "
      "shared-memory collective where the ranks share the memory bandwidth or the cores); and "
      "raw loopback TCP (two processes, one 127.0.0.1 connection, both directions at once; "
      "reported per direction).\n"
      "Ranks are separate processes on this host. For every message size, collective and impl: "
      "warm-up iterations, a barrier, then timed iterations; time is the slowest rank's mean; "
      "outputs are checked against the closed form (#wrong counts mismatching f32 elements, "
      "summed over ranks). Columns as nccl-tests: size(B) is the whole buffer the bandwidth "
      "is about (all-reduce: the buffer; reduce-scatter: the scattered input; all-gather: the "
      "gathered output), algbw = size/time, busbw = algbw x 2(n-1)/n (all-reduce) or (n-1)/n "
      "(reduce-scatter, all-gather); GB = 1e9 B. Targets at the largest size: shm busbw >= "
      "0.5x one thread's memcpy (also compared, without a target, with the memcpy at once); "
      "tcp busbw >= raw Gloo's, and tcp all-reduce >= 0.7x loopback TCP. "
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
  app.add_option("--impls", flags.impl_names, "comma-separated: shm, shm-copy, tcp, gloo")
      ->delimiter(',')
      ->capture_default_str();
  app.add_option("--timeout", flags.timeout, "connect and per-collective timeout")
      ->capture_default_str()
      ->check(DurationValidator());
  app.add_option("--memcpy-trials", flags.memcpy_trials,
                 "memcpy trials, of one thread and of every rank at once (best kept)")
      ->capture_default_str()
      ->check(CLI::Range(1, 100));
  app.add_flag("--skip-loopback", flags.skip_loopback, "do not measure loopback TCP");
  app.add_flag("--in-place", flags.in_place,
               "in place, as the engine runs on its buckets (nccl-tests' in-place columns): "
               "all-reduce on one buffer, reduce-scatter into the rank's block of its input, "
               "all-gather from the rank's block of its output; raw Gloo is not measured");
  app.add_option("--loopback-bytes", flags.loopback_bytes,
                 "bytes each way per loopback TCP trial")
      ->capture_default_str()
      ->transform(CLI::AsSizeValue(false));
  app.add_option("--loopback-trials", flags.loopback_trials, "loopback TCP trials (best kept)")
      ->capture_default_str()
      ->check(CLI::Range(1, 100));
  // What the first process gives the ones it starts.
  app.add_option("--rank", flags.rank)->group("");
  app.add_option("--store", flags.store)->group("");
  app.add_option("--results", flags.results)->group("");
  app.add_option("--loopback-peer", flags.loopback_port)->group("");
  bench::Output output;
  bench::AddOutputOptions(app, &output);
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

  if (flags.loopback_port > 0) return RunLoopbackPeer(flags);
  if (flags.rank >= 0) return RunRank(flags);

  // The ranks and the loopback peer are this program again, with the run's own arguments.
  std::vector<std::string> run = {std::filesystem::read_symlink("/proc/self/exe").string()};
  run.insert(run.end(), argv + 1, argv + argc);
  bench::Report report("shard-bench-collectives", output);
  report.Note(absl::StrFormat(
      "%d ranks (processes) on 127.0.0.1, f32 sum, %s, warmup %d, iters %d, impls %s, "
      "tcp segment_bytes %llu, shm slot_bytes %llu x depth %d",
      flags.ranks, flags.in_place ? "in place" : "out-of-place", flags.warmup, flags.iters,
      absl::StrJoin(flags.impls, ",",
                    [](std::string* out, Impl impl) { absl::StrAppend(out, ImplName(impl)); }),
      static_cast<unsigned long long>(flags.segment_bytes),
      static_cast<unsigned long long>(flags.shm_slot_bytes), ShmOptions().depth));
  report.Note("time: the slowest rank's mean over the timed iterations; size(B): the buffer the "
              "bandwidth is about (all-reduce: the buffer; reduce-scatter: the scattered input; "
              "all-gather: the gathered output); gloo has no reduce-scatter here; at the largest "
              "size, busbw against one thread's memcpy, every rank's memcpy at once, loopback "
              "TCP per direction and the other impls");
  // One thread copying the largest size between two buffers touched beforehand.
  std::vector<char> from(flags.max_bytes, 1);
  std::vector<char> to(flags.max_bytes, 0);
  const bench::Record memcpy_record(
      {.op = "memcpy",
       .impl = "1 thread",
       .bytes = static_cast<int64_t>(flags.max_bytes),
       .stat = bench::Statistic::kBest},
      bench::Summarize(bench::TimeRuns(0, flags.memcpy_trials, [&] {
        std::memcpy(to.data(), from.data(), flags.max_bytes);
        // The copy's result must count as used.
        asm volatile("" : : "r"(to.data()) : "memory");
      })));
  from = {};
  to = {};
  report.Add(memcpy_record);

  const char* tmp = std::getenv("TMPDIR");
  std::string dir = absl::StrCat(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp",
                                 "/shard-bench-collectives.XXXXXX");
  if (::mkdtemp(dir.data()) == nullptr) {
    std::fprintf(stderr, "shard-bench-collectives: cannot create a temporary directory %s: %s\n",
                 dir.c_str(), std::strerror(errno));
    return 1;
  }
  bool ok = true;
  std::optional<double> loopback_gbps;
  if (!flags.skip_loopback) {
    absl::StatusOr<std::vector<double>> measured = MeasureLoopbackTcp(flags, run, dir);
    if (measured.ok()) {
      const bench::Record loopback({.op = "loopback_tcp",
                                    .impl = "per direction",
                                    .bytes = static_cast<int64_t>(flags.loopback_bytes),
                                    .ranks = 2,
                                    .stat = bench::Statistic::kBest},
                                   bench::Summarize(*measured));
      loopback_gbps = loopback.algbw_gbps();
      report.Add(loopback);
    } else {
      std::fprintf(stderr, "shard-bench-collectives: loopback TCP: %s\n",
                   std::string(measured.status().message()).c_str());
      ok = false;
    }
  }
  Results results(&report, flags, *memcpy_record.algbw_gbps(), loopback_gbps);
  if (!RunRanks(flags, run, dir, results)) ok = false;
  results.Close();
  std::error_code ignored;
  std::filesystem::remove_all(dir, ignored);
  return report.Finish() && ok ? 0 : 1;
}

}  // namespace
}  // namespace shard

int main(int argc, char** argv) { return shard::Main(argc, argv); }
