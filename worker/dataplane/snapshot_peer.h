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
// On the same host a push copies nothing: the receiver keeps the pusher's own pages. A rank's
// copy of its state is a memory file (worker/dataplane/state_buffer.h). The server also listens
// on an abstract Unix socket named after its address, which only a process in the same network
// namespace (so on the same host) can reach; a push that reaches it sends the shard's
// description there, in the same frames, and passes the memory file's descriptor. The server
// opens the file again (a description of its own), takes a read lock on it, maps the pages
// read-only and keeps them as the replica; the lock goes when the store drops the replica or the
// server's process dies, and until then the pusher does not write those pages again. The pages
// are not hashed again: nothing travelled, and the pusher hashed them itself (a restore checks
// every byte it reads). A replica on the same host guards against a worker's death, not the
// host's, and the pages outlive the pusher. Nothing is named in /dev/shm, so nothing outlives
// the workers. Only a process of the server's user may push this way. A pusher killed before it
// passed the descriptor leaves nothing kept, as over TCP; one that passed it and heard no answer
// never writes those pages again (the server might keep them).
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

class ShardHasher;

struct PeerCallOptions {
  absl::Duration timeout = absl::Seconds(60);  // for the whole call
  const std::atomic<bool>* cancel = nullptr;   // set: the call ends with Cancelled
  // Set: a push to a server on this host hands it the pages of the pushed buffer (above); not
  // set: over TCP always, as across hosts.
  bool same_host_pages = false;
  // Set: why a buddy on this host did not keep the pages, when the push went over TCP instead.
  absl::Status* pages_refused = nullptr;
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
  // A push from this host on `fd` (the shard's description `shard`): keeps the pages of the
  // memory file the pusher passes as the replica.
  void TakeSameHostPush(int fd, const SnapshotShard& shard);
  // Whether a received replica's bytes hashed (`hasher`, fed all of them) to the checksums it
  // was sent with: DataLoss if not. Then CorruptIfAsked.
  absl::Status CheckReplica(const SnapshotShard& shard, ShardHasher& hasher,
                            char* bytes) const;
  // Flips a bit of replica `bytes` if SHARD_CORRUPT_REPLICAS asks.
  void CorruptIfAsked(const SnapshotShard& shard, char* bytes) const;
  // Joins the threads of connections that are done.
  void ReapLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string address_;
  const int listen_fd_;
  const int local_listen_fd_;  // the abstract Unix socket, or -1 (its name too long)
  SnapshotStore* const store_;
  const ReplicaCallback on_replica_;
  std::atomic<bool> stopping_{false};
  absl::Mutex mu_;
  std::list<Connection> connections_ ABSL_GUARDED_BY(mu_);  // cut at shutdown
  std::thread accept_thread_;
};

// Sends `bytes` (shard `shard` of a snapshot, `shard.record` its checksums) to the server at
// `address`, which keeps it once it checked them, or on the same host keeps its pages (then
// `bytes` is retired if the server may keep them without having answered). OK only once it
// holds it.
absl::Status PushSnapshotShard(const std::string& address, const SnapshotShard& shard,
                               StateBuffer& bytes, const PeerCallOptions& options);

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
