#include "worker/dataplane/engine.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/safetensors.h"

namespace shard {
namespace {

double Milliseconds(absl::Duration d) { return absl::ToDoubleMilliseconds(d); }

}  // namespace

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(Manifest manifest,
                                                      Communicator* communicator,
                                                      PlanProvider* plans, EngineOptions options) {
  if (absl::Status valid = ValidateManifest(manifest); !valid.ok()) return valid;
  for (const ParamSpec& param : manifest.params) {
    if (param.dtype != DataType::kFloat32) {
      return absl::InvalidArgumentError(absl::StrCat(
          "parameter '", param.name, "' is ", DataTypeName(param.dtype),
          "; the CPU engine trains f32 parameters (16-bit weights need the GPU data path)"));
    }
  }
  if (options.zero_stage < 0 || options.zero_stage > 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("ZeRO stage must be 0, 1 or 2, got ", options.zero_stage));
  }
  absl::StatusOr<AppliedPlan> initial = plans->Initial(manifest);
  if (!initial.ok()) return initial.status();
  if (initial->plan->options.world_size != communicator->size()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the plan is for ", initial->plan->options.world_size, " ranks but the communicator has ",
        communicator->size()));
  }
  std::unique_ptr<Engine> engine(
      new Engine(std::move(manifest), communicator, plans, std::move(options)));
  engine->Apply(std::move(*initial), /*carry_gradients=*/false);
  if (engine->options_.overlap) {
    engine->communication_thread_ = std::thread([e = engine.get()] { e->CommunicationLoop(); });
  }
  return engine;
}

Engine::Engine(Manifest manifest, Communicator* communicator, PlanProvider* plans,
               EngineOptions options)
    : manifest_(std::move(manifest)),
      communicator_(communicator),
      plans_(plans),
      options_(std::move(options)),
      optimizer_(options_.optimizer),
      frozen_(manifest_.params.size()) {
  for (size_t i = 0; i < manifest_.params.size(); ++i) {
    if (!manifest_.params[i].requires_grad) frozen_[i].resize(manifest_.params[i].numel());
  }
}

Engine::~Engine() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (communication_thread_.joinable()) communication_thread_.join();
}

void Engine::Apply(AppliedPlan applied, bool carry_gradients) {
  const Plan& plan = *applied.plan;
  const int rank = communicator_->rank();
  const int world = communicator_->size();
  std::vector<BucketState> buckets(plan.buckets.size());
  for (size_t b = 0; b < plan.buckets.size(); ++b) {
    const Bucket& bucket = plan.buckets[b];
    BucketState& state = buckets[b];
    state.params.assign(bucket.padded_numel, 0.0f);
    state.grads.assign(bucket.padded_numel, 0.0f);
    if (options_.zero_stage == 0) {
      state.own_end = bucket.padded_numel;
    } else if (plan.options.mode == ShardMode::kRange) {
      const int64_t shard = ShardNumel(bucket, world);
      state.own_begin = rank * shard;
      state.own_end = (rank + 1) * shard;
    } else if (bucket.owner == rank) {
      state.own_end = bucket.padded_numel;
    }
    state.state.assign(optimizer_.state_names().size(),
                       std::vector<float>(state.own_end - state.own_begin, 0.0f));
    state.pending = static_cast<int>(bucket.entries.size());
  }
  if (plan_ != nullptr) {
    for (size_t p = 0; p < manifest_.params.size(); ++p) {
      const ParamLocation from = plan_->locations[p];
      const ParamLocation to = plan.locations[p];
      if (from.bucket < 0) continue;
      const int64_t n = manifest_.params[p].numel();
      std::memcpy(buckets[to.bucket].params.data() + to.offset,
                  buckets_[from.bucket].params.data() + from.offset, n * sizeof(float));
      if (carry_gradients) {
        std::memcpy(buckets[to.bucket].grads.data() + to.offset,
                    buckets_[from.bucket].grads.data() + from.offset, n * sizeof(float));
      }
    }
  }
  buckets_ = std::move(buckets);
  plan_ = std::move(applied.plan);
  plan_version_ = applied.version;
  rebuilt_ = applied.rebuilt;
  marked_.assign(manifest_.params.size(), false);
  ready_order_.clear();
  absl::MutexLock lock(&mu_);
  bucket_ready_.assign(buckets_.size(), false);
  next_bucket_ = 0;
  reduced_ = 0;
  reduce_spans_.clear();
  first_step_all_reduce_ = !rebuilt_;
}

const float* Engine::param_pointer(int index) const {
  const ParamLocation location = plan_->locations[index];
  if (location.bucket < 0) return frozen_[index].data();
  return buckets_[location.bucket].params.data() + location.offset;
}

float* Engine::param(int index) { return const_cast<float*>(param_pointer(index)); }

float* Engine::grad(int index) {
  const ParamLocation location = plan_->locations[index];
  if (location.bucket < 0) return nullptr;
  return buckets_[location.bucket].grads.data() + location.offset;
}

absl::Status Engine::BroadcastParameters() {
  for (BucketState& bucket : buckets_) {
    if (absl::Status s = communicator_->Broadcast(bucket.params.data(), bucket.params.size(),
                                                  DataType::kFloat32, 0);
        !s.ok()) {
      return s;
    }
  }
  for (std::vector<float>& frozen : frozen_) {
    if (frozen.empty()) continue;
    if (absl::Status s =
            communicator_->Broadcast(frozen.data(), frozen.size(), DataType::kFloat32, 0);
        !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

void Engine::StartBackward() { backward_start_ = absl::Now(); }

void Engine::MarkGradReady(int index) {
  const ParamLocation location = plan_->locations[index];
  if (location.bucket < 0 || marked_[index]) return;
  marked_[index] = true;
  ready_order_.push_back(index);
  backward_end_ = absl::Now();
  if (--buckets_[location.bucket].pending == 0) {
    absl::MutexLock lock(&mu_);
    bucket_ready_[location.bucket] = true;
  }
}

absl::Status Engine::ReduceBucket(int b) {
  bool all_reduce = false;
  {
    absl::MutexLock lock(&mu_);
    all_reduce = first_step_all_reduce_;
  }
  BucketState& state = buckets_[b];
  const Bucket& bucket = plan_->buckets[b];
  float* grads = state.grads.data();
  const size_t n = state.grads.size();
  if (all_reduce || options_.zero_stage < 2) {
    return communicator_->AllReduce(grads, grads, n, DataType::kFloat32, ReduceOp::kSum);
  }
  if (plan_->options.mode == ShardMode::kRange) {
    // In place: this rank's shard of the bucket receives the reduced shard.
    const int64_t shard = ShardNumel(bucket, communicator_->size());
    return communicator_->ReduceScatter(grads, grads + communicator_->rank() * shard, shard,
                                        DataType::kFloat32, ReduceOp::kSum);
  }
  return communicator_->Reduce(grads, grads, n, DataType::kFloat32, ReduceOp::kSum,
                               bucket.owner);
}

void Engine::CommunicationLoop() {
  while (true) {
    int bucket = 0;
    {
      absl::MutexLock lock(&mu_);
      auto work = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stopping_ || (next_bucket_ < static_cast<int>(bucket_ready_.size()) &&
                             bucket_ready_[next_bucket_]);
      };
      mu_.Await(absl::Condition(&work));
      if (stopping_) return;
      bucket = next_bucket_++;
    }
    const absl::Time start = absl::Now();
    absl::Status reduced = ReduceBucket(bucket);
    const absl::Time end = absl::Now();
    absl::MutexLock lock(&mu_);
    reduce_spans_.push_back({start, end});
    ++reduced_;
    if (!reduced.ok() && communication_error_.ok()) communication_error_ = reduced;
  }
}

absl::Status Engine::ClipGradients(StepTimings* timings) {
  double sum_squares = 0;
  for (const BucketState& bucket : buckets_) {
    for (int64_t i = bucket.own_begin; i < bucket.own_end; ++i) {
      sum_squares += static_cast<double>(bucket.grads[i]) * bucket.grads[i];
    }
  }
  // At stage 0 every rank owns (and holds) all gradients; otherwise the shards add up.
  if (options_.zero_stage > 0) {
    if (absl::Status s = communicator_->AllReduce(&sum_squares, &sum_squares, 1,
                                                  DataType::kFloat64, ReduceOp::kSum);
        !s.ok()) {
      return s;
    }
  }
  const double norm = std::sqrt(sum_squares);
  timings->grad_norm = norm;
  // torch.nn.utils.clip_grad_norm_: scale by max_norm / (norm + 1e-6), clamped to 1.
  const double coefficient = std::min(1.0, options_.grad_clip_norm / (norm + 1e-6));
  if (coefficient < 1.0) {
    const float scale = static_cast<float>(coefficient);
    for (BucketState& bucket : buckets_) {
      for (int64_t i = bucket.own_begin; i < bucket.own_end; ++i) bucket.grads[i] *= scale;
    }
  }
  return absl::OkStatus();
}

absl::Status Engine::GatherParameters() {
  const int rank = communicator_->rank();
  for (size_t b = 0; b < buckets_.size(); ++b) {
    BucketState& state = buckets_[b];
    const Bucket& bucket = plan_->buckets[b];
    absl::Status s;
    if (plan_->options.mode == ShardMode::kRange) {
      const int64_t shard = ShardNumel(bucket, communicator_->size());
      s = communicator_->AllGather(state.params.data() + rank * shard, state.params.data(), shard,
                                   DataType::kFloat32);
    } else {
      s = communicator_->Broadcast(state.params.data(), state.params.size(), DataType::kFloat32,
                                   bucket.owner);
    }
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status Engine::Step(StepTimings* timings) {
  *timings = StepTimings{};
  for (size_t p = 0; p < manifest_.params.size(); ++p) {
    if (manifest_.params[p].requires_grad && !marked_[p]) {
      return absl::FailedPreconditionError(absl::StrCat(
          "step ", steps_done_ + 1, ": the gradient of '", manifest_.params[p].name,
          "' was never marked ready; backward must mark every trainable parameter"));
    }
  }
  // Reductions: on the communication thread (already under way) or here.
  std::vector<std::pair<absl::Time, absl::Time>> spans;
  if (options_.overlap) {
    absl::MutexLock lock(&mu_);
    auto done = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return reduced_ == static_cast<int>(bucket_ready_.size());
    };
    mu_.Await(absl::Condition(&done));
    if (!communication_error_.ok()) return communication_error_;
    spans.swap(reduce_spans_);
  } else {
    for (int b = 0; b < static_cast<int>(buckets_.size()); ++b) {
      const absl::Time start = absl::Now();
      if (absl::Status s = ReduceBucket(b); !s.ok()) return s;
      spans.push_back({start, absl::Now()});
    }
  }
  for (const auto& [start, end] : spans) {
    timings->communication_ms += Milliseconds(end - start);
    const absl::Time overlap_start = std::max(start, backward_start_);
    const absl::Time overlap_end = std::min(end, backward_end_);
    if (overlap_end > overlap_start) timings->hidden_ms += Milliseconds(overlap_end - overlap_start);
  }
  timings->backward_ms = Milliseconds(backward_end_ - backward_start_);
  for (const BucketState& bucket : buckets_) {
    timings->bucket_bytes.push_back(static_cast<int64_t>(bucket.grads.size() * sizeof(float)));
  }

  if (!rebuilt_) {
    // Every rank holds the full reduced gradients (the first step all-reduces), so the rebuilt
    // layout can take over right here, before any optimizer state exists.
    absl::StatusOr<AppliedPlan> rebuilt = plans_->Rebuild(plan_version_, ready_order_);
    if (!rebuilt.ok()) return rebuilt.status();
    if (rebuilt->plan->options.world_size != communicator_->size()) {
      return absl::FailedPreconditionError("the rebuilt plan is for another world size");
    }
    Apply(std::move(*rebuilt), /*carry_gradients=*/true);
    timings->rebuilt = true;
    if (pending_state_ != nullptr) {
      // Imported optimizer state, now into the final layout (still before any update).
      if (absl::Status read = ReadOwned(*pending_state_, /*params=*/false, /*states=*/true);
          !read.ok()) {
        return read;
      }
      pending_state_.reset();
    }
  }

  if (options_.grad_clip_norm > 0) {
    if (absl::Status s = ClipGradients(timings); !s.ok()) return s;
  }
  const absl::Time update_start = absl::Now();
  const int64_t step = steps_done_ + 1;
  for (BucketState& bucket : buckets_) {
    const int64_t n = bucket.own_end - bucket.own_begin;
    if (n == 0) continue;
    std::vector<float*> state;
    for (std::vector<float>& s : bucket.state) state.push_back(s.data());
    optimizer_.Update(step, bucket.params.data() + bucket.own_begin,
                      bucket.grads.data() + bucket.own_begin, state.data(),
                      static_cast<size_t>(n));
  }
  timings->optimizer_ms = Milliseconds(absl::Now() - update_start);
  if (options_.zero_stage > 0) {
    const absl::Time gather_start = absl::Now();
    if (absl::Status s = GatherParameters(); !s.ok()) return s;
    timings->gather_ms = Milliseconds(absl::Now() - gather_start);
  }

  // Ready for the next step.
  ++steps_done_;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    buckets_[b].pending = static_cast<int>(plan_->buckets[b].entries.size());
  }
  std::fill(marked_.begin(), marked_.end(), false);
  ready_order_.clear();
  absl::MutexLock lock(&mu_);
  std::fill(bucket_ready_.begin(), bucket_ready_.end(), false);
  next_bucket_ = 0;
  reduced_ = 0;
  first_step_all_reduce_ = false;
  return absl::OkStatus();
}

absl::Status Engine::CopyOwnedState(std::vector<char>* out) const {
  const int states = static_cast<int>(optimizer_.state_names().size());
  const ShardLayout layout = MakeShardLayout(manifest_, *plan_, communicator_->rank(), states);
  // Every byte is written below; a buffer kept from the previous save is reused as it is.
  if (out->size() != layout.bytes) out->resize(layout.bytes);
  for (const ShardPiece& piece : layout.pieces) {
    char* dst = out->data() + piece.byte_offset;
    const size_t bytes = piece.numel * sizeof(float);
    const ParamLocation location = plan_->locations[piece.param];
    if (location.bucket < 0) {  // no gradient: values only, zero state
      std::memcpy(dst, frozen_[piece.param].data() + piece.param_offset, bytes);
      std::memset(dst + bytes, 0, bytes * states);
      continue;
    }
    const BucketState& bucket = buckets_[location.bucket];
    const int64_t offset = location.offset + piece.param_offset;
    if (offset < bucket.own_begin || offset + piece.numel > bucket.own_end) {
      return absl::InternalError(absl::StrCat("rank ", communicator_->rank(),
                                              " does not hold the state of its plan range of '",
                                              manifest_.params[piece.param].name, "'"));
    }
    std::memcpy(dst, bucket.params.data() + offset, bytes);
    for (int k = 0; k < states; ++k) {
      std::memcpy(dst + (k + 1) * bytes, bucket.state[k].data() + (offset - bucket.own_begin),
                  bytes);
    }
  }
  return absl::OkStatus();
}

absl::Status Engine::Restore(CheckpointReader& checkpoint) {
  const CheckpointManifest& saved = checkpoint.manifest();
  if (absl::Status same = CompareManifests(manifest_, saved.model(),
                                           absl::StrCat("checkpoint ", saved.id));
      !same.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("checkpoint ", saved.id, " is of a different model: ", same.message()));
  }
  if (saved.state_names != optimizer_.state_names()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "checkpoint ", saved.id, " holds ", OptimizerKindName(saved.optimizer.kind),
        " state but this job's optimizer is ", OptimizerKindName(optimizer_.config().kind)));
  }
  if (!rebuilt_) {
    return absl::FailedPreconditionError(
        "restoring needs the rebuilt plan (the checkpoint's gradient order)");
  }
  if (absl::Status read = ReadOwned(checkpoint, /*params=*/true, /*states=*/true); !read.ok()) {
    return read;
  }
  if (options_.zero_stage > 0) {
    if (absl::Status gathered = GatherParameters(); !gathered.ok()) return gathered;
  }
  steps_done_ = saved.step;
  return absl::OkStatus();
}

absl::Status Engine::ReadOwned(StateSource& source, bool params, bool states) {
  const int state_count = states ? static_cast<int>(optimizer_.state_names().size()) : 0;
  // What this rank owns: its owned span of every bucket.
  for (size_t b = 0; b < buckets_.size(); ++b) {
    BucketState& bucket = buckets_[b];
    for (const BucketEntry& entry : plan_->buckets[b].entries) {
      const int64_t begin = std::max(entry.offset, bucket.own_begin);
      const int64_t end = std::min(entry.offset + entry.numel, bucket.own_end);
      if (begin >= end) continue;
      const int64_t param_offset = begin - entry.offset;
      if (params) {
        if (absl::Status read = source.ReadElements(entry.param, -1, param_offset, end - begin,
                                                    bucket.params.data() + begin);
            !read.ok()) {
          return read;
        }
      }
      for (int k = 0; k < state_count; ++k) {
        if (absl::Status read =
                source.ReadElements(entry.param, k, param_offset, end - begin,
                                    bucket.state[k].data() + (begin - bucket.own_begin));
            !read.ok()) {
          return read;
        }
      }
    }
  }
  if (!params) return absl::OkStatus();
  for (size_t p = 0; p < frozen_.size(); ++p) {
    if (frozen_[p].empty()) continue;
    if (absl::Status read = source.ReadElements(static_cast<int>(p), -1, 0,
                                                static_cast<int64_t>(frozen_[p].size()),
                                                frozen_[p].data());
        !read.ok()) {
      return read;
    }
  }
  return absl::OkStatus();
}

absl::Status Engine::LoadState(std::unique_ptr<StateSource> source, bool with_state,
                               int64_t steps_done) {
  if (absl::Status read = ReadOwned(*source, /*params=*/true, with_state && rebuilt_); !read.ok()) {
    return read;
  }
  if (options_.zero_stage > 0) {
    if (absl::Status gathered = GatherParameters(); !gathered.ok()) return gathered;
  }
  steps_done_ = steps_done;
  // Before the rebuild the owned spans are not final: the state waits for the new layout.
  if (with_state && !rebuilt_) pending_state_ = std::move(source);
  return absl::OkStatus();
}

absl::Status Engine::ConsolidateStateDict(int to_rank, const std::string& path) {
  const int rank = communicator_->rank();
  const int states = static_cast<int>(optimizer_.state_names().size());
  // Full optimizer state of every bucket on `to_rank`: owned spans add up to the whole (the
  // others contribute zeros); at stage 0 every rank already holds it all.
  std::vector<std::vector<std::vector<float>>> full(buckets_.size());
  for (size_t b = 0; b < buckets_.size(); ++b) {
    const BucketState& bucket = buckets_[b];
    for (int k = 0; k < states; ++k) {
      std::vector<float> values(bucket.params.size(), 0.0f);
      std::copy(bucket.state[k].begin(), bucket.state[k].end(),
                values.begin() + bucket.own_begin);
      if (options_.zero_stage > 0) {
        if (absl::Status s = communicator_->Reduce(values.data(), values.data(), values.size(),
                                                   DataType::kFloat32, ReduceOp::kSum, to_rank);
            !s.ok()) {
          return s;
        }
      }
      if (rank == to_rank) full[b].push_back(std::move(values));
    }
  }
  if (rank != to_rank) return absl::OkStatus();
  std::vector<TensorDecl> tensors;
  std::vector<const void*> data;
  for (size_t p = 0; p < manifest_.params.size(); ++p) {
    const ParamSpec& param = manifest_.params[p];
    tensors.push_back(TensorDecl{param.name, param.dtype, param.shape});
    data.push_back(param_pointer(static_cast<int>(p)));
    const ParamLocation location = plan_->locations[p];
    if (location.bucket < 0) continue;
    for (int k = 0; k < states; ++k) {
      tensors.push_back(TensorDecl{param.name + "." + optimizer_.state_names()[k], DataType::kFloat32,
                                   param.shape});
      data.push_back(full[location.bucket][k].data() + location.offset);
    }
  }
  return WriteSafetensors(path, tensors, data,
                          {{"format", "pt"},
                           {"producer", "shard"},
                           {"step", absl::StrCat(steps_done_)},
                           {"optimizer", std::string(OptimizerKindName(optimizer_.config().kind))}});
}

int64_t Engine::optimizer_state_bytes() const {
  int64_t bytes = 0;
  for (const BucketState& bucket : buckets_) {
    for (const std::vector<float>& s : bucket.state) bytes += s.size() * sizeof(float);
  }
  return bytes;
}

}  // namespace shard
