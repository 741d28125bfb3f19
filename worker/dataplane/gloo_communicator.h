// The CPU data path: collectives over Gloo's TCP transport.
//
// Connection set-up is Gloo's full mesh through our rendezvous store. The collectives are our
// own pipelined ring algorithms on Gloo's unbound buffers (segments of `segment_bytes` flow
// through the ring while earlier ones are being reduced), because that lets Abort() wake a
// thread blocked in a collective at once: Gloo's built-in collectives can only time out.
//
// Thread-compatible for collectives (one caller at a time); Abort() is thread-safe.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "worker/dataplane/communicator.h"
#include "worker/dataplane/key_value_store.h"

namespace gloo {
class Context;
}

namespace shard {

struct GlooOptions {
  int rank = 0;
  int size = 1;
  std::string hostname = "127.0.0.1";  // interface this rank listens on for its peers
  // Waiting for peers to arrive in the store, and every collective.
  absl::Duration timeout = absl::Seconds(60);
  // Once a peer's address is in the store, how long its TCP connection may take: a peer that
  // published it and then left its generation never answers, and this bounds that wait.
  absl::Duration connect_timeout = absl::Seconds(10);
  // A connection whose sent data stays unacknowledged this long, or that stays silent this long
  // and then misses its keepalive probes, fails (TCP_USER_TIMEOUT and TCP keepalive on every
  // socket of the mesh): a partitioned link is found in about this time even while collectives
  // may wait longer. A live peer's kernel acknowledges and answers keepalives even when its
  // process is stopped or hung, so only the network trips it. Zero leaves the kernel's defaults.
  absl::Duration link_timeout = absl::Seconds(10);
  std::string key_prefix = "gloo/";            // namespace in the rendezvous store
  size_t segment_bytes = size_t{1} << 20;      // pipelining granularity of the rings
  // End creation with a barrier, so that a rank that returns (and perhaps exits at once) never
  // breaks a peer's connection half-way. A caller that runs a collective of its own right after
  // creation (the worker's self-check) turns it off: that collective can be aborted when the
  // generation ends, while a barrier inside creation could only time out.
  bool barrier_after_connect = true;
};

class GlooCommunicator;

// Connects to every peer through `store` and returns once every rank is connected (creation
// is collective unless barrier_after_connect is off); fails after `timeout` if a peer does not
// arrive, or after `connect_timeout` if one that arrived does not connect.
absl::StatusOr<std::unique_ptr<GlooCommunicator>> CreateGlooCommunicator(
    KeyValueStore* store, const GlooOptions& options);

class GlooCommunicator : public Communicator {
 public:
  ~GlooCommunicator() override;

  int rank() const override;
  int size() const override;
  absl::string_view backend() const override { return "gloo"; }

  absl::Status AllReduce(const void* send, void* recv, size_t count, DataType dtype,
                         ReduceOp op) override;
  absl::Status ReduceScatter(const void* send, void* recv, size_t recv_count, DataType dtype,
                             ReduceOp op) override;
  absl::Status AllGather(const void* send, void* recv, size_t send_count,
                         DataType dtype) override;
  absl::Status Reduce(const void* send, void* recv, size_t count, DataType dtype, ReduceOp op,
                      int root) override;
  absl::Status Broadcast(void* buffer, size_t count, DataType dtype, int root) override;
  absl::Status Barrier() override;
  void SetCollectiveTimeout(absl::Duration timeout) override;
  void Abort(absl::string_view reason) override;
  bool aborted() const override;
  std::optional<PeerFault> peer_fault() const override;

  // The underlying Gloo context, for benchmarks that compare with Gloo's own collectives.
  const std::shared_ptr<gloo::Context>& gloo_context() const;

 private:
  class Impl;
  explicit GlooCommunicator(std::unique_ptr<Impl> impl);
  friend absl::StatusOr<std::unique_ptr<GlooCommunicator>> CreateGlooCommunicator(
      KeyValueStore*, const GlooOptions&);

  std::unique_ptr<Impl> impl_;
};

}  // namespace shard
