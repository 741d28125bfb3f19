// A DeviceCommunicator over any host Communicator (Gloo in the worker): each collective copies its
// device input into pinned host memory, runs the host collective there, and copies the result
// back, ordered after the compute stream like NCCL's (see device_communicator.h).
//
// It lets several ranks share one GPU, which NCCL refuses, and GPU ranks train with the Gloo
// backend, e.g. in tests on a one-GPU machine. The price is two PCIe copies per collective and a
// host wait for the device-to-host copy, because the host library needs the data before it
// starts; the copy back is asynchronous.
//
// Collectives are issued from one thread at a time; Abort() (forwarded to the inner
// communicator) and aborted() from any thread.
#pragma once

#include <atomic>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "worker/gpu/collective_stream.h"
#include "worker/gpu/cuda_resources.h"
#include "worker/gpu/device_communicator.h"

namespace shard {

class StagedCommunicator final : public DeviceCommunicator {
 public:
  // `inner` (not owned) must outlive this communicator and works on host memory.
  static absl::StatusOr<std::unique_ptr<StagedCommunicator>> Create(
      Communicator* inner, DeviceCommunicatorOptions options);
  // The same, owning `inner` (e.g. the worker's Gloo communicator of the generation).
  static absl::StatusOr<std::unique_ptr<StagedCommunicator>> Create(
      std::unique_ptr<Communicator> inner, DeviceCommunicatorOptions options);

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  absl::string_view backend() const override { return backend_; }

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
  StagedCommunicator(Communicator* inner, DeviceCommunicatorOptions options,
                     CollectiveStream stream, CudaEvent staged);

  // One collective's data movement. The host collective reads the send area and writes the
  // receive area, which is the send area itself when `in_place`.
  struct Transfer {
    const void* send;  // device
    size_t send_bytes;
    bool copy_in;  // false where this rank's input is not used (a broadcast's non-roots)
    void* recv;    // device
    size_t recv_bytes;
    bool copy_out;  // false where this rank gets no output (a reduce's non-roots)
    bool in_place;
  };

  // Copies the input to pinned memory, waits for that copy, runs `collective(host_send,
  // host_recv)`, and enqueues the copy of the output back to the device.
  absl::Status Stage(absl::string_view what, const Transfer& transfer,
                     absl::FunctionRef<absl::Status(void* host_send, void* host_recv)> collective);
  absl::Status AbortedStatus() const;

  std::unique_ptr<Communicator> owned_inner_;  // set when created owning it
  Communicator* const inner_;
  const DeviceCommunicatorOptions options_;
  const std::string backend_;
  CollectiveStream stream_;
  CudaEvent staged_;      // the device-to-host copy of the current collective is done
  PinnedBuffer staging_;  // send area, then receive area; grows to the largest collective

  mutable absl::Mutex mu_;
  std::string abort_reason_ ABSL_GUARDED_BY(mu_);
  std::atomic<bool> aborted_{false};
};

}  // namespace shard
