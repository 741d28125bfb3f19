#include "worker/dataplane/gloo_communicator.h"


#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <set>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/status_macros.h"
#include "gloo/common/error.h"
#include "gloo/rendezvous/context.h"
#include "gloo/rendezvous/store.h"
#include "gloo/transport/tcp/device.h"
#include "gloo/transport/unbound_buffer.h"
#include "worker/dataplane/reduce.h"
#include "worker/dataplane/tcp_links.h"

namespace shard {
namespace {

using gloo::transport::UnboundBuffer;

// Slots of our ring steps; Gloo's own collectives use small prefixes in the top byte.
constexpr uint64_t kSlotPrefix = uint64_t{0x53} << 56;

std::chrono::milliseconds ToChrono(absl::Duration d) {
  return std::chrono::milliseconds(absl::ToInt64Milliseconds(d));
}

// Gloo's Store interface over our rendezvous store. Gloo expects exceptions; the first failure
// is kept so the caller can return its precise status.
class StoreAdapter : public gloo::rendezvous::Store {
 public:
  StoreAdapter(KeyValueStore* store, std::string prefix, absl::Duration timeout)
      : store_(store), prefix_(std::move(prefix)), timeout_(timeout) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    Check(store_->Set(prefix_ + key, std::string(data.begin(), data.end())));
  }

  std::vector<char> get(const std::string& key) override {
    wait({key});
    absl::StatusOr<std::string> value = store_->Get(prefix_ + key);
    Check(value.status());
    return std::vector<char>(value->begin(), value->end());
  }

  void wait(const std::vector<std::string>& keys) override { Wait(keys, timeout_); }

  // Gloo passes its connect timeout; peers may arrive later than a connection takes, so the
  // wait for them is bounded by the rendezvous timeout instead (and ends at once when the
  // store's generation does).
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& /*connect_timeout*/) override {
    Wait(keys, timeout_);
  }

  const absl::Status& first_error() const { return first_error_; }

 private:
  void Wait(const std::vector<std::string>& keys, absl::Duration timeout) {
    std::vector<std::string> prefixed;
    prefixed.reserve(keys.size());
    for (const std::string& key : keys) prefixed.push_back(prefix_ + key);
    Check(store_->Wait(prefixed, timeout));
  }

  void Check(const absl::Status& status) {
    if (status.ok()) return;
    if (first_error_.ok()) first_error_ = status;
    throw gloo::IoException(std::string(status.message()));
  }

  KeyValueStore* store_;
  std::string prefix_;
  absl::Duration timeout_;
  absl::Status first_error_;
};

std::vector<Block> EqualBlocks(int ranks, size_t count) {
  std::vector<Block> blocks(ranks);
  for (int i = 0; i < ranks; ++i) blocks[i] = Block{i * count, count};
  return blocks;
}

}  // namespace

class GlooCommunicator::Impl {
 public:
  Impl(std::shared_ptr<gloo::Context> context, GlooOptions options)
      : context_(std::move(context)),
        options_(std::move(options)),
        timeout_ms_(absl::ToInt64Milliseconds(options_.timeout)) {}

  absl::Duration Timeout() const { return absl::Milliseconds(timeout_ms_.load()); }
  void SetTimeout(absl::Duration timeout) {
    timeout_ms_.store(absl::ToInt64Milliseconds(timeout));
  }

  int rank() const { return context_->rank; }
  int size() const { return context_->size; }
  const std::shared_ptr<gloo::Context>& context() const { return context_; }

  absl::Status AllReduce(const void* send, void* recv, size_t count, DataType dtype,
                         ReduceOp op) {
    return Run("all-reduce", [&] {
      const size_t bytes = count * DataTypeSize(dtype);
      if (size() == 1) {
        if (send != recv) std::memmove(recv, send, bytes);
        return absl::OkStatus();
      }
      const std::vector<Block> blocks = BalancedBlocks(size(), count);
      char* out = static_cast<char*>(recv);
      const size_t own = blocks[rank()].offset * DataTypeSize(dtype);
      absl::Status reduced =
          RingReduceScatter(static_cast<const char*>(send), out + own, blocks, dtype, op);
      if (!reduced.ok()) return reduced;
      return RingAllGather(out, blocks, dtype);
    });
  }

  absl::Status ReduceScatter(const void* send, void* recv, size_t recv_count, DataType dtype,
                             ReduceOp op) {
    return Run("reduce-scatter", [&] {
      if (size() == 1) {
        std::memmove(recv, send, recv_count * DataTypeSize(dtype));
        return absl::OkStatus();
      }
      return RingReduceScatter(static_cast<const char*>(send), static_cast<char*>(recv),
                               EqualBlocks(size(), recv_count), dtype, op);
    });
  }

  absl::Status AllGather(const void* send, void* recv, size_t send_count, DataType dtype) {
    return Run("all-gather", [&] {
      const size_t bytes = send_count * DataTypeSize(dtype);
      char* out = static_cast<char*>(recv);
      char* own = out + rank() * bytes;
      if (own != send) std::memmove(own, send, bytes);
      if (size() == 1) return absl::OkStatus();
      return RingAllGather(out, EqualBlocks(size(), send_count), dtype);
    });
  }

  absl::Status Reduce(const void* send, void* recv, size_t count, DataType dtype, ReduceOp op,
                      int root) {
    if (root < 0 || root >= size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("reduce root ", root, " is not a rank of this world of ", size()));
    }
    return Run("reduce", [&] {
      if (size() == 1) {
        if (send != recv) std::memmove(recv, send, count * DataTypeSize(dtype));
        return absl::OkStatus();
      }
      return ChainReduce(static_cast<const char*>(send), static_cast<char*>(recv), count, dtype,
                         op, root);
    });
  }

  absl::Status Broadcast(void* buffer, size_t count, DataType dtype, int root) {
    if (root < 0 || root >= size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("broadcast root ", root, " is not a rank of this world of ", size()));
    }
    return Run("broadcast", [&] {
      if (size() == 1) return absl::OkStatus();
      return ChainBroadcast(static_cast<char*>(buffer), count, dtype, root);
    });
  }

  absl::Status Barrier() {
    int64_t token = 0;
    return AllReduce(&token, &token, 1, DataType::kInt64, ReduceOp::kSum);
  }

  void Abort(absl::string_view reason) {
    absl::MutexLock lock(&mu_);
    if (!abort_reason_.empty()) return;
    abort_reason_ = reason.empty() ? "aborted" : std::string(reason);
    for (UnboundBuffer* buffer : in_flight_) {
      buffer->abortWaitRecv();
      buffer->abortWaitSend();
    }
    // Peers blocked on us see the connection close and fail at once too.
    try {
      context_->closeConnections();
    } catch (const std::exception&) {
      // Closing is best effort: a pair that is already broken needs no closing.
    }
  }

  bool aborted() const {
    absl::MutexLock lock(&mu_);
    return !abort_reason_.empty();
  }

  std::optional<PeerFault> peer_fault() const {
    absl::MutexLock lock(&mu_);
    return peer_fault_;
  }

 private:
  // The unbound buffers of one collective, registered so that Abort() can wake their waits.
  class Buffers {
   public:
    explicit Buffers(Impl* impl) : impl_(impl) {}
    ~Buffers() {
      absl::MutexLock lock(&impl_->mu_);
      impl_->in_flight_.clear();
    }
    UnboundBuffer* Make(void* data, size_t bytes) {
      owned_.push_back(impl_->context_->createUnboundBuffer(data, std::max<size_t>(bytes, 1)));
      absl::MutexLock lock(&impl_->mu_);
      UnboundBuffer* buffer = owned_.back().get();
      impl_->in_flight_.push_back(buffer);
      if (!impl_->abort_reason_.empty()) {
        buffer->abortWaitRecv();
        buffer->abortWaitSend();
      }
      return buffer;
    }

   private:
    Impl* impl_;
    std::vector<std::unique_ptr<UnboundBuffer>> owned_;
  };

  // A segment of a block: [offset, offset + count) elements within the block.
  struct Segment {
    size_t offset;
    size_t count;
  };

  size_t SegmentElements(DataType dtype) const {
    return std::max<size_t>(1, options_.segment_bytes / DataTypeSize(dtype));
  }

  std::vector<Segment> Segments(size_t count, DataType dtype) const {
    const size_t per = SegmentElements(dtype);
    std::vector<Segment> segments;
    for (size_t offset = 0; offset < count; offset += per) {
      segments.push_back(Segment{offset, std::min(per, count - offset)});
    }
    return segments;
  }

  // Every ring and chain here receives from the left neighbour and sends to the right one:
  // the link a wait depends on is known while it waits.
  absl::Status WaitRecv(UnboundBuffer* buffer) {
    waiting_on_ = {Left(), LinkFailure::kReceive, ""};
    if (!buffer->waitRecv(nullptr, ToChrono(Timeout()))) return AbortedStatus();
    return absl::OkStatus();
  }

  absl::Status WaitSend(UnboundBuffer* buffer) {
    waiting_on_ = {Right(), LinkFailure::kSend, ""};
    if (!buffer->waitSend(nullptr, ToChrono(Timeout()))) return AbortedStatus();
    return absl::OkStatus();
  }


  absl::Status AbortedStatus() const {
    absl::MutexLock lock(&mu_);
    return absl::AbortedError(absl::StrCat("communicator aborted: ", abort_reason_));
  }

  int Left() const { return (rank() + size() - 1) % size(); }
  int Right() const { return (rank() + 1) % size(); }
  int Mod(int i) const { return ((i % size()) + size()) % size(); }

  char* Scratch(size_t index, size_t bytes) {
    std::vector<char>& buffer = scratch_[index];
    if (buffer.size() < bytes) buffer.resize(bytes);
    return buffer.data();
  }

  // Ring reduce-scatter: after W-1 steps this rank holds the reduction of block rank() in
  // `out`. At step k it sends its partial sum of block (r-k-1) and receives the left
  // neighbour's partial sum of block (r-k-2), adding its own contribution. Segments of a
  // block are forwarded as soon as they are reduced, so reduction overlaps the transfer.
  absl::Status RingReduceScatter(const char* send, char* out, const std::vector<Block>& blocks,
                                 DataType dtype, ReduceOp op) {
    const int r = rank();
    const int steps = size() - 1;
    const size_t esize = DataTypeSize(dtype);
    size_t max_block = 0;
    for (const Block& b : blocks) max_block = std::max(max_block, b.count);
    const size_t seg_elems = SegmentElements(dtype);
    const size_t seg_bytes = seg_elems * esize;
    const size_t max_segments = (max_block + seg_elems - 1) / seg_elems;
    auto sent_block = [&](int k) { return Mod(r - k - 1); };
    auto received_block = [&](int k) { return Mod(r - k - 2); };

    Buffers buffers(this);
    // received[p][j] and partial[p][j]: segment j of the step with parity p.
    std::vector<UnboundBuffer*> received[2];
    std::vector<UnboundBuffer*> partial[2];
    std::vector<bool> partial_pending[2];
    char* received_data[2];
    char* partial_data[2];
    for (int p = 0; p < 2; ++p) {
      received_data[p] = Scratch(p, max_segments * seg_bytes);
      partial_data[p] = Scratch(2 + p, max_segments * seg_bytes);
      for (size_t j = 0; j < max_segments; ++j) {
        received[p].push_back(buffers.Make(received_data[p] + j * seg_bytes, seg_bytes));
        partial[p].push_back(buffers.Make(partial_data[p] + j * seg_bytes, seg_bytes));
      }
      partial_pending[p].assign(max_segments, false);
    }
    auto post_receives = [&](int k) {
      for (const Segment& s : Segments(blocks[received_block(k)].count, dtype)) {
        received[k % 2][s.offset / seg_elems]->recv(Left(), kSlotPrefix + k, 0,
                                                             s.count * esize);
      }
    };

    // Step 0 sends straight from the caller's buffer.
    const Block& first = blocks[sent_block(0)];
    std::vector<UnboundBuffer*> first_sends;
    post_receives(0);
    for (const Segment& s : Segments(first.count, dtype)) {
      UnboundBuffer* buffer = buffers.Make(
          const_cast<char*>(send) + (first.offset + s.offset) * esize, s.count * esize);
      buffer->send(Right(), kSlotPrefix, 0, s.count * esize);
      first_sends.push_back(buffer);
    }
    for (int k = 0; k < steps; ++k) {
      const int p = k % 2;
      if (k + 1 < steps) post_receives(k + 1);
      const Block& block = blocks[received_block(k)];
      for (const Segment& s : Segments(block.count, dtype)) {
        const size_t j = s.offset / seg_elems;
        SHARD_RETURN_IF_ERROR(WaitRecv(received[p][j]));
        const char* own = send + (block.offset + s.offset) * esize;
        const char* incoming = received_data[p] + j * seg_bytes;
        if (k + 1 == steps) {
          ReduceBuffers(dtype, op, out + s.offset * esize, own, incoming, s.count);
          continue;
        }
        if (partial_pending[p][j]) {
          SHARD_RETURN_IF_ERROR(WaitSend(partial[p][j]));
        }
        ReduceBuffers(dtype, op, partial_data[p] + j * seg_bytes, own, incoming, s.count);
        partial[p][j]->send(Right(), kSlotPrefix + k + 1, 0, s.count * esize);
        partial_pending[p][j] = true;
      }
    }
    for (UnboundBuffer* buffer : first_sends) {
      SHARD_RETURN_IF_ERROR(WaitSend(buffer));
    }
    for (int p = 0; p < 2; ++p) {
      for (size_t j = 0; j < max_segments; ++j) {
        if (!partial_pending[p][j]) continue;
        SHARD_RETURN_IF_ERROR(WaitSend(partial[p][j]));
      }
    }
    return absl::OkStatus();
  }

  // Ring all-gather in place: block rank() is already in `data`. At step k this rank forwards
  // block (r-k) and receives block (r-k-1), segment by segment.
  absl::Status RingAllGather(char* data, const std::vector<Block>& blocks, DataType dtype) {
    const int r = rank();
    const int steps = size() - 1;
    const size_t esize = DataTypeSize(dtype);
    Buffers buffers(this);
    // segments[i][j]: segment j of block i, used to receive it and then to forward it.
    std::vector<std::vector<UnboundBuffer*>> segments(size());
    std::vector<std::vector<Segment>> layout(size());
    for (int i = 0; i < size(); ++i) {
      layout[i] = Segments(blocks[i].count, dtype);
      for (const Segment& s : layout[i]) {
        segments[i].push_back(
            buffers.Make(data + (blocks[i].offset + s.offset) * esize, s.count * esize));
      }
    }
    auto post_receives = [&](int k) {
      const int b = Mod(r - k - 1);
      for (size_t j = 0; j < layout[b].size(); ++j) {
        segments[b][j]->recv(Left(), kSlotPrefix + k, 0, layout[b][j].count * esize);
      }
    };
    post_receives(0);
    for (size_t j = 0; j < layout[r].size(); ++j) {
      segments[r][j]->send(Right(), kSlotPrefix, 0, layout[r][j].count * esize);
    }
    for (int k = 0; k < steps; ++k) {
      if (k + 1 < steps) post_receives(k + 1);
      const int b = Mod(r - k - 1);
      for (size_t j = 0; j < layout[b].size(); ++j) {
        SHARD_RETURN_IF_ERROR(WaitRecv(segments[b][j]));
        if (k + 1 < steps) {
          segments[b][j]->send(Right(), kSlotPrefix + k + 1, 0, layout[b][j].count * esize);
        }
      }
    }
    // Every block but the one received last was forwarded once.
    for (int i = 0; i < size(); ++i) {
      if (i == Mod(r - steps)) continue;
      for (UnboundBuffer* buffer : segments[i]) {
        SHARD_RETURN_IF_ERROR(WaitSend(buffer));
      }
    }
    return absl::OkStatus();
  }

  // Pipelined chain root+1 -> root+2 -> ... -> root: each rank adds its contribution to the
  // partial sum of a segment and forwards it as soon as it arrives; root ends with the total.
  absl::Status ChainReduce(const char* send, char* recv, size_t count, DataType dtype,
                           ReduceOp op, int root) {
    const int position = Mod(rank() - root - 1);  // 0 starts the chain, size()-1 is root
    const bool first = position == 0;
    const bool last = position == size() - 1;
    const size_t esize = DataTypeSize(dtype);
    const size_t bytes = count * esize;
    Buffers buffers(this);
    const std::vector<Segment> layout = Segments(count, dtype);
    char* incoming = first ? nullptr : Scratch(0, bytes);
    char* partial = first || last ? nullptr : Scratch(2, bytes);
    std::vector<UnboundBuffer*> received;
    std::vector<UnboundBuffer*> sent;
    for (const Segment& s : layout) {
      const size_t offset = s.offset * esize;
      const size_t length = s.count * esize;
      if (!first) {
        received.push_back(buffers.Make(incoming + offset, length));
        received.back()->recv(Left(), kSlotPrefix, 0, length);
      }
      if (!last) {
        char* source = first ? const_cast<char*>(send) + offset : partial + offset;
        sent.push_back(buffers.Make(source, length));
      }
    }
    for (size_t j = 0; j < layout.size(); ++j) {
      const size_t offset = layout[j].offset * esize;
      if (!first) {
        SHARD_RETURN_IF_ERROR(WaitRecv(received[j]));
        ReduceBuffers(dtype, op, last ? recv + offset : partial + offset, send + offset,
                      incoming + offset, layout[j].count);
      }
      if (!last) sent[j]->send(Right(), kSlotPrefix, 0, layout[j].count * esize);
    }
    for (UnboundBuffer* buffer : sent) {
      SHARD_RETURN_IF_ERROR(WaitSend(buffer));
    }
    return absl::OkStatus();
  }

  // Pipelined chain root -> root+1 -> ... : each rank forwards a segment as soon as it has it.
  absl::Status ChainBroadcast(char* data, size_t count, DataType dtype, int root) {
    const int position = Mod(rank() - root);
    const bool last = position == size() - 1;
    const size_t esize = DataTypeSize(dtype);
    Buffers buffers(this);
    std::vector<UnboundBuffer*> segments;
    const std::vector<Segment> layout = Segments(count, dtype);
    for (const Segment& s : layout) {
      segments.push_back(buffers.Make(data + s.offset * esize, s.count * esize));
    }
    if (position != 0) {
      for (size_t j = 0; j < layout.size(); ++j) {
        segments[j]->recv(Left(), kSlotPrefix, 0, layout[j].count * esize);
      }
    }
    for (size_t j = 0; j < layout.size(); ++j) {
      if (position != 0) {
        SHARD_RETURN_IF_ERROR(WaitRecv(segments[j]));
      }
      if (!last) segments[j]->send(Right(), kSlotPrefix, 0, layout[j].count * esize);
    }
    if (!last) {
      for (UnboundBuffer* buffer : segments) {
        SHARD_RETURN_IF_ERROR(WaitSend(buffer));
      }
    }
    return absl::OkStatus();
  }

  // Runs one collective: refuses if aborted, turns Gloo's exceptions into statuses, and
  // aborts the communicator after any failure (the ring is out of step from then on).
  template <typename Fn>
  absl::Status Run(absl::string_view what, Fn&& fn) {
    {
      absl::MutexLock lock(&mu_);
      if (!abort_reason_.empty()) {
        return absl::AbortedError(
            absl::StrCat(what, " refused: communicator aborted: ", abort_reason_));
      }
    }
    absl::Status status;
    try {
      status = fn();
    } catch (const gloo::IoException& e) {
      const std::string message = e.what();
      // The kernel gave up on the connection (TCP_USER_TIMEOUT, keepalive) or has no route:
      // the link failed, whatever the peer's process does. A reset or a closed connection is a
      // peer that went away (or aborted), not a link.
      const bool link_gave_up = absl::StrContains(message, "timed out") ||
                                absl::StrContains(message, "No route to host");
      if (aborted()) {
        status = AbortedStatus();
      } else if (absl::StrContains(message, "Timed out") ||
                 absl::StrContains(message, "timeout")) {
        status = absl::DeadlineExceededError(absl::StrCat(
            "rank ", waiting_on_.peer_rank, " did not respond within ",
            absl::FormatDuration(Timeout()), ": ", message));
        NoteLinkFault(message);
      } else {
        status = absl::UnavailableError(absl::StrCat("connection to a peer failed: ", message));
        if (link_gave_up) NoteLinkFault(message);
      }
    } catch (const std::exception& e) {
      // An abort that closes the connections under a collective can also surface as Gloo's
      // own check failing ("epoll_ctl: Bad file descriptor"): the abort is the cause to name.
      status = aborted() ? AbortedStatus() : absl::InternalError(e.what());
    }
    if (status.ok()) return status;
    status = absl::Status(status.code(), absl::StrCat(what, " on rank ", rank(), " of ", size(),
                                                      " failed: ", status.message()));
    Abort(status.message());
    return status;
  }

  void NoteLinkFault(const std::string& message) {
    absl::MutexLock lock(&mu_);
    if (!peer_fault_.has_value()) {
      peer_fault_ = PeerFault{waiting_on_.peer_rank, waiting_on_.how, message};
    }
  }

  std::shared_ptr<gloo::Context> context_;
  const GlooOptions options_;
  PeerFault waiting_on_;  // the link the collective in flight waits on (its thread only)
  std::atomic<int64_t> timeout_ms_;  // each wait of a collective: options_.timeout, then derived
  std::vector<char> scratch_[4];
  mutable absl::Mutex mu_;
  std::string abort_reason_ ABSL_GUARDED_BY(mu_);
  std::vector<UnboundBuffer*> in_flight_ ABSL_GUARDED_BY(mu_);
  std::optional<PeerFault> peer_fault_ ABSL_GUARDED_BY(mu_);
};

absl::StatusOr<std::unique_ptr<GlooCommunicator>> CreateGlooCommunicator(
    KeyValueStore* store, const GlooOptions& options) {
  IgnoreSigpipeUnlessHandled();
  if (options.size < 1 || options.rank < 0 || options.rank >= options.size) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", options.rank,
                                                   " is not in a world of size ", options.size));
  }
  StoreAdapter adapter(store, options.key_prefix, options.timeout);
  std::unique_ptr<GlooCommunicator> communicator;
  try {
    gloo::transport::tcp::attr attr;
    attr.hostname = options.hostname;
    std::shared_ptr<gloo::transport::Device> device = gloo::transport::tcp::CreateDevice(attr);
    auto context = std::make_shared<gloo::rendezvous::Context>(options.rank, options.size);
    context->setTimeout(ToChrono(std::min(options.timeout, options.connect_timeout)));
    const std::set<ino_t> sockets_before = OpenSockets();
    context->connectFullMesh(adapter, device);
    SetLinkTimeouts(sockets_before, options.link_timeout);
    context->setTimeout(ToChrono(options.timeout));  // for Gloo's own collectives
    communicator.reset(
        new GlooCommunicator(std::make_unique<GlooCommunicator::Impl>(std::move(context), options)));
  } catch (const std::exception& e) {
    const std::string where = absl::StrCat("cannot connect rank ", options.rank, " of ",
                                           options.size, " over Gloo TCP on ", options.hostname);
    if (!adapter.first_error().ok()) {
      return absl::Status(adapter.first_error().code(),
                          absl::StrCat(where, ": rendezvous failed: ",
                                       adapter.first_error().message()));
    }
    return absl::UnavailableError(absl::StrCat(where, ": ", e.what()));
  }
  // Connecting is not collective: a rank may finish while a peer still completes its side of
  // the handshake. A barrier makes creation collective, as NCCL's init is, so a rank that
  // returns (and perhaps exits at once) never breaks a peer's connection half-way.
  if (options.barrier_after_connect) SHARD_RETURN_IF_ERROR(communicator->Barrier());
  return communicator;
}

GlooCommunicator::GlooCommunicator(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
GlooCommunicator::~GlooCommunicator() = default;
int GlooCommunicator::rank() const { return impl_->rank(); }
int GlooCommunicator::size() const { return impl_->size(); }

absl::Status GlooCommunicator::AllReduce(const void* send, void* recv, size_t count,
                                         DataType dtype, ReduceOp op) {
  return impl_->AllReduce(send, recv, count, dtype, op);
}

absl::Status GlooCommunicator::ReduceScatter(const void* send, void* recv, size_t recv_count,
                                             DataType dtype, ReduceOp op) {
  return impl_->ReduceScatter(send, recv, recv_count, dtype, op);
}

absl::Status GlooCommunicator::AllGather(const void* send, void* recv, size_t send_count,
                                         DataType dtype) {
  return impl_->AllGather(send, recv, send_count, dtype);
}

absl::Status GlooCommunicator::Reduce(const void* send, void* recv, size_t count, DataType dtype,
                                      ReduceOp op, int root) {
  return impl_->Reduce(send, recv, count, dtype, op, root);
}

absl::Status GlooCommunicator::Broadcast(void* buffer, size_t count, DataType dtype, int root) {
  return impl_->Broadcast(buffer, count, dtype, root);
}

absl::Status GlooCommunicator::Barrier() { return impl_->Barrier(); }
void GlooCommunicator::SetCollectiveTimeout(absl::Duration timeout) {
  impl_->SetTimeout(timeout);
}
void GlooCommunicator::Abort(absl::string_view reason) { impl_->Abort(reason); }
bool GlooCommunicator::aborted() const { return impl_->aborted(); }
std::optional<PeerFault> GlooCommunicator::peer_fault() const { return impl_->peer_fault(); }

const std::shared_ptr<gloo::Context>& GlooCommunicator::gloo_context() const {
  return impl_->context();
}

}  // namespace shard
