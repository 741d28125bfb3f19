// A worker's snapshot store and the transfers between workers (worker/dataplane/snapshot_store.h,
// snapshot_peer.h, snapshot_fetch.h): the newest snapshots kept and their buffers reused; a
// replica pushed to a peer's server is kept only when every byte checks and only then answered;
// one cut off half-way or garbled is never kept; replication runs below training's priority;
// ranges fetched back are the bytes sent; a reader over the holders verifies what they serve and
// names the shard when it does not check; the buffers of the next snapshots are prepared off the
// training thread; a push from this host hands the holder the pusher's own pages, which the
// pusher writes again only once the holder dropped them. Servers listen on 127.0.0.1 ports the
// kernel picks; everything runs in this process (a lock on another open file description
// conflicts within one process as across two).
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cinttypes>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <numeric>
#include <set>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/shard_hasher.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/process.h"
#include "tests/support/status_assertions.h"
#include "worker/dataplane/snapshot_fetch.h"
#include "worker/dataplane/snapshot_peer.h"
#include "worker/dataplane/snapshot_store.h"
#include "worker/dataplane/snapshotter.h"

namespace shard {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

// Deterministic bytes, different for every (seed, offset).
std::vector<char> Bytes(uint64_t size, int seed) {
  std::vector<char> bytes(size);
  for (uint64_t i = 0; i < size; ++i) bytes[i] = static_cast<char>((i * 131 + seed * 7) % 251);
  return bytes;
}

// Rank `rank`'s shard of snapshot (generation, step) in a world of `world`, holding `bytes`.
SnapshotShard Shard(int64_t generation, int64_t step, int rank, int world,
                    const std::vector<char>& bytes) {
  SnapshotShard shard;
  shard.id = SnapshotId(step, generation);
  shard.generation = generation;
  shard.step = step;
  shard.rank = rank;
  shard.plan.world_size = world;
  shard.plan_hash = "0123456789abcdef";
  shard.counters.optimizer_step = step;
  shard.record = HashShard(bytes.data(), bytes.size(), ShardFileName(rank, world), rank);
  return shard;
}

std::vector<char> Copy(absl::Span<const char> bytes) {
  return std::vector<char>(bytes.begin(), bytes.end());
}

// A rank's copy of its state holding `bytes`.
StateBuffer Buffer(const std::vector<char>& bytes) {
  StateBuffer buffer = *StateBuffer::Make(bytes.size());
  (void)buffer.Resize(bytes.size());  // within its capacity: it cannot fail
  std::copy(bytes.begin(), bytes.end(), buffer.data());
  return buffer;
}

SnapshotBytes Shared(const std::vector<char>& bytes) {
  return std::make_shared<StateBuffer>(Buffer(bytes));
}

TEST(SnapshotStoreTest, KeepsTheNewestSnapshotsAndHandsTheirBuffersOutAgain) {
  SnapshotStore store(/*kept_snapshots=*/2);
  const std::vector<char> bytes = Bytes(1000, 1);
  EXPECT_THAT(store.Add(Shard(3, 10, 0, 2, bytes), Shared(bytes)), IsEmpty());
  EXPECT_THAT(store.Add(Shard(3, 10, 1, 2, bytes), Shared(bytes)), IsEmpty());
  EXPECT_THAT(store.Add(Shard(3, 20, 0, 2, bytes), Shared(bytes)), IsEmpty());
  // A third snapshot drops the oldest, with every shard of it this worker held.
  SnapshotBytes third = Shared(bytes);
  std::set<const char*> dropped_buffers;
  for (int rank : {0, 1}) {
    std::optional<SnapshotStore::Held> oldest = store.Find(SnapshotId(10, 3), rank);
    ASSERT_TRUE(oldest.has_value());
    dropped_buffers.insert(oldest->bytes.data());
  }
  EXPECT_THAT(store.Add(Shard(3, 30, 0, 2, bytes), third), ElementsAre(SnapshotId(10, 3)));
  EXPECT_FALSE(store.Find(SnapshotId(10, 3), 0).has_value());
  EXPECT_FALSE(store.Find(SnapshotId(10, 3), 1).has_value());
  ASSERT_TRUE(store.Find(SnapshotId(30, 3), 0).has_value());
  EXPECT_EQ(store.Find(SnapshotId(30, 3), 0)->bytes.data(), third->data()) << "not copied";
  // The next snapshot's buffer is one a dropped shard had: its pages are mapped already.
  absl::StatusOr<StateBuffer> reused = store.TakeBuffer(1000);
  SHARD_ASSERT_OK(reused.status());
  EXPECT_EQ(reused->size(), 1000u);
  EXPECT_EQ(dropped_buffers.count(reused->data()), 1u);
  // A later generation is newer whatever its step (a restore to an earlier step).
  EXPECT_THAT(store.Add(Shard(4, 5, 0, 2, bytes), Shared(bytes)), ElementsAre(SnapshotId(20, 3)));
  std::vector<std::string> ids;
  for (const SnapshotShard& held : store.Holdings()) ids.push_back(held.id);
  EXPECT_THAT(ids, ElementsAre(SnapshotId(5, 4), SnapshotId(30, 3)));
  // An older snapshot than those kept is not kept.
  EXPECT_THAT(store.Add(Shard(3, 15, 1, 2, bytes), Shared(bytes)), ElementsAre(SnapshotId(15, 3)));
  EXPECT_EQ(store.held_bytes(), 2 * 1000u);
}

TEST(SnapshotStoreTest, PreparedBuffersAreWhatTheNextSnapshotsTakeWithRoomToSpare) {
  SnapshotStore store;
  EXPECT_EQ(store.Prepare(1600, 2), 2);
  EXPECT_EQ(store.Prepare(1600, 2), 0) << "ready already";
  EXPECT_EQ(store.ReadyBuffers(1600), 2);
  // A prepared buffer has 1/16 to spare (a fresh one would hold the bytes exactly): a snapshot
  // a little larger after a plan rebuild, or with extras after it, still fits.
  std::vector<StateBuffer> taken;
  for (int i = 0; i < 2; ++i) {
    taken.push_back(*store.TakeBuffer(1650));
    EXPECT_EQ(taken.back().size(), 1650u);
    EXPECT_EQ(taken.back().capacity(), 1700u) << "buffer " << i << " is not a prepared one";
  }
  EXPECT_EQ(store.ReadyBuffers(1600), 0);
  // None left: a fresh one, with the same room to spare.
  StateBuffer fresh = *store.TakeBuffer(1600);
  EXPECT_EQ(fresh.capacity(), 1700u);
  EXPECT_NE(fresh.data(), taken[0].data());
  EXPECT_NE(fresh.data(), taken[1].data());
  // At most 4 free buffers; buffers too small for the new size make way for it.
  EXPECT_EQ(store.Prepare(800, 9), 4);
  EXPECT_EQ(store.Prepare(3200, 1), 1);
  EXPECT_EQ(store.ReadyBuffers(3200), 1);
  EXPECT_EQ(store.ReadyBuffers(800), 4);
  EXPECT_EQ(store.TakeBuffer(3200)->capacity(), 3400u);
  EXPECT_EQ(store.ReadyBuffers(3200), 0) << "the prepared one was taken";
}

TEST(SnapshotStoreTest, TheSnapshotterPreparesTheNextSnapshotsBuffersOffTheCallersThread) {
  SnapshotStore buddy_store;
  std::unique_ptr<SnapshotServer> buddy =
      *SnapshotServer::Start("127.0.0.1", 0, &buddy_store, nullptr);
  SnapshotStore store;
  Snapshotter snapshotter(&store, {{buddy->address()}, true, /*received_over_tcp=*/1},
                          Snapshotter::Callbacks{});
  // Its own shard and the one replica it receives over TCP.
  snapshotter.PrepareBuffers(4800);
  EXPECT_TRUE(testing::Eventually([&] { return store.ReadyBuffers(4800) == 2; },
                                  absl::Seconds(30)));
  // After a snapshot, the next one's are made ready for its size (the one it took is held).
  const std::vector<char> bytes = Bytes(4800, 4);
  StateBuffer buffer = *store.TakeBuffer(bytes.size());
  std::copy(bytes.begin(), bytes.end(), buffer.data());
  SHARD_ASSERT_OK(snapshotter.Start(Shard(1, 10, 0, 2, bytes),
                                    std::make_shared<StateBuffer>(std::move(buffer)), nullptr));
  SHARD_ASSERT_OK(snapshotter.WaitIdle(nullptr));
  EXPECT_TRUE(buddy_store.Find(SnapshotId(10, 1), 0).has_value());
  EXPECT_TRUE(testing::Eventually([&] { return store.ReadyBuffers(4800) == 2; },
                                  absl::Seconds(30)));
}

TEST(SnapshotStoreTest, OnlyReplicasReceivedOverTcpAreGivenABufferOfTheStore) {
  // A replica from this host is the pusher's pages: a store buffer made ready for it would sit
  // idle (a rank's share of the state, per replica).
  const std::vector<std::string> servers = {"s0", "s1", "s2", "s3"};
  const std::vector<std::string> one_host(4, "a");
  const std::vector<std::string> two_hosts = {"a", "a", "b", "b"};
  for (int rank = 0; rank < 4; ++rank) {
    const Snapshotter::Replication lent = ReplicationOf(one_host, servers, rank, 1, true);
    EXPECT_EQ(lent.buddies, std::vector<std::string>{servers[(rank + 1) % 4]});
    EXPECT_EQ(lent.received_over_tcp, 0);
    EXPECT_EQ(ReplicationOf(one_host, servers, rank, 1, false).received_over_tcp, 1);
    EXPECT_EQ(ReplicationOf(one_host, servers, rank, 3, true).buddies.size(), 3u);
    // With two hosts the ring alternates between them: every replica crosses over.
    EXPECT_EQ(ReplicationOf(two_hosts, servers, rank, 1, true).received_over_tcp, 1);
    EXPECT_EQ(ReplicationOf(two_hosts, servers, rank, 3, true).received_over_tcp, 2);
  }
}

// A snapshot server over its own store, recording the replicas it was told of.
struct Peer {
  SnapshotStore store;
  absl::Mutex mu;
  std::vector<SnapshotShard> replicas;
  std::unique_ptr<SnapshotServer> server;

  explicit Peer(int kept_snapshots = 2) : store(kept_snapshots) {
    server = *SnapshotServer::Start("127.0.0.1", 0, &store,
                                    [this](const SnapshotShard& shard,
                                           const std::vector<std::string>&) {
                                      absl::MutexLock lock(&mu);
                                      replicas.push_back(shard);
                                    });
  }
};

// Pushed over TCP, or (SameHost) as the pusher's own pages, kept by the holder on this host.
class PushTest : public ::testing::TestWithParam<bool> {
 protected:
  PeerCallOptions Options() {
    PeerCallOptions options;
    options.same_host_pages = GetParam();
    return options;
  }
};

INSTANTIATE_TEST_SUITE_P(OverTcpAndOnTheSameHost, PushTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "SameHost" : "OverTcp";
                         });

TEST_P(PushTest, APushedReplicaIsKeptAndAnsweredAndItsRangesFetchBack) {
  Peer peer;
  // Two whole 4 MiB blocks and a short one.
  const std::vector<char> bytes = Bytes(2 * kCheckpointBlockBytes + 4097, 2);
  const SnapshotShard shard = Shard(5, 40, 2, 4, bytes);
  {
    StateBuffer pushed = Buffer(bytes);
    SHARD_ASSERT_OK(PushSnapshotShard(peer.server->address(), shard, pushed, Options()));
    EXPECT_EQ(pushed.HeldElsewhere(), GetParam())
        << "a holder on this host keeps the pusher's pages; over TCP, a copy of its own";
    EXPECT_FALSE(pushed.retired());
  }
  // The pusher's own buffer is gone: the replica is still whole.
  {
    absl::MutexLock lock(&peer.mu);
    ASSERT_EQ(peer.replicas.size(), 1u) << "told of it before the pusher heard back";
    EXPECT_EQ(peer.replicas[0], shard);
  }
  std::optional<SnapshotStore::Held> held = peer.store.Find(shard.id, 2);
  ASSERT_TRUE(held.has_value());
  EXPECT_EQ(Copy(held->bytes), bytes);

  for (const auto& [offset, length] :
       std::vector<std::pair<uint64_t, uint64_t>>{{0, bytes.size()}, {4095, 9}, {kCheckpointBlockBytes - 1, kCheckpointBlockBytes + 2}}) {
    std::vector<char> out(length);
    SHARD_ASSERT_OK(FetchSnapshotRange(peer.server->address(), shard.id, 2, offset, length,
                                       out.data(), PeerCallOptions{}));
    EXPECT_TRUE(std::equal(out.begin(), out.end(), bytes.begin() + offset)) << offset;
  }
  std::vector<char> out(8);
  absl::Status missing = FetchSnapshotRange(peer.server->address(), shard.id, 1, 0, 8,
                                            out.data(), PeerCallOptions{});
  EXPECT_TRUE(absl::IsNotFound(missing)) << missing;
  absl::Status past = FetchSnapshotRange(peer.server->address(), shard.id, 2, bytes.size() - 4, 8,
                                         out.data(), PeerCallOptions{});
  EXPECT_TRUE(absl::IsOutOfRange(past)) << past;
}

// A training script's own optimizer appends extras to its shard: the replica keeps where they
// are (the checksums cannot say it).
TEST(SnapshotPeerTest, AReplicaKeepsItsExtrasAndItsOptimizerState) {
  Peer peer;
  const std::vector<char> bytes = Bytes(5000, 4);
  SnapshotShard shard = Shard(5, 40, 1, 2, bytes);
  shard.record.extras = {{-1, 4000, 600}, {3, 4600, 400}};
  shard.state = OptimizerStateKind{"torch.optim.adamw.AdamW", {"exp_avg", "exp_avg_sq"}};
  StateBuffer pushed = Buffer(bytes);
  SHARD_ASSERT_OK(PushSnapshotShard(peer.server->address(), shard, pushed, PeerCallOptions{}));
  std::optional<SnapshotStore::Held> held = peer.store.Find(shard.id, 1);
  ASSERT_TRUE(held.has_value());
  absl::MutexLock lock(&peer.mu);
  ASSERT_EQ(peer.replicas.size(), 1u);
  EXPECT_EQ(peer.replicas[0], shard);
}

// Over TCP: on the same host nothing travels, and the pages are the pusher's, which it hashed.
TEST(SnapshotPeerTest, AReplicaWhoseBytesDoNotMatchItsChecksumsIsRefusedAndNotKept) {
  Peer peer;
  std::vector<char> bytes = Bytes(100000, 3);
  const SnapshotShard shard = Shard(5, 40, 1, 2, bytes);
  bytes[54321] ^= 1;  // garbled after it was described
  StateBuffer garbled = Buffer(bytes);
  absl::Status pushed =
      PushSnapshotShard(peer.server->address(), shard, garbled, PeerCallOptions{});
  EXPECT_TRUE(absl::IsDataLoss(pushed)) << pushed;
  EXPECT_FALSE(peer.store.Find(shard.id, 1).has_value());
  absl::MutexLock lock(&peer.mu);
  EXPECT_THAT(peer.replicas, IsEmpty());
}

TEST(SnapshotPeerTest, AReplicaCutOffHalfWayIsNeverKept) {
  auto peer = std::make_unique<Peer>();
  const std::vector<char> bytes = Bytes(3 * kCheckpointBlockBytes, 4);
  const SnapshotShard shard = Shard(5, 40, 0, 2, bytes);
  // A sender that dies after half the bytes: the request's frame, then half, then its socket
  // closes.
  const std::string address = peer->server->address();
  int port = 0;
  ASSERT_TRUE(absl::SimpleAtoi(address.substr(address.rfind(':') + 1), &port));
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(static_cast<uint16_t>(port));
  to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof(to)), 0);
  const std::string header = SnapshotShardToJson(shard);
  const uint32_t frame[3] = {0x51524853, 2, static_cast<uint32_t>(header.size())};
  ASSERT_EQ(::send(fd, frame, sizeof(frame), 0), static_cast<ssize_t>(sizeof(frame)));
  ASSERT_EQ(::send(fd, header.data(), header.size(), 0), static_cast<ssize_t>(header.size()));
  size_t sent = 0;
  while (sent < bytes.size() / 2) {
    const ssize_t n = ::send(fd, bytes.data() + sent, bytes.size() / 2 - sent, 0);
    ASSERT_GT(n, 0);
    sent += static_cast<size_t>(n);
  }
  ::close(fd);
  // Stopping the server waits for every connection it serves: whatever it did with the torn
  // push is done by then.
  SnapshotStore& store = peer->store;
  peer->server.reset();
  EXPECT_FALSE(store.Find(shard.id, 0).has_value());
  absl::MutexLock lock(&peer->mu);
  EXPECT_THAT(peer->replicas, IsEmpty());
}

// A rank takes its snapshot buffers from its store and pushes them to a buddy on this host that
// keeps more snapshots than it does: a buffer the buddy still keeps is never written again (every
// replica the buddy holds stays as it was pushed), one it dropped is, and no snapshot maps new
// memory once the buffers in use are there.
TEST(SnapshotPeerTest, ARanksBufferIsWrittenAgainOnlyOnceTheBuddyOnThisHostDroppedIt) {
  Peer buddy(/*kept_snapshots=*/3);
  SnapshotStore own(/*kept_snapshots=*/2);
  PeerCallOptions options;
  options.same_host_pages = true;
  const uint64_t size = kCheckpointBlockBytes + 3000;
  std::set<std::pair<dev_t, ino_t>> files;
  for (int step = 10; step <= 120; step += 10) {
    StateBuffer buffer = *own.TakeBuffer(size);
    EXPECT_FALSE(buffer.HeldElsewhere()) << "step " << step;
    struct stat file{};
    ASSERT_EQ(::fstat(buffer.fd(), &file), 0);
    files.insert({file.st_dev, file.st_ino});
    const std::vector<char> bytes = Bytes(size, step);
    std::copy(bytes.begin(), bytes.end(), buffer.data());
    const SnapshotShard shard = Shard(5, step, 1, 2, bytes);
    auto shared = std::make_shared<StateBuffer>(std::move(buffer));
    own.Add(shard, shared);
    SHARD_ASSERT_OK(PushSnapshotShard(buddy.server->address(), shard, *shared, options));
    EXPECT_TRUE(shared->HeldElsewhere());
    shared.reset();
    // Every replica the buddy keeps is the bytes pushed for its step.
    for (int kept = step; kept > 0 && kept > step - 30; kept -= 10) {
      std::optional<SnapshotStore::Held> held = buddy.store.Find(SnapshotId(kept, 5), 1);
      ASSERT_TRUE(held.has_value()) << kept;
      EXPECT_EQ(Copy(held->bytes), Bytes(size, kept)) << "step " << kept << "'s replica, after "
                                                      << step;
    }
  }
  // The buddy keeps 3 snapshots and the rank 2 of its own, so 4 buffers in turn; a fifth only if
  // the store's free list held one back.
  EXPECT_LE(files.size(), 5u);
  EXPECT_GE(files.size(), 4u);
}

// The abstract Unix socket the snapshot server at `address` takes pushes from this host on.
struct LocalSocket {
  explicit LocalSocket(const std::string& address) {
    at.sun_family = AF_UNIX;
    const std::string name = "shard-snapshot " + address;
    std::memcpy(at.sun_path + 1, name.data(), name.size());
    length = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  }
  sockaddr* address() { return reinterpret_cast<sockaddr*>(&at); }

  sockaddr_un at{};
  socklen_t length = 0;
};

// One byte, with room for one descriptor: the message a descriptor is passed in.
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

// Speaks the same-host push by hand to the server at `address`: sends `shard`'s description
// and, if `file` >= 0, passes that descriptor. The status code of the answer, or -1 without one.
int PushByHand(const std::string& address, const SnapshotShard& shard, int file) {
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  LocalSocket to(address);
  EXPECT_EQ(::connect(fd, to.address(), to.length), 0);
  const std::string header = SnapshotShardToJson(shard);
  const uint32_t frame[3] = {0x51524853, 3, static_cast<uint32_t>(header.size())};
  EXPECT_EQ(::send(fd, frame, sizeof(frame), MSG_NOSIGNAL), static_cast<ssize_t>(sizeof(frame)));
  EXPECT_EQ(::send(fd, header.data(), header.size(), MSG_NOSIGNAL),
            static_cast<ssize_t>(header.size()));
  if (file < 0) {
    ::close(fd);
    return -1;
  }
  DescriptorMessage sent;
  cmsghdr* passed = CMSG_FIRSTHDR(&sent.message);
  passed->cmsg_level = SOL_SOCKET;
  passed->cmsg_type = SCM_RIGHTS;
  passed->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(passed), &file, sizeof(int));
  EXPECT_EQ(::sendmsg(fd, &sent.message, MSG_NOSIGNAL), 1);
  uint32_t head[3] = {0, 0, 0};
  const bool answered =
      ::recv(fd, head, sizeof(head), MSG_WAITALL) == static_cast<ssize_t>(sizeof(head));
  ::close(fd);
  return answered ? static_cast<int>(head[1]) : -1;
}

// SHARD_CORRUPT_REPLICAS on the same host garbles the holder's copy, as a memory error of the
// holder's would, never the pusher's pages.
TEST(SnapshotPeerTest, AReplicaCorruptedOnTheSameHostIsAPrivateCopy) {
  Peer peer;
  const std::vector<char> bytes = Bytes(kCheckpointBlockBytes + 77, 12);
  const SnapshotShard shard = Shard(5, 40, 0, 2, bytes);
  StateBuffer pushed = Buffer(bytes);
  PeerCallOptions options;
  options.same_host_pages = true;
  ::setenv("SHARD_CORRUPT_REPLICAS", "1", 1);
  const absl::Status status = PushSnapshotShard(peer.server->address(), shard, pushed, options);
  ::unsetenv("SHARD_CORRUPT_REPLICAS");
  SHARD_ASSERT_OK(status);
  ASSERT_TRUE(peer.store.Find(shard.id, 0).has_value());
  EXPECT_NE(Copy(peer.store.Find(shard.id, 0)->bytes), bytes);
  EXPECT_EQ(Copy(absl::MakeConstSpan(pushed.data(), pushed.size())), bytes);
  EXPECT_FALSE(pushed.HeldElsewhere());
}

// A buddy on this host that cannot keep the pages (here another open file description holds a
// write lock on them, as if they were being written) takes the replica over TCP, and the rank is
// told so once.
TEST(SnapshotPeerTest, PagesABuddyCannotKeepGoOverTcpAndTheRankIsToldOnce) {
  Peer buddy;
  SnapshotStore own;
  absl::Mutex mu;
  std::vector<std::string> refusals;
  Snapshotter::Callbacks callbacks;
  callbacks.on_push_failed = [](const SnapshotShard&, const std::string&,
                                const absl::Status& why) { ADD_FAILURE() << why; };
  callbacks.on_pages_refused = [&](const SnapshotShard&, const std::string& who,
                                   const absl::Status& why) {
    absl::MutexLock lock(&mu);
    refusals.push_back(absl::StrCat(who, ": ", why.message()));
  };
  Snapshotter snapshotter(&own, {{buddy.server->address()}, true, 0}, callbacks);
  for (int step : {10, 20}) {
    const std::vector<char> bytes = Bytes(5000, step);
    SnapshotBytes buffer = Shared(bytes);
    const int writer = ::open(absl::StrCat("/proc/self/fd/", buffer->fd()).c_str(), O_RDWR);
    ASSERT_GE(writer, 0);
    struct flock lock{};
    lock.l_type = F_WRLCK;
    lock.l_whence = SEEK_SET;
    ASSERT_EQ(::fcntl(writer, F_OFD_SETLK, &lock), 0);
    SHARD_ASSERT_OK(snapshotter.Start(Shard(1, step, 0, 2, bytes), buffer, nullptr));
    SHARD_ASSERT_OK(snapshotter.WaitIdle(nullptr));
    ::close(writer);
    std::optional<SnapshotStore::Held> held = buddy.store.Find(SnapshotId(step, 1), 0);
    ASSERT_TRUE(held.has_value()) << step;
    EXPECT_EQ(Copy(held->bytes), bytes);
    EXPECT_FALSE(buffer->HeldElsewhere()) << "the buddy keeps a copy of its own";
  }
  absl::MutexLock lock(&mu);
  ASSERT_EQ(refusals.size(), 1u);
  EXPECT_THAT(refusals[0], HasSubstr(buddy.server->address() + ": "));
  EXPECT_THAT(refusals[0], HasSubstr("locking its memory file"));
}

// A pusher on this host killed before it passed its pages leaves nothing kept; pages too few
// for the shard, or being written (another description holds a write lock), are refused; whole
// pages are kept.
TEST(SnapshotPeerTest, ASameHostPushCutOffOrWrongIsNeverKept) {
  auto peer = std::make_unique<Peer>();
  const std::vector<char> bytes = Bytes(kCheckpointBlockBytes + 5000, 6);
  const std::string address = peer->server->address();
  StateBuffer pages = Buffer(bytes);
  const SnapshotShard torn = Shard(5, 40, 0, 2, bytes);
  EXPECT_EQ(PushByHand(address, torn, -1), -1);
  const std::vector<char> fewer(bytes.begin(), bytes.end() - 1);
  StateBuffer short_pages = Buffer(fewer);
  const SnapshotShard short_one = Shard(5, 50, 0, 2, bytes);
  EXPECT_EQ(PushByHand(address, short_one, short_pages.fd()),
            static_cast<int>(absl::StatusCode::kInvalidArgument));
  const SnapshotShard written = Shard(5, 55, 0, 2, bytes);
  {
    const int writer = ::open(absl::StrCat("/proc/self/fd/", pages.fd()).c_str(), O_RDWR);
    ASSERT_GE(writer, 0);
    struct flock lock{};
    lock.l_type = F_WRLCK;
    lock.l_whence = SEEK_SET;
    ASSERT_EQ(::fcntl(writer, F_OFD_SETLK, &lock), 0);
    EXPECT_EQ(PushByHand(address, written, pages.fd()),
              static_cast<int>(absl::StatusCode::kUnavailable));
    ::close(writer);
  }
  EXPECT_FALSE(pages.HeldElsewhere());
  const SnapshotShard whole = Shard(5, 60, 0, 2, bytes);
  EXPECT_EQ(PushByHand(address, whole, pages.fd()), 0);
  EXPECT_TRUE(pages.HeldElsewhere());
  SnapshotStore& store = peer->store;
  peer->server.reset();  // waits for every connection it serves
  EXPECT_FALSE(store.Find(torn.id, 0).has_value());
  EXPECT_FALSE(store.Find(short_one.id, 0).has_value());
  EXPECT_FALSE(store.Find(written.id, 0).has_value());
  ASSERT_TRUE(store.Find(whole.id, 0).has_value());
  EXPECT_EQ(Copy(store.Find(whole.id, 0)->bytes), bytes);
  {
    absl::MutexLock lock(&peer->mu);
    ASSERT_EQ(peer->replicas.size(), 1u);
    EXPECT_EQ(peer->replicas[0].id, whole.id);
  }
  // Dropped by the store (here, with the whole store), the pages may be written again.
  peer.reset();
  EXPECT_FALSE(pages.HeldElsewhere());
}

// A holder on this host that took the pages and never answered (its process died, or it ran
// past the deadline) might keep them: the pusher's buffer is retired, never to be written again.
TEST(SnapshotPeerTest, PagesPassedWithoutAnAnswerAreNeverWrittenAgain) {
  // A holder that takes the description and the descriptor, then closes without an answer.
  const std::string address = absl::StrCat("holder-", ::getpid(), ":1");
  const int listener = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  LocalSocket at(address);
  ASSERT_EQ(::bind(listener, at.address(), at.length), 0);
  ASSERT_EQ(::listen(listener, 1), 0);
  bool got_descriptor = false;
  std::thread holder([&] {
    const int fd = ::accept(listener, nullptr, nullptr);
    uint32_t frame[3] = {0, 0, 0};
    ASSERT_EQ(::recv(fd, frame, sizeof(frame), MSG_WAITALL), static_cast<ssize_t>(sizeof(frame)));
    std::string header(frame[2], '\0');
    ASSERT_EQ(::recv(fd, header.data(), header.size(), MSG_WAITALL),
              static_cast<ssize_t>(header.size()));
    DescriptorMessage received;
    got_descriptor = ::recvmsg(fd, &received.message, MSG_CMSG_CLOEXEC) == 1 &&
                     CMSG_FIRSTHDR(&received.message) != nullptr;
    if (got_descriptor) {
      int passed = -1;
      std::memcpy(&passed, CMSG_DATA(CMSG_FIRSTHDR(&received.message)), sizeof(int));
      ::close(passed);
    }
    ::close(fd);
  });
  const std::vector<char> bytes = Bytes(5000, 9);
  const SnapshotShard shard = Shard(5, 10, 0, 2, bytes);
  auto pushed = std::make_shared<StateBuffer>(Buffer(bytes));
  PeerCallOptions options;
  options.same_host_pages = true;
  const absl::Status status = PushSnapshotShard(address, shard, *pushed, options);
  holder.join();
  ::close(listener);
  ASSERT_TRUE(got_descriptor);
  EXPECT_TRUE(absl::IsUnavailable(status)) << status;
  EXPECT_TRUE(pushed->retired());
  // Its snapshot dropped, the store does not hand the buffer out again.
  SnapshotStore own(/*kept_snapshots=*/1);
  own.Add(shard, pushed);
  pushed.reset();
  own.Add(Shard(5, 20, 0, 2, bytes), Shared(bytes));
  EXPECT_EQ(own.ReadyBuffers(bytes.size()), 0);
}

TEST(SnapshotPeerTest, CallsEndWhenCancelledOrWhenTheirDeadlinePasses) {
  // A peer that takes connections (the kernel's backlog) and never answers.
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in at{};
  at.sin_family = AF_INET;
  at.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&at), sizeof(at)), 0);
  ASSERT_EQ(::listen(fd, 4), 0);
  socklen_t length = sizeof(at);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&at), &length);
  const std::string silent = absl::StrCat("127.0.0.1:", ntohs(at.sin_port));
  std::vector<char> out(16);
  PeerCallOptions timed;
  timed.timeout = absl::Milliseconds(200);
  absl::Status late = FetchSnapshotRange(silent, "step-00000001-g1", 0, 0, 16, out.data(), timed);
  EXPECT_TRUE(absl::IsDeadlineExceeded(late)) << late;
  std::atomic<bool> cancel{true};
  PeerCallOptions cancelled;
  cancelled.cancel = &cancel;
  absl::Status stopped =
      FetchSnapshotRange(silent, "step-00000001-g1", 0, 0, 16, out.data(), cancelled);
  EXPECT_TRUE(absl::IsCancelled(stopped)) << stopped;
  ::close(fd);
  // Nobody listening at all.
  absl::Status refused =
      FetchSnapshotRange(silent, "step-00000001-g1", 0, 0, 16, out.data(), timed);
  EXPECT_FALSE(refused.ok());
}

// A checkpoint manifest over `shards` of one rank each (the pieces do not matter here: the
// reader's byte ranges are what is tested).
CheckpointManifest ManifestOf(const std::vector<SnapshotShard>& shards) {
  CheckpointManifest manifest;
  manifest.id = shards[0].id;
  for (const SnapshotShard& shard : shards) manifest.shards.push_back(shard.record);
  ParamSpec param{"p", {static_cast<int64_t>(shards[0].record.bytes / 4)}, DataType::kFloat32,
                  false};
  manifest.tensors.push_back(CheckpointTensor{param, {{0, param.numel(), 0, 0}}});
  return manifest;
}

int CallingThreadsNice() {
  return ::getpriority(PRIO_PROCESS, static_cast<id_t>(::syscall(SYS_gettid)));
}

// Replicates one snapshot from a Snapshotter to a buddy's server, both started on the calling
// thread: the nice values of the threads that reported it held and kept, in that order.
std::vector<int> NiceOfReplicationThreads() {
  absl::Mutex mu;
  std::vector<int> nice;
  const auto record_nice = [&] {
    absl::MutexLock lock(&mu);
    nice.push_back(CallingThreadsNice());
  };
  SnapshotStore buddy_store;
  std::unique_ptr<SnapshotServer> buddy = *SnapshotServer::Start(
      "127.0.0.1", 0, &buddy_store,
      [&](const SnapshotShard&, const std::vector<std::string>&) { record_nice(); });
  SnapshotStore own_store;
  Snapshotter::Callbacks callbacks;
  callbacks.on_held = [&](const SnapshotShard&, const std::vector<std::string>&) {
    record_nice();
  };
  callbacks.on_push_failed = [](const SnapshotShard&, const std::string&,
                                const absl::Status& why) { ADD_FAILURE() << why; };
  Snapshotter snapshotter(&own_store, {{buddy->address()}}, callbacks);
  const std::vector<char> bytes = Bytes(4097, 3);
  SHARD_EXPECT_OK(snapshotter.Start(Shard(1, 10, 0, 2, bytes), Shared(bytes), nullptr));
  SHARD_EXPECT_OK(snapshotter.WaitIdle(nullptr));
  EXPECT_TRUE(buddy_store.Find(SnapshotId(10, 1), 0).has_value()) << "the replica was not kept";
  absl::MutexLock lock(&mu);
  return nice;
}

TEST(SnapshotPeerTest, ReplicationRunsAtBackgroundPriorityAndTheCallerKeepsItsOwn) {
  const int caller_nice = CallingThreadsNice();
  if (caller_nice >= kBackgroundNice) GTEST_SKIP() << "the test itself runs at nice " << caller_nice;
  EXPECT_THAT(NiceOfReplicationThreads(), ElementsAre(kBackgroundNice, kBackgroundNice));
  EXPECT_EQ(CallingThreadsNice(), caller_nice);
  // A worker that runs below that priority already keeps its own for replication (a root
  // process could otherwise raise it). On a thread of its own, so that this one keeps its nice.
  std::vector<int> lower;
  std::thread([&] {
    ASSERT_EQ(::setpriority(PRIO_PROCESS, static_cast<id_t>(::syscall(SYS_gettid)), 15), 0);
    lower = NiceOfReplicationThreads();
  }).join();
  EXPECT_THAT(lower, ElementsAre(15, 15));
}

TEST(SnapshotFetchTest, ARangeIsReadFromTheOwnStoreOrTheFirstHolderThatServesItAndVerified) {
  Peer holder;  // holds rank 0's shard
  SnapshotStore own;
  const std::vector<char> bytes0 = Bytes(kCheckpointBlockBytes + 400, 5);
  const std::vector<char> bytes1 = Bytes(kCheckpointBlockBytes + 400, 6);
  const SnapshotShard shard0 = Shard(2, 8, 0, 2, bytes0);
  const SnapshotShard shard1 = Shard(2, 8, 1, 2, bytes1);
  StateBuffer pushed = Buffer(bytes0);
  SHARD_ASSERT_OK(PushSnapshotShard(holder.server->address(), shard0, pushed, PeerCallOptions{}));
  own.Add(shard1, Shared(bytes1));
  // Rank 0's first listed holder is gone; the second serves it.
  std::vector<std::vector<SnapshotHolderAddress>> holders = {
      {{"w9", "127.0.0.1:1"}, {"w5", holder.server->address()}}, {{"me", "127.0.0.1:1"}}};
  SnapshotReadStats stats;
  std::unique_ptr<CheckpointReader> reader = CheckpointReader::Open(
      ManifestOf({shard0, shard1}),
      SnapshotShards(shard0.id, holders, &own, absl::Seconds(10), nullptr, &stats), "memory");
  std::vector<float> values(bytes0.size() / 4);
  SHARD_ASSERT_OK(reader->ReadElements(0, -1, 0, static_cast<int64_t>(values.size()),
                                       values.data()));
  EXPECT_EQ(std::memcmp(values.data(), bytes0.data(), values.size() * 4), 0);
  EXPECT_EQ(stats.bytes_from_peers.load(), values.size() * 4);

  // Rank 1's shard is this worker's own: no network. Garbled in memory, it is caught, and with
  // no other holder of it the read fails naming the copy.
  std::vector<char> read(bytes1.size());
  std::unique_ptr<ShardStorage> storage =
      SnapshotShards(shard0.id, holders, &own, absl::Seconds(10), nullptr, nullptr);
  SHARD_ASSERT_OK(storage->Read(1, 0, read.size(), read.data()));
  EXPECT_EQ(read, bytes1);
  const_cast<char*>(own.Find(shard1.id, 1)->bytes.data())[12] ^= 1;
  CheckpointManifest manifest = ManifestOf({shard0, shard1});
  manifest.tensors[0].pieces[0].shard = 1;
  std::vector<std::vector<SnapshotHolderAddress>> only_mine = {holders[0], {}};
  std::unique_ptr<CheckpointReader> garbled = CheckpointReader::Open(
      manifest, SnapshotShards(shard0.id, only_mine, &own, absl::Seconds(10), nullptr, nullptr),
      "memory");
  absl::Status corrupt = garbled->ReadElements(0, -1, 0, 4, values.data());
  EXPECT_TRUE(absl::IsDataLoss(corrupt)) << corrupt;
  EXPECT_THAT(corrupt.message(),
              HasSubstr("rank 1's shard of memory snapshot step-00000008-g2 as this worker held "
                        "it"));

  // Nobody holds it: the error names every holder tried.
  std::vector<std::vector<SnapshotHolderAddress>> gone = {{{"w9", "127.0.0.1:1"}}, {}};
  absl::Status unavailable =
      SnapshotShards(shard0.id, gone, nullptr, absl::Seconds(10), nullptr, nullptr)
          ->Read(0, 0, 8, read.data());
  EXPECT_TRUE(absl::IsUnavailable(unavailable)) << unavailable;
  EXPECT_THAT(unavailable.message(), HasSubstr("w9 at 127.0.0.1:1"));
}

// A holder's replica garbled in its memory after it was verified (SHARD_CORRUPT_REPLICAS, as a
// flipped bit would leave it) is refused by its checksums: the read goes on from the next holder
// and returns the right bytes, and what was refused is said. Only when every copy is bad does
// the read fail, naming them.
TEST(SnapshotFetchTest, ACopyThatFailsItsChecksumsIsRefusedAndTheNextHolderRead) {
  Peer flipped;
  Peer good;
  const std::vector<char> bytes = Bytes(2 * kCheckpointBlockBytes + 1000, 8);
  StateBuffer pushed = Buffer(bytes);
  const SnapshotShard shard = Shard(3, 20, 0, 1, bytes);
  ::setenv("SHARD_CORRUPT_REPLICAS", "1", 1);
  // The replica arrives whole; the bit flips once it is kept.
  SHARD_ASSERT_OK(PushSnapshotShard(flipped.server->address(), shard, pushed, PeerCallOptions{}));
  ::unsetenv("SHARD_CORRUPT_REPLICAS");
  SHARD_ASSERT_OK(PushSnapshotShard(good.server->address(), shard, pushed, PeerCallOptions{}));
  ASSERT_NE(Copy(flipped.store.Find(shard.id, 0)->bytes), bytes);
  ASSERT_EQ(Copy(good.store.Find(shard.id, 0)->bytes), bytes);

  const std::vector<std::vector<SnapshotHolderAddress>> holders = {
      {{"w1", flipped.server->address()}, {"w2", good.server->address()}}};
  SnapshotReadStats stats;
  std::unique_ptr<CheckpointReader> reader = CheckpointReader::Open(
      ManifestOf({shard}),
      SnapshotShards(shard.id, holders, nullptr, absl::Seconds(10), nullptr, &stats), "memory");
  std::vector<float> values(bytes.size() / 4);
  SHARD_ASSERT_OK(reader->ReadElements(0, -1, 0, static_cast<int64_t>(values.size()),
                                       values.data()));
  EXPECT_EQ(std::memcmp(values.data(), bytes.data(), values.size() * 4), 0);
  ASSERT_EQ(stats.refusals().size(), 1u);
  EXPECT_THAT(stats.refusals()[0],
              AllOf(HasSubstr("rank 0's shard of memory snapshot step-00000020-g3 as w1 at " +
                              flipped.server->address() + " held it failed its checksums"),
                    HasSubstr("do not match their checksum"),
                    HasSubstr("refused, read from the next holder")));
  // Later reads go to the good holder only.
  SHARD_ASSERT_OK(reader->VerifyShard(0, nullptr));
  EXPECT_EQ(stats.refusals().size(), 1u);

  // Held only by the garbled copy: the read fails, naming it.
  SnapshotReadStats alone;
  std::unique_ptr<CheckpointReader> bad = CheckpointReader::Open(
      ManifestOf({shard}),
      SnapshotShards(shard.id, {{holders[0][0]}}, nullptr, absl::Seconds(10), nullptr, &alone),
      "memory");
  const absl::Status refused = bad->ReadElements(0, -1, 0, static_cast<int64_t>(values.size()),
                                                 values.data());
  EXPECT_TRUE(absl::IsDataLoss(refused)) << refused;
  EXPECT_THAT(refused.message(), HasSubstr("as w1 at " + flipped.server->address() + " held it"));
  ASSERT_EQ(alone.refusals().size(), 1u);
  EXPECT_THAT(alone.refusals()[0], HasSubstr("no other holder has it"));
}

}  // namespace
}  // namespace shard
