#include "worker/dataplane/hierarchical_communicator.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace shard {

HostLayout HostLayout::FromDomains(const std::vector<std::string>& domains) {
  HostLayout layout;
  std::map<std::string, int> index;
  for (const std::string& domain : domains) {
    auto [at, added] = index.emplace(domain, static_cast<int>(index.size()));
    layout.host.push_back(at->second);
  }
  return layout;
}

int HostLayout::hosts() const {
  return host.empty() ? 0 : *std::max_element(host.begin(), host.end()) + 1;
}

std::vector<int> HostLayout::RanksOn(int h) const {
  std::vector<int> ranks;
  for (int r = 0; r < static_cast<int>(host.size()); ++r) {
    if (host[r] == h) ranks.push_back(r);
  }
  return ranks;
}

namespace {

class HierarchicalCommunicator final : public Communicator {
 public:
  HierarchicalCommunicator(int rank, HostLayout layout, std::unique_ptr<Communicator> local,
                           std::unique_ptr<Communicator> leaders)
      : rank_(rank),
        layout_(std::move(layout)),
        host_(layout_.host[rank]),
        local_(std::move(local)),
        leaders_(std::move(leaders)) {
    for (int h = 0; h < layout_.hosts(); ++h) ranks_on_.push_back(layout_.RanksOn(h));
  }

  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(layout_.host.size()); }
  absl::string_view backend() const override { return "shm+gloo"; }

  absl::Status AllReduce(const void* send, void* recv, size_t count, DataType dtype,
                         ReduceOp op) override {
    return Run("all-reduce", [&]() -> absl::Status {
      SHARD_RETURN_IF_ERROR(local_->Reduce(send, recv, count, dtype, op, 0));
      if (leader()) SHARD_RETURN_IF_ERROR(leaders_->AllReduce(recv, recv, count, dtype, op));
      return local_->Broadcast(recv, count, dtype, 0);
    });
  }

  absl::Status ReduceScatter(const void* send, void* recv, size_t recv_count, DataType dtype,
                             ReduceOp op) override {
    return Run("reduce-scatter", [&]() -> absl::Status {
      const size_t block = recv_count * DataTypeSize(dtype);
      const std::vector<int>& mine = ranks_on_[host_];
      // The leader gets the whole reduction, and hands each rank of its host its block.
      char* total = leader() ? Scratch(0, size() * block) : nullptr;
      SHARD_RETURN_IF_ERROR(local_->Reduce(send, total, size() * recv_count, dtype, op, 0));
      char* packed = Scratch(1, mine.size() * block);
      if (leader()) {
        SHARD_RETURN_IF_ERROR(
            leaders_->AllReduce(total, total, size() * recv_count, dtype, op));
        for (size_t i = 0; i < mine.size(); ++i) {
          std::memcpy(packed + i * block, total + mine[i] * block, block);
        }
      }
      SHARD_RETURN_IF_ERROR(local_->Broadcast(packed, mine.size() * recv_count, dtype, 0));
      std::memmove(recv, packed + local_rank() * block, block);
      return absl::OkStatus();
    });
  }

  absl::Status AllGather(const void* send, void* recv, size_t send_count,
                         DataType dtype) override {
    return Run("all-gather", [&]() -> absl::Status {
      const size_t block = send_count * DataTypeSize(dtype);
      char* out = static_cast<char*>(recv);
      const std::vector<int>& mine = ranks_on_[host_];
      char* packed = Scratch(1, mine.size() * block);
      SHARD_RETURN_IF_ERROR(local_->AllGather(send, packed, send_count, dtype));
      if (leader()) {
        // Each leader in turn sends its host's blocks to the others.
        for (int h = 0; h < layout_.hosts(); ++h) {
          const std::vector<int>& ranks = ranks_on_[h];
          char* blocks = h == host_ ? packed : Scratch(0, ranks.size() * block);
          SHARD_RETURN_IF_ERROR(
              leaders_->Broadcast(blocks, ranks.size() * send_count, dtype, h));
          for (size_t i = 0; i < ranks.size(); ++i) {
            std::memcpy(out + ranks[i] * block, blocks + i * block, block);
          }
        }
      }
      return local_->Broadcast(recv, size() * send_count, dtype, 0);
    });
  }

  absl::Status Reduce(const void* send, void* recv, size_t count, DataType dtype, ReduceOp op,
                      int root) override {
    SHARD_RETURN_IF_ERROR(CheckRoot("reduce", root));
    return Run("reduce", [&]() -> absl::Status {
      const size_t bytes = count * DataTypeSize(dtype);
      const int root_host = layout_.host[root];
      char* total = Scratch(0, bytes);
      SHARD_RETURN_IF_ERROR(local_->Reduce(send, total, count, dtype, op, 0));
      if (leader()) {
        SHARD_RETURN_IF_ERROR(leaders_->Reduce(total, total, count, dtype, op, root_host));
      }
      if (host_ != root_host) return absl::OkStatus();
      // On the root's host the leader holds the result; the root gets it from there.
      if (root != ranks_on_[host_][0]) {
        SHARD_RETURN_IF_ERROR(local_->Broadcast(total, count, dtype, 0));
      }
      if (rank_ == root) std::memcpy(recv, total, bytes);
      return absl::OkStatus();
    });
  }

  absl::Status Broadcast(void* buffer, size_t count, DataType dtype, int root) override {
    SHARD_RETURN_IF_ERROR(CheckRoot("broadcast", root));
    return Run("broadcast", [&]() -> absl::Status {
      const int root_host = layout_.host[root];
      const std::vector<int>& mine = ranks_on_[host_];
      if (host_ == root_host) {
        const int root_local =
            static_cast<int>(std::find(mine.begin(), mine.end(), root) - mine.begin());
        SHARD_RETURN_IF_ERROR(local_->Broadcast(buffer, count, dtype, root_local));
      }
      if (leader()) SHARD_RETURN_IF_ERROR(leaders_->Broadcast(buffer, count, dtype, root_host));
      if (host_ != root_host) return local_->Broadcast(buffer, count, dtype, 0);
      return absl::OkStatus();
    });
  }

  absl::Status Barrier() override {
    return Run("barrier", [&]() -> absl::Status {
      SHARD_RETURN_IF_ERROR(local_->Barrier());
      if (leader()) SHARD_RETURN_IF_ERROR(leaders_->Barrier());
      return local_->Barrier();
    });
  }

  void SetCollectiveTimeout(absl::Duration timeout) override {
    local_->SetCollectiveTimeout(timeout);
    if (leader()) leaders_->SetCollectiveTimeout(timeout);
  }

  void Abort(absl::string_view reason) override {
    aborted_.store(true);
    local_->Abort(reason);
    if (leader()) leaders_->Abort(reason);
  }

  bool aborted() const override { return aborted_.load(); }

  std::optional<PeerFault> peer_fault() const override {
    std::optional<PeerFault> fault = leader() ? leaders_->peer_fault() : std::nullopt;
    // The leaders' communicator numbers hosts; the coordinator wants the peer's rank.
    if (fault.has_value()) fault->peer_rank = ranks_on_[fault->peer_rank][0];
    return fault;
  }

 private:
  bool leader() const { return leaders_ != nullptr; }

  int local_rank() const {
    const std::vector<int>& mine = ranks_on_[host_];
    return static_cast<int>(std::find(mine.begin(), mine.end(), rank_) - mine.begin());
  }

  char* Scratch(int index, size_t bytes) {
    std::vector<char>& buffer = scratch_[index];
    if (buffer.size() < bytes) buffer.resize(bytes);
    return buffer.data();
  }

  absl::Status CheckRoot(absl::string_view what, int root) const {
    if (root >= 0 && root < size()) return absl::OkStatus();
    return absl::InvalidArgumentError(
        absl::StrCat(what, " root ", root, " is not a rank of this world of ", size()));
  }

  // Runs one collective: refuses once aborted, and aborts both levels after a failure at
  // either (the hosts are out of step from then on).
  template <typename Fn>
  absl::Status Run(absl::string_view what, Fn&& fn) {
    if (aborted()) {
      return absl::AbortedError(absl::StrCat(what, " refused: communicator aborted"));
    }
    absl::Status status = fn();
    if (status.ok()) return status;
    status = absl::Status(status.code(), absl::StrCat(what, " on rank ", rank_, " of ", size(),
                                                      " failed: ", status.message()));
    Abort(status.message());
    return status;
  }

  const int rank_;
  const HostLayout layout_;
  const int host_;
  std::vector<std::vector<int>> ranks_on_;
  const std::unique_ptr<Communicator> local_;
  const std::unique_ptr<Communicator> leaders_;
  std::vector<char> scratch_[2];
  std::atomic<bool> aborted_{false};
};

}  // namespace

std::unique_ptr<Communicator> MakeHierarchicalCommunicator(int rank, HostLayout layout,
                                                           std::unique_ptr<Communicator> local,
                                                           std::unique_ptr<Communicator> leaders) {
  return std::make_unique<HierarchicalCommunicator>(rank, std::move(layout), std::move(local),
                                                    std::move(leaders));
}

}  // namespace shard
