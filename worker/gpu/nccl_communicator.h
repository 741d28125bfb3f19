// The GPU backend of Communicator: NCCL on a stream of its own (see device_communicator.h for the
// ordering rules), created without blocking and abortable at any moment.
//
//   IdExchange exchange{publish, fetch};  // e.g. the coordinator's KV store, per generation
//   auto comm = NcclCommunicator::Create(rank, size, exchange, options);
//   comm->AllReduce(grads, grads, n, DataType::kFloat32, ReduceOp::kSum);  // enqueued
//   comm->OrderComputeAfterCollectives();  // the optimizer, enqueued next, sees the sums
//
// Creation: rank 0 makes the NCCL unique id and publishes it, the others fetch it; then
// ncclCommInitRankConfig runs with blocking = 0, so Create returns while the ranks connect. The
// first collective (or WaitReady) waits for that, up to init_timeout, polling
// ncclCommGetAsyncError so that Abort() ends the wait at once.
//
// Abort(reason) (thread-safe, idempotent) calls ncclCommAbort, which also ends kernels waiting
// for a dead peer; the call in flight and every later one return Aborted with the reason.
// Every NCCL failure carries ncclGetErrorString and ncclGetLastError.
//
// Collectives are issued from one thread at a time (as Communicator requires); Abort(),
// aborted() and the accessors may be called from any thread.
#pragma once

#include <nccl.h>

#include <atomic>
#include <functional>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "worker/gpu/collective_stream.h"
#include "worker/dataplane/key_value_store.h"
#include "worker/gpu/cuda_resources.h"
#include "worker/gpu/device_communicator.h"

namespace shard {

// How ranks agree on the NCCL unique id: rank 0 publishes it, the others fetch it. In the worker
// both go to the coordinator's key-value store, which scopes keys by generation.
struct IdExchange {
  std::function<absl::Status(const std::string& key, const std::string& value)> publish;
  // Waits until `key` exists (under the store's own timeout; Aborted when the generation ends).
  std::function<absl::StatusOr<std::string>(const std::string& key)> fetch;
};

// Publishes with store->Set and fetches with store->Wait (up to `timeout`) then Get. `store` (not
// owned) must outlive the exchange.
IdExchange KeyValueIdExchange(KeyValueStore* store, absl::Duration timeout);

struct NcclOptions : DeviceCommunicatorOptions {
  std::string key = "nccl_unique_id";  // where the unique id is published
  absl::Duration init_timeout = absl::Minutes(2);
};

class NcclCommunicator final : public DeviceCommunicator {
 public:
  // InvalidArgument for a bad rank or size, the exchange's error, or NCCL's (with its text).
  static absl::StatusOr<std::unique_ptr<NcclCommunicator>> Create(int rank, int size,
                                                                  const IdExchange& exchange,
                                                                  NcclOptions options);
  // Finalises and destroys the communicator when it is healthy (bounded wait), else aborts it.
  ~NcclCommunicator() override;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  // Waits until every rank has connected. DeadlineExceeded (and the communicator aborted) after
  // init_timeout, Aborted after Abort(), NCCL's error if initialisation failed.
  absl::Status WaitReady();

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  absl::string_view backend() const override { return "nccl"; }

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

  void Abort(absl::string_view reason) override;
  bool aborted() const override { return aborted_.load(); }

  cudaStream_t stream() const override { return stream_.get(); }
  absl::Status OrderComputeAfterCollectives() override;
  absl::Status Synchronize() override;

 private:
  NcclCommunicator(int rank, int size, NcclOptions options, CollectiveStream stream,
                   DeviceBuffer barrier_value);

  // Enqueues one NCCL call on the stream, after the compute stream.
  template <typename Call>
  absl::Status Run(absl::string_view what, Call call);
  // Polls ncclCommGetAsyncError until the communicator is no longer in progress: true when
  // idle, an error when it failed or was aborted.
  absl::StatusOr<bool> Idle(absl::string_view what);
  // Error for a failed NCCL call, with ncclGetLastError of comm_.
  absl::Status Failure(ncclResult_t result, absl::string_view what)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status AbortedStatus() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status CheckRoot(int root) const;
  // Flushes a healthy communicator before ncclCommDestroy; false when that fails or a peer
  // does not take part within a bounded time.
  bool Finalize(ncclComm_t comm) const;

  const int rank_;
  const int size_;
  const NcclOptions options_;
  CollectiveStream stream_;
  DeviceBuffer barrier_value_;  // the one float Barrier() all-reduces

  // NCCL calls on comm_ are serialised with Abort(), which takes it (null once aborted).
  mutable absl::Mutex mu_;
  ncclComm_t comm_ ABSL_GUARDED_BY(mu_) = nullptr;
  std::string abort_reason_ ABSL_GUARDED_BY(mu_);
  std::atomic<bool> aborted_{false};
  std::atomic<bool> ready_{false};
};

}  // namespace shard
