// The data path's collectives, with one interface for every backend (Gloo over TCP on CPU,
// NCCL on GPU). Buffers are raw pointers with element counts, as in NCCL: host memory for
// Gloo, device memory for NCCL.
//
// Collectives are issued from one thread at a time and in the same order on every rank.
// Abort() may be called from any thread: it makes the collective in flight and every later
// one return Aborted promptly instead of waiting for a peer that will never come.
#pragma once

#include <cstddef>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/control_types.h"
#include "common/dtype.h"

namespace shard {

enum class ReduceOp { kSum, kMax, kMin };

// Host memory the peers on this host read in place; see Communicator::ShareHostBuffer. The
// memory stops being shared when this is destroyed: destroy it before the memory is freed, and
// before the communicator.
class SharedHostBuffer {
 public:
  virtual ~SharedHostBuffer() = default;
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual absl::string_view backend() const = 0;
  // Whether the buffers passed in are device memory (a GPU backend) rather than host memory.
  virtual bool device_buffers() const { return false; }

  // recv[i] = op over ranks of send[i], for i < count. send == recv is allowed (in place).
  virtual absl::Status AllReduce(const void* send, void* recv, size_t count, DataType dtype,
                                 ReduceOp op) = 0;
  // send holds size() * recv_count elements; rank r receives the reduction of block r.
  virtual absl::Status ReduceScatter(const void* send, void* recv, size_t recv_count,
                                     DataType dtype, ReduceOp op) = 0;
  // recv holds size() * send_count elements: block r is rank r's send.
  virtual absl::Status AllGather(const void* send, void* recv, size_t send_count,
                                 DataType dtype) = 0;
  // recv on `root` = op over ranks of send (recv is only written on root; in place allowed).
  virtual absl::Status Reduce(const void* send, void* recv, size_t count, DataType dtype,
                              ReduceOp op, int root) = 0;
  // buffer of `root` is copied to every rank's buffer.
  virtual absl::Status Broadcast(void* buffer, size_t count, DataType dtype, int root) = 0;
  virtual absl::Status Barrier() = 0;

  // Offers `bytes` of host memory at `data` to the peers on this host, so that later
  // collectives whose send buffer (for an all-reduce, its recv buffer too) lies in it are read
  // in place by the peers, not copied through the communicator's own buffers: one copy
  // fewer each way. Collective: every rank calls it at the same point with the same `bytes`,
  // while no thread uses the memory. `data` must start whole pages of an anonymous mapping the
  // caller owns and `bytes` be a multiple of the page size; the pages keep their address and
  // contents. Returns null where the backend reads no peer's memory (the collectives work on
  // any buffer as before), and ResourceExhausted, on every rank alike and with the
  // communicator still usable, where a rank could not share its buffer (no room in /dev/shm).
  virtual absl::StatusOr<std::unique_ptr<SharedHostBuffer>> ShareHostBuffer(void* /*data*/,
                                                                            size_t /*bytes*/) {
    return nullptr;
  }

  // Makes the compute that follows see every collective issued so far. Host backends finish a
  // collective before returning, so for them there is nothing to do; a GPU backend's
  // collectives run on a stream of their own (worker/gpu/device_communicator.h).
  virtual absl::Status OrderComputeAfterCollectives() { return absl::OkStatus(); }

  // How long a collective waits for a peer from now on (thread-safe; the worker derives it from
  // the measured step times). A backend whose collectives cannot time out ignores it.
  virtual void SetCollectiveTimeout(absl::Duration /*timeout*/) {}

  // Thread-safe and idempotent; `reason` is carried in the errors that follow.
  virtual void Abort(absl::string_view reason) = 0;
  virtual bool aborted() const = 0;

  // The peer whose link failed a collective, and how (a send or receive that timed out, or a
  // connection the kernel gave up on), once one did; none where no link failed or the backend
  // cannot tell. The worker reports it to the coordinator (server/reachability.h).
  virtual std::optional<PeerFault> peer_fault() const { return std::nullopt; }
};

}  // namespace shard
