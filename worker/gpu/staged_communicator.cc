#include "worker/gpu/staged_communicator.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "worker/gpu/cuda_check.h"

namespace shard {

absl::StatusOr<std::unique_ptr<StagedCommunicator>> StagedCommunicator::Create(
    Communicator* inner, DeviceCommunicatorOptions options) {
  if (inner == nullptr) {
    return absl::InvalidArgumentError("StagedCommunicator needs a host communicator");
  }
  SHARD_ASSIGN_OR_RETURN(CollectiveStream stream,
                         CollectiveStream::Create(options.device, options.compute_stream));
  SHARD_ASSIGN_OR_RETURN(CudaEvent staged, CudaEvent::Create());
  return std::unique_ptr<StagedCommunicator>(
      new StagedCommunicator(inner, options, std::move(stream), std::move(staged)));
}

absl::StatusOr<std::unique_ptr<StagedCommunicator>> StagedCommunicator::Create(
    std::unique_ptr<Communicator> inner, DeviceCommunicatorOptions options) {
  SHARD_ASSIGN_OR_RETURN(std::unique_ptr<StagedCommunicator> staged,
                         Create(inner.get(), options));
  staged->owned_inner_ = std::move(inner);
  return staged;
}

StagedCommunicator::StagedCommunicator(Communicator* inner, DeviceCommunicatorOptions options,
                                       CollectiveStream stream, CudaEvent staged)
    : inner_(inner),
      options_(options),
      backend_(absl::StrCat(inner->backend(), "+staged")),
      stream_(std::move(stream)),
      staged_(std::move(staged)) {}

absl::Status StagedCommunicator::AbortedStatus() const {
  absl::MutexLock lock(&mu_);
  return absl::AbortedError(absl::StrCat("staged ", inner_->backend(), " communicator (rank ",
                                         rank(), " of ", size(), ") was aborted: ",
                                         abort_reason_));
}

void StagedCommunicator::Abort(absl::string_view reason) {
  {
    absl::MutexLock lock(&mu_);
    if (aborted_.load()) return;
    abort_reason_ = std::string(reason);
    aborted_.store(true);
  }
  inner_->Abort(reason);
}

absl::Status StagedCommunicator::Stage(
    absl::string_view what, const Transfer& transfer,
    absl::FunctionRef<absl::Status(void* host_send, void* host_recv)> collective) {
  if (aborted_.load()) return AbortedStatus();
  const auto check_abort = [this]() -> absl::Status {
    return aborted_.load() ? AbortedStatus() : absl::OkStatus();
  };
  const size_t needed = transfer.in_place ? std::max(transfer.send_bytes, transfer.recv_bytes)
                                          : transfer.send_bytes + transfer.recv_bytes;
  if (staging_.bytes() < needed) {
    // The last collective's copy back may still read the old buffer.
    SHARD_RETURN_IF_ERROR(stream_.Wait(options_.wait_timeout, "staged copies", check_abort));
    staging_ = PinnedBuffer();
    SHARD_ASSIGN_OR_RETURN(staging_, PinnedBuffer::Allocate(needed));
  }
  char* host_send = staging_.as<char>();
  char* host_recv = transfer.in_place ? host_send : host_send + transfer.send_bytes;
  SHARD_RETURN_IF_ERROR(stream_.AfterCompute());
  if (transfer.copy_in && transfer.send_bytes > 0) {
    // In stream order after the previous collective's copy back, which read the same memory.
    SHARD_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(host_send, transfer.send, transfer.send_bytes,
                                               cudaMemcpyDeviceToHost, stream_.get()));
  }
  SHARD_CUDA_RETURN_IF_ERROR(cudaEventRecord(staged_.get(), stream_.get()));
  SHARD_RETURN_IF_ERROR(stream_.Wait(options_.wait_timeout,
                                     absl::StrCat(what, ": copy to host"), check_abort,
                                     staged_.get()));
  SHARD_RETURN_IF_ERROR(collective(host_send, host_recv));
  if (transfer.copy_out && transfer.recv_bytes > 0) {
    SHARD_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(transfer.recv, host_recv, transfer.recv_bytes,
                                               cudaMemcpyHostToDevice, stream_.get()));
  }
  return stream_.MarkIssued();
}

absl::Status StagedCommunicator::AllReduce(const void* send, void* recv, size_t count,
                                           DataType dtype, ReduceOp op) {
  const size_t bytes = count * DataTypeSize(dtype);
  return Stage("staged all-reduce", {send, bytes, true, recv, bytes, true, /*in_place=*/true},
               [&](void* host, void*) { return inner_->AllReduce(host, host, count, dtype, op); });
}

absl::Status StagedCommunicator::ReduceScatter(const void* send, void* recv, size_t recv_count,
                                               DataType dtype, ReduceOp op) {
  const size_t recv_bytes = recv_count * DataTypeSize(dtype);
  return Stage("staged reduce-scatter",
               {send, recv_bytes * size(), true, recv, recv_bytes, true, /*in_place=*/false},
               [&](void* host_send, void* host_recv) {
                 return inner_->ReduceScatter(host_send, host_recv, recv_count, dtype, op);
               });
}

absl::Status StagedCommunicator::AllGather(const void* send, void* recv, size_t send_count,
                                           DataType dtype) {
  const size_t send_bytes = send_count * DataTypeSize(dtype);
  return Stage("staged all-gather",
               {send, send_bytes, true, recv, send_bytes * size(), true, /*in_place=*/false},
               [&](void* host_send, void* host_recv) {
                 return inner_->AllGather(host_send, host_recv, send_count, dtype);
               });
}

absl::Status StagedCommunicator::Reduce(const void* send, void* recv, size_t count,
                                        DataType dtype, ReduceOp op, int root) {
  const size_t bytes = count * DataTypeSize(dtype);
  return Stage("staged reduce",
               {send, bytes, true, recv, bytes, rank() == root, /*in_place=*/true},
               [&](void* host, void*) {
                 return inner_->Reduce(host, host, count, dtype, op, root);
               });
}

absl::Status StagedCommunicator::Broadcast(void* buffer, size_t count, DataType dtype,
                                           int root) {
  const size_t bytes = count * DataTypeSize(dtype);
  const bool is_root = rank() == root;
  return Stage("staged broadcast", {buffer, bytes, is_root, buffer, bytes, !is_root,
                                    /*in_place=*/true},
               [&](void* host, void*) { return inner_->Broadcast(host, count, dtype, root); });
}

absl::Status StagedCommunicator::Barrier() {
  if (aborted_.load()) return AbortedStatus();
  return inner_->Barrier();
}

absl::Status StagedCommunicator::OrderComputeAfterCollectives() {
  if (aborted_.load()) return AbortedStatus();
  return stream_.OrderCompute();
}

absl::Status StagedCommunicator::Synchronize() {
  const auto check_abort = [this]() -> absl::Status {
    return aborted_.load() ? AbortedStatus() : absl::OkStatus();
  };
  SHARD_RETURN_IF_ERROR(stream_.Wait(options_.wait_timeout,
                                     absl::StrCat("staged ", inner_->backend(), " collectives"),
                                     check_abort));
  return check_abort();
}

}  // namespace shard
