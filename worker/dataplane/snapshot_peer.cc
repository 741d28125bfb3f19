#include "worker/dataplane/snapshot_peer.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <list>
#include <optional>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/fault.h"
#include "common/shard_hasher.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"

namespace shard {
namespace {

constexpr uint32_t kRequestMagic = 0x51524853;   // "SHRQ"
constexpr uint32_t kResponseMagic = 0x53524853;  // "SHRS"
constexpr uint32_t kFetch = 1;
constexpr uint32_t kPush = 2;
// A push from this host: the pusher passes its buffer's memory file, and the server keeps the
// same pages.
constexpr uint32_t kSameHostPush = 3;
// A replica is checked block by block: every byte is in a block, so the whole shard's hash would
// add a second pass over the bytes and no check.
constexpr ShardHasher::Sums kReplicaSums = ShardHasher::Sums::kBlocksOnly;
constexpr uint32_t kMaxHeaderBytes = 16 << 20;  // a shard's description: its block checksums
// How often a blocked call looks at its cancel flag.
constexpr absl::Duration kPollSlice = absl::Milliseconds(100);
// A connection the server serves must deliver its header within this.
constexpr absl::Duration kHeaderTimeout = absl::Seconds(30);

absl::Status ErrnoStatus(absl::string_view what, int err) {
  return absl::UnavailableError(absl::StrCat(what, ": ", std::strerror(err)));
}

// A socket or file descriptor, closed when it goes out of scope.
class Descriptor {
 public:
  explicit Descriptor(int fd = -1) : fd_(fd) {}
  Descriptor(Descriptor&& other) noexcept : fd_(other.fd_) { other.fd_ = -1; }
  Descriptor& operator=(Descriptor&& other) noexcept {
    std::swap(fd_, other.fd_);
    return *this;
  }
  ~Descriptor() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }
  int release() { return std::exchange(fd_, -1); }

 private:
  int fd_;
};

// Where a blocking call must end, and what can end it early.
struct Limit {
  absl::Time deadline;
  const std::atomic<bool>* cancel = nullptr;
  const char* what = "";  // for errors: "fetching from 10.0.0.3:41000"
};

// Waits until `fd` is ready for `events`, in slices, honouring the limit.
absl::Status WaitReady(int fd, short events, const Limit& limit) {
  while (true) {
    if (limit.cancel != nullptr && limit.cancel->load()) {
      return absl::CancelledError(absl::StrCat(limit.what, ": cancelled"));
    }
    const absl::Duration left = limit.deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      return absl::DeadlineExceededError(absl::StrCat(limit.what, ": timed out"));
    }
    pollfd p{fd, events, 0};
    const int ready = ::poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(
                                        std::min(left, kPollSlice)) + 1));
    if (ready < 0 && errno != EINTR) return ErrnoStatus(limit.what, errno);
    if (ready > 0) return absl::OkStatus();
  }
}

absl::Status SendAll(int fd, const void* data, uint64_t bytes, const Limit& limit) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::send(fd, p, std::min<uint64_t>(bytes, 64 << 20), MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) return ErrnoStatus(limit.what, errno);
      SHARD_RETURN_IF_ERROR(WaitReady(fd, POLLOUT, limit));
      continue;
    }
    p += n;
    bytes -= static_cast<uint64_t>(n);
  }
  return absl::OkStatus();
}

absl::Status RecvAll(int fd, void* out, uint64_t bytes, const Limit& limit) {
  char* p = static_cast<char*>(out);
  while (bytes > 0) {
    const ssize_t n = ::recv(fd, p, std::min<uint64_t>(bytes, 64 << 20), 0);
    if (n == 0) {
      return absl::UnavailableError(
          absl::StrCat(limit.what, ": the peer closed the connection ", bytes, " bytes short"));
    }
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) return ErrnoStatus(limit.what, errno);
      SHARD_RETURN_IF_ERROR(WaitReady(fd, POLLIN, limit));
      continue;
    }
    p += n;
    bytes -= static_cast<uint64_t>(n);
  }
  return absl::OkStatus();
}

absl::Status SendFrame(int fd, uint32_t magic, uint32_t code, const std::string& text,
                       const Limit& limit) {
  const uint32_t head[3] = {magic, code, static_cast<uint32_t>(text.size())};
  SHARD_RETURN_IF_ERROR(SendAll(fd, head, sizeof(head), limit));
  return SendAll(fd, text.data(), text.size(), limit);
}

// A frame's code and text; InvalidArgument if it is not one of ours.
absl::StatusOr<std::pair<uint32_t, std::string>> RecvFrame(int fd, uint32_t magic,
                                                          const Limit& limit) {
  uint32_t head[3];
  SHARD_RETURN_IF_ERROR(RecvAll(fd, head, sizeof(head), limit));
  if (head[0] != magic || head[2] > kMaxHeaderBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(limit.what, ": not a Shard snapshot peer (bad frame)"));
  }
  std::string text(head[2], '\0');
  SHARD_RETURN_IF_ERROR(RecvAll(fd, text.data(), text.size(), limit));
  return std::make_pair(head[1], std::move(text));
}

void SetSocketOptions(int fd) {
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
}

absl::StatusOr<std::pair<std::string, std::string>> SplitAddress(const std::string& address) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == address.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("snapshot peer address '", address, "' is not host:port"));
  }
  std::string host = address.substr(0, colon);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  return std::make_pair(host, address.substr(colon + 1));
}

absl::StatusOr<Descriptor> Connect(const std::string& address, const Limit& limit) {
  SHARD_ASSIGN_OR_RETURN(const auto host_port, SplitAddress(address));
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (const int err = ::getaddrinfo(host_port.first.c_str(), host_port.second.c_str(), &hints,
                                    &found);
      err != 0) {
    return absl::UnavailableError(
        absl::StrCat(limit.what, ": cannot resolve ", address, ": ", ::gai_strerror(err)));
  }
  absl::Status last = absl::UnavailableError(absl::StrCat(limit.what, ": no address"));
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    Descriptor socket(::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol));
    if (socket.get() < 0) {
      last = ErrnoStatus(limit.what, errno);
      continue;
    }
    SetSocketOptions(socket.get());
    if (::connect(socket.get(), a->ai_addr, a->ai_addrlen) != 0 && errno != EINPROGRESS) {
      last = ErrnoStatus(limit.what, errno);
      continue;
    }
    if (absl::Status ready = WaitReady(socket.get(), POLLOUT, limit); !ready.ok()) {
      last = ready;
      if (absl::IsCancelled(ready)) break;
      continue;
    }
    int err = 0;
    socklen_t length = sizeof(err);
    ::getsockopt(socket.get(), SOL_SOCKET, SO_ERROR, &err, &length);
    if (err != 0) {
      last = ErrnoStatus(limit.what, err);
      continue;
    }
    ::freeaddrinfo(found);
    return socket;
  }
  ::freeaddrinfo(found);
  return last;
}

// The abstract Unix socket of the server at `address`, and its length: per network namespace,
// so only a process on the same host can reach it. None when the name does not fit.
std::optional<std::pair<sockaddr_un, socklen_t>> LocalAddress(const std::string& address) {
  sockaddr_un local{};
  local.sun_family = AF_UNIX;
  const std::string name = absl::StrCat("shard-snapshot ", address);
  if (name.size() + 1 > sizeof(local.sun_path)) return std::nullopt;
  std::memcpy(local.sun_path + 1, name.data(), name.size());  // sun_path[0] == 0: abstract
  return std::make_pair(local,
                        static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size()));
}

// Listens on the abstract Unix socket of the server at `address`; -1 if it cannot (the name too
// long): pushes from this host then come over TCP.
int ListenLocal(const std::string& address) {
  const auto local = LocalAddress(address);
  if (!local.has_value()) return -1;
  Descriptor socket(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (socket.get() < 0 ||
      ::bind(socket.get(), reinterpret_cast<const sockaddr*>(&local->first), local->second) != 0 ||
      ::listen(socket.get(), 64) != 0) {
    return -1;
  }
  return socket.release();
}

// A connection to the server at `address` through its abstract Unix socket, if it listens in
// this network namespace.
std::optional<Descriptor> ConnectLocal(const std::string& address) {
  const auto local = LocalAddress(address);
  if (!local.has_value()) return std::nullopt;
  Descriptor socket(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (socket.get() < 0 ||
      ::connect(socket.get(), reinterpret_cast<const sockaddr*>(&local->first), local->second) !=
          0) {
    return std::nullopt;  // none here (another host), or its backlog is full: TCP then
  }
  return socket;
}

// One byte, with room for one descriptor: the message a lent buffer travels in.
struct DescriptorMessage {
  DescriptorMessage() {
    message.msg_iov = &io;
    message.msg_iovlen = 1;
    message.msg_control = control;
    message.msg_controllen = sizeof(control);
  }
  DescriptorMessage(const DescriptorMessage&) = delete;
  DescriptorMessage& operator=(const DescriptorMessage&) = delete;

  char byte = 0;
  iovec io{&byte, 1};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr message{};
};

// Passes descriptor `passed` over the Unix socket `fd`.
absl::Status SendDescriptor(int fd, int passed, const Limit& limit) {
  DescriptorMessage sent;
  cmsghdr* header = CMSG_FIRSTHDR(&sent.message);
  header->cmsg_level = SOL_SOCKET;
  header->cmsg_type = SCM_RIGHTS;
  header->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(header), &passed, sizeof(int));
  while (true) {
    if (::sendmsg(fd, &sent.message, MSG_NOSIGNAL) == 1) return absl::OkStatus();
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) return ErrnoStatus(limit.what, errno);
    SHARD_RETURN_IF_ERROR(WaitReady(fd, POLLOUT, limit));
  }
}

// The descriptor passed over the Unix socket `fd`.
absl::StatusOr<Descriptor> RecvDescriptor(int fd, const Limit& limit) {
  DescriptorMessage received;
  while (true) {
    const ssize_t n = ::recvmsg(fd, &received.message, MSG_CMSG_CLOEXEC);
    if (n == 1) break;
    if (n == 0) {
      return absl::UnavailableError(absl::StrCat(limit.what, ": the peer closed the connection"));
    }
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) return ErrnoStatus(limit.what, errno);
    SHARD_RETURN_IF_ERROR(WaitReady(fd, POLLIN, limit));
  }
  const cmsghdr* header = CMSG_FIRSTHDR(&received.message);
  if (header == nullptr || header->cmsg_level != SOL_SOCKET || header->cmsg_type != SCM_RIGHTS ||
      header->cmsg_len != CMSG_LEN(sizeof(int))) {
    return absl::InvalidArgumentError(absl::StrCat(limit.what, ": no buffer came with the answer"));
  }
  int passed = -1;
  std::memcpy(&passed, CMSG_DATA(header), sizeof(int));
  return Descriptor(passed);
}

absl::Status StatusFromWire(uint32_t code, const std::string& message) {
  if (code == 0) return absl::OkStatus();
  const auto status_code = code <= static_cast<uint32_t>(absl::StatusCode::kUnauthenticated)
                               ? static_cast<absl::StatusCode>(code)
                               : absl::StatusCode::kUnknown;
  return absl::Status(status_code, message);
}

}  // namespace

// The pages of a memory file a pusher on this host passed, mapped read-only and kept from the
// pusher's writes by a read lock, for as long as the store keeps them as a replica.
class KeptPages {
 public:
  // The pages of `passed` (the pusher's descriptor), of which `bytes` are the shard.
  static absl::StatusOr<std::shared_ptr<const KeptPages>> Keep(int passed, uint64_t bytes,
                                                               const std::string& what) {
    // A description of this process's own: a lock on the pusher's would be the pusher's own
    // lock, and no bar to its writes.
    Descriptor file(::open(absl::StrCat("/proc/self/fd/", passed).c_str(), O_RDONLY | O_CLOEXEC));
    if (file.get() < 0) return ErrnoStatus(absl::StrCat(what, ": opening its memory file"), errno);
    struct flock lock{};
    lock.l_type = F_RDLCK;
    lock.l_whence = SEEK_SET;
    if (::fcntl(file.get(), F_OFD_SETLK, &lock) != 0) {
      return ErrnoStatus(absl::StrCat(what, ": locking its memory file"), errno);
    }
    struct stat status{};
    if (::fstat(file.get(), &status) != 0) return ErrnoStatus(what, errno);
    if (static_cast<uint64_t>(status.st_size) < bytes) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": its memory file has ",
                                                     status.st_size, " bytes, not ", bytes));
    }
    if (bytes == 0) return std::make_shared<const KeptPages>(std::move(file), nullptr, 0);
    void* base = ::mmap(nullptr, bytes, PROT_READ, MAP_SHARED, file.get(), 0);
    if (base == MAP_FAILED) return ErrnoStatus(absl::StrCat(what, ": mapping its pages"), errno);
    return std::make_shared<const KeptPages>(std::move(file), static_cast<const char*>(base),
                                             bytes);
  }

  KeptPages(Descriptor file, const char* base, uint64_t bytes)
      : file_(std::move(file)), base_(base), bytes_(bytes) {}
  ~KeptPages() {
    if (base_ != nullptr) ::munmap(const_cast<char*>(base_), bytes_);
  }  // then closing the file drops the lock: the pusher may write the pages again
  KeptPages(const KeptPages&) = delete;
  KeptPages& operator=(const KeptPages&) = delete;

  absl::Span<const char> bytes() const { return {base_, bytes_}; }

 private:
  Descriptor file_;
  const char* base_;
  uint64_t bytes_;
};

void YieldToTraining() {
  const id_t thread = static_cast<id_t>(::syscall(SYS_gettid));
  errno = 0;
  const int nice = ::getpriority(PRIO_PROCESS, thread);
  // Never above the priority the worker runs at (a root process could raise it). Raising one's
  // own nice value cannot be refused; a thread that kept its priority would only replicate sooner.
  if (errno == 0 && nice < kBackgroundNice) {
    (void)::setpriority(PRIO_PROCESS, thread, kBackgroundNice);
  }
}

absl::Duration TransferTimeout(uint64_t bytes, absl::Duration floor,
                               double min_bytes_per_second) {
  return floor + absl::Seconds(static_cast<double>(bytes) / min_bytes_per_second);
}

// --- Server --------------------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<SnapshotServer>> SnapshotServer::Start(const std::string& host,
                                                                       int port,
                                                                       SnapshotStore* store,
                                                                       ReplicaCallback on_replica) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  if (const int err = ::getaddrinfo(host.c_str(), service.c_str(), &hints, &found); err != 0) {
    return absl::InvalidArgumentError(absl::StrCat("the snapshot server cannot listen on '", host,
                                                   "': ", ::gai_strerror(err)));
  }
  absl::Status last = absl::UnavailableError("no address to listen on");
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    Descriptor socket(::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol));
    if (socket.get() < 0) {
      last = ErrnoStatus("snapshot server socket", errno);
      continue;
    }
    if (::bind(socket.get(), a->ai_addr, a->ai_addrlen) != 0 || ::listen(socket.get(), 64) != 0) {
      last = ErrnoStatus(absl::StrCat("the snapshot server cannot listen on ", host, ":", port),
                         errno);
      continue;
    }
    sockaddr_storage bound{};
    socklen_t length = sizeof(bound);
    ::getsockname(socket.get(), reinterpret_cast<sockaddr*>(&bound), &length);
    const int bound_port = ntohs(bound.ss_family == AF_INET6
                                     ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                     : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
    ::freeaddrinfo(found);
    const std::string shown = host.find(':') != std::string::npos ? absl::StrCat("[", host, "]")
                                                                   : host;
    const std::string address = absl::StrCat(shown, ":", bound_port);
    std::unique_ptr<SnapshotServer> server(new SnapshotServer(
        address, socket.release(), ListenLocal(address), store, std::move(on_replica)));
    server->accept_thread_ = std::thread([s = server.get()] { s->AcceptLoop(); });
    return server;
  }
  ::freeaddrinfo(found);
  return last;
}

SnapshotServer::SnapshotServer(std::string address, int listen_fd, int local_listen_fd,
                               SnapshotStore* store, ReplicaCallback on_replica)
    : address_(std::move(address)),
      listen_fd_(listen_fd),
      local_listen_fd_(local_listen_fd),
      store_(store),
      on_replica_(std::move(on_replica)) {}

SnapshotServer::~SnapshotServer() {
  stopping_ = true;
  accept_thread_.join();
  ::close(listen_fd_);
  if (local_listen_fd_ >= 0) ::close(local_listen_fd_);
  std::list<Connection> connections;
  {
    absl::MutexLock lock(&mu_);
    for (Connection& connection : connections_) ::shutdown(connection.fd, SHUT_RDWR);
    connections.swap(connections_);
  }
  for (Connection& connection : connections) connection.thread.join();
}

void SnapshotServer::ReapLocked() {
  for (auto it = connections_.begin(); it != connections_.end();) {
    if (!it->done) {
      ++it;
      continue;
    }
    it->thread.join();  // it has returned already
    it = connections_.erase(it);
  }
}

void SnapshotServer::AcceptLoop() {
  while (!stopping_) {
    pollfd p[2] = {{listen_fd_, POLLIN, 0}, {local_listen_fd_, POLLIN, 0}};
    const nfds_t listening = local_listen_fd_ >= 0 ? 2 : 1;
    if (::poll(p, listening, static_cast<int>(absl::ToInt64Milliseconds(kPollSlice))) <= 0) {
      continue;
    }
    const int fd = ::accept4((p[0].revents & POLLIN) != 0 ? listen_fd_ : local_listen_fd_,
                             nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    SetSocketOptions(fd);
    absl::MutexLock lock(&mu_);
    ReapLocked();
    if (stopping_) {
      ::close(fd);
      return;
    }
    Connection& connection = connections_.emplace_back();
    connection.fd = fd;
    connection.thread = std::thread([this, &connection] {
      YieldToTraining();
      Serve(connection.fd);
      absl::MutexLock lock(&mu_);
      ::close(connection.fd);
      connection.fd = -1;
      connection.done = true;
    });
  }
}

void SnapshotServer::Serve(int fd) {
  Limit limit{absl::Now() + kHeaderTimeout, nullptr, "a snapshot peer's request"};
  uint32_t kind_head[3];
  if (!RecvAll(fd, kind_head, sizeof(kind_head), limit).ok() || kind_head[0] != kRequestMagic ||
      kind_head[2] > kMaxHeaderBytes) {
    return;  // not a request of ours, or a peer gone: nothing to answer
  }
  std::string header(kind_head[2], '\0');
  if (!RecvAll(fd, header.data(), header.size(), limit).ok()) return;
  const auto reply = [&](const absl::Status& status) {
    (void)SendFrame(fd, kResponseMagic, static_cast<uint32_t>(status.code()),
                    std::string(status.message()), limit);
  };
  if (kind_head[1] == kFetch) {
    const nlohmann::json request = nlohmann::json::parse(header, nullptr, false);
    if (request.is_discarded() || !request.is_object() || !request.contains("id") ||
        !request["id"].is_string() || !request.contains("rank") ||
        !request["rank"].is_number_integer() || !request.contains("offset") ||
        !request["offset"].is_number_unsigned() || !request.contains("bytes") ||
        !request["bytes"].is_number_unsigned()) {
      reply(absl::InvalidArgumentError("a malformed fetch request"));
      return;
    }
    const std::string id = request["id"].get<std::string>();
    const int rank = request["rank"].get<int>();
    const uint64_t offset = request["offset"].get<uint64_t>();
    const uint64_t bytes = request["bytes"].get<uint64_t>();
    const std::optional<SnapshotStore::Held> held = store_->Find(id, rank);
    if (!held.has_value()) {
      reply(absl::NotFoundError(absl::StrCat("the worker at ", address_,
                                             " holds no shard of rank ", rank, " of snapshot ",
                                             id, " (any more)")));
      return;
    }
    if (offset > held->bytes.size() || bytes > held->bytes.size() - offset) {
      reply(absl::OutOfRangeError(absl::StrCat("bytes [", offset, ", ", offset + bytes,
                                               ") are past the end of rank ", rank,
                                               "'s shard of ", id, " (", held->bytes.size(),
                                               " bytes)")));
      return;
    }
    limit.deadline = absl::Now() + TransferTimeout(bytes, kHeaderTimeout);
    reply(absl::OkStatus());
    (void)SendAll(fd, held->bytes.data() + offset, bytes, limit);
    return;
  }
  if (kind_head[1] != kPush && kind_head[1] != kSameHostPush) {
    reply(absl::InvalidArgumentError(absl::StrCat("unknown request kind ", kind_head[1])));
    return;
  }
  absl::StatusOr<SnapshotShard> shard = SnapshotShardFromJson(header);
  if (!shard.ok()) {
    reply(shard.status());
    return;
  }
  if (kind_head[1] == kSameHostPush) {
    TakeSameHostPush(fd, *shard);
    return;
  }
  // Received and hashed a piece at a time, the hash reading what the receive just brought into
  // the cache: a replica is kept only if every byte checks.
  constexpr uint64_t kPiece = 256 << 10;
  const uint64_t total = shard->record.bytes;
  limit.deadline = absl::Now() + TransferTimeout(total, kHeaderTimeout);
  absl::StatusOr<StateBuffer> buffer = store_->TakeBuffer(total);
  if (!buffer.ok()) {
    reply(buffer.status());
    return;
  }
  ShardHasher hasher(kReplicaSums);
  for (uint64_t done = 0; done < total;) {
    const uint64_t take = std::min<uint64_t>(kPiece, total - done);
    if (absl::Status received = RecvAll(fd, buffer->data() + done, take, limit);
        !received.ok()) {
      return;  // cut off: nothing is kept, and nobody is left to answer
    }
    hasher.Append(buffer->data() + done, take);
    done += take;
  }
  if (absl::Status checked = CheckReplica(*shard, hasher, buffer->data()); !checked.ok()) {
    reply(checked);
    return;
  }
  const std::vector<std::string> dropped =
      store_->Add(*shard, std::make_shared<StateBuffer>(*std::move(buffer)));
  if (on_replica_) on_replica_(*shard, dropped);
  reply(absl::OkStatus());
}

absl::Status SnapshotServer::CheckReplica(const SnapshotShard& shard, ShardHasher& hasher,
                                          char* bytes) const {
  ShardRecord record = hasher.Finish(shard.record.file, shard.rank);
  // Where the bytes belong, which hashing cannot tell, and the whole shard's hash, which the
  // blocks' vouch for.
  record.extras = shard.record.extras;
  record.xxh3 = shard.record.xxh3;
  if (record != shard.record) {
    return absl::DataLossError(absl::StrCat("rank ", shard.rank, "'s shard of snapshot ",
                                            shard.id, " arrived at ", address_,
                                            " with other checksums than it was sent with"));
  }
  CorruptIfAsked(shard, bytes);
  return absl::OkStatus();
}

void SnapshotServer::CorruptIfAsked(const SnapshotShard& shard, char* bytes) const {
  CorruptReplicaIfAsked(bytes, shard.record.bytes,
                        absl::StrCat("rank ", shard.rank, "'s shard of snapshot ", shard.id,
                                     ", kept at ", address_, " for a buddy"));
}

void SnapshotServer::TakeSameHostPush(int fd, const SnapshotShard& shard) {
  const uint64_t total = shard.record.bytes;
  const std::string what = absl::StrCat("taking rank ", shard.rank, "'s shard of snapshot ",
                                        shard.id, " from this host");
  Limit limit{absl::Now() + kHeaderTimeout, nullptr, what.c_str()};
  const auto reply = [&](const absl::Status& status) {
    (void)SendFrame(fd, kResponseMagic, static_cast<uint32_t>(status.code()),
                    std::string(status.message()), limit);
  };
  absl::StatusOr<Descriptor> passed = RecvDescriptor(fd, limit);
  if (!passed.ok()) return;  // a pusher gone before it passed its pages: nothing to keep
  ucred peer{};
  socklen_t length = sizeof(peer);
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &peer, &length) != 0 || peer.uid != ::geteuid()) {
    reply(absl::PermissionDeniedError(absl::StrCat(
        what, ": only a process of this worker's user may hand it memory to keep")));
    return;
  }
  absl::StatusOr<std::shared_ptr<const KeptPages>> pages =
      KeptPages::Keep(passed->get(), total, what);
  if (!pages.ok()) {
    reply(pages.status());  // the pusher sends over TCP instead
    return;
  }
  // The pages are the pusher's own copy, which it hashed: nothing travelled that could tear, and
  // the lock keeps the pusher from writing them while they are kept. So they are not hashed
  // again here (a restore still checks every byte it reads).
  absl::Span<const char> bytes = (*pages)->bytes();
  std::shared_ptr<const void> keep = *std::move(pages);
  if (ReplicasCorrupted()) {  // a memory error in this worker's copy, not in the pusher's
    auto copy = std::make_shared<std::vector<char>>(bytes.begin(), bytes.end());
    CorruptIfAsked(shard, copy->data());
    bytes = absl::Span<const char>(copy->data(), copy->size());
    keep = std::move(copy);
  }
  const std::vector<std::string> dropped = store_->Add(shard, bytes, std::move(keep));
  if (on_replica_) on_replica_(shard, dropped);
  reply(absl::OkStatus());
}

// --- Calls -------------------------------------------------------------------------------------

absl::Status PushSnapshotShard(const std::string& address, const SnapshotShard& shard,
                               StateBuffer& bytes, const PeerCallOptions& options) {
  const std::string what = absl::StrCat("pushing rank ", shard.rank, "'s shard of snapshot ",
                                        shard.id, " to ", address);
  const Limit limit{absl::Now() + options.timeout, options.cancel, what.c_str()};
  if (bytes.size() != shard.record.bytes) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", bytes.size(),
                                                   " bytes for a record of ",
                                                   shard.record.bytes));
  }
  const std::string header = SnapshotShardToJson(shard);
  if (std::optional<Descriptor> local = options.same_host_pages && bytes.fd() >= 0
                                            ? ConnectLocal(address)
                                            : std::nullopt;
      local.has_value()) {
    SHARD_RETURN_IF_ERROR(SendFrame(local->get(), kRequestMagic, kSameHostPush, header, limit));
    FaultPoint("snapshot-push-midway");
    SHARD_RETURN_IF_ERROR(SendDescriptor(local->get(), bytes.fd(), limit));
    const absl::StatusOr<std::pair<uint32_t, std::string>> answer =
        RecvFrame(local->get(), kResponseMagic, limit);
    if (!answer.ok()) {
      // The buddy has the pages and may keep them without having said so: they are never
      // written again.
      bytes.Retire();
      return answer.status();
    }
    // A buddy that could not keep the pages (this process's user is not its own, its memory
    // file would not map) takes the bytes over TCP.
    const absl::Status kept = StatusFromWire(answer->first, answer->second);
    if (kept.ok()) return kept;
    if (options.pages_refused != nullptr) *options.pages_refused = kept;
  }
  SHARD_ASSIGN_OR_RETURN(Descriptor socket, Connect(address, limit));
  SHARD_RETURN_IF_ERROR(SendFrame(socket.get(), kRequestMagic, kPush, header, limit));
  const uint64_t half = bytes.size() / 2;
  SHARD_RETURN_IF_ERROR(SendAll(socket.get(), bytes.data(), half, limit));
  FaultPoint("snapshot-push-midway");
  SHARD_RETURN_IF_ERROR(SendAll(socket.get(), bytes.data() + half, bytes.size() - half, limit));
  SHARD_ASSIGN_OR_RETURN(const auto answer, RecvFrame(socket.get(), kResponseMagic, limit));
  return StatusFromWire(answer.first, answer.second);
}

absl::Status FetchSnapshotRange(const std::string& address, const std::string& id, int rank,
                                uint64_t offset, uint64_t bytes, char* out,
                                const PeerCallOptions& options) {
  const std::string what = absl::StrCat("fetching bytes [", offset, ", ", offset + bytes,
                                        ") of rank ", rank, "'s shard of snapshot ", id,
                                        " from ", address);
  const Limit limit{absl::Now() + options.timeout, options.cancel, what.c_str()};
  SHARD_ASSIGN_OR_RETURN(Descriptor socket, Connect(address, limit));
  const nlohmann::json request = {{"id", id}, {"rank", rank}, {"offset", offset},
                                  {"bytes", bytes}};
  SHARD_RETURN_IF_ERROR(SendFrame(socket.get(), kRequestMagic, kFetch, request.dump(), limit));
  SHARD_ASSIGN_OR_RETURN(const auto answer, RecvFrame(socket.get(), kResponseMagic, limit));
  SHARD_RETURN_IF_ERROR(StatusFromWire(answer.first, answer.second));
  return RecvAll(socket.get(), out, bytes, limit);
}

std::vector<ConnectProbe> ProbeConnect(const std::vector<std::string>& addresses,
                                       const PeerCallOptions& options) {
  std::vector<ConnectProbe> probes(addresses.size());
  std::vector<std::thread> threads;
  const absl::Time start = absl::Now();
  for (size_t i = 0; i < addresses.size(); ++i) {
    threads.emplace_back([&, i] {
      const std::string what = absl::StrCat("connecting to ", addresses[i]);
      const Limit limit{start + options.timeout, options.cancel, what.c_str()};
      absl::StatusOr<Descriptor> socket = Connect(addresses[i], limit);
      probes[i].took = absl::Now() - start;
      probes[i].reachable = socket.ok();
      if (!socket.ok()) probes[i].detail = std::string(socket.status().message());
    });
  }
  for (std::thread& thread : threads) thread.join();
  return probes;
}

}  // namespace shard
