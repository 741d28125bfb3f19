// Snapshot shards between workers, without the coordinator: a worker's SnapshotServer serves
// byte ranges of the shards its SnapshotStore holds and takes the replicas its buddies push to
// it; PushSnapshotShard and FetchSnapshotRange are the two calls.
//
// Over TCP, one request per connection: [u32 magic][u32 kind][u32 header bytes][header]
// [payload], answered by [u32 magic][u32 status code][u32 message bytes][message][payload]; the
// header is JSON (a push's is the shard's description, common/snapshot.h). A pushed replica is
// checked against its block checksums (every byte is in a block) before it is kept and before the
// pusher hears back, so a push cut off half-way (a killed sender, a broken connection) leaves
// nothing behind, and an answered push is held. Every call and every connection the server serves has a deadline, and a call can be
// cancelled (a generation that ends). Like the Gloo data path, these connections are neither
// encrypted nor authenticated: they carry the job's state between its own workers, on the network
// their collectives use (--host).
//
// On the same host a push copies its bytes once, into memory the receiver keeps. The server also
// listens on an abstract Unix socket named after its address, which only a process in the same
// network namespace (so on the same host) can reach; a push that reaches it asks for a buffer
// there, in the same frames. The server lends one of its shared buffers (a memory file passed as
// a descriptor); the pusher maps it (once: LentBuffers keeps it mapped, and the server lends the
// same few buffers again and again), copies its bytes in and says so; the server checks the
// checksums and keeps the buffer as the replica. When the store drops that replica the buffer goes
// back to the server's pool. Nothing is named in /dev/shm, so nothing outlives the workers. Only a
// process of the server's user may push this way. A pusher cut off before it said it was done
// leaves nothing kept, as over TCP; a buffer whose pusher ran past the deadline is not lent again
// (the pusher might still write to it).
#pragma once

#include <atomic>
#include <functional>
#include <list>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/snapshot.h"
#include "worker/dataplane/snapshot_store.h"

namespace shard {

// The buffers buddies on this host lent a pusher, mapped once and reused. One pusher thread.
class LentBuffers {
 public:
  LentBuffers() = default;
  ~LentBuffers();
  LentBuffers(const LentBuffers&) = delete;
  LentBuffers& operator=(const LentBuffers&) = delete;

  // The lent buffer `fd` refers to, mapped, with room for `bytes`.
  absl::StatusOr<char*> Map(int fd, uint64_t bytes);

 private:
  struct Mapping {
    uint64_t device = 0;
    uint64_t inode = 0;
    char* base = nullptr;
    uint64_t bytes = 0;
    uint64_t last_used = 0;
  };
  std::vector<Mapping> mappings_;
  uint64_t uses_ = 0;
};

class ShardHasher;
class SharedBufferPool;

struct PeerCallOptions {
  absl::Duration timeout = absl::Seconds(60);  // for the whole call
  const std::atomic<bool>* cancel = nullptr;   // set: the call ends with Cancelled
  // Set: a push to a server on this host copies into a buffer it lends (above), mapped through
  // these; null: over TCP always, as across hosts.
  LentBuffers* lent = nullptr;
};

// Lowers the calling thread's priority to kBackgroundNice (a thread already lower keeps its
// own), so that replication takes the CPU time training leaves.
constexpr int kBackgroundNice = 10;
void YieldToTraining();

// How long moving `bytes` may take: `floor` plus the time at `min_bytes_per_second` (a peer that
// is slower than that is as good as gone).
absl::Duration TransferTimeout(uint64_t bytes, absl::Duration floor,
                               double min_bytes_per_second = 50e6);

class SnapshotServer {
 public:
  // Called after a pushed replica is verified and in the store (with the snapshot ids the store
  // dropped to make room), before the pusher hears back: the worker tells the coordinator there.
  using ReplicaCallback =
      std::function<void(const SnapshotShard& shard, const std::vector<std::string>& dropped)>;

  // Listens on `host` (the address peers reach this worker at), port `port` (0: any free one).
  static absl::StatusOr<std::unique_ptr<SnapshotServer>> Start(const std::string& host, int port,
                                                               SnapshotStore* store,
                                                               ReplicaCallback on_replica);
  // Stops listening, cuts the connections it serves and waits for their threads.
  ~SnapshotServer();
  SnapshotServer(const SnapshotServer&) = delete;
  SnapshotServer& operator=(const SnapshotServer&) = delete;

  // host:port, for peers.
  const std::string& address() const { return address_; }

 private:
  SnapshotServer(std::string address, int listen_fd, int local_listen_fd, SnapshotStore* store,
                 ReplicaCallback on_replica);
  // A connection being served, on its own thread.
  struct Connection {
    int fd = -1;
    std::thread thread;
    bool done = false;  // its thread has finished (join it)
  };

  void AcceptLoop();
  void Serve(int fd);
  // A push from this host on `fd` (the shard's description `shard`): lends it a buffer, and
  // keeps the buffer as the replica once the pusher wrote it and it checks.
  void TakeSameHostPush(int fd, const SnapshotShard& shard);
  // Whether a received replica's bytes hashed (`hasher`, fed all of them) to the checksums it
  // was sent with: DataLoss if not. Then flips a bit of `bytes` if SHARD_CORRUPT_REPLICAS asks.
  absl::Status CheckReplica(const SnapshotShard& shard, ShardHasher& hasher,
                            char* bytes) const;
  // Joins the threads of connections that are done.
  void ReapLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string address_;
  const int listen_fd_;
  const int local_listen_fd_;  // the abstract Unix socket, or -1 (its name too long)
  const std::shared_ptr<SharedBufferPool> pool_;  // the buffers lent to pushers on this host
  SnapshotStore* const store_;
  const ReplicaCallback on_replica_;
  std::atomic<bool> stopping_{false};
  absl::Mutex mu_;
  std::list<Connection> connections_ ABSL_GUARDED_BY(mu_);  // cut at shutdown
  std::thread accept_thread_;
};

// Sends `bytes` (shard `shard` of a snapshot, `shard.record` its checksums) to the server at
// `address`, which keeps it once it checked them. OK only once it holds it.
absl::Status PushSnapshotShard(const std::string& address, const SnapshotShard& shard,
                               const std::vector<char>& bytes, const PeerCallOptions& options);

// Reads bytes [offset, offset + bytes) of rank `rank`'s shard of snapshot `id` from the server
// at `address` into `out`. NotFound when it does not hold that shard (any more). The bytes are
// as it holds them: the reader checks them against the snapshot's checksums.
absl::Status FetchSnapshotRange(const std::string& address, const std::string& id, int rank,
                                uint64_t offset, uint64_t bytes, char* out,
                                const PeerCallOptions& options);

// Whether this worker can open a TCP connection to a peer's server, and how long that took.
struct ConnectProbe {
  bool reachable = false;
  absl::Duration took;
  std::string detail;  // why not
};

// Connects to each of `addresses` (host:port of peers' snapshot servers, which listen on the
// data path's network) and closes again, all at once, each within `options.timeout`: the connect
// probe a generation runs before its data path connects, and an isolated standby before it may
// be folded in (server/reachability.h). By address.
std::vector<ConnectProbe> ProbeConnect(const std::vector<std::string>& addresses,
                                       const PeerCallOptions& options);

}  // namespace shard
