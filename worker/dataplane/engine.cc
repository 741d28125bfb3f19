#include "worker/dataplane/engine.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/host_cores.h"
#include "common/param_groups.h"
#include "common/safetensors.h"
#include "common/status_macros.h"
#include "worker/dataplane/cpu_device.h"

namespace shard {
namespace {

double Milliseconds(absl::Duration d) { return absl::ToDoubleMilliseconds(d); }

}  // namespace

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(Manifest manifest,
                                                      Communicator* communicator,
                                                      PlanProvider* plans, EngineOptions options) {
  SHARD_RETURN_IF_ERROR(ValidateManifest(manifest));
  for (const ParamSpec& param : manifest.params) {
    if (param.dtype != DataType::kFloat32) {
      return absl::InvalidArgumentError(absl::StrCat(
          "parameter '", param.name, "' is ", DataTypeName(param.dtype),
          "; the engine keeps f32 parameters (master weights; a 16-bit model computes with "
          "copies of them)"));
    }
  }
  if (options.zero_stage < 0 || options.zero_stage > 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("ZeRO stage must be 0, 1 or 2, got ", options.zero_stage));
  }
  SHARD_RETURN_IF_ERROR(ValidateOptimizerConfig(options.optimizer));
  // A group that takes no parameter (a typo in a pattern) fails here, naming its patterns.
  SHARD_ASSIGN_OR_RETURN(std::vector<int> param_groups,
                         AssignParamGroups(options.optimizer, manifest));
  SHARD_ASSIGN_OR_RETURN(AppliedPlan initial, plans->Initial(manifest));
  if (initial.plan->options.world_size != communicator->size()) {
    return absl::FailedPreconditionError(
        absl::StrCat("the plan is for ", initial.plan->options.world_size,
                     " ranks but the communicator has ", communicator->size()));
  }
  std::optional<LossScaler> scaler;
  if (options.loss_scaling.has_value()) {
    SHARD_ASSIGN_OR_RETURN(scaler, LossScaler::Create(*options.loss_scaling));
  }
  std::unique_ptr<Engine> engine(new Engine(std::move(manifest), communicator, plans,
                                            std::move(options), std::move(param_groups)));
  engine->scaler_ = std::move(scaler);
  SHARD_RETURN_IF_ERROR(engine->device_->BindThread());
  SHARD_RETURN_IF_ERROR(engine->Allocate());
  SHARD_RETURN_IF_ERROR(engine->Apply(std::move(initial), /*carry_gradients=*/false));
  if (engine->options_.overlap) {
    engine->communication_thread_ = std::thread([e = engine.get()] { e->CommunicationLoop(); });
  }
  return engine;
}

Engine::Engine(Manifest manifest, Communicator* communicator, PlanProvider* plans,
               EngineOptions options, std::vector<int> param_groups)
    : manifest_(std::move(manifest)),
      communicator_(communicator),
      plans_(plans),
      options_(std::move(options)),
      device_(options_.device != nullptr ? options_.device : &HostDevice()),
      optimizer_(options_.optimizer),
      param_groups_(std::move(param_groups)),
      frozen_(manifest_.params.size()) {}

absl::Status Engine::Allocate() {
  for (size_t i = 0; i < manifest_.params.size(); ++i) {
    if (manifest_.params[i].requires_grad) continue;
    SHARD_ASSIGN_OR_RETURN(frozen_[i], device_->Allocate(manifest_.params[i].numel()));
  }
  return absl::OkStatus();
}

Engine::~Engine() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (communication_thread_.joinable()) communication_thread_.join();
}

absl::Status Engine::Apply(AppliedPlan applied, bool carry_gradients) {
  const Plan& plan = *applied.plan;
  const int rank = communicator_->rank();
  const int world = communicator_->size();
  std::vector<BucketState> buckets(plan.buckets.size());
  std::vector<OwnedSpan> spans;
  for (size_t b = 0; b < plan.buckets.size(); ++b) {
    const Bucket& bucket = plan.buckets[b];
    BucketState& state = buckets[b];
    SHARD_ASSIGN_OR_RETURN(state.params, device_->Allocate(bucket.padded_numel));
    SHARD_ASSIGN_OR_RETURN(state.grads, device_->Allocate(bucket.padded_numel));
    if (options_.zero_stage == 0) {
      state.own_end = bucket.padded_numel;
    } else if (plan.options.mode == ShardMode::kRange) {
      const int64_t shard = ShardNumel(bucket, world);
      state.own_begin = rank * shard;
      state.own_end = (rank + 1) * shard;
    } else if (bucket.owner == rank) {
      state.own_end = bucket.padded_numel;
    }
    const int64_t owned = state.own_end - state.own_begin;
    for (size_t k = 0; k < optimizer_.state_names().size(); ++k) {
      SHARD_ASSIGN_OR_RETURN(DeviceArray array, device_->Allocate(owned));
      state.state.push_back(std::move(array));
    }
    if (owned > 0) {
      for (OwnedSpan& span : SplitOwnedSpan(bucket, state)) spans.push_back(std::move(span));
    }
    state.pending = static_cast<int>(bucket.entries.size());
  }
  SHARD_ASSIGN_OR_RETURN(std::unique_ptr<SpanKernels> kernels,
                         device_->PrepareSpans(optimizer_.config(), std::move(spans)));
  if (plan_ != nullptr) {
    for (size_t p = 0; p < manifest_.params.size(); ++p) {
      const ParamLocation from = plan_->locations[p];
      const ParamLocation to = plan.locations[p];
      if (from.bucket < 0) continue;
      const int64_t n = manifest_.params[p].numel();
      SHARD_RETURN_IF_ERROR(device_->Copy(buckets_[from.bucket].params.data() + from.offset,
                                          buckets[to.bucket].params.data() + to.offset, n));
      if (carry_gradients) {
        SHARD_RETURN_IF_ERROR(device_->Copy(buckets_[from.bucket].grads.data() + from.offset,
                                            buckets[to.bucket].grads.data() + to.offset, n));
      }
    }
  }
  // Only now: until here a failure leaves the engine on its old layout, kernels included.
  buckets_ = std::move(buckets);
  kernels_ = std::move(kernels);
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
  return absl::OkStatus();
}

std::vector<OwnedSpan> Engine::SplitOwnedSpan(const Bucket& bucket,
                                              const BucketState& state) const {
  // Where each parameter of the bucket starts, with its group. An element belongs to the group
  // of the last parameter starting at or before it: alignment gaps and the padding go with the
  // parameter before them (they hold zeros whatever the settings).
  std::vector<std::pair<int64_t, int>> starts;
  for (const BucketEntry& entry : bucket.entries) {
    starts.push_back({entry.offset, param_groups_[entry.param]});
  }
  std::sort(starts.begin(), starts.end());
  int group = starts.empty() ? -1 : starts.front().second;
  for (const auto& [offset, g] : starts) {
    if (offset <= state.own_begin) group = g;
  }
  std::vector<OwnedSpan> spans;
  const auto add = [&](int64_t begin, int64_t end, int span_group) {
    OwnedSpan span{state.params.data() + begin, state.grads.data() + begin, {}, end - begin,
                   span_group};
    for (const DeviceArray& array : state.state) {
      span.state.push_back(array.data() + (begin - state.own_begin));
    }
    spans.push_back(std::move(span));
  };
  int64_t begin = state.own_begin;
  for (const auto& [offset, g] : starts) {
    if (offset <= state.own_begin || offset >= state.own_end || g == group) continue;
    add(begin, offset, group);
    begin = offset;
    group = g;
  }
  add(begin, state.own_end, group);
  return spans;
}

const float* Engine::ParamData(int index) const {
  const ParamLocation location = plan_->locations[index];
  if (location.bucket < 0) return frozen_[index].data();
  return buckets_[location.bucket].params.data() + location.offset;
}

float* Engine::param(int index) { return const_cast<float*>(ParamData(index)); }

absl::StatusOr<std::vector<float>> Engine::ParamValues(int index) const {
  std::vector<float> values(manifest_.params[index].numel());
  SHARD_RETURN_IF_ERROR(
      device_->Download(ParamData(index), values.data(), static_cast<int64_t>(values.size())));
  return values;
}

absl::Status Engine::SetParamValues(int index, const float* values) {
  return device_->Upload(values, param(index), manifest_.params[index].numel());
}

float* Engine::grad(int index) {
  const ParamLocation location = plan_->locations[index];
  if (location.bucket < 0) return nullptr;
  return buckets_[location.bucket].grads.data() + location.offset;
}

absl::Status Engine::BroadcastParameters() {
  for (BucketState& bucket : buckets_) {
    SHARD_RETURN_IF_ERROR(communicator_->Broadcast(bucket.params.data(), bucket.params.size(),
                                                   DataType::kFloat32, 0));
  }
  for (DeviceArray& frozen : frozen_) {
    if (frozen.size() == 0) continue;
    if (absl::Status s =
            communicator_->Broadcast(frozen.data(), frozen.size(), DataType::kFloat32, 0);
        !s.ok()) {
      return s;
    }
  }
  return communicator_->OrderComputeAfterCollectives();
}

absl::Status Engine::ZeroGradients() {
  for (BucketState& bucket : buckets_) {
    SHARD_RETURN_IF_ERROR(device_->Zero(bucket.grads.data(), bucket.grads.size()));
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
  const size_t n = static_cast<size_t>(state.grads.size());
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
  if (absl::Status bound = device_->BindThread(); !bound.ok()) {
    absl::MutexLock lock(&mu_);
    communication_error_ = bound;
    return;
  }
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
  SHARD_ASSIGN_OR_RETURN(double sum_squares, kernels_->GradSquaredSum());
  // At stage 0 every rank owns (and holds) all gradients; otherwise the shards add up.
  if (options_.zero_stage > 0) {
    SHARD_RETURN_IF_ERROR(device_->AllReduceHostValues(*communicator_, &sum_squares, 1,
                                                       DataType::kFloat64, ReduceOp::kSum));
  }
  const double norm = std::sqrt(sum_squares);
  timings->grad_norm = norm;
  // torch.nn.utils.clip_grad_norm_: scale by max_norm / (norm + 1e-6), clamped to 1.
  const double coefficient = std::min(1.0, options_.grad_clip_norm / (norm + 1e-6));
  if (coefficient < 1.0) {
    SHARD_RETURN_IF_ERROR(
        kernels_->ScaleGradients(static_cast<float>(coefficient), /*check_finite=*/false)
            .status());
  }
  return absl::OkStatus();
}

absl::StatusOr<bool> Engine::UnscaleGradients(StepTimings* timings) {
  timings->loss_scale = scaler_->scale();
  SHARD_ASSIGN_OR_RETURN(bool found_inf,
                         kernels_->ScaleGradients(scaler_->inv_scale(), /*check_finite=*/true));
  // Every rank must skip together. At stage 0 each checked the same all-reduced gradients (as
  // in ClipGradients); at stages 1 and 2 each checked only its own shard.
  float found = found_inf ? 1.0f : 0.0f;
  if (options_.zero_stage > 0) {
    SHARD_RETURN_IF_ERROR(device_->AllReduceHostValues(*communicator_, &found, 1,
                                                       DataType::kFloat32, ReduceOp::kMax));
  }
  return scaler_->Update(found > 0);
}

absl::Status Engine::GatherBucket(size_t b) {
  BucketState& state = buckets_[b];
  const Bucket& bucket = plan_->buckets[b];
  if (plan_->options.mode == ShardMode::kRange) {
    const int64_t shard = ShardNumel(bucket, communicator_->size());
    return communicator_->AllGather(state.params.data() + communicator_->rank() * shard,
                                    state.params.data(), shard, DataType::kFloat32);
  }
  return communicator_->Broadcast(state.params.data(), state.params.size(), DataType::kFloat32,
                                  bucket.owner);
}

absl::Status Engine::GatherParameters() {
  for (size_t b = 0; b < buckets_.size(); ++b) SHARD_RETURN_IF_ERROR(GatherBucket(b));
  // The next forward pass reads the gathered parameters.
  return communicator_->OrderComputeAfterCollectives();
}

absl::Status Engine::Step(StepTimings* timings) {
  SHARD_ASSIGN_OR_RETURN(const bool update, ReduceGradients(timings));
  if (update) SHARD_RETURN_IF_ERROR(UpdateOwned(timings));
  return EndStep(update, timings);
}

absl::StatusOr<bool> Engine::ReduceGradients(StepTimings* timings) {
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
    // An error ends the wait at once: a later bucket may never be reduced (the communication
    // thread could not start, or the communicator was aborted).
    auto done = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return reduced_ == static_cast<int>(bucket_ready_.size()) || !communication_error_.ok();
    };
    mu_.Await(absl::Condition(&done));
    if (!communication_error_.ok()) return communication_error_;
    spans.swap(reduce_spans_);
  } else {
    for (int b = 0; b < static_cast<int>(buckets_.size()); ++b) {
      const absl::Time start = absl::Now();
      SHARD_RETURN_IF_ERROR(ReduceBucket(b));
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
  // The update below reads the reduced gradients.
  SHARD_RETURN_IF_ERROR(communicator_->OrderComputeAfterCollectives());

  if (!rebuilt_) {
    // Every rank holds the full reduced gradients (the first step all-reduces), so the rebuilt
    // layout can take over right here, before any optimizer state exists.
    SHARD_ASSIGN_OR_RETURN(AppliedPlan rebuilt, plans_->Rebuild(plan_version_, ready_order_));
    if (rebuilt.plan->options.world_size != communicator_->size()) {
      return absl::FailedPreconditionError("the rebuilt plan is for another world size");
    }
    SHARD_RETURN_IF_ERROR(Apply(std::move(rebuilt), /*carry_gradients=*/true));
    timings->rebuilt = true;
    if (pending_state_ != nullptr) {
      // Imported optimizer state, now into the final layout (still before any update).
      SHARD_RETURN_IF_ERROR(ReadOwned(*pending_state_, /*params=*/false, /*states=*/true));
      pending_state_.reset();
    }
  }

  bool update = true;
  if (scaler_.has_value()) {
    SHARD_ASSIGN_OR_RETURN(update, UnscaleGradients(timings));
    timings->skipped = !update;
  }
  if (update && options_.grad_clip_norm > 0) {
    SHARD_RETURN_IF_ERROR(ClipGradients(timings));
  }
  return update;
}

absl::Status Engine::UpdateOwned(StepTimings* timings) {
  const absl::Time update_start = absl::Now();
  SHARD_RETURN_IF_ERROR(kernels_->OptimizerStep(optimizer_steps_ + 1));
  timings->optimizer_ms = Milliseconds(absl::Now() - update_start);
  return absl::OkStatus();
}

absl::Status Engine::EndStep(bool updated, StepTimings* timings) {
  if (updated) ++optimizer_steps_;
  // A skipped update changed no parameter: every rank still holds the gathered ones.
  if (updated && options_.zero_stage > 0) {
    const absl::Time gather_start = absl::Now();
    SHARD_RETURN_IF_ERROR(GatherParameters());
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

std::vector<OwnedRange> Engine::UpdatedRanges() const {
  std::vector<OwnedRange> ranges;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    const BucketState& bucket = buckets_[b];
    for (const BucketEntry& entry : plan_->buckets[b].entries) {
      const int64_t begin = std::max(entry.offset, bucket.own_begin);
      const int64_t end = std::min(entry.offset + entry.numel, bucket.own_end);
      if (begin >= end) continue;
      ranges.push_back(OwnedRange{entry.param, static_cast<int>(b), begin - entry.offset, begin,
                                  end - begin});
    }
  }
  return ranges;
}

float* Engine::RangeData(const OwnedRange& range, int array) {
  BucketState& bucket = buckets_[range.bucket];
  if (array < 0) return bucket.params.data() + range.bucket_offset;
  return bucket.state[array].data() + (range.bucket_offset - bucket.own_begin);
}

float* Engine::RangeGrad(const OwnedRange& range) {
  return buckets_[range.bucket].grads.data() + range.bucket_offset;
}

int Engine::ExtrasHolder(int param) const {
  for (const RankOwnership& owner : plan_->ranks) {
    for (const OwnedRange& range : owner.ranges) {
      if (range.param == param && range.param_offset == 0) return owner.rank;
    }
  }
  return -1;
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
      SHARD_RETURN_IF_ERROR(device_->Download(frozen_[piece.param].data() + piece.param_offset,
                                              reinterpret_cast<float*>(dst), piece.numel));
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
    SHARD_RETURN_IF_ERROR(device_->Download(bucket.params.data() + offset,
                                            reinterpret_cast<float*>(dst), piece.numel));
    for (int k = 0; k < states; ++k) {
      SHARD_RETURN_IF_ERROR(
          device_->Download(bucket.state[k].data() + (offset - bucket.own_begin),
                            reinterpret_cast<float*>(dst + (k + 1) * bytes), piece.numel));
    }
  }
  return absl::OkStatus();
}

absl::Status Engine::Restore(CheckpointReader& checkpoint, RestoreTimings* timings) {
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
  const absl::Time read_start = absl::Now();
  absl::Time gather_start;
  if (options_.zero_stage == 0 || !options_.gather_during_reads || !device_->host_memory()) {
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
        if (absl::Status status = GatherBucket(b); !status.ok()) {
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
                                       bucket.params.data() + begin));
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
  SHARD_RETURN_IF_ERROR(ReadAndGather(*source, with_state && rebuilt_, nullptr));
  steps_done_ = steps_done;
  SHARD_RETURN_IF_ERROR(ContinueCounters(counters));
  // Before the rebuild the owned spans are not final: the state waits for the new layout.
  if (with_state && !rebuilt_) pending_state_ = std::move(source);
  return absl::OkStatus();
}

absl::Status Engine::ConsolidateStateDict(int to_rank, const std::string& path) {
  const bool mine = communicator_->rank() == to_rank;
  const int states = static_cast<int>(optimizer_.state_names().size());
  // Every tensor in full on `to_rank`, one parameter at a time (GatherToRank).
  std::vector<TensorDecl> tensors;
  std::vector<std::vector<float>> values;
  for (size_t p = 0; p < manifest_.params.size(); ++p) {
    const ParamSpec& param = manifest_.params[p];
    const int last = param.requires_grad ? states : 0;
    for (int array = -1; array < last; ++array) {
      std::vector<float> full(mine ? param.numel() : 0);
      SHARD_RETURN_IF_ERROR(GatherToRank(static_cast<int>(p), array, to_rank,
                                         mine ? full.data() : nullptr));
      if (!mine) continue;
      tensors.push_back(TensorDecl{
          array < 0 ? param.name : param.name + "." + optimizer_.state_names()[array],
          DataType::kFloat32, param.shape});
      values.push_back(std::move(full));
    }
  }
  if (!mine) return absl::OkStatus();
  std::vector<const void*> data;
  for (const std::vector<float>& full : values) data.push_back(full.data());
  return WriteSafetensors(path, tensors, data,
                          TrainedFileMetadata(steps_done_, optimizer_.config().kind, counters()));
}

absl::Status Engine::GatherToRank(int param, int array, int to_rank, float* out) {
  const int rank = communicator_->rank();
  if (param < 0 || param >= static_cast<int>(manifest_.params.size()) ||
      array >= static_cast<int>(optimizer_.state_names().size()) ||
      (array >= 0 && !manifest_.params[param].requires_grad)) {
    return absl::OutOfRangeError(absl::StrCat("parameter ", param, " has no array ", array));
  }
  if (rank == to_rank && out == nullptr) {
    return absl::InvalidArgumentError("the gathering rank needs a place for the values");
  }
  // Parameter values are on every rank after a step, and at stage 0 so is the state.
  if (array < 0 || options_.zero_stage == 0) {
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
