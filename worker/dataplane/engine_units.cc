// The engine's parameters on demand (engine.h): stage 3's gathered buckets in slots, with
// prefetch in the previous step's order, and stage 1 and 2's gathers overlapped with forward.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/dataplane/engine.h"

namespace shard {

bool Engine::gathers_on_demand() const {
  return sharded_params() || (options_.overlap_param_gather && options_.zero_stage > 0);
}

void Engine::ResetUnits() {
  param_slots_.clear();
  grad_slots_.clear();
  slot_numel_ = 0;
  access_order_.clear();
  access_now_.clear();
  cursor_ = 0;
  prefetching_ = false;
  gathers_pending_ = false;
}

absl::Status Engine::AllocateSlots() {
  if (!sharded_params()) return absl::OkStatus();
  for (const Bucket& bucket : plan_->buckets) {
    slot_numel_ = std::max(slot_numel_, bucket.padded_numel);
  }
  const int count = options_.prefetch + 1;
  param_slots_.resize(count);
  grad_slots_.resize(count);
  for (std::vector<Slot>* slots : {&param_slots_, &grad_slots_}) {
    for (Slot& slot : *slots) {
      SHARD_ASSIGN_OR_RETURN(slot.array, device_->Allocate(slot_numel_));
    }
  }
  return absl::OkStatus();
}

int Engine::FindSlot(std::vector<Slot>& slots, bool for_prefetch) {
  // A free slot, else the least recently used one whose bucket nobody holds and that the next
  // acquisitions do not need.
  int best = -1;
  for (size_t s = 0; s < slots.size(); ++s) {
    if (slots[s].bucket < 0) return static_cast<int>(s);
    const BucketState& bucket = buckets_[slots[s].bucket];
    if (bucket.holders > 0) continue;
    if (for_prefetch && prefetching_) {
      const size_t end = std::min(access_order_.size(), cursor_ + options_.prefetch);
      if (std::find(access_order_.begin() + cursor_, access_order_.begin() + end,
                    slots[s].bucket) != access_order_.begin() + end) {
        continue;
      }
    }
    if (best < 0 || slots[s].last_used < slots[best].last_used) best = static_cast<int>(s);
  }
  return best;
}

absl::Status Engine::StartGather(int b, bool prefetch) {
  int s = FindSlot(param_slots_, prefetch);
  if (s < 0) {
    if (prefetch) return absl::OkStatus();  // no room: the bucket is gathered when acquired
    // Every slot's bucket is held: the caller holds more buckets at once than prefetch + 1.
    // One more slot, counted in gathered_units.
    Slot extra;
    SHARD_ASSIGN_OR_RETURN(extra.array, device_->Allocate(slot_numel_));
    param_slots_.push_back(std::move(extra));
    s = static_cast<int>(param_slots_.size()) - 1;
  }
  Slot& slot = param_slots_[s];
  if (slot.bucket >= 0) buckets_[slot.bucket].slot = -1;
  slot.bucket = b;
  slot.last_used = ++use_clock_;
  float* whole = slot.array.data();
  // A slot's earlier gather into it runs before this one (the queue's order).
  slot.ticket = queue_->Submit([this, b, whole] { return GatherBucket(b, whole); });
  buckets_[b].slot = s;
  buckets_[b].gather = slot.ticket;
  gathered_peak_ = std::max(gathered_peak_, gathered_units());
  return absl::OkStatus();
}

int Engine::gathered_units() const {
  int units = 0;
  for (const Slot& slot : param_slots_) units += slot.bucket >= 0 ? 1 : 0;
  return units;
}

void Engine::Prefetch() {
  if (!prefetching_) return;
  const size_t end = std::min(access_order_.size(), cursor_ + options_.prefetch);
  for (size_t k = cursor_; k < end; ++k) {
    const int b = access_order_[k];
    if (buckets_[b].slot >= 0) continue;
    if (!StartGather(b, /*prefetch=*/true).ok()) return;  // retried, and reported, on Acquire
    if (buckets_[b].slot < 0) return;
  }
}

absl::Status Engine::SubmitPendingGathers() {
  if (!gathers_pending_) return absl::OkStatus();
  gathers_pending_ = false;
  // In the order the step before acquired the buckets, then any it did not.
  std::vector<int> order;
  for (int b : access_order_) {
    if (std::find(order.begin(), order.end(), b) == order.end()) order.push_back(b);
  }
  for (int b = 0; b < static_cast<int>(buckets_.size()); ++b) {
    if (std::find(order.begin(), order.end(), b) == order.end()) order.push_back(b);
  }
  for (int b : order) {
    float* whole = buckets_[b].params.data();
    buckets_[b].gather = queue_->Submit([this, b, whole] { return GatherBucket(b, whole); });
  }
  return absl::OkStatus();
}

absl::Status Engine::WaitGathered(int b) {
  const CommunicationQueue::Ticket ticket = buckets_[b].gather;
  if (ticket <= 0 || queue_->Done(ticket)) {
    if (ticket > 0) SHARD_RETURN_IF_ERROR(queue_->Wait(ticket));  // its error, if any
  } else {
    const absl::Time start = absl::Now();
    SHARD_RETURN_IF_ERROR(queue_->Wait(ticket));
    gather_wait_ms_ += absl::ToDoubleMilliseconds(absl::Now() - start);
  }
  // The compute that follows reads what the gather wrote.
  return communicator_->OrderComputeAfterCollectives();
}

absl::Status Engine::Acquire(int index) {
  const int b = plan_->locations[index].bucket;
  if (b < 0) return absl::OkStatus();  // frozen: whole everywhere
  return AcquireBucket(b).status();
}

void Engine::Release(int index) {
  const int b = plan_->locations[index].bucket;
  if (b >= 0) ReleaseBucket(b);
}

absl::StatusOr<float*> Engine::AcquireGrad(int index) {
  const ParamLocation location = plan_->locations[index];
  if (location.bucket < 0) return nullptr;
  SHARD_ASSIGN_OR_RETURN(float* grads, AcquireGradBucket(location.bucket));
  return grads + location.offset;
}

absl::StatusOr<float*> Engine::AcquireBucket(int b) {
  if (b < 0 || b >= static_cast<int>(buckets_.size())) {
    return absl::OutOfRangeError(
        absl::StrCat("bucket ", b, " is not in [0, ", buckets_.size(), ")"));
  }
  if (!gathers_on_demand()) return buckets_[b].params.data();
  if (access_now_.empty() || access_now_.back() != b) {
    access_now_.push_back(b);
    if (prefetching_) {
      if (cursor_ < access_order_.size() && access_order_[cursor_] == b) {
        ++cursor_;
      } else {
        prefetching_ = false;  // this step goes another way than the last: no guessing
      }
    }
  }
  if (!sharded_params()) {
    SHARD_RETURN_IF_ERROR(SubmitPendingGathers());
    SHARD_RETURN_IF_ERROR(WaitGathered(b));
    return buckets_[b].params.data();
  }
  BucketState& bucket = buckets_[b];
  if (bucket.slot < 0) SHARD_RETURN_IF_ERROR(StartGather(b, /*prefetch=*/false));
  ++bucket.holders;
  param_slots_[bucket.slot].last_used = ++use_clock_;
  Prefetch();
  SHARD_RETURN_IF_ERROR(WaitGathered(b));
  return param_slots_[bucket.slot].array.data();
}

void Engine::ReleaseBucket(int b) {
  if (!sharded_params() || b < 0 || b >= static_cast<int>(buckets_.size())) return;
  if (buckets_[b].holders > 0) --buckets_[b].holders;
}

absl::StatusOr<float*> Engine::AcquireGradBucket(int b) {
  if (b < 0 || b >= static_cast<int>(buckets_.size())) {
    return absl::OutOfRangeError(
        absl::StrCat("bucket ", b, " is not in [0, ", buckets_.size(), ")"));
  }
  BucketState& bucket = buckets_[b];
  if (!sharded_params()) return bucket.grads.data();
  if (bucket.grad_slot < 0) {
    // A free slot (its last reduction done reading it), else one more.
    int s = -1;
    for (size_t k = 0; k < grad_slots_.size(); ++k) {
      if (grad_slots_[k].bucket < 0 && (s < 0 || grad_slots_[k].ticket < grad_slots_[s].ticket)) {
        s = static_cast<int>(k);
      }
    }
    if (s < 0) {
      Slot extra;
      SHARD_ASSIGN_OR_RETURN(extra.array, device_->Allocate(slot_numel_));
      grad_slots_.push_back(std::move(extra));
      s = static_cast<int>(grad_slots_.size()) - 1;
    }
    Slot& slot = grad_slots_[s];
    if (slot.ticket > 0) {
      SHARD_RETURN_IF_ERROR(queue_->Wait(slot.ticket));
      SHARD_RETURN_IF_ERROR(communicator_->OrderComputeAfterCollectives());
    }
    slot.bucket = b;
    slot.ticket = 0;
    bucket.grad_slot = s;
    SHARD_RETURN_IF_ERROR(device_->Zero(slot.array.data(), slot_numel_));
  }
  return grad_slots_[bucket.grad_slot].array.data();
}

absl::Status Engine::FinishGathers() {
  SHARD_RETURN_IF_ERROR(SubmitPendingGathers());
  SHARD_RETURN_IF_ERROR(queue_->Drain());
  return communicator_->OrderComputeAfterCollectives();
}

HeldBytes Engine::held_bytes() const {
  HeldBytes held;
  constexpr int64_t kFloat = sizeof(float);
  for (const BucketState& bucket : buckets_) {
    held.params += (bucket.params.size() + bucket.owned_params.size()) * kFloat;
    held.grads += (bucket.grads.size() + bucket.owned_grads.size()) * kFloat;
    for (const DeviceArray& s : bucket.state) held.optimizer_state += s.size() * kFloat;
  }
  for (const std::vector<Slot>* slots : {&param_slots_, &grad_slots_}) {
    for (const Slot& slot : *slots) held.gathered += slot.array.size() * kFloat;
  }
  for (const DeviceArray& frozen : frozen_) held.frozen += frozen.size() * kFloat;
  return held;
}

absl::Status Engine::BroadcastStagedValues() {
  // Rank 0's values, one bucket at a time: it lays the bucket out whole and broadcasts it, and
  // every rank keeps what it owns. Alone, SetParamValues wrote them where they stay.
  if (communicator_->size() == 1) return absl::OkStatus();
  const bool root = communicator_->rank() == 0;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    const Bucket& bucket = plan_->buckets[b];
    BucketState& state = buckets_[b];
    SHARD_ASSIGN_OR_RETURN(DeviceArray whole, device_->Allocate(bucket.padded_numel));
    if (root) {
      for (const BucketEntry& entry : bucket.entries) {
        if (entry.param >= static_cast<int>(staged_values_.size()) ||
            staged_values_[entry.param].empty()) {
          return absl::FailedPreconditionError(
              absl::StrCat("rank 0 set no initial values for '",
                           manifest_.params[entry.param].name, "' before BroadcastParameters"));
        }
        SHARD_RETURN_IF_ERROR(device_->Upload(staged_values_[entry.param].data(),
                                              whole.data() + entry.offset, entry.numel));
      }
    }
    SHARD_RETURN_IF_ERROR(communicator_->Broadcast(whole.data(), bucket.padded_numel,
                                                   DataType::kFloat32, 0));
    SHARD_RETURN_IF_ERROR(communicator_->OrderComputeAfterCollectives());
    SHARD_RETURN_IF_ERROR(device_->Copy(whole.data() + state.own_begin, OwnedParams(state),
                                        state.own_end - state.own_begin));
  }
  staged_values_.clear();
  return absl::OkStatus();
}

absl::Status Engine::Relayout(const Plan& plan, std::vector<BucketState>& buckets,
                              bool carry_gradients) {
  // Stage 3 holds only owned spans: each old bucket is gathered whole (its parameters and, at
  // the rebuild, the first step's reduced gradients), one at a time, and every rank keeps what
  // falls in its new owned spans.
  for (size_t ob = 0; ob < buckets_.size(); ++ob) {
    const Bucket& old_bucket = plan_->buckets[ob];
    SHARD_ASSIGN_OR_RETURN(DeviceArray params, device_->Allocate(old_bucket.padded_numel));
    SHARD_RETURN_IF_ERROR(GatherBucket(ob, params.data()));
    DeviceArray grads;
    if (carry_gradients) {
      SHARD_ASSIGN_OR_RETURN(grads, device_->Allocate(old_bucket.padded_numel));
      const BucketState& old_state = buckets_[ob];
      if (plan_->options.mode == ShardMode::kRange) {
        SHARD_RETURN_IF_ERROR(communicator_->AllGather(
            OwnedGrads(old_state), grads.data(), ShardNumel(old_bucket, communicator_->size()),
            DataType::kFloat32));
      } else {
        if (old_bucket.owner == communicator_->rank()) {
          SHARD_RETURN_IF_ERROR(
              device_->Copy(OwnedGrads(old_state), grads.data(), old_bucket.padded_numel));
        }
        SHARD_RETURN_IF_ERROR(communicator_->Broadcast(grads.data(), old_bucket.padded_numel,
                                                       DataType::kFloat32, old_bucket.owner));
      }
    }
    SHARD_RETURN_IF_ERROR(communicator_->OrderComputeAfterCollectives());
    for (const BucketEntry& entry : old_bucket.entries) {
      const ParamLocation to = plan.locations[entry.param];
      BucketState& state = buckets[to.bucket];
      const int64_t begin = std::max(to.offset, state.own_begin);
      const int64_t end = std::min(to.offset + entry.numel, state.own_end);
      if (begin >= end) continue;
      const int64_t from = entry.offset + (begin - to.offset);
      SHARD_RETURN_IF_ERROR(device_->Copy(params.data() + from,
                                          state.owned_params.data() + (begin - state.own_begin),
                                          end - begin));
      if (carry_gradients) {
        SHARD_RETURN_IF_ERROR(device_->Copy(grads.data() + from,
                                            state.owned_grads.data() + (begin - state.own_begin),
                                            end - begin));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace shard
