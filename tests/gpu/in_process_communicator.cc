#include "tests/gpu/in_process_communicator.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace shard {

class InProcessCommunicator : public Communicator {
 public:
  InProcessCommunicator(InProcessWorld* world, int rank) : world_(world), rank_(rank) {}

  int rank() const override { return rank_; }
  int size() const override { return world_->size_; }
  absl::string_view backend() const override { return "in-process"; }

  absl::Status AllReduce(const void* send, void* recv, size_t count, DataType dtype,
                         ReduceOp op) override {
    return Collective(send, recv, count * DataTypeSize(dtype), [&](char* out) {
      return ReduceRanks(0, count, dtype, op, out);
    });
  }

  absl::Status ReduceScatter(const void* send, void* recv, size_t recv_count, DataType dtype,
                             ReduceOp op) override {
    return Collective(send, recv, recv_count * DataTypeSize(dtype), [&](char* out) {
      return ReduceRanks(rank_ * recv_count, recv_count, dtype, op, out);
    });
  }

  absl::Status AllGather(const void* send, void* recv, size_t send_count,
                         DataType dtype) override {
    const size_t bytes = send_count * DataTypeSize(dtype);
    return Collective(send, recv, bytes * size(), [&](char* out) {
      for (int r = 0; r < size(); ++r) std::memcpy(out + r * bytes, world_->inputs_[r], bytes);
      return absl::OkStatus();
    });
  }

  absl::Status Reduce(const void* send, void* recv, size_t count, DataType dtype, ReduceOp op,
                      int root) override {
    return Collective(send, rank_ == root ? recv : nullptr, count * DataTypeSize(dtype),
                      [&](char* out) { return ReduceRanks(0, count, dtype, op, out); });
  }

  absl::Status Broadcast(void* buffer, size_t count, DataType dtype, int root) override {
    const size_t bytes = count * DataTypeSize(dtype);
    return Collective(buffer, buffer, bytes, [&](char* out) {
      std::memcpy(out, world_->inputs_[root], bytes);
      return absl::OkStatus();
    });
  }

  absl::Status Barrier() override { return world_->Arrive(); }
  void Abort(absl::string_view reason) override { world_->Abort(reason); }
  bool aborted() const override { return world_->aborted(); }

 private:
  // Publishes `send`, and once every rank has, computes this rank's output into a scratch
  // buffer (inputs may alias outputs), waits for every rank to be done reading, and copies the
  // output to `recv` (unless null).
  template <typename Compute>
  absl::Status Collective(const void* send, void* recv, size_t recv_bytes, Compute compute) {
    world_->inputs_[rank_] = send;
    SHARD_RETURN_IF_ERROR(world_->Arrive());
    std::vector<char> out(recv_bytes);
    SHARD_RETURN_IF_ERROR(compute(out.data()));
    SHARD_RETURN_IF_ERROR(world_->Arrive());
    if (recv != nullptr && recv_bytes > 0) std::memcpy(recv, out.data(), recv_bytes);
    return absl::OkStatus();
  }

  absl::Status ReduceRanks(size_t offset, size_t count, DataType dtype, ReduceOp op, char* out) {
    switch (dtype) {
      case DataType::kFloat32: return ReduceAs<float>(offset, count, op, out);
      case DataType::kFloat64: return ReduceAs<double>(offset, count, op, out);
      case DataType::kInt64: return ReduceAs<int64_t>(offset, count, op, out);
      default:
        return absl::UnimplementedError(absl::StrCat("in-process communicator: no reduction of ",
                                                     DataTypeName(dtype)));
    }
  }

  template <typename T>
  absl::Status ReduceAs(size_t offset, size_t count, ReduceOp op, char* out) {
    T* result = reinterpret_cast<T*>(out);
    for (size_t i = 0; i < count; ++i) {
      T value = static_cast<const T*>(world_->inputs_[0])[offset + i];
      for (int r = 1; r < size(); ++r) {
        const T other = static_cast<const T*>(world_->inputs_[r])[offset + i];
        value = op == ReduceOp::kSum   ? value + other
                : op == ReduceOp::kMax ? std::max(value, other)
                                       : std::min(value, other);
      }
      result[i] = value;
    }
    return absl::OkStatus();
  }

  InProcessWorld* const world_;
  const int rank_;
};

InProcessWorld::InProcessWorld(int size) : size_(size), inputs_(size) {}

std::unique_ptr<Communicator> InProcessWorld::Join(int rank) {
  return std::make_unique<InProcessCommunicator>(this, rank);
}

absl::Status InProcessWorld::AbortedStatus() const {
  return absl::AbortedError(absl::StrCat("in-process world aborted: ", reason_));
}

absl::Status InProcessWorld::Arrive() {
  absl::MutexLock lock(&mu_);
  if (aborted_) return AbortedStatus();
  const int64_t generation = generation_;
  if (++arrived_ == size_) {
    arrived_ = 0;
    ++generation_;
    return absl::OkStatus();
  }
  const auto released = [&] {
    return generation_ != generation || aborted_;
  };
  mu_.Await(absl::Condition(&released));
  if (generation_ == generation) return AbortedStatus();
  return absl::OkStatus();
}

void InProcessWorld::Abort(absl::string_view reason) {
  absl::MutexLock lock(&mu_);
  if (aborted_) return;
  aborted_ = true;
  reason_ = std::string(reason);
}

bool InProcessWorld::aborted() const {
  absl::MutexLock lock(&mu_);
  return aborted_;
}

}  // namespace shard
