#include "worker/gpu/nccl_communicator.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "worker/gpu/cuda_check.h"

namespace shard {
namespace {

absl::StatusOr<ncclDataType_t> NcclType(DataType dtype) {
  switch (dtype) {
    case DataType::kFloat32: return ncclFloat32;
    case DataType::kFloat16: return ncclFloat16;
    case DataType::kBFloat16: return ncclBfloat16;
    case DataType::kInt64: return ncclInt64;
    case DataType::kFloat64: return ncclFloat64;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("NCCL: no NCCL type for dtype ", static_cast<int>(dtype)));
}

absl::StatusOr<ncclRedOp_t> NcclOp(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return ncclSum;
    case ReduceOp::kMax: return ncclMax;
    case ReduceOp::kMin: return ncclMin;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("NCCL: no NCCL reduction for op ", static_cast<int>(op)));
}

}  // namespace

IdExchange KeyValueIdExchange(KeyValueStore* store, absl::Duration timeout) {
  return IdExchange{
      [store](const std::string& key, const std::string& value) { return store->Set(key, value); },
      [store, timeout](const std::string& key) -> absl::StatusOr<std::string> {
        SHARD_RETURN_IF_ERROR(store->Wait({key}, timeout));
        return store->Get(key);
      }};
}

absl::StatusOr<std::unique_ptr<NcclCommunicator>> NcclCommunicator::Create(
    int rank, int size, const IdExchange& exchange, NcclOptions options) {
  if (size < 1 || rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(
        absl::StrCat("NCCL communicator: rank ", rank, " is not in a world of size ", size));
  }
  SHARD_ASSIGN_OR_RETURN(CollectiveStream stream,
                         CollectiveStream::Create(options.device, options.compute_stream));
  ncclUniqueId id;
  if (rank == 0) {
    SHARD_RETURN_IF_ERROR(NcclStatus(ncclGetUniqueId(&id), nullptr, "ncclGetUniqueId"));
    SHARD_RETURN_IF_ERROR(
        exchange.publish(options.key, std::string(id.internal, sizeof(id.internal))));
  } else {
    SHARD_ASSIGN_OR_RETURN(const std::string bytes, exchange.fetch(options.key));
    if (bytes.size() != sizeof(id.internal)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "NCCL communicator: the unique id under '", options.key, "' has ", bytes.size(),
          " bytes, not ", sizeof(id.internal), "; is another program using that key?"));
    }
    std::memcpy(id.internal, bytes.data(), bytes.size());
  }
  SHARD_ASSIGN_OR_RETURN(DeviceBuffer barrier_value, DeviceBuffer::Allocate(sizeof(float)));
  std::unique_ptr<NcclCommunicator> comm(new NcclCommunicator(
      rank, size, std::move(options), std::move(stream), std::move(barrier_value)));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // return at once; WaitReady polls, so Abort can interrupt the connect
  absl::MutexLock lock(&comm->mu_);
  const ncclResult_t result = ncclCommInitRankConfig(&comm->comm_, size, id, rank, &config);
  if (result != ncclSuccess && result != ncclInProgress) {
    return comm->Failure(result, absl::StrCat("ncclCommInitRankConfig (rank ", rank, " of ",
                                              size, ", device ", comm->options_.device, ")"));
  }
  return comm;
}

NcclCommunicator::NcclCommunicator(int rank, int size, NcclOptions options,
                                   CollectiveStream stream, DeviceBuffer barrier_value)
    : rank_(rank),
      size_(size),
      options_(std::move(options)),
      stream_(std::move(stream)),
      barrier_value_(std::move(barrier_value)) {}

NcclCommunicator::~NcclCommunicator() {
  ncclComm_t comm;
  {
    absl::MutexLock lock(&mu_);
    comm = std::exchange(comm_, nullptr);
  }
  if (comm == nullptr) return;  // aborted
  if (ready_.load() && Finalize(comm)) {
    ncclCommDestroy(comm);
    return;
  }
  ncclCommAbort(comm);  // never connected, failed, or not flushed in time
}

bool NcclCommunicator::Finalize(ncclComm_t comm) const {
  const ncclResult_t result = ncclCommFinalize(comm);
  if (result != ncclSuccess && result != ncclInProgress) return false;
  // Flushing needs the peers' part too; a dead peer must not hang the destructor.
  const absl::Duration limit = std::min(options_.wait_timeout, absl::Seconds(10));
  return PollUntil(limit, "ncclCommFinalize", [&]() -> absl::StatusOr<bool> {
           ncclResult_t state = ncclSuccess;
           if (ncclCommGetAsyncError(comm, &state) != ncclSuccess ||
               (state != ncclSuccess && state != ncclInProgress)) {
             return absl::UnavailableError("ncclCommFinalize failed");
           }
           return state == ncclSuccess;
         }).ok();
}

absl::Status NcclCommunicator::AbortedStatus() const {
  return absl::AbortedError(absl::StrCat("NCCL communicator (rank ", rank_, " of ", size_,
                                         ") was aborted: ", abort_reason_));
}

absl::Status NcclCommunicator::Failure(ncclResult_t result, absl::string_view what) {
  return NcclStatus(result, comm_, absl::StrCat(what, " on rank ", rank_, " of ", size_));
}

void NcclCommunicator::Abort(absl::string_view reason) {
  ncclComm_t comm;
  {
    absl::MutexLock lock(&mu_);
    if (aborted_.load()) return;
    abort_reason_ = std::string(reason);
    aborted_.store(true);
    comm = std::exchange(comm_, nullptr);
  }
  // Outside the lock, so pollers see the abort at once. ncclCommAbort also ends kernels that
  // wait for a dead peer; its result is of no use, the communicator is freed either way.
  if (comm != nullptr) ncclCommAbort(comm);
}

absl::StatusOr<bool> NcclCommunicator::Idle(absl::string_view what) {
  absl::MutexLock lock(&mu_);
  if (comm_ == nullptr) return AbortedStatus();
  ncclResult_t state = ncclSuccess;
  const ncclResult_t result = ncclCommGetAsyncError(comm_, &state);
  if (result != ncclSuccess) return Failure(result, "ncclCommGetAsyncError");
  if (state == ncclInProgress) return false;
  if (state != ncclSuccess) return Failure(state, what);
  return true;
}

absl::Status NcclCommunicator::WaitReady() {
  if (ready_.load()) return absl::OkStatus();
  const std::string what = absl::StrCat("NCCL communicator initialisation (rank ", rank_, " of ",
                                        size_, ")");
  const absl::Status status =
      PollUntil(options_.init_timeout, what, [&] { return Idle(what); });
  if (absl::IsDeadlineExceeded(status)) {
    Abort(status.message());
    return absl::DeadlineExceededError(absl::StrCat(
        status.message(), ": not every rank joined; check that all ", size_,
        " workers are running and can reach each other (NCCL_SOCKET_IFNAME)"));
  }
  SHARD_RETURN_IF_ERROR(status);
  ready_.store(true);
  return absl::OkStatus();
}

template <typename Call>
absl::Status NcclCommunicator::Run(absl::string_view what, Call call) {
  SHARD_RETURN_IF_ERROR(WaitReady());
  SHARD_RETURN_IF_ERROR(stream_.AfterCompute());
  ncclResult_t result;
  {
    absl::MutexLock lock(&mu_);
    if (comm_ == nullptr) return AbortedStatus();
    result = call(comm_, stream_.get());
    if (result != ncclSuccess && result != ncclInProgress) return Failure(result, what);
  }
  if (result == ncclInProgress) {
    // A non-blocking communicator may return before the work is on the stream: wait for that
    // (not for the collective itself) before marking it issued.
    SHARD_RETURN_IF_ERROR(
        PollUntil(options_.wait_timeout, what, [&] { return Idle(what); }));
  }
  return stream_.MarkIssued();
}

absl::Status NcclCommunicator::CheckRoot(int root) const {
  if (root < 0 || root >= size_) {
    return absl::InvalidArgumentError(
        absl::StrCat("NCCL: root ", root, " is not a rank of a world of size ", size_));
  }
  return absl::OkStatus();
}

absl::Status NcclCommunicator::AllReduce(const void* send, void* recv, size_t count,
                                         DataType dtype, ReduceOp op) {
  SHARD_ASSIGN_OR_RETURN(const ncclDataType_t type, NcclType(dtype));
  SHARD_ASSIGN_OR_RETURN(const ncclRedOp_t nccl_op, NcclOp(op));
  return Run(absl::StrCat("ncclAllReduce of ", count, " ", DataTypeName(dtype)),
             [&](ncclComm_t comm, cudaStream_t stream) {
               return ncclAllReduce(send, recv, count, type, nccl_op, comm, stream);
             });
}

absl::Status NcclCommunicator::ReduceScatter(const void* send, void* recv, size_t recv_count,
                                             DataType dtype, ReduceOp op) {
  SHARD_ASSIGN_OR_RETURN(const ncclDataType_t type, NcclType(dtype));
  SHARD_ASSIGN_OR_RETURN(const ncclRedOp_t nccl_op, NcclOp(op));
  return Run(absl::StrCat("ncclReduceScatter of ", recv_count, " ", DataTypeName(dtype)),
             [&](ncclComm_t comm, cudaStream_t stream) {
               return ncclReduceScatter(send, recv, recv_count, type, nccl_op, comm, stream);
             });
}

absl::Status NcclCommunicator::AllGather(const void* send, void* recv, size_t send_count,
                                         DataType dtype) {
  SHARD_ASSIGN_OR_RETURN(const ncclDataType_t type, NcclType(dtype));
  return Run(absl::StrCat("ncclAllGather of ", send_count, " ", DataTypeName(dtype)),
             [&](ncclComm_t comm, cudaStream_t stream) {
               return ncclAllGather(send, recv, send_count, type, comm, stream);
             });
}

absl::Status NcclCommunicator::Reduce(const void* send, void* recv, size_t count,
                                      DataType dtype, ReduceOp op, int root) {
  SHARD_RETURN_IF_ERROR(CheckRoot(root));
  SHARD_ASSIGN_OR_RETURN(const ncclDataType_t type, NcclType(dtype));
  SHARD_ASSIGN_OR_RETURN(const ncclRedOp_t nccl_op, NcclOp(op));
  return Run(absl::StrCat("ncclReduce of ", count, " ", DataTypeName(dtype), " to ", root),
             [&](ncclComm_t comm, cudaStream_t stream) {
               return ncclReduce(send, recv, count, type, nccl_op, root, comm, stream);
             });
}

absl::Status NcclCommunicator::Broadcast(void* buffer, size_t count, DataType dtype, int root) {
  SHARD_RETURN_IF_ERROR(CheckRoot(root));
  SHARD_ASSIGN_OR_RETURN(const ncclDataType_t type, NcclType(dtype));
  return Run(absl::StrCat("ncclBroadcast of ", count, " ", DataTypeName(dtype), " from ", root),
             [&](ncclComm_t comm, cudaStream_t stream) {
               return ncclBroadcast(buffer, buffer, count, type, root, comm, stream);
             });
}

absl::Status NcclCommunicator::Barrier() {
  // NCCL has no barrier: a one-element all-reduce that every rank waits for does the same.
  SHARD_RETURN_IF_ERROR(Run("the barrier's ncclAllReduce", [&](ncclComm_t comm,
                                                               cudaStream_t stream) {
    return ncclAllReduce(barrier_value_.data(), barrier_value_.data(), 1, ncclFloat32, ncclSum,
                         comm, stream);
  }));
  return Synchronize();
}

absl::Status NcclCommunicator::OrderComputeAfterCollectives() {
  {
    absl::MutexLock lock(&mu_);
    if (comm_ == nullptr) return AbortedStatus();
  }
  return stream_.OrderCompute();
}

absl::Status NcclCommunicator::Synchronize() {
  SHARD_RETURN_IF_ERROR(WaitReady());
  const std::string what = absl::StrCat("NCCL collectives of rank ", rank_, " of ", size_);
  const absl::Status status =
      stream_.Wait(options_.wait_timeout, what, [&]() -> absl::Status {
        // Also surfaces a peer's failure (ncclRemoteError) while the kernels wait for it.
        return Idle(what).status();
      });
  if (status.ok()) {
    // Aborted kernels end too: finished is not the same as succeeded.
    absl::MutexLock lock(&mu_);
    if (comm_ == nullptr) return AbortedStatus();
  }
  if (absl::IsDeadlineExceeded(status)) {
    return absl::DeadlineExceededError(absl::StrCat(
        status.message(), "; a peer may be stuck or dead: Abort() this communicator and "
                          "re-form the world"));
  }
  return status;
}

}  // namespace shard
