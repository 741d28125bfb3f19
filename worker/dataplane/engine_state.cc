// The engine's state in and out (engine.h): checkpoint shards, restores, loading full
// tensors, and consolidation to one rank.
#include <algorithm>
#include <cstring>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/host_cores.h"
#include "common/safetensors.h"
#include "common/status_macros.h"
#include "worker/dataplane/engine.h"

namespace shard {
namespace {

double Milliseconds(absl::Duration d) { return absl::ToDoubleMilliseconds(d); }

}  // namespace

int Engine::ExtrasHolder(int param) const {
  for (const RankOwnership& owner : plan_->ranks) {
    for (const OwnedRange& range : owner.ranges) {
      if (range.param == param && range.param_offset == 0) return owner.rank;
    }
  }
  return -1;
}

uint64_t Engine::OwnedStateBytes() const {
  return MakeShardLayout(manifest_, *plan_, communicator_->rank(),
                         static_cast<int>(optimizer_.state_names().size()))
      .bytes;
}

absl::Status Engine::CopyOwnedState(std::vector<char>* out) {
  // Every byte is written: a buffer kept from the previous save is reused as it is.
  if (out->size() != OwnedStateBytes()) out->resize(OwnedStateBytes());
  return CopyOwnedState(absl::MakeSpan(*out));
}

bool Engine::CopiesStateInBackground() const {
  return queue_->threaded() && device_->host_memory();
}

absl::StatusOr<CommunicationQueue::Ticket> Engine::CopyOwnedStateInBackground(
    absl::Span<char> out, std::shared_ptr<const void> keep, std::shared_ptr<ShardHasher> hasher) {
  if (!CopiesStateInBackground()) {
    return absl::InternalError(
        "a copy of the state in the background without a communication thread in host memory: "
        "a bug, report it");
  }
  // The gathers first: the next forward waits for them, and not for the copy.
  SHARD_RETURN_IF_ERROR(SubmitPendingGathers());
  return queue_->Submit([this, out, keep = std::move(keep), hasher = std::move(hasher)] {
    return CopyOwnedStateNow(out, hasher.get());
  });
}

absl::Status Engine::CopyOwnedState(absl::Span<char> out) {
  // The copy reads this rank's own ranges only, and at a step boundary nothing submitted writes
  // them any more (the updates are done). So on the host the parameter gathers not started yet
  // stay pending and overlap the next forward, as at a boundary without a save; forcing them
  // here held a snapshot at 4 ranks 7.5 ms against 1.8 ms for the copy. A device copy is ordered
  // after the compute instead.
  if (device_->host_memory()) {
    SHARD_RETURN_IF_ERROR(queue_->Drain());
  } else {
    SHARD_RETURN_IF_ERROR(FinishGathers());
  }
  return CopyOwnedStateNow(out);
}

absl::Status Engine::CopyOwnedStateNow(absl::Span<char> out, ShardHasher* hasher) {
  if (hasher != nullptr && !device_->host_memory()) {
    return absl::InternalError("hashing a copy of device memory as it is copied: a bug, report it");
  }
  // With a hasher, piece by piece: each piece's source is still in the cache when it is hashed
  // (the copy's streamed stores leave the destination out of it), and in host memory the source
  // holds the bytes the copy wrote.
  auto download = [&](const float* from, char* to, int64_t numel) -> absl::Status {
    if (hasher == nullptr) return device_->Download(from, reinterpret_cast<float*>(to), numel);
    constexpr int64_t kPieceFloats = (64 << 10) / sizeof(float);
    for (int64_t done = 0; done < numel; done += kPieceFloats) {
      const int64_t count = std::min(kPieceFloats, numel - done);
      SHARD_RETURN_IF_ERROR(
          device_->Download(from + done, reinterpret_cast<float*>(to) + done, count));
      hasher->Append(from + done, static_cast<size_t>(count) * sizeof(float));
    }
    return absl::OkStatus();
  };
  const int states = static_cast<int>(optimizer_.state_names().size());
  const ShardLayout layout = MakeShardLayout(manifest_, *plan_, communicator_->rank(), states);
  if (out.size() != layout.bytes) {
    return absl::InternalError(absl::StrCat("a buffer of ", out.size(), " bytes for rank ",
                                            communicator_->rank(), "'s ", layout.bytes,
                                            " bytes of state"));
  }
  for (const ShardPiece& piece : layout.pieces) {
    char* dst = out.data() + piece.byte_offset;
    const size_t bytes = piece.numel * sizeof(float);
    const ParamLocation location = plan_->locations[piece.param];
    if (location.bucket < 0) {  // no gradient: values only, zero state
      SHARD_RETURN_IF_ERROR(
          download(frozen_[piece.param].data() + piece.param_offset, dst, piece.numel));
      std::memset(dst + bytes, 0, bytes * states);
      if (hasher != nullptr) hasher->Append(dst + bytes, bytes * states);
      continue;
    }
    const BucketState& bucket = buckets_[location.bucket];
    const int64_t offset = location.offset + piece.param_offset;
    if (offset < bucket.own_begin || offset + piece.numel > bucket.own_end) {
      return absl::InternalError(absl::StrCat("rank ", communicator_->rank(),
                                              " does not hold the state of its plan range of '",
                                              manifest_.params[piece.param].name, "'"));
    }
    SHARD_RETURN_IF_ERROR(
        download(OwnedParams(bucket) + (offset - bucket.own_begin), dst, piece.numel));
    for (int k = 0; k < states; ++k) {
      SHARD_RETURN_IF_ERROR(download(bucket.state[k].data() + (offset - bucket.own_begin),
                                     dst + (k + 1) * bytes, piece.numel));
    }
  }
  return absl::OkStatus();
}

absl::Status Engine::Restore(CheckpointReader& checkpoint, RestoreTimings* timings) {
  SHARD_RETURN_IF_ERROR(queue_->Drain());  // SubmitCollective's, if one is in flight
  const CheckpointManifest& saved = checkpoint.manifest();
  if (absl::Status same = CompareManifests(manifest_, saved.model(),
                                           absl::StrCat("checkpoint ", saved.id));
      !same.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("checkpoint ", saved.id, " is of a different model: ", same.message()));
  }
  if (StateKindOf(saved.optimizer) != StateKindOf(optimizer_.config()) ||
      saved.state_names != optimizer_.state_names()) {
    auto describe = [](const OptimizerConfig& o) {
      return o.kind == OptimizerKind::kTorch
                 ? absl::StrCat(o.torch_class, " (state ", absl::StrJoin(o.torch_state, ", "), ")")
                 : std::string(OptimizerKindName(o.kind));
    };
    return absl::FailedPreconditionError(absl::StrCat(
        "checkpoint ", saved.id, " holds the state of ", describe(saved.optimizer),
        " but this job's optimizer is ", describe(optimizer_.config())));
  }
  if (!rebuilt_) {
    return absl::FailedPreconditionError(
        "restoring needs the rebuilt plan (the checkpoint's gradient order)");
  }
  SHARD_RETURN_IF_ERROR(ReadAndGather(checkpoint, /*states=*/true, timings));
  steps_done_ = saved.step;
  return ContinueCounters(saved.counters.value_or(TrainingCounters{.optimizer_step = saved.step}));
}

TrainingCounters Engine::counters() const {
  TrainingCounters counters{.optimizer_step = optimizer_steps_};
  if (scaler_.has_value()) {
    counters.loss_scale = scaler_->scale();
    counters.loss_scale_growth_tracker = scaler_->growth_tracker();
  }
  return counters;
}

absl::Status Engine::ContinueCounters(const TrainingCounters& counters) {
  optimizer_steps_ = counters.optimizer_step;
  // A run saved without loss scaling (or restored into a job without it) has no scale to keep.
  if (scaler_.has_value() && counters.loss_scale > 0) {
    return scaler_->Restore(counters.loss_scale, counters.loss_scale_growth_tracker);
  }
  return absl::OkStatus();
}

bool GatherDuringReadsPays(int ranks_on_host) {
  return UsableCores() >= 2 * ranks_on_host;
}

absl::Status Engine::ReadAndGather(StateSource& source, bool states, RestoreTimings* timings) {
  SHARD_RETURN_IF_ERROR(FinishGathers());
  // What was gathered is stale once the owned spans are read; stage 3 gathers on demand.
  for (Slot& slot : param_slots_) {
    if (slot.bucket >= 0) buckets_[slot.bucket].slot = -1;
    slot.bucket = -1;
  }
  for (BucketState& bucket : buckets_) bucket.gather = 0;
  const absl::Time read_start = absl::Now();
  absl::Time gather_start;
  if (options_.zero_stage == 0 || sharded_params() || !options_.gather_during_reads ||
      !device_->host_memory()) {
    // On a GPU the gather follows the reads: NCCL gathers in milliseconds what the disk reads
    // in seconds.
    SHARD_RETURN_IF_ERROR(ReadOwned(source, /*params=*/true, states));
    gather_start = absl::Now();
    if (options_.zero_stage > 0) SHARD_RETURN_IF_ERROR(GatherParameters());
  } else {
    // A host collective holds its caller until it is done: each bucket is gathered on a second
    // thread once this rank's part of its parameters is read.
    absl::Mutex mu;
    size_t params_read = 0;  // buckets [0, params_read) are ready to gather
    bool reads_failed = false;
    absl::Status gathered;
    std::thread gatherer([&] {
      for (size_t b = 0; b < buckets_.size(); ++b) {
        {
          absl::MutexLock lock(&mu);
          auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
            return params_read > b || reads_failed;
          };
          mu.Await(absl::Condition(&ready));
          if (params_read <= b) return;  // this rank will not take part: its restore failed
        }
        if (absl::Status status = GatherBucket(b, buckets_[b].params.data()); !status.ok()) {
          absl::MutexLock lock(&mu);
          gathered = std::move(status);
          return;
        }
      }
    });
    absl::Status read = ReadOwned(source, /*params=*/true, states, [&](size_t bucket) {
      absl::MutexLock lock(&mu);
      params_read = bucket + 1;
    });
    gather_start = absl::Now();
    {
      absl::MutexLock lock(&mu);
      if (!read.ok()) reads_failed = true;
    }
    gatherer.join();
    SHARD_RETURN_IF_ERROR(read);
    SHARD_RETURN_IF_ERROR(gathered);
    SHARD_RETURN_IF_ERROR(communicator_->OrderComputeAfterCollectives());
  }
  if (timings != nullptr) {
    timings->read_ms = Milliseconds(gather_start - read_start);
    timings->gather_ms = Milliseconds(absl::Now() - gather_start);
  }
  return absl::OkStatus();
}

absl::Status Engine::ReadOwned(StateSource& source, bool params, bool states,
                               const std::function<void(size_t)>& params_read) {
  const int state_count = states ? static_cast<int>(optimizer_.state_names().size()) : 0;
  // What this rank owns: its owned span of every bucket.
  for (size_t b = 0; b < buckets_.size(); ++b) {
    BucketState& bucket = buckets_[b];
    const std::vector<BucketEntry>& entries = plan_->buckets[b].entries;
    auto owned_begin = [&](const BucketEntry& e) { return std::max(e.offset, bucket.own_begin); };
    auto owned_end = [&](const BucketEntry& e) {
      return std::min(e.offset + e.numel, bucket.own_end);
    };
    // An entry's parameters and states lie together in a shard, so entries are read one after
    // the other, each whole; the bucket's parameters are all in after its last owned entry's.
    size_t last_owned = entries.size();
    for (size_t e = 0; e < entries.size(); ++e) {
      if (owned_begin(entries[e]) < owned_end(entries[e])) last_owned = e;
    }
    if (last_owned == entries.size() && params_read) params_read(b);
    for (size_t e = 0; e < entries.size(); ++e) {
      const BucketEntry& entry = entries[e];
      const int64_t begin = owned_begin(entry);
      const int64_t end = owned_end(entry);
      if (begin >= end) continue;
      const int64_t param_offset = begin - entry.offset;
      if (params) {
        SHARD_RETURN_IF_ERROR(ReadInto(source, entry.param, -1, param_offset, end - begin,
                                       OwnedParams(bucket) + (begin - bucket.own_begin)));
      }
      if (e == last_owned && params_read) params_read(b);
      for (int k = 0; k < state_count; ++k) {
        SHARD_RETURN_IF_ERROR(ReadInto(source, entry.param, k, param_offset, end - begin,
                                       bucket.state[k].data() + (begin - bucket.own_begin)));
      }
    }
  }
  if (!params) return absl::OkStatus();
  for (size_t p = 0; p < frozen_.size(); ++p) {
    if (frozen_[p].size() == 0) continue;
    SHARD_RETURN_IF_ERROR(
        ReadInto(source, static_cast<int>(p), -1, 0, frozen_[p].size(), frozen_[p].data()));
  }
  return absl::OkStatus();
}

absl::Status Engine::ReadInto(StateSource& source, int param, int array, int64_t begin,
                              int64_t count, float* out) {
  if (device_->host_memory()) return source.ReadElements(param, array, begin, count, out);
  host_scratch_.resize(count);
  SHARD_RETURN_IF_ERROR(source.ReadElements(param, array, begin, count, host_scratch_.data()));
  return device_->Upload(host_scratch_.data(), out, count);
}

absl::Status Engine::LoadState(std::unique_ptr<StateSource> source, bool with_state,
                               int64_t steps_done, const TrainingCounters& counters) {
  SHARD_RETURN_IF_ERROR(queue_->Drain());  // SubmitCollective's, if one is in flight
  SHARD_RETURN_IF_ERROR(ReadAndGather(*source, with_state && rebuilt_, nullptr));
  steps_done_ = steps_done;
  SHARD_RETURN_IF_ERROR(ContinueCounters(counters));
  // Before the rebuild the owned spans are not final: the state waits for the new layout.
  if (with_state && !rebuilt_) pending_state_ = std::move(source);
  return absl::OkStatus();
}

absl::Status Engine::ConsolidateStateDict(int to_rank, const std::string& path,
                                          bool with_state) {
  const bool mine = communicator_->rank() == to_rank;
  const int states = with_state ? static_cast<int>(optimizer_.state_names().size()) : 0;
  // Every tensor in full on `to_rank`, one at a time (GatherToRank), written as it arrives:
  // no rank holds more than one tensor beyond its own state.
  std::vector<TensorDecl> tensors;
  for (const ParamSpec& param : manifest_.params) {
    const int last = param.requires_grad ? states : 0;
    for (int array = -1; array < last; ++array) {
      tensors.push_back(TensorDecl{
          array < 0 ? param.name : param.name + "." + optimizer_.state_names()[array],
          DataType::kFloat32, param.shape});
    }
  }
  std::unique_ptr<SafetensorsWriter> writer;
  if (mine) {
    SHARD_ASSIGN_OR_RETURN(
        writer, SafetensorsWriter::Create(
                    path, tensors,
                    with_state ? TrainedFileMetadata(steps_done_, optimizer_.config().kind,
                                                     counters())
                               : std::map<std::string, std::string>{{"format", "pt"},
                                                                    {"producer", "shard"}}));
  }
  std::vector<float> full;
  for (size_t p = 0; p < manifest_.params.size(); ++p) {
    const ParamSpec& param = manifest_.params[p];
    const int last = param.requires_grad ? states : 0;
    for (int array = -1; array < last; ++array) {
      full.assign(mine ? param.numel() : 0, 0.0f);
      SHARD_RETURN_IF_ERROR(GatherToRank(static_cast<int>(p), array, to_rank,
                                         mine ? full.data() : nullptr));
      if (mine) SHARD_RETURN_IF_ERROR(writer->Append(full.data(), full.size() * sizeof(float)));
    }
  }
  return mine ? writer->Finish() : absl::OkStatus();
}

absl::Status Engine::GatherToRank(int param, int array, int to_rank, float* out) {
  SHARD_RETURN_IF_ERROR(queue_->Drain());  // SubmitCollective's, if one is in flight
  const int rank = communicator_->rank();
  if (param < 0 || param >= static_cast<int>(manifest_.params.size()) ||
      array >= static_cast<int>(optimizer_.state_names().size()) ||
      (array >= 0 && !manifest_.params[param].requires_grad)) {
    return absl::OutOfRangeError(absl::StrCat("parameter ", param, " has no array ", array));
  }
  if (rank == to_rank && out == nullptr) {
    return absl::InvalidArgumentError("the gathering rank needs a place for the values");
  }
  SHARD_RETURN_IF_ERROR(FinishGathers());
  // Parameter values are on every rank after a step (below stage 3), and at stage 0 so is the
  // state.
  const bool frozen = plan_->locations[param].bucket < 0;
  if ((array < 0 && (frozen || !sharded_params())) || options_.zero_stage == 0) {
    if (rank != to_rank) return absl::OkStatus();
    if (array < 0) {
      return device_->Download(ParamData(param), out, manifest_.params[param].numel());
    }
    const ParamLocation location = plan_->locations[param];
    const BucketState& bucket = buckets_[location.bucket];
    return device_->Download(bucket.state[array].data() + (location.offset - bucket.own_begin),
                             out, manifest_.params[param].numel());
  }
  // Each range from the rank that updates it, in the plan's order on every rank.
  for (int owner = 0; owner < communicator_->size(); ++owner) {
    for (const OwnedRange& range : plan_->ranks[owner].ranges) {
      if (range.param != param) continue;
      float* to = out != nullptr ? out + range.param_offset : nullptr;
      if (owner == to_rank) {
        if (rank == to_rank) {
          SHARD_RETURN_IF_ERROR(device_->Download(RangeData(range, array), to, range.numel));
        }
        continue;
      }
      SHARD_ASSIGN_OR_RETURN(DeviceArray piece, device_->Allocate(range.numel));
      if (rank == owner) {
        SHARD_RETURN_IF_ERROR(device_->Copy(RangeData(range, array), piece.data(), range.numel));
      }
      SHARD_RETURN_IF_ERROR(
          communicator_->Broadcast(piece.data(), range.numel, DataType::kFloat32, owner));
      SHARD_RETURN_IF_ERROR(communicator_->OrderComputeAfterCollectives());
      if (rank == to_rank) SHARD_RETURN_IF_ERROR(device_->Download(piece.data(), to, range.numel));
    }
  }
  return absl::OkStatus();
}

absl::Status Engine::SendBytes(int from_rank, int to_rank, std::string* bytes) {
  if (from_rank == to_rank) return absl::OkStatus();
  SHARD_RETURN_IF_ERROR(FinishGathers());  // and SubmitCollective's, if one is in flight
  const int rank = communicator_->rank();
  int64_t size = rank == from_rank ? static_cast<int64_t>(bytes->size()) : 0;
  SHARD_RETURN_IF_ERROR(device_->AllReduceHostValues(*communicator_, &size, 1, DataType::kInt64,
                                                     ReduceOp::kMax));
  if (size == 0) {
    if (rank == to_rank) bytes->clear();
    return absl::OkStatus();
  }
  // The bytes travel as floats in the device's memory, which every communicator moves.
  const int64_t floats = (size + 3) / 4;
  SHARD_ASSIGN_OR_RETURN(DeviceArray carrier, device_->Allocate(floats));
  std::vector<float> host(floats, 0.0f);
  if (rank == from_rank) {
    std::memcpy(host.data(), bytes->data(), size);
    SHARD_RETURN_IF_ERROR(device_->Upload(host.data(), carrier.data(), floats));
  }
  SHARD_RETURN_IF_ERROR(
      communicator_->Broadcast(carrier.data(), floats, DataType::kFloat32, from_rank));
  SHARD_RETURN_IF_ERROR(communicator_->OrderComputeAfterCollectives());
  if (rank != to_rank) return absl::OkStatus();
  SHARD_RETURN_IF_ERROR(device_->Download(carrier.data(), host.data(), floats));
  bytes->assign(reinterpret_cast<const char*>(host.data()), size);
  return absl::OkStatus();
}

int64_t Engine::optimizer_state_bytes() const {
  int64_t bytes = 0;
  for (const BucketState& bucket : buckets_) {
    for (const DeviceArray& s : bucket.state) bytes += s.size() * sizeof(float);
  }
  return bytes;
}

}  // namespace shard
