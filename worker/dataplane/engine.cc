#include "worker/dataplane/engine.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "common/param_groups.h"
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
  if (options.zero_stage < 0 || options.zero_stage > 3) {
    return absl::InvalidArgumentError(
        absl::StrCat("ZeRO stage must be 0, 1, 2 or 3, got ", options.zero_stage));
  }
  if (options.prefetch < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("prefetch must be 0 or more buckets, got ", options.prefetch));
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
  Device* device = engine->device_;
  // A world of one rank has no communication to overlap: its buckets' work (the update, at most
  // a copy) runs where they are marked ready, sparing a thread hand-off per bucket.
  const bool threaded = engine->options_.overlap && communicator->size() > 1;
  engine->queue_ = std::make_unique<CommunicationQueue>(threaded,
                                                        [device] { return device->BindThread(); });
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

Engine::~Engine() = default;

float* Engine::OwnedParams(const BucketState& bucket) const {
  return sharded_params() ? bucket.owned_params.data() : bucket.params.data() + bucket.own_begin;
}

float* Engine::OwnedGrads(const BucketState& bucket) const {
  return sharded_params() ? bucket.owned_grads.data() : bucket.grads.data() + bucket.own_begin;
}

absl::Status Engine::Apply(AppliedPlan applied, bool carry_gradients) {
  const Plan& plan = *applied.plan;
  const int rank = communicator_->rank();
  const int world = communicator_->size();
  std::vector<BucketState> buckets(plan.buckets.size());
  for (size_t b = 0; b < plan.buckets.size(); ++b) {
    const Bucket& bucket = plan.buckets[b];
    BucketState& state = buckets[b];
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
    if (sharded_params()) {
      SHARD_ASSIGN_OR_RETURN(state.owned_params, device_->Allocate(owned));
      SHARD_ASSIGN_OR_RETURN(state.owned_grads, device_->Allocate(owned));
    } else {
      SHARD_ASSIGN_OR_RETURN(state.params, device_->Allocate(bucket.padded_numel));
      SHARD_ASSIGN_OR_RETURN(state.grads, device_->Allocate(bucket.padded_numel));
    }
    for (size_t k = 0; k < optimizer_.state_names().size(); ++k) {
      SHARD_ASSIGN_OR_RETURN(DeviceArray array, device_->Allocate(owned));
      state.state.push_back(std::move(array));
    }
    state.pending = static_cast<int>(bucket.entries.size());
  }
  std::vector<OwnedSpan> spans;
  for (size_t b = 0; b < plan.buckets.size(); ++b) {
    if (buckets[b].own_end == buckets[b].own_begin) continue;
    for (OwnedSpan& span : SplitOwnedSpan(plan.buckets[b], buckets[b])) {
      spans.push_back(std::move(span));
    }
  }
  // No collective may run while the new buckets are shared; the old layout's are done with.
  if (queue_ != nullptr) SHARD_RETURN_IF_ERROR(queue_->Drain());
  SHARD_RETURN_IF_ERROR(ShareBucketArrays(buckets));
  SHARD_ASSIGN_OR_RETURN(std::unique_ptr<SpanKernels> kernels,
                         device_->PrepareSpans(optimizer_.config(), std::move(spans)));
  std::vector<std::unique_ptr<SpanKernels>> bucket_kernels;
  if (options_.overlap_update) {
    for (size_t b = 0; b < plan.buckets.size(); ++b) {
      std::vector<OwnedSpan> owned;
      if (buckets[b].own_end > buckets[b].own_begin) {
        owned = SplitOwnedSpan(plan.buckets[b], buckets[b]);
      }
      SHARD_ASSIGN_OR_RETURN(std::unique_ptr<SpanKernels> bucket_kernel,
                             device_->PrepareSpans(optimizer_.config(), std::move(owned)));
      bucket_kernels.push_back(std::move(bucket_kernel));
    }
  }
  if (plan_ != nullptr) {
    if (sharded_params()) {
      // The relayout gathers into arrays of its own: the old layout's slots go first, so that
      // the two layouts' spans are the only thing held twice. An engine a failure leaves on
      // its old layout allocates slots again as it acquires.
      for (BucketState& old : buckets_) {
        old.slot = -1;
        old.grad_slot = -1;
      }
      param_slots_.clear();
      grad_slots_.clear();
      SHARD_RETURN_IF_ERROR(Relayout(plan, buckets, carry_gradients));
    } else {
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
  }
  // Only now: until here a failure leaves the engine on its old layout, kernels included.
  buckets_ = std::move(buckets);
  kernels_ = std::move(kernels);
  bucket_kernels_ = std::move(bucket_kernels);
  plan_ = std::move(applied.plan);
  plan_version_ = applied.version;
  rebuilt_ = applied.rebuilt;
  marked_.assign(manifest_.params.size(), false);
  bucket_ready_.assign(buckets_.size(), false);
  next_reduce_ = 0;
  ready_order_.clear();
  first_step_all_reduce_ = !rebuilt_;
  {
    absl::MutexLock lock(&spans_mu_);
    reduce_spans_.clear();
  }
  ResetUnits();
  return AllocateSlots();
}

absl::Status Engine::ShareBucketArrays(std::vector<BucketState>& buckets) {
  if (!device_->host_memory() || communicator_->size() == 1 || sharded_params()) {
    return absl::OkStatus();
  }
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  for (BucketState& state : buckets) {
    for (auto [array, shared] : {std::pair{&state.params, &state.shared_params},
                                 std::pair{&state.grads, &state.shared_grads}}) {
      const size_t bytes = static_cast<size_t>(array->size()) * sizeof(float);
      // Every rank's buckets have the same sizes, so every rank decides the same.
      if (bytes < kHostArrayPagesFrom) continue;
      absl::StatusOr<std::unique_ptr<SharedHostBuffer>> share =
          communicator_->ShareHostBuffer(array->data(), (bytes + page - 1) / page * page);
      if (absl::IsResourceExhausted(share.status())) {
        // Still correct, one copy slower each way: said in the worker's summary.
        if (unshared_reason_.empty()) unshared_reason_ = std::string(share.status().message());
        continue;
      }
      SHARD_RETURN_IF_ERROR(share.status());
      *shared = std::move(*share);
    }
  }
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
    const int64_t at = begin - state.own_begin;
    OwnedSpan span{OwnedParams(state) + at, OwnedGrads(state) + at, {}, end - begin, span_group};
    for (const DeviceArray& array : state.state) span.state.push_back(array.data() + at);
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
  const BucketState& bucket = buckets_[location.bucket];
  if (!sharded_params()) return bucket.params.data() + location.offset;
  if (bucket.slot < 0) return nullptr;
  return param_slots_[bucket.slot].array.data() + location.offset;
}

float* Engine::param(int index) { return const_cast<float*>(ParamData(index)); }

absl::StatusOr<std::vector<float>> Engine::ParamValues(int index) const {
  const float* data = ParamData(index);
  if (data == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "at ZeRO stage 3 parameter '", manifest_.params[index].name,
        "' is whole only while acquired: Acquire it first, or gather it (GatherToRank)"));
  }
  std::vector<float> values(manifest_.params[index].numel());
  SHARD_RETURN_IF_ERROR(
      device_->Download(data, values.data(), static_cast<int64_t>(values.size())));
  return values;
}

absl::Status Engine::SetParamValues(int index, const float* values, bool same_on_every_rank) {
  const int64_t numel = manifest_.params[index].numel();
  const ParamLocation location = plan_->locations[index];
  if (!sharded_params() || location.bucket < 0) {
    return device_->Upload(values, param(index), numel);
  }
  // What this rank owns now; rank 0 keeps the whole tensor for BroadcastParameters.
  const BucketState& bucket = buckets_[location.bucket];
  const int64_t begin = std::max(location.offset, bucket.own_begin);
  const int64_t end = std::min(location.offset + numel, bucket.own_end);
  if (begin < end) {
    SHARD_RETURN_IF_ERROR(device_->Upload(values + (begin - location.offset),
                                          OwnedParams(bucket) + (begin - bucket.own_begin),
                                          end - begin));
  }
  if (communicator_->rank() == 0 && communicator_->size() > 1 && !same_on_every_rank) {
    staged_values_.resize(manifest_.params.size());
    staged_values_[index].assign(values, values + numel);
  }
  return absl::OkStatus();
}

float* Engine::grad(int index) {
  const ParamLocation location = plan_->locations[index];
  if (location.bucket < 0) return nullptr;
  const BucketState& bucket = buckets_[location.bucket];
  if (!sharded_params()) return bucket.grads.data() + location.offset;
  if (bucket.grad_slot < 0) return nullptr;
  return grad_slots_[bucket.grad_slot].array.data() + location.offset;
}

absl::StatusOr<CommunicationQueue::Ticket> Engine::SubmitCollective(
    CommunicationQueue::Operation operation) {
  if (queue_->threaded() && device_->host_memory()) return queue_->Submit(std::move(operation));
  SHARD_RETURN_IF_ERROR(queue_->Drain());
  SHARD_RETURN_IF_ERROR(operation());
  return CommunicationQueue::Ticket{0};
}

absl::Status Engine::BroadcastParameters() {
  SHARD_RETURN_IF_ERROR(FinishGathers());  // and SubmitCollective's, if one is in flight
  if (sharded_params()) {
    SHARD_RETURN_IF_ERROR(BroadcastStagedValues());
  } else {
    for (BucketState& bucket : buckets_) {
      SHARD_RETURN_IF_ERROR(communicator_->Broadcast(bucket.params.data(), bucket.params.size(),
                                                     DataType::kFloat32, 0));
    }
  }
  for (DeviceArray& frozen : frozen_) {
    if (frozen.size() == 0) continue;
    SHARD_RETURN_IF_ERROR(
        communicator_->Broadcast(frozen.data(), frozen.size(), DataType::kFloat32, 0));
  }
  return communicator_->OrderComputeAfterCollectives();
}

absl::Status Engine::BroadcastFrozen(int index) {
  SHARD_RETURN_IF_ERROR(queue_->Drain());  // SubmitCollective's, if one is in flight
  SHARD_RETURN_IF_ERROR(communicator_->Broadcast(param(index), manifest_.params[index].numel(),
                                                 DataType::kFloat32, 0));
  return communicator_->OrderComputeAfterCollectives();
}

absl::Status Engine::ZeroGradients() {
  for (BucketState& bucket : buckets_) {
    if (sharded_params()) {
      // Backward's buffers are zeroed as they are handed out (AcquireGrad).
      SHARD_RETURN_IF_ERROR(device_->Zero(bucket.owned_grads.data(), bucket.owned_grads.size()));
    } else {
      SHARD_RETURN_IF_ERROR(device_->Zero(bucket.grads.data(), bucket.grads.size()));
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
    bucket_ready_[location.bucket] = true;
    SubmitReadyReductions();
  }
}

bool Engine::GathersAfterEachUpdate() const {
  return options_.zero_stage > 0 && !sharded_params() && !options_.overlap_param_gather;
}

bool Engine::UpdatesDuringBackward() const {
  return options_.overlap_update && options_.overlap && rebuilt_ && !first_step_all_reduce_ &&
         options_.grad_clip_norm == 0 && !scaler_.has_value() &&
         optimizer_.config().kind != OptimizerKind::kTorch && device_->host_memory() &&
         bucket_kernels_.size() == buckets_.size();
}

void Engine::SubmitReadyReductions() {
  // In plan order on every rank, as DDP does, whatever order backward finished them in.
  const bool update = UpdatesDuringBackward();
  const bool gather = update && GathersAfterEachUpdate();
  const int64_t update_step = optimizer_steps_ + 1;
  while (next_reduce_ < static_cast<int>(buckets_.size()) && bucket_ready_[next_reduce_]) {
    const int b = next_reduce_++;
    BucketState& bucket = buckets_[b];
    if (sharded_params() && bucket.grad_slot < 0) {
      // Nothing to reduce from: fails the step (ReduceGradients) rather than guess zeros.
      queue_->Submit([this, b] {
        return absl::FailedPreconditionError(absl::StrCat(
            "at ZeRO stage 3 the gradients of bucket ", b, " were marked ready, but backward "
            "never took their buffer (Engine::AcquireGrad) for '",
            manifest_.params[plan_->buckets[b].entries.front().param].name, "'"));
      });
      continue;
    }
    float* grads = sharded_params() ? grad_slots_[bucket.grad_slot].array.data()
                                    : bucket.grads.data();
    // Averaging: on the compute thread, in its device order after backward's writes (the
    // bucket's padding and alignment gaps hold zeros, which stay zeros). A failure fails the
    // step (ReduceGradients).
    absl::Status averaged = absl::OkStatus();
    if (options_.average_gradients && communicator_->size() > 1) {
      averaged = device_->Divide(grads, plan_->buckets[b].padded_numel,
                                 static_cast<float>(communicator_->size()));
    }
    const bool all_reduce = first_step_all_reduce_;
    const CommunicationQueue::Ticket ticket =
        queue_->Submit([this, b, all_reduce, grads, update, gather, update_step, averaged] {
          const absl::Time start = absl::Now();
          absl::Status reduced = averaged.ok() ? ReduceBucket(b, all_reduce, grads) : averaged;
          const absl::Time end = absl::Now();
          // The bucket's owned range is final: update it while backward goes on, and gather
          // the bucket's parameters (every rank does the same, in plan order).
          if (reduced.ok() && update) reduced = bucket_kernels_[b]->OptimizerStep(update_step);
          const absl::Time updated = absl::Now();
          if (reduced.ok() && gather) reduced = GatherBucket(b, buckets_[b].params.data());
          absl::MutexLock lock(&spans_mu_);
          reduce_spans_.push_back({start, end});
          if (gather) reduce_spans_.push_back({updated, absl::Now()});
          update_ms_ += Milliseconds(updated - end);
          return reduced;
        });
    if (sharded_params()) {
      // The slot is free again once the reduction has read it.
      Slot& slot = grad_slots_[bucket.grad_slot];
      slot.ticket = ticket;
      slot.bucket = -1;
      bucket.grad_slot = -1;
    }
  }
}

absl::Status Engine::ReduceBucket(int b, bool all_reduce, float* grads) {
  BucketState& state = buckets_[b];
  const Bucket& bucket = plan_->buckets[b];
  const size_t n = static_cast<size_t>(bucket.padded_numel);
  const int64_t owned = state.own_end - state.own_begin;
  if (all_reduce || options_.zero_stage < 2) {
    SHARD_RETURN_IF_ERROR(
        communicator_->AllReduce(grads, grads, n, DataType::kFloat32, ReduceOp::kSum));
    if (!sharded_params() || owned == 0) return absl::OkStatus();
    SHARD_RETURN_IF_ERROR(communicator_->OrderComputeAfterCollectives());
    return device_->Copy(grads + state.own_begin, OwnedGrads(state), owned);
  }
  if (plan_->options.mode == ShardMode::kRange) {
    // This rank's shard of the bucket receives the reduced shard (in place below stage 3).
    return communicator_->ReduceScatter(grads, OwnedGrads(state),
                                        ShardNumel(bucket, communicator_->size()),
                                        DataType::kFloat32, ReduceOp::kSum);
  }
  float* recv = bucket.owner == communicator_->rank() ? OwnedGrads(state) : grads;
  return communicator_->Reduce(grads, recv, n, DataType::kFloat32, ReduceOp::kSum, bucket.owner);
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
  // in ClipGradients); at stages 1 to 3 each checked only its own shard.
  float found = found_inf ? 1.0f : 0.0f;
  if (options_.zero_stage > 0) {
    SHARD_RETURN_IF_ERROR(device_->AllReduceHostValues(*communicator_, &found, 1,
                                                       DataType::kFloat32, ReduceOp::kMax));
  }
  return scaler_->Update(found > 0);
}

absl::Status Engine::GatherBucket(size_t b, float* whole) {
  BucketState& state = buckets_[b];
  const Bucket& bucket = plan_->buckets[b];
  if (plan_->options.mode == ShardMode::kRange) {
    const int64_t shard = ShardNumel(bucket, communicator_->size());
    return communicator_->AllGather(OwnedParams(state), whole, shard, DataType::kFloat32);
  }
  if (sharded_params() && bucket.owner == communicator_->rank()) {
    // A GPU communicator orders the broadcast after this copy (device_communicator.h).
    SHARD_RETURN_IF_ERROR(device_->Copy(OwnedParams(state), whole, bucket.padded_numel));
  }
  return communicator_->Broadcast(whole, bucket.padded_numel, DataType::kFloat32, bucket.owner);
}

absl::Status Engine::GatherParameters() {
  if (sharded_params()) return absl::OkStatus();  // gathered on demand
  for (size_t b = 0; b < buckets_.size(); ++b) {
    SHARD_RETURN_IF_ERROR(GatherBucket(b, buckets_[b].params.data()));
  }
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
  // The reductions: on the communication thread (already under way) or done as they were
  // submitted. An error ends the wait at once.
  SHARD_RETURN_IF_ERROR(queue_->Drain());
  updated_during_backward_ = UpdatesDuringBackward();
  std::vector<std::pair<absl::Time, absl::Time>> spans;
  {
    absl::MutexLock lock(&spans_mu_);
    spans.swap(reduce_spans_);
    if (updated_during_backward_) timings->optimizer_ms = update_ms_;
    timings->update_overlapped = updated_during_backward_;
    update_ms_ = 0;
  }
  for (const auto& [start, end] : spans) {
    timings->communication_ms += Milliseconds(end - start);
    const absl::Time overlap_start = std::max(start, backward_start_);
    const absl::Time overlap_end = std::min(end, backward_end_);
    if (overlap_end > overlap_start) timings->hidden_ms += Milliseconds(overlap_end - overlap_start);
  }
  timings->backward_ms = Milliseconds(backward_end_ - backward_start_);
  timings->gather_wait_ms = gather_wait_ms_;
  timings->gathered_units = gathered_peak_;
  for (const Bucket& bucket : plan_->buckets) {
    timings->bucket_bytes.push_back(static_cast<int64_t>(bucket.padded_numel * sizeof(float)));
  }
  // The update below reads the reduced gradients.
  SHARD_RETURN_IF_ERROR(communicator_->OrderComputeAfterCollectives());

  if (!rebuilt_) {
    // Every rank holds the full reduced gradients (the first step all-reduces; at stage 3 its
    // owned span of them), so the rebuilt layout can take over right here, before any
    // optimizer state exists.
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
  if (updated_during_backward_) return absl::OkStatus();  // ReduceGradients timed it
  const absl::Time update_start = absl::Now();
  SHARD_RETURN_IF_ERROR(kernels_->OptimizerStep(optimizer_steps_ + 1));
  timings->optimizer_ms = Milliseconds(absl::Now() - update_start);
  return absl::OkStatus();
}

absl::Status Engine::EndStep(bool updated, StepTimings* timings) {
  if (updated) ++optimizer_steps_;
  // A skipped update changed no parameter: every rank still holds the gathered ones.
  if (updated && options_.zero_stage > 0) {
    if (sharded_params() || options_.overlap_param_gather) {
      // The next step's Acquire gathers (engine_units.cc); what is gathered now is stale.
      for (BucketState& bucket : buckets_) bucket.gather = -1;
      for (Slot& slot : param_slots_) {
        if (slot.bucket >= 0) buckets_[slot.bucket].slot = -1;
        slot.bucket = -1;
      }
      gathers_pending_ = !sharded_params();
    } else if (!(updated_during_backward_ && GathersAfterEachUpdate())) {
      // (Otherwise each bucket was gathered right after its update, during backward.)
      const absl::Time gather_start = absl::Now();
      SHARD_RETURN_IF_ERROR(GatherParameters());
      timings->gather_ms = Milliseconds(absl::Now() - gather_start);
    }
  }

  // Ready for the next step.
  ++steps_done_;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    buckets_[b].pending = static_cast<int>(plan_->buckets[b].entries.size());
  }
  std::fill(marked_.begin(), marked_.end(), false);
  std::fill(bucket_ready_.begin(), bucket_ready_.end(), false);
  next_reduce_ = 0;
  ready_order_.clear();
  first_step_all_reduce_ = false;
  access_order_.swap(access_now_);
  access_now_.clear();
  cursor_ = 0;
  prefetching_ = !access_order_.empty();
  gather_wait_ms_ = 0;
  gathered_peak_ = 0;
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
  const int64_t at = range.bucket_offset - bucket.own_begin;
  if (array < 0) return OwnedParams(bucket) + at;
  return bucket.state[array].data() + at;
}

float* Engine::RangeGrad(const OwnedRange& range) {
  const BucketState& bucket = buckets_[range.bucket];
  return OwnedGrads(bucket) + (range.bucket_offset - bucket.own_begin);
}

}  // namespace shard
