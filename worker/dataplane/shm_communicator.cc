#include "worker/dataplane/shm_communicator.h"

#include <dirent.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstring>
#include <fstream>
#include <map>
#include <optional>
#include <random>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/cleanup/cleanup.h"
#include "absl/functional/function_ref.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "common/host_cores.h"
#include "common/status_macros.h"
#include "worker/dataplane/reduce.h"

namespace shard {
namespace {

constexpr size_t kControlBytes = 4096;
constexpr size_t kReasonBytes = 512;
// How often a waiting rank looks at whether its peer's process still exists.
constexpr absl::Duration kLivenessInterval = absl::Milliseconds(50);
// Elements reduced per pass over the W contributions, so the partial result stays in cache.
constexpr size_t kReduceTileBytes = 32 * 1024;

static_assert(std::atomic<uint32_t>::is_always_lock_free,
              "shared-memory counters must be address-free atomics");

// A counter the peers wait on with a futex; `waiters` spares the publisher a wake-up syscall
// when nobody sleeps on it.
struct alignas(64) Counter {
  std::atomic<uint32_t> value{0};
  std::atomic<uint32_t> waiters{0};
};

// The head of each rank's segment, written by its rank and read by its peers.
struct Control {
  Counter ready;  // rounds whose data this rank has put in its slot
  Counter done;   // rounds this rank has finished reading from its peers' slots
  alignas(64) std::atomic<uint32_t> left{0};  // set once this rank aborted or went away
  int32_t pid = 0;
  uint64_t pid_namespace = 0;
  char reason[kReasonBytes] = {};  // why it left; written before `left`
};
static_assert(sizeof(Control) <= kControlBytes);

bool Reached(uint32_t value, uint32_t target) {
  return static_cast<int32_t>(value - target) >= 0;
}

long Futex(std::atomic<uint32_t>* word, int op, uint32_t value, const timespec* timeout) {
  return ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, timeout, nullptr, 0);
}

void WakeAll(Counter& counter) {
  if (counter.waiters.load() > 0) Futex(&counter.value, FUTEX_WAKE, INT_MAX, nullptr);
}

void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

uint64_t InodeOf(const char* path) {
  struct stat info {};
  return ::stat(path, &info) == 0 ? static_cast<uint64_t>(info.st_ino) : 0;
}

uint64_t PidNamespace() { return InodeOf("/proc/self/ns/pid"); }

// Whether process `pid` (of this pid namespace) has exited: gone, or a zombie not yet reaped.
bool ProcessGone(int32_t pid) {
  if (::kill(pid, 0) != 0) return errno == ESRCH;
  std::ifstream stat(absl::StrCat("/proc/", pid, "/stat"));
  std::string line;
  if (!std::getline(stat, line)) return false;
  const size_t end_of_name = line.rfind(')');
  if (end_of_name == std::string::npos || end_of_name + 2 >= line.size()) return false;
  const char state = line[end_of_name + 2];
  return state == 'Z' || state == 'X';
}

// Segment names: shard-<pid namespace>-<pid>-<random>, so that a later process can tell which
// ones belonged to processes that are gone.
std::string SegmentName(uint64_t pid_namespace) {
  std::random_device random;
  const uint64_t nonce = (uint64_t{random()} << 32) | random();
  return absl::StrFormat("/shard-%d-%d-%016x", pid_namespace, ::getpid(), nonce);
}

// Unlinks the segments of processes of this pid namespace that died before they could
// (killed between creating and every peer mapping it).
void SweepSegmentsOfGoneProcesses(uint64_t pid_namespace) {
  DIR* dir = ::opendir("/dev/shm");
  if (dir == nullptr) return;
  while (const dirent* entry = ::readdir(dir)) {
    const std::vector<std::string> parts = absl::StrSplit(entry->d_name, '-');
    uint64_t name_namespace = 0;
    int32_t pid = 0;
    if (parts.size() != 4 || parts[0] != "shard" || !absl::SimpleAtoi(parts[1], &name_namespace) ||
        !absl::SimpleAtoi(parts[2], &pid) || name_namespace != pid_namespace ||
        !ProcessGone(pid)) {
      continue;
    }
    ::shm_unlink(absl::StrCat("/", entry->d_name).c_str());
  }
  ::closedir(dir);
}

// A mapped segment, unmapped on destruction.
class Mapping {
 public:
  Mapping() = default;
  Mapping(void* base, size_t bytes) : base_(base), bytes_(bytes) {}
  Mapping(Mapping&& other) noexcept
      : base_(std::exchange(other.base_, nullptr)), bytes_(other.bytes_) {}
  Mapping& operator=(Mapping&& other) noexcept {
    if (this != &other) {
      Unmap();
      base_ = std::exchange(other.base_, nullptr);
      bytes_ = other.bytes_;
    }
    return *this;
  }
  ~Mapping() { Unmap(); }
  Control* control() const { return static_cast<Control*>(base_); }
  char* slots() const { return static_cast<char*>(base_) + kControlBytes; }
  char* data() const { return static_cast<char*>(base_); }

 private:
  void Unmap() {
    if (base_ != nullptr) ::munmap(base_, bytes_);
  }

  void* base_ = nullptr;
  size_t bytes_ = 0;
};

absl::StatusOr<Mapping> Map(int fd, size_t bytes, const std::string& what) {
  void* base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot map ", what, " (", bytes, " bytes): ", std::strerror(errno)));
  }
  return Mapping(base, bytes);
}

// Unlinks a segment's name when it goes out of scope.
class NameUnlinker {
 public:
  explicit NameUnlinker(std::string name) : name_(std::move(name)) {}
  ~NameUnlinker() { ::shm_unlink(name_.c_str()); }

 private:
  std::string name_;
};

// Maps a peer's segment `name` of `bytes` bytes.
absl::StatusOr<Mapping> MapPeerSegment(const std::string& name, size_t bytes) {
  const int fd = ::shm_open(name.c_str(), O_RDWR, 0);
  struct stat info {};
  if (fd < 0 || ::fstat(fd, &info) != 0 || static_cast<size_t>(info.st_size) != bytes) {
    const std::string why = fd < 0 ? std::strerror(errno)
                                   : absl::StrCat("it has ", info.st_size, " bytes, not ", bytes);
    if (fd >= 0) ::close(fd);
    return absl::FailedPreconditionError(absl::StrCat("/dev/shm", name, ": ", why));
  }
  absl::StatusOr<Mapping> mapped = Map(fd, bytes, absl::StrCat("/dev/shm", name));
  ::close(fd);
  return mapped;
}

size_t CeilDiv(size_t a, size_t b) { return (a + b - 1) / b; }

// The part of a block of `count` elements that round `round` carries, `per_round` at a time.
size_t PieceLength(size_t count, size_t round, size_t per_round) {
  const size_t start = round * per_round;
  return start >= count ? 0 : std::min(per_round, count - start);
}

// The collectives that read shared buffers in place, as their descriptors name them.
enum InPlaceCollective : uint32_t {
  kInPlaceReduceScatter = 1,
  kInPlaceAllGather,
  kInPlaceAllReduce,
  kInPlaceReduce,
  kInPlaceBroadcast,
};

// What a rank passes to a collective read in place: which collective, and where its buffers are
// in the buffers it shared. Written to the rank's slot in the collective's first round.
struct InPlaceDescriptor {
  uint64_t magic = 0x5348415244495051;  // "SHARDIPQ": not a slot-path round's data
  uint32_t collective = 0;
  uint32_t element_bytes = 0;
  uint64_t count = 0;
  uint64_t send_buffer = 0;  // ids of the shared buffers (0: none) and offsets in them
  uint64_t send_offset = 0;
  uint64_t recv_buffer = 0;
  uint64_t recv_offset = 0;
  uint64_t root = 0;  // of a reduce or broadcast
};

// What a rank writes to its slot in the two rounds of ShareHostBuffer.
struct ShareOffer {
  uint64_t bytes = 0;
  uint32_t ok = 0;  // round 1: this rank's segment is ready; round 2: it mapped every peer's
  char name[96] = {};
};

// A buffer shared with the peers: this rank's memory and its mappings of theirs.
struct SharedBuffer {
  uint64_t id = 0;
  const char* data = nullptr;
  size_t bytes = 0;
  std::vector<Mapping> peers;  // by rank; this rank's entry is empty
};

// Where a collective's buffer lies in a shared buffer.
struct Located {
  const SharedBuffer* buffer = nullptr;
  size_t offset = 0;
};

class ShmCommunicator final : public Communicator {
 public:
  ShmCommunicator(const ShmOptions& options, size_t slot_bytes, std::vector<Mapping> segments)
      : rank_(options.rank),
        size_(options.size),
        depth_(options.depth),
        slot_bytes_(slot_bytes),
        segments_(std::move(segments)),
        spin_(options.size <= UsableCores()),
        timeout_ms_(absl::ToInt64Milliseconds(options.timeout)) {}

  ~ShmCommunicator() override { Leave("it left the communicator"); }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  absl::string_view backend() const override { return "shm"; }

  absl::Status AllReduce(const void* send, void* recv, size_t count, DataType dtype,
                         ReduceOp op) override {
    return Run("all-reduce", [&]() -> absl::Status {
      const size_t esize = DataTypeSize(dtype);
      const char* in = static_cast<const char*>(send);
      char* out = static_cast<char*>(recv);
      if (size_ == 1 || count == 0) {
        if (in != out) std::memmove(out, in, count * esize);
        return absl::OkStatus();
      }
      const std::optional<Located> send_at = Locate(in, count * esize);
      const std::optional<Located> recv_at =
          in == out ? send_at : Locate(out, count * esize);
      if (send_at.has_value() && recv_at.has_value()) {
        return AllReduceInPlace(*send_at, *recv_at, in, out, count, dtype, op);
      }
      // A slot holds one piece of every block (the contributions) and one reduced piece.
      const size_t per_round = PieceElements(esize, size_ + 1);
      const std::vector<Block> blocks = BalancedBlocks(size_, count);
      const size_t reduce_rounds = CeilDiv(blocks[0].count, per_round);
      const size_t result_offset = size_ * per_round * esize;
      const Block& own = blocks[rank_];
      for (size_t j = 0; j <= reduce_rounds; ++j) {
        SHARD_RETURN_IF_ERROR(AwaitSlotFree());
        char* slot = Slot(rank_);
        if (j < reduce_rounds) {
          for (int b = 0; b < size_; ++b) {
            if (b == rank_) continue;
            std::memcpy(slot + b * per_round * esize,
                        in + (blocks[b].offset + j * per_round) * esize,
                        PieceLength(blocks[b].count, j, per_round) * esize);
          }
        }
        if (j > 0) {
          std::memcpy(slot + result_offset, out + (own.offset + (j - 1) * per_round) * esize,
                      PieceLength(own.count, j - 1, per_round) * esize);
        }
        Publish();
        SHARD_RETURN_IF_ERROR(AwaitEveryPeer());
        if (j < reduce_rounds) {
          const size_t start = (own.offset + j * per_round) * esize;
          ReduceChain(dtype, op, out + start, PieceLength(own.count, j, per_round), rank_,
                      [&](int r) -> const char* {
                        return r == rank_ ? in + start : Slot(r) + rank_ * per_round * esize;
                      });
        }
        if (j > 0) {
          for (int p = 0; p < size_; ++p) {
            if (p == rank_) continue;
            std::memcpy(out + (blocks[p].offset + (j - 1) * per_round) * esize,
                        Slot(p) + result_offset,
                        PieceLength(blocks[p].count, j - 1, per_round) * esize);
          }
        }
        FinishRound();
      }
      return absl::OkStatus();
    });
  }

  absl::Status ReduceScatter(const void* send, void* recv, size_t recv_count, DataType dtype,
                             ReduceOp op) override {
    return Run("reduce-scatter", [&]() -> absl::Status {
      const size_t esize = DataTypeSize(dtype);
      const char* in = static_cast<const char*>(send);
      char* out = static_cast<char*>(recv);
      if (size_ == 1) {
        std::memmove(out, in, recv_count * esize);
        return absl::OkStatus();
      }
      if (const std::optional<Located> send_at = Locate(in, size_ * recv_count * esize)) {
        return ReduceScatterInPlace(*send_at, in, out, recv_count, dtype, op);
      }
      const size_t per_round = PieceElements(esize, size_);
      for (size_t j = 0; j < CeilDiv(recv_count, per_round); ++j) {
        const size_t length = PieceLength(recv_count, j, per_round);
        SHARD_RETURN_IF_ERROR(AwaitSlotFree());
        char* slot = Slot(rank_);
        for (int b = 0; b < size_; ++b) {
          if (b == rank_) continue;
          std::memcpy(slot + b * per_round * esize, in + (b * recv_count + j * per_round) * esize,
                      length * esize);
        }
        Publish();
        SHARD_RETURN_IF_ERROR(AwaitEveryPeer());
        const char* own = in + (rank_ * recv_count + j * per_round) * esize;
        ReduceChain(dtype, op, out + j * per_round * esize, length, rank_,
                    [&](int r) -> const char* {
                      return r == rank_ ? own : Slot(r) + rank_ * per_round * esize;
                    });
        FinishRound();
      }
      return absl::OkStatus();
    });
  }

  absl::Status AllGather(const void* send, void* recv, size_t send_count,
                         DataType dtype) override {
    return Run("all-gather", [&]() -> absl::Status {
      const size_t esize = DataTypeSize(dtype);
      char* out = static_cast<char*>(recv);
      char* own = out + rank_ * send_count * esize;
      const char* in = static_cast<const char*>(send);
      if (size_ == 1) {
        if (own != in) std::memmove(own, in, send_count * esize);
        return absl::OkStatus();
      }
      if (const std::optional<Located> send_at = Locate(in, send_count * esize)) {
        return AllGatherInPlace(*send_at, in, out, send_count, dtype);
      }
      const size_t per_round = PieceElements(esize, 1);
      for (size_t j = 0; j < CeilDiv(send_count, per_round); ++j) {
        const size_t bytes = PieceLength(send_count, j, per_round) * esize;
        const size_t start = j * per_round * esize;
        SHARD_RETURN_IF_ERROR(AwaitSlotFree());
        std::memcpy(Slot(rank_), in + start, bytes);
        // Out of place, this rank's own piece is copied from the slot, still in cache, rather
        // than read from memory a second time.
        if (own != in) std::memcpy(own + start, Slot(rank_), bytes);
        Publish();
        SHARD_RETURN_IF_ERROR(AwaitEveryPeer());
        for (int p = 0; p < size_; ++p) {
          if (p != rank_) std::memcpy(out + p * send_count * esize + start, Slot(p), bytes);
        }
        FinishRound();
      }
      return absl::OkStatus();
    });
  }

  absl::Status Reduce(const void* send, void* recv, size_t count, DataType dtype, ReduceOp op,
                      int root) override {
    SHARD_RETURN_IF_ERROR(CheckRoot("reduce", root));
    return Run("reduce", [&]() -> absl::Status {
      const size_t esize = DataTypeSize(dtype);
      const char* in = static_cast<const char*>(send);
      char* out = static_cast<char*>(recv);
      if (size_ == 1) {
        if (in != out) std::memmove(out, in, count * esize);
        return absl::OkStatus();
      }
      if (const std::optional<Located> send_at = Locate(in, count * esize)) {
        SHARD_RETURN_IF_ERROR(
            AgreeInPlace("reduce", kInPlaceReduce, esize, count, *send_at, in, nullptr, nullptr,
                         root));
        // The root reduces straight from every rank's buffer.
        if (rank_ == root) {
          ReduceChain(dtype, op, out, count, root,
                      [&](int r) -> const char* { return peer_send_[r]; });
        }
        FinishRound();
        return AwaitPeersDone();
      }
      const size_t per_round = PieceElements(esize, 1);
      for (size_t j = 0; j < CeilDiv(count, per_round); ++j) {
        const size_t length = PieceLength(count, j, per_round);
        const size_t start = j * per_round * esize;
        if (rank_ != root) {
          SHARD_RETURN_IF_ERROR(AwaitSlotFree());
          std::memcpy(Slot(rank_), in + start, length * esize);
        }
        Publish();
        if (rank_ == root) {
          SHARD_RETURN_IF_ERROR(AwaitEveryPeer());
          ReduceChain(dtype, op, out + start, length, root, [&](int r) -> const char* {
            return r == root ? in + start : Slot(r);
          });
        }
        FinishRound();
      }
      return absl::OkStatus();
    });
  }

  absl::Status Broadcast(void* buffer, size_t count, DataType dtype, int root) override {
    SHARD_RETURN_IF_ERROR(CheckRoot("broadcast", root));
    return Run("broadcast", [&]() -> absl::Status {
      if (size_ == 1) return absl::OkStatus();
      const size_t esize = DataTypeSize(dtype);
      char* data = static_cast<char*>(buffer);
      if (const std::optional<Located> at = Locate(data, count * esize)) {
        SHARD_RETURN_IF_ERROR(
            AgreeInPlace("broadcast", kInPlaceBroadcast, esize, count, *at, data, nullptr,
                         nullptr, root));
        // Every other rank copies straight from the root's buffer.
        if (rank_ != root) std::memcpy(data, peer_send_[root], count * esize);
        FinishRound();
        return AwaitPeersDone();
      }
      const size_t per_round = PieceElements(esize, 1);
      for (size_t j = 0; j < CeilDiv(count, per_round); ++j) {
        const size_t bytes = PieceLength(count, j, per_round) * esize;
        const size_t start = j * per_round * esize;
        if (rank_ == root) {
          SHARD_RETURN_IF_ERROR(AwaitSlotFree());
          std::memcpy(Slot(rank_), data + start, bytes);
        }
        Publish();
        if (rank_ != root) {
          SHARD_RETURN_IF_ERROR(AwaitPublished(root));
          std::memcpy(data + start, Slot(root), bytes);
        }
        FinishRound();
      }
      return absl::OkStatus();
    });
  }

  absl::Status Barrier() override {
    int64_t token = 0;
    return AllReduce(&token, &token, 1, DataType::kInt64, ReduceOp::kSum);
  }

  absl::StatusOr<std::unique_ptr<SharedHostBuffer>> ShareHostBuffer(void* data,
                                                                    size_t bytes) override {
    absl::StatusOr<std::unique_ptr<SharedHostBuffer>> shared;
    absl::Status status = Run("sharing a buffer", [&]() -> absl::Status {
      shared = Share(static_cast<char*>(data), bytes);
      // A rank that could not share fails every rank's call alike; the rounds stayed in step.
      return shared.ok() || absl::IsResourceExhausted(shared.status()) ? absl::OkStatus()
                                                                      : shared.status();
    });
    if (!status.ok()) return status;
    return shared;
  }

  void SetCollectiveTimeout(absl::Duration timeout) override {
    timeout_ms_.store(absl::ToInt64Milliseconds(timeout));
  }

  void Abort(absl::string_view reason) override {
    {
      absl::MutexLock lock(&mu_);
      if (!abort_reason_.empty()) return;
      abort_reason_ = reason.empty() ? "aborted" : std::string(reason);
      aborted_.store(true);
    }
    Leave(absl::StrCat("it aborted: ", reason.empty() ? "aborted" : reason));
  }

  bool aborted() const override { return aborted_.load(); }

 private:

  class SharedHandle final : public SharedHostBuffer {
   public:
    SharedHandle(ShmCommunicator* communicator, uint64_t id)
        : communicator_(communicator), id_(id) {}
    ~SharedHandle() override {
      absl::MutexLock lock(&communicator_->shared_mu_);
      communicator_->shared_.erase(id_);
    }

   private:
    ShmCommunicator* const communicator_;
    const uint64_t id_;
  };

  // The shared buffer that holds [data, data + bytes) whole, if any.
  std::optional<Located> Locate(const void* data, size_t bytes) const {
    const char* at = static_cast<const char*>(data);
    absl::MutexLock lock(&shared_mu_);
    for (const auto& [id, buffer] : shared_) {
      if (at >= buffer->data && at + bytes <= buffer->data + buffer->bytes) {
        return Located{buffer.get(), static_cast<size_t>(at - buffer->data)};
      }
    }
    return std::nullopt;
  }

  // Where rank `peer`'s buffer `id`, at `offset`, is mapped in this process.
  absl::StatusOr<const char*> PeerAddress(int peer, uint64_t id, uint64_t offset) const {
    absl::MutexLock lock(&shared_mu_);
    const auto found = shared_.find(id);
    if (found == shared_.end() || offset > found->second->bytes) {
      return absl::InternalError(absl::StrCat("rank ", peer, " passed shared buffer ", id,
                                              " at ", offset, ", which this rank does not "
                                              "share: a bug, report it"));
    }
    return found->second->peers[peer].data() + offset;
  }

  // The first round of a collective read in place, once this rank's data is in place: every
  // rank publishes what it passes and checks that its peers run the same collective. Sets
  // peer_send_ and peer_recv_: where each rank's buffers are mapped in this process (this
  // rank's own pointers for itself).
  absl::Status AgreeInPlace(absl::string_view what, InPlaceCollective collective,
                            size_t element_bytes,
                            size_t count, const Located& send_at, const char* send,
                            const Located* recv_at = nullptr, const char* recv = nullptr,
                            int root = 0) {
    InPlaceDescriptor own;
    own.root = static_cast<uint64_t>(root);
    own.collective = collective;
    own.element_bytes = static_cast<uint32_t>(element_bytes);
    own.count = count;
    own.send_buffer = send_at.buffer->id;
    own.send_offset = send_at.offset;
    if (recv_at != nullptr) {
      own.recv_buffer = recv_at->buffer->id;
      own.recv_offset = recv_at->offset;
    }
    SHARD_RETURN_IF_ERROR(AwaitSlotFree());
    std::memcpy(Slot(rank_), &own, sizeof(own));
    Publish();
    SHARD_RETURN_IF_ERROR(AwaitEveryPeer());
    peer_send_.assign(size_, send);
    peer_recv_.assign(size_, recv);
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      InPlaceDescriptor theirs;
      std::memcpy(&theirs, Slot(p), sizeof(theirs));
      if (theirs.magic != own.magic || theirs.collective != own.collective ||
          theirs.element_bytes != own.element_bytes || theirs.count != own.count ||
          theirs.root != own.root) {
        return absl::InternalError(absl::StrCat(
            "rank ", p, " did not pass shared buffers of the same size to this ", what,
            " (a rank that shares a buffer its peers do not, or collectives issued in another "
            "order): a bug, report it"));
      }
      SHARD_ASSIGN_OR_RETURN(peer_send_[p],
                             PeerAddress(p, theirs.send_buffer, theirs.send_offset));
      if (theirs.recv_buffer != 0) {
        SHARD_ASSIGN_OR_RETURN(peer_recv_[p],
                               PeerAddress(p, theirs.recv_buffer, theirs.recv_offset));
      }
    }
    return absl::OkStatus();
  }

  // After this rank's last round of a collective read in place: its peers have finished
  // reading this rank's buffers, which the caller may change once the collective returns.
  absl::Status AwaitPeersDone() {
    for (int p = 0; p < size_; ++p) {
      if (p != rank_) SHARD_RETURN_IF_ERROR(WaitFor(p, control(p).done, round_));
    }
    return absl::OkStatus();
  }

  absl::Status ReduceScatterInPlace(const Located& send_at, const char* in, char* out,
                                    size_t recv_count, DataType dtype, ReduceOp op) {
    const size_t esize = DataTypeSize(dtype);
    SHARD_RETURN_IF_ERROR(AgreeInPlace("reduce-scatter", kInPlaceReduceScatter, esize,
                                       recv_count, send_at, in));
    const size_t block = rank_ * recv_count * esize;
    ReduceChain(dtype, op, out, recv_count, rank_,
                [&](int r) -> const char* { return peer_send_[r] + block; });
    FinishRound();
    return AwaitPeersDone();
  }

  absl::Status AllGatherInPlace(const Located& send_at, const char* in, char* out,
                                size_t send_count, DataType dtype) {
    const size_t esize = DataTypeSize(dtype);
    const size_t bytes = send_count * esize;
    SHARD_RETURN_IF_ERROR(
        AgreeInPlace("all-gather", kInPlaceAllGather, esize, send_count, send_at, in));
    for (int p = 0; p < size_; ++p) {
      char* to = out + p * bytes;
      if (to != peer_send_[p]) std::memcpy(to, peer_send_[p], bytes);
    }
    FinishRound();
    return AwaitPeersDone();
  }

  // Round 1: each rank reduces its block straight from its peers' send buffers into its recv
  // buffer; round 2: each copies its peers' reduced blocks from their recv buffers.
  absl::Status AllReduceInPlace(const Located& send_at, const Located& recv_at, const char* in,
                                char* out, size_t count, DataType dtype, ReduceOp op) {
    const size_t esize = DataTypeSize(dtype);
    SHARD_RETURN_IF_ERROR(
        AgreeInPlace("all-reduce", kInPlaceAllReduce, esize, count, send_at, in, &recv_at, out));
    const std::vector<Block> blocks = BalancedBlocks(size_, count);
    const size_t start = blocks[rank_].offset * esize;
    ReduceChain(dtype, op, out + start, blocks[rank_].count, rank_,
                [&](int r) -> const char* { return peer_send_[r] + start; });
    FinishRound();
    Publish();
    SHARD_RETURN_IF_ERROR(AwaitEveryPeer());
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      const size_t at = blocks[p].offset * esize;
      std::memcpy(out + at, peer_recv_[p] + at, blocks[p].count * esize);
    }
    FinishRound();
    return AwaitPeersDone();
  }

  // ShareHostBuffer's two rounds. Round 1: each rank moves its buffer's pages into a segment
  // of its own and offers its name; round 2: each says whether it mapped every peer's. Only
  // then do the names go and the buffer count as shared, on every rank or on none.
  absl::StatusOr<std::unique_ptr<SharedHostBuffer>> Share(char* data, size_t bytes) {
    const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
    std::string why_not;
    if (reinterpret_cast<uintptr_t>(data) % page != 0 || bytes == 0 || bytes % page != 0) {
      why_not = absl::StrCat("its buffer of ", bytes, " bytes at ", absl::Hex(data),
                             " is not whole pages");
    }
    ShareOffer offer;
    offer.bytes = bytes;
    int fd = -1;
    const std::string name = SegmentName(pid_namespace_);
    if (why_not.empty()) {
      fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
      if (fd < 0) {
        why_not = absl::StrCat("cannot create /dev/shm", name, ": ", std::strerror(errno));
      } else if (const int error = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes));
                 error != 0) {
        why_not = absl::StrCat("/dev/shm has no room for ", bytes, " bytes (",
                               std::strerror(error), ")");
      }
    }
    NameUnlinker unlink_when_done(name);
    const auto close_fd = absl::MakeCleanup([&] {
      if (fd >= 0) ::close(fd);
    });
    offer.ok = why_not.empty() ? 1 : 0;
    std::memcpy(offer.name, name.data(), std::min(name.size(), sizeof(offer.name) - 1));

    auto shared = std::make_unique<SharedBuffer>();
    shared->data = data;
    shared->bytes = bytes;
    shared->peers.resize(size_);
    bool everyone = true;
    for (int exchange = 0; exchange < 2; ++exchange) {
      SHARD_RETURN_IF_ERROR(AwaitSlotFree());
      std::memcpy(Slot(rank_), &offer, sizeof(offer));
      Publish();
      SHARD_RETURN_IF_ERROR(AwaitEveryPeer());
      for (int p = 0; p < size_; ++p) {
        ShareOffer theirs;
        std::memcpy(&theirs, Slot(p), sizeof(theirs));
        if (theirs.ok == 0 || theirs.bytes != bytes) everyone = false;
        if (exchange == 1 || p == rank_ || !everyone || !why_not.empty()) continue;
        theirs.name[sizeof(theirs.name) - 1] = '\0';
        absl::StatusOr<Mapping> mapped = MapPeerSegment(theirs.name, bytes);
        if (mapped.ok()) {
          shared->peers[p] = std::move(*mapped);
        } else {
          why_not = absl::StrCat("cannot map rank ", p, "'s: ", mapped.status().message());
        }
      }
      FinishRound();
      offer.ok = why_not.empty() && everyone ? 1 : 0;
    }
    if (!everyone || !why_not.empty()) {
      return absl::ResourceExhaustedError(
          why_not.empty() ? "a peer could not share its buffer (its log says why)"
                          : absl::StrCat("rank ", rank_, " could not share its buffer: ",
                                         why_not));
    }
    // Every peer has mapped the segment: this rank's pages move into it, at the same address.
    void* segment = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (segment == MAP_FAILED) {
      return absl::InternalError(absl::StrCat("cannot map this rank's own shared buffer: ",
                                              std::strerror(errno)));
    }
    std::memcpy(segment, data, bytes);
    ::munmap(segment, bytes);
    if (::mmap(data, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0) == MAP_FAILED) {
      return absl::InternalError(absl::StrCat("cannot put this rank's buffer in shared memory: ",
                                              std::strerror(errno)));
    }
    absl::MutexLock lock(&shared_mu_);
    shared->id = next_shared_id_++;
    const uint64_t id = shared->id;
    shared_.emplace(id, std::move(shared));
    return std::unique_ptr<SharedHostBuffer>(std::make_unique<SharedHandle>(this, id));
  }

  // Elements of each of `pieces` pieces that fit one slot, a multiple of a cache line.
  size_t PieceElements(size_t esize, int pieces) const {
    const size_t line = std::max<size_t>(1, 64 / esize);
    const size_t fit = slot_bytes_ / (static_cast<size_t>(pieces) * esize);
    return std::max<size_t>(1, fit >= line ? fit - fit % line : fit);
  }

  Control& control(int r) const { return *segments_[r].control(); }

  // Rank r's slot of the round in progress.
  char* Slot(int r) const { return segments_[r].slots() + (round_ % depth_) * slot_bytes_; }

  // Before this rank writes its slot again: every peer has read what the slot held last, in
  // round (round_ - depth_).
  absl::Status AwaitSlotFree() {
    if (round_ < static_cast<uint64_t>(depth_)) return absl::OkStatus();
    const uint32_t target = static_cast<uint32_t>(round_ - depth_ + 1);
    for (int p = 0; p < size_; ++p) {
      if (p != rank_) SHARD_RETURN_IF_ERROR(WaitFor(p, control(p).done, target));
    }
    return absl::OkStatus();
  }

  void Publish() {
    Counter& ready = control(rank_).ready;
    ready.value.store(static_cast<uint32_t>(round_ + 1));
    WakeAll(ready);
  }

  absl::Status AwaitPublished(int peer) {
    return WaitFor(peer, control(peer).ready, static_cast<uint32_t>(round_ + 1));
  }

  absl::Status AwaitEveryPeer() {
    for (int p = 0; p < size_; ++p) {
      if (p != rank_) SHARD_RETURN_IF_ERROR(AwaitPublished(p));
    }
    return absl::OkStatus();
  }

  void FinishRound() {
    Counter& done = control(rank_).done;
    done.value.store(static_cast<uint32_t>(round_ + 1));
    WakeAll(done);
    ++round_;
  }

  // out = the ranks' contributions combined in the TCP ring's order: starting with the rank
  // after `owner`, each next rank's added to the partial result, `owner`'s last. Done a tile at
  // a time so the partial result stays in cache.
  void ReduceChain(DataType dtype, ReduceOp op, char* out, size_t count, int owner,
                   absl::FunctionRef<const char*(int)> source) {
    const size_t esize = DataTypeSize(dtype);
    const size_t tile = std::max<size_t>(1, kReduceTileBytes / esize);
    const auto ring = [&](int k) { return (owner + k) % size_; };
    for (size_t start = 0; start < count; start += tile) {
      const size_t n = std::min(tile, count - start);
      const size_t at = start * esize;
      char* to = out + at;
      // The owner's contribution comes last; if it is the output itself (in place), keep it.
      const char* last = source(owner) + at;
      if (size_ > 2 && last < to + n * esize && to < last + n * esize) {
        scratch_.assign(last, last + n * esize);
        last = scratch_.data();
      }
      if (size_ == 2) {
        ReduceBuffers(dtype, op, to, source(ring(1)) + at, last, n);
        continue;
      }
      ReduceBuffers(dtype, op, to, source(ring(1)) + at, source(ring(2)) + at, n);
      for (int k = 3; k < size_; ++k) ReduceBuffers(dtype, op, to, to, source(ring(k)) + at, n);
      ReduceBuffers(dtype, op, to, to, last, n);
    }
  }

  // Waits until `counter` of `peer` reaches `target`; see the header for how a wait ends
  // otherwise.
  absl::Status WaitFor(int peer, Counter& counter, uint32_t target) {
    if (Reached(counter.value.load(), target)) return absl::OkStatus();
    if (spin_) {
      for (int i = 0; i < 2000; ++i) {
        CpuRelax();
        if (Reached(counter.value.load(), target)) return absl::OkStatus();
      }
    }
    const absl::Duration timeout = absl::Milliseconds(timeout_ms_.load());
    const absl::Time deadline = absl::Now() + timeout;
    const Control& other = control(peer);
    while (true) {
      if (aborted_.load()) return AbortedStatus();
      // A peer publishes before it leaves: what it published before leaving still counts.
      if (other.left.load() != 0 && !Reached(counter.value.load(), target)) {
        return absl::UnavailableError(absl::StrCat(
            "rank ", peer, " left the collective: ",
            std::string(other.reason, strnlen(other.reason, kReasonBytes))));
      }
      counter.waiters.fetch_add(1);
      const uint32_t seen = counter.value.load();
      if (!Reached(seen, target)) {
        const absl::Duration slice = std::min(kLivenessInterval, deadline - absl::Now());
        const timespec wait = absl::ToTimespec(std::max(slice, absl::ZeroDuration()));
        Futex(&counter.value, FUTEX_WAIT, seen, &wait);
      }
      counter.waiters.fetch_sub(1);
      if (Reached(counter.value.load(), target)) return absl::OkStatus();
      if (other.pid_namespace == pid_namespace_ && other.pid != ::getpid() &&
          ProcessGone(other.pid)) {
        return absl::UnavailableError(absl::StrCat("rank ", peer, " (process ", other.pid,
                                                   ") is gone: it was killed or exited"));
      }
      if (absl::Now() >= deadline) {
        return absl::DeadlineExceededError(absl::StrCat(
            "rank ", peer, " did not respond within ", absl::FormatDuration(timeout)));
      }
    }
  }

  // Tells the peers this rank will not come (they fail at once) and wakes them, and this
  // rank's own thread if it waits on one of them.
  void Leave(const std::string& why) {
    Control& own = control(rank_);
    if (own.left.load() != 0) return;
    const std::string reason = absl::StrCat("rank ", rank_, ": ", why);
    std::memcpy(own.reason, reason.data(), std::min(reason.size(), kReasonBytes - 1));
    own.left.store(1);
    for (int r = 0; r < size_; ++r) {
      Futex(&control(r).ready.value, FUTEX_WAKE, INT_MAX, nullptr);
      Futex(&control(r).done.value, FUTEX_WAKE, INT_MAX, nullptr);
    }
  }

  absl::Status CheckRoot(absl::string_view what, int root) const {
    if (root >= 0 && root < size_) return absl::OkStatus();
    return absl::InvalidArgumentError(
        absl::StrCat(what, " root ", root, " is not a rank of this world of ", size_));
  }

  absl::Status AbortedStatus() const {
    absl::MutexLock lock(&mu_);
    return absl::AbortedError(absl::StrCat("communicator aborted: ", abort_reason_));
  }

  // Runs one collective: refuses if aborted, and aborts after any failure (the rounds are out
  // of step from then on).
  template <typename Fn>
  absl::Status Run(absl::string_view what, Fn&& fn) {
    if (aborted_.load()) {
      absl::MutexLock lock(&mu_);
      return absl::AbortedError(
          absl::StrCat(what, " refused: communicator aborted: ", abort_reason_));
    }
    absl::Status status = fn();
    if (status.ok()) return status;
    if (aborted_.load() && !absl::IsAborted(status)) status = AbortedStatus();
    status = absl::Status(status.code(), absl::StrCat(what, " on rank ", rank_, " of ", size_,
                                                      " failed: ", status.message()));
    Abort(status.message());
    return status;
  }

  const int rank_;
  const int size_;
  const int depth_;
  const size_t slot_bytes_;
  const std::vector<Mapping> segments_;  // every rank's, this rank's included
  const bool spin_;  // a usable core per rank (affinity, container quota): spin briefly first
  const uint64_t pid_namespace_ = PidNamespace();
  uint64_t round_ = 0;  // rounds this rank has started, the same on every rank between calls
  std::vector<char> scratch_;
  // Every rank's buffers of the collective read in place that is running, by rank.
  std::vector<const char*> peer_send_;
  std::vector<const char*> peer_recv_;
  mutable absl::Mutex shared_mu_;
  // Buffers shared by ShareHostBuffer, by id: the same ids on every rank.
  std::map<uint64_t, std::unique_ptr<SharedBuffer>> shared_ ABSL_GUARDED_BY(shared_mu_);
  uint64_t next_shared_id_ ABSL_GUARDED_BY(shared_mu_) = 1;
  std::atomic<int64_t> timeout_ms_;
  std::atomic<bool> aborted_{false};
  mutable absl::Mutex mu_;
  std::string abort_reason_ ABSL_GUARDED_BY(mu_);
};

std::string ReadFirstLine(const char* path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

}  // namespace

std::string SharedMemoryDomain() {
  struct stat shm {};
  const bool has_shm = ::stat("/dev/shm", &shm) == 0;
  return absl::StrCat("boot ", ReadFirstLine("/proc/sys/kernel/random/boot_id"), ", /dev/shm ",
                      has_shm ? absl::StrCat(shm.st_dev, ":", shm.st_ino) : "absent",
                      ", network namespace ", InodeOf("/proc/self/ns/net"));
}

absl::StatusOr<std::unique_ptr<Communicator>> CreateShmCommunicator(KeyValueStore* store,
                                                                    const ShmOptions& options) {
  if (options.size < 1 || options.rank < 0 || options.rank >= options.size) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", options.rank, " is not in a world of size ", options.size));
  }
  if (options.depth < 1 || options.slot_bytes < 64) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shared-memory slots of ", options.slot_bytes, " bytes, ", options.depth,
        " deep: a slot needs at least 64 bytes and a segment at least one slot"));
  }
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  const size_t slot_bytes = CeilDiv(options.slot_bytes, page) * page;
  const size_t bytes = kControlBytes + slot_bytes * options.depth;
  const uint64_t pid_namespace = PidNamespace();
  const std::string where = absl::StrCat("rank ", options.rank, " of ", options.size);
  SweepSegmentsOfGoneProcesses(pid_namespace);

  const std::string name = SegmentName(pid_namespace);
  const int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(where, ": cannot create shared-memory segment /dev/shm", name, ": ",
                     std::strerror(errno), "; use --transport tcp"));
  }
  NameUnlinker unlink_when_done(name);
  if (const int error = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes)); error != 0) {
    ::close(fd);
    return absl::ResourceExhaustedError(absl::StrCat(
        where, ": /dev/shm has no room for this rank's ", bytes, "-byte segment (",
        std::strerror(error),
        "): enlarge /dev/shm (on Kubernetes, a memory-backed emptyDir there) or use "
        "--transport tcp"));
  }
  absl::StatusOr<Mapping> own = Map(fd, bytes, "this rank's shared-memory segment");
  ::close(fd);
  if (!own.ok()) return own.status();
  Control* control = new (own->control()) Control();
  control->pid = static_cast<int32_t>(::getpid());
  control->pid_namespace = pid_namespace;

  const auto key = [&](absl::string_view kind, int rank) {
    return absl::StrCat(options.key_prefix, kind, "/", rank);
  };
  const auto every_rank = [&](absl::string_view kind) {
    std::vector<std::string> keys;
    for (int r = 0; r < options.size; ++r) keys.push_back(key(kind, r));
    return keys;
  };
  SHARD_RETURN_IF_ERROR(store->Set(key("segment", options.rank), name));
  if (absl::Status arrived = store->Wait(every_rank("segment"), options.timeout); !arrived.ok()) {
    return absl::Status(arrived.code(), absl::StrCat(where, ": waiting for the peers' shared-"
                                                            "memory segments: ",
                                                     arrived.message()));
  }
  std::vector<Mapping> segments;
  for (int r = 0; r < options.size; ++r) {
    if (r == options.rank) {
      segments.push_back(std::move(*own));
      continue;
    }
    SHARD_ASSIGN_OR_RETURN(const std::string peer_name, store->Get(key("segment", r)));
    absl::StatusOr<Mapping> mapped = MapPeerSegment(peer_name, bytes);
    if (!mapped.ok()) {
      return absl::Status(
          mapped.status().code(),
          absl::StrCat(where, ": cannot use rank ", r, "'s shared-memory segment ",
                       mapped.status().message(), " (different slot options?). Is rank ", r,
                       " on another host or in another /dev/shm? Use --transport tcp"));
    }
    segments.push_back(std::move(*mapped));
  }
  // Every rank mapped every segment: the names can go (the mappings keep the memory).
  SHARD_RETURN_IF_ERROR(store->Set(key("mapped", options.rank), "1"));
  if (absl::Status mapped = store->Wait(every_rank("mapped"), options.connect_timeout);
      !mapped.ok()) {
    return absl::Status(mapped.code(), absl::StrCat(where, ": waiting for the peers to map the "
                                                           "shared-memory segments: ",
                                                    mapped.message()));
  }
  return std::unique_ptr<Communicator>(
      std::make_unique<ShmCommunicator>(options, slot_bytes, std::move(segments)));
}

}  // namespace shard
