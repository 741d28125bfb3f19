// The data-parallel engine: the worker library's public API for a model, the built-in MLP's
// or a user's own.
//
//   auto engine = Engine::Create(manifest, communicator, plans, options);
//   engine->BroadcastParameters();            // after writing initial values into param(i)
//   for each step:
//     forward with param(i)                   // views into the engine's flat buffers
//     engine->StartBackward();
//     backward: write grad(i), then MarkGradReady(i), last layers first
//     engine->Step(&timings);                 // waits for reductions, updates, gathers
//
// Parameters and gradients live in per-bucket flat buffers laid out by the plan, in the memory
// of EngineOptions::device (the host by default, or a GPU: device.h); param(i) and grad(i) are
// views into them (valid until the next Step: the first Step rebuilds the buckets), device
// pointers on a GPU. ParamValues / SetParamValues move values between them and the host.
// Backward overwrites each gradient (no accumulation). When a bucket's last gradient is marked
// ready, a communication thread starts its reduction while backward continues (overlap);
// buckets are reduced in plan order on every rank, as DDP does.
//
// ZeRO stages: 0 all-reduces gradients and every rank updates everything; 1 all-reduces, each
// rank updates only what the plan makes it own and the parameters are all-gathered; 2
// reduce-scatters (range mode) or reduces to the owner (param mode), so each rank keeps only
// its reduced gradient shard. Optimizer state exists only for owned elements: 1/W of the total
// plus padding at stages 1 to 3.
//
// Stage 3 (FSDP's FULL_SHARD, DeepSpeed's ZeRO-3) shards the parameters too: a rank keeps only
// its owned span of each bucket (parameters, reduced gradients, optimizer state). A bucket is
// the unit that is gathered: Acquire(i) makes param(i) whole (its bucket all-gathered into one
// of `prefetch + 1` slots, or broadcast from its owner in param mode) until Release(i);
// AcquireGrad(i) gives backward a zeroed gradient buffer for i's bucket, which the bucket's
// reduction (reduce-scatter to the owned span) frees. The buckets the previous step acquired
// next are gathered ahead on the communication thread (prefetch), at most `prefetch + 1` at
// once: a released bucket stays gathered until its slot is needed. Frozen parameters (no
// gradient) stay whole on every rank.
//
// Gathering on demand at stages 1 and 2 (EngineOptions::overlap_param_gather, Megatron's
// overlap_param_gather): the step ends after the update; the first Acquire of the next step
// starts every bucket's all-gather (in the order the step before acquired them) and each
// Acquire waits only for its own bucket's, so the gathers overlap the forward pass.
// Checkpoints, exports and every collective the engine makes on the caller's thread wait for
// them first.
//
// Every rank must acquire the same parameters in the same order (the same model does): the
// gathers and reductions are collectives issued in that order (communication_queue.h).
//
// The first step reduces with all-reduce at every stage and reports the gradient-ready order;
// the rebuilt plan (the same on every rank) takes over before the first update, so no
// optimizer state ever needs moving between layouts.
//
// Dynamic loss scaling (EngineOptions::loss_scaling, for fp16): backward must scale the loss by
// loss_scale(); Step unscales the reduced gradients, and when any rank found an inf or NaN it
// skips the update (the optimizer's step count does not advance) and lowers the scale, as
// torch.cuda.amp.GradScaler does.
//
// Thread-compatible: one compute thread calls everything; the engine owns the communication
// thread.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/checkpoint.h"
#include "common/job_spec.h"
#include "common/manifest.h"
#include "common/plan.h"
#include "common/shard_hasher.h"
#include "worker/dataplane/communication_queue.h"
#include "worker/dataplane/communicator.h"
#include "worker/dataplane/device.h"
#include "worker/dataplane/loss_scaler.h"
#include "worker/dataplane/optimizer.h"
#include "worker/dataplane/plan_provider.h"

namespace shard {

struct EngineOptions {
  int zero_stage = 1;   // 0 to 3
  bool overlap = true;  // reduce buckets during backward on the communication thread
  // Stages 1 and 2: the parameters' all-gather after the update overlaps the next forward
  // pass instead of ending the step. The caller must Acquire parameters before it reads them.
  bool overlap_param_gather = false;
  // Stage 3: buckets gathered ahead of the one in use.
  int prefetch = 1;
  // Each bucket's owned range updated on the communication thread as soon as its reduction
  // completes, while backward goes on (ZeroRedundancyOptimizer's overlap_with_ddp). Only where
  // the update needs nothing global or from the caller: after the first step's rebuild, with
  // `overlap`, without clipping or loss scaling, with the built-in optimizer, on host memory;
  // otherwise the update runs after backward as before. At stages 1 and 2 without
  // overlap_param_gather each bucket's all-gather follows its update there too, instead of
  // ending the step. The same arithmetic on the same values: the same bits. Backward must not
  // read a parameter after marking it ready.
  bool overlap_update = false;
  // The update rule with its param groups, matched against the manifest's names by Create
  // (InvalidArgument for a group that takes no parameter), and its learning-rate schedule over
  // optimizer.total_steps updates, at the optimizer's step count (which checkpoints keep, so a
  // restored run continues the schedule). common/param_groups.h.
  OptimizerConfig optimizer;
  double grad_clip_norm = 0;  // global L2 norm; 0 = off
  // Each bucket's gradients divided by the world size just before its reduction sums them, so
  // that the ranks' gradients are averaged (as DDP does) when each rank's loss is the mean over
  // its own samples (a training script's). Off: the caller scales the loss by the global batch.
  bool average_gradients = false;
  // Where the buffers live and the update runs (not owned; null: the host). The communicator's
  // buffers must be this device's memory.
  Device* device = nullptr;
  std::optional<LossScalerOptions> loss_scaling;  // off unless set
  // At stages 1 and 2 on host memory, a restore (and LoadState) all-gathers each bucket's
  // parameters on a second thread as soon as this rank's part is read, while the reads go on,
  // instead of after the last read. Faster where a rank has cores of its own (a 1 GiB restore at
  // 2 and 4 ranks on 16 cores: 0.77-0.89x the raw disk read before, 0.91-1.23x with it), slower
  // where ranks share them (on 2 cores: the same at 2 ranks, about 13% slower at 4), so the
  // worker turns it on where this process may use 2 cores per rank on its host
  // (GatherDuringReadsPays).
  bool gather_during_reads = false;
};

// Whether gather_during_reads pays for a rank of `ranks_on_host` ranks sharing this host: this
// process may use at least 2 cores per rank (UsableCores()).
bool GatherDuringReadsPays(int ranks_on_host);

struct StepTimings {
  double backward_ms = 0;       // StartBackward to the last MarkGradReady
  double communication_ms = 0;  // gradient reductions, summed over buckets
  double hidden_ms = 0;         // the part of those reductions that overlapped backward
  double optimizer_ms = 0;       // the update (during backward, on the communication thread,
                                // when update_overlapped)
  bool update_overlapped = false;  // each bucket updated as its reduction completed
  double gather_ms = 0;         // parameter all-gather at the end of the step (stages 1, 2)
  // Forward and backward waiting for parameter gathers (stage 3, overlap_param_gather).
  double gather_wait_ms = 0;
  int gathered_units = 0;       // the most buckets gathered at once during the step (stage 3)
  double grad_norm = 0;         // before clipping (0 when clipping is off)
  bool skipped = false;         // loss scaling found an inf/NaN gradient: no update this step
  float loss_scale = 1;         // the scale this step's backward used
  std::vector<int64_t> bucket_bytes;
  bool rebuilt = false;         // this step switched to the rebuilt plan
};

// Where a restore's time went.
struct RestoreTimings {
  double read_ms = 0;    // reading (and checking) what this rank owns
  // The parameters' all-gather from their owners (stages 1 and 2) left once the reads are done
  // (on host memory most of it runs during the reads).
  double gather_ms = 0;
};

// The bytes of model state a rank holds (the engine's own accounting).
struct HeldBytes {
  int64_t params = 0;           // whole buckets (stages 0-2) or the owned spans (stage 3)
  int64_t grads = 0;            // the same for gradients
  int64_t optimizer_state = 0;
  int64_t gathered = 0;         // stage 3: the slots gathered parameters and gradients use
  int64_t frozen = 0;           // parameters without gradient, whole on every rank
  int64_t total() const { return params + grads + optimizer_state + gathered + frozen; }
};

class Engine {
 public:
  static absl::StatusOr<std::unique_ptr<Engine>> Create(Manifest manifest,
                                                        Communicator* communicator,
                                                        PlanProvider* plans,
                                                        EngineOptions options);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  const Manifest& manifest() const { return manifest_; }
  const Plan& plan() const { return *plan_; }
  std::shared_ptr<const Plan> plan_pointer() const { return plan_; }
  int64_t plan_version() const { return plan_version_; }
  // Whether the buckets are final: planned from the gradients' ready order (a checkpoint's, or
  // the one this run's first step saw, after which the buckets were rebuilt).
  bool buckets_final() const { return rebuilt_; }
  int64_t steps_done() const { return steps_done_; }

  // At stage 3 param(i) is null unless i's bucket is gathered (Acquire), grad(i) unless backward
  // has its buffer (AcquireGrad).
  float* param(int index);
  float* grad(int index);  // null for a parameter without gradient
  // Parameter `index`'s values on the host, and from the host (numel floats). At stage 3
  // ParamValues needs the parameter acquired; SetParamValues keeps what this rank owns, and
  // rank 0 also keeps the whole tensor for BroadcastParameters unless the caller gives every
  // rank the same values (`same_on_every_rank`: a seeded initialization), which then need no
  // broadcast.
  absl::StatusOr<std::vector<float>> ParamValues(int index) const;
  absl::Status SetParamValues(int index, const float* values, bool same_on_every_rank = false);

  // Parameters on demand (stage 3; stages 1 and 2 with overlap_param_gather; otherwise
  // Acquire and Release do nothing and AcquireGrad is grad()). param(i) is whole from
  // Acquire(i) to Release(i); acquire again for backward.
  bool gathers_on_demand() const;
  absl::Status Acquire(int index);
  void Release(int index);
  // Backward's gradient buffer for parameter `index` (zeroed at stage 3 when its bucket's
  // buffer is handed out), valid until MarkGradReady of the bucket's last parameter.
  absl::StatusOr<float*> AcquireGrad(int index);
  // The same by bucket (plan().buckets' index), for callers that hold whole buckets (module
  // hooks): the bucket's whole parameters (padded_numel floats) until ReleaseBucket, and its
  // gradient buffer.
  absl::StatusOr<float*> AcquireBucket(int bucket);
  void ReleaseBucket(int bucket);
  absl::StatusOr<float*> AcquireGradBucket(int bucket);
  // Waits for every gather and reduction in flight; at stages 1 and 2 afterwards every
  // parameter is whole.
  absl::Status FinishGathers();
  HeldBytes held_bytes() const;
  // Why the buckets' collectives copy through the shared-memory transport's slots rather than
  // reading the peers' buckets in place (a rank could not share them); empty where they do, or
  // where the transport does not read peers' memory.
  const std::string& unshared_reason() const { return unshared_reason_; }
  int gathered_units() const;
  // The factor backward scales the loss by (1 without loss scaling).
  float loss_scale() const { return scaler_.has_value() ? scaler_->scale() : 1.0f; }
  // Updates applied so far (steps_done() less the steps loss scaling skipped).
  int64_t optimizer_steps() const { return optimizer_steps_; }
  // The optimizer's step count and the loss scaler's state, as checkpoints keep them.
  TrainingCounters counters() const;

  // Makes every rank's parameters rank 0's (as DDP does at construction).
  absl::Status BroadcastParameters();
  // Makes every rank's values of frozen tensor `index` (a module buffer) rank 0's. Collective.
  absl::Status BroadcastFrozen(int index);

  // A collective of the caller's (the step boundary's agreement), queued behind the engine's
  // own so that the caller does not wait for it: it runs on the communication thread when the
  // engine has one and its memory is the host's. A device's host values pass through its
  // compute stream, so there (and without a thread) it runs now. WaitCollective waits for it
  // and everything queued before it; the engine's own collectives outside the queue (the
  // methods marked Collective) wait for it first, so the two never run at once.
  absl::StatusOr<CommunicationQueue::Ticket> SubmitCollective(
      CommunicationQueue::Operation operation);
  absl::Status WaitCollective(CommunicationQueue::Ticket ticket) { return queue_->Wait(ticket); }

  // Zeroes every gradient, one bucket at a time (for callers whose backward accumulates into
  // the gradients, as torch's autograd does).
  absl::Status ZeroGradients();
  void StartBackward();
  void MarkGradReady(int index);
  // ReduceGradients, then (if it says so) UpdateOwned, then EndStep.
  absl::Status Step(StepTimings* timings);

  // Step in its parts, for an update rule outside the engine (a training script's own
  // optimizer: optimizer kind kTorch), which runs between ReduceGradients and EndStep on the
  // ranges UpdatedRanges() names, through RangeData and RangeGrad.
  //
  // Waits for the reductions, switches to the rebuilt plan after the first step, unscales and
  // clips. Returns whether this step updates (false: loss scaling found an inf or NaN).
  absl::StatusOr<bool> ReduceGradients(StepTimings* timings);
  // The built-in optimizer's update of everything this rank updates.
  absl::Status UpdateOwned(StepTimings* timings);
  // Counts the update (if `updated`), gathers the parameters and readies the next step.
  absl::Status EndStep(bool updated, StepTimings* timings);

  // The elements this rank updates, by parameter: its owned span of every bucket (at stage 0
  // every bucket) cut at parameter bounds, in bucket order. Valid until the layout changes (the
  // first step's rebuild).
  std::vector<OwnedRange> UpdatedRanges() const;
  // Where `range`'s (one of UpdatedRanges) parameter values (array -1) or optimizer state tensor
  // `array` live, and its reduced gradient.
  float* RangeData(const OwnedRange& range, int array);
  float* RangeGrad(const OwnedRange& range);
  // The rank whose plan range holds the first element of `param`: the one that saves the
  // parameter's checkpoint extras (common/checkpoint.h ShardExtra). -1 for a frozen parameter.
  int ExtrasHolder(int param) const;
  bool SavesExtrasOf(int param) const { return ExtrasHolder(param) == communicator_->rank(); }

  // Checkpoints. How many bytes this rank saves: its plan ranges, parameters and optimizer
  // state, laid out as common/checkpoint.h MakeShardLayout says.
  uint64_t OwnedStateBytes() const;
  // Those bytes, copied out of the live buffers into `out` (OwnedStateBytes() long).
  absl::Status CopyOwnedState(absl::Span<char> out);
  // The same into a vector, resized to fit (a buffer of the right size from an earlier save is
  // reused without reallocation).
  absl::Status CopyOwnedState(std::vector<char>* out);
  // Whether CopyOwnedStateInBackground copies off the caller's thread: with a communication
  // thread, in host memory.
  bool CopiesStateInBackground() const;
  // CopyOwnedState queued on the communication thread, behind the parameter gathers the next
  // forward reads, so that the copy runs while the caller computes. The state is still the one
  // at this call: every update of it is queued later, or waits for the queue. `keep` keeps
  // `out` alive until the copy is done. WaitCollective(ticket) waits for it. Only where
  // CopiesStateInBackground(). `hasher`, if given, is handed every byte copied, in order, each
  // piece while the cache still holds it: the copy's checksums without another pass over memory.
  absl::StatusOr<CommunicationQueue::Ticket> CopyOwnedStateInBackground(
      absl::Span<char> out, std::shared_ptr<const void> keep,
      std::shared_ptr<ShardHasher> hasher = nullptr);
  // Loads the elements this rank owns from a checkpoint of the same model and optimizer, of any
  // world size, gathers the parameters, and continues the step count from the checkpoint's.
  // Needs the rebuilt plan (the checkpoint's gradient order). `timings`, if given, says how long
  // the read and the gather took.
  absl::Status Restore(CheckpointReader& checkpoint, RestoreTimings* timings = nullptr);
  // Loads parameters (now) and, with `with_state`, optimizer state (now if the plan is
  // rebuilt, else right after the first step's rebuild, before any update) from full tensors,
  // e.g. a consolidated file; the step count continues from `steps_done`, the optimizer's and
  // the loss scale's from `counters`. Collective (the parameters are gathered).
  absl::Status LoadState(std::unique_ptr<StateSource> source, bool with_state,
                         int64_t steps_done, const TrainingCounters& counters);
  // Like ZeroRedundancyOptimizer.consolidate_state_dict(to=rank): every rank sends what it owns,
  // one parameter at a time (GatherToRank), and `to_rank` writes `path`, a safetensors file with
  // every parameter and its optimizer state (<name>.<state>) in full, and the step count in its
  // metadata. Collective.
  // With `with_state` false, the parameters alone (the job's export). Collective.
  absl::Status ConsolidateStateDict(int to_rank, const std::string& path,
                                    bool with_state = true);
  // Parameter `param`'s values (array -1) or optimizer state tensor `array` in full on rank
  // `to_rank`, into `out` (numel floats of host memory; other ranks pass null): each range comes
  // from the rank that updates it. Collective, one parameter at a time, so that no rank but
  // `to_rank` ever holds more than one parameter's range (ZeroRedundancyOptimizer's
  // consolidate_state_dict with memory bounded by the largest parameter).
  absl::Status GatherToRank(int param, int array, int to_rank, float* out);
  // Rank `from_rank`'s `*bytes` to rank `to_rank` (whose `*bytes` it replaces). Collective.
  absl::Status SendBytes(int from_rank, int to_rank, std::string* bytes);

  // Bytes of optimizer state this rank holds, and the state's names (exp_avg, ...).
  int64_t optimizer_state_bytes() const;
  const std::vector<std::string>& optimizer_state_names() const {
    return optimizer_.state_names();
  }
  const OptimizerConfig& optimizer_config() const { return optimizer_.config(); }

 private:
  struct BucketState {
    DeviceArray params;  // the whole bucket (stages 0-2; stage 3 gathers into a slot)
    DeviceArray grads;
    DeviceArray owned_params;  // stage 3: the owned span's parameters and reduced gradients
    DeviceArray owned_grads;
    std::vector<DeviceArray> state;  // per optimizer state tensor, over the owned span
    // Stages 0-2 on the host: `params` and `grads` as the peers on this host read them in
    // place (ShareBucketArrays). After the arrays: they stop being shared before they go.
    std::unique_ptr<SharedHostBuffer> shared_params;
    std::unique_ptr<SharedHostBuffer> shared_grads;
    int64_t own_begin = 0;           // owned span within the bucket
    int64_t own_end = 0;
    int pending = 0;                 // gradients not yet marked ready this step
    // Parameters on demand.
    int slot = -1;       // stage 3: the parameter slot holding the gathered bucket
    int grad_slot = -1;  // stage 3: the gradient slot backward writes
    int holders = 0;     // Acquire without Release
    CommunicationQueue::Ticket gather = 0;  // the gather that makes the bucket whole
  };
  // A stage-3 buffer the size of the largest bucket, lent to one bucket at a time.
  struct Slot {
    DeviceArray array;
    int bucket = -1;
    int64_t last_used = 0;
    CommunicationQueue::Ticket ticket = 0;  // the collective that last used it
  };

  Engine(Manifest manifest, Communicator* communicator, PlanProvider* plans,
         EngineOptions options, std::vector<int> param_groups);

  // Allocates the frozen parameters' arrays.
  absl::Status Allocate();
  // Lays out buckets for `plan`, carrying parameters (and, if asked, gradients) over from the
  // current layout when there is one (at stage 3 one old bucket at a time: Relayout).
  absl::Status Apply(AppliedPlan applied, bool carry_gradients);
  absl::Status Relayout(const Plan& plan, std::vector<BucketState>& buckets,
                        bool carry_gradients);
  // Shares the new layout's whole buckets with the peers on this host, where the communicator
  // reads peers' memory (shared memory): their collectives then read them in place instead of
  // copying through the communicator's slots. Collective.
  absl::Status ShareBucketArrays(std::vector<BucketState>& buckets);
  const float* ParamData(int index) const;
  // The owned span's first element of bucket b's parameters and gradients.
  float* OwnedParams(const BucketState& bucket) const;
  float* OwnedGrads(const BucketState& bucket) const;
  bool sharded_params() const { return options_.zero_stage == 3; }
  // The owned span of `state` (not empty) cut where the parameter group changes, with views of
  // its parameters, gradients and optimizer state.
  std::vector<OwnedSpan> SplitOwnedSpan(const Bucket& bucket, const BucketState& state) const;
  // Unscales the reduced gradients; false when the step must be skipped (an inf or NaN).
  absl::StatusOr<bool> UnscaleGradients(StepTimings* timings);
  // source.ReadElements into device memory at `out`.
  absl::Status ReadInto(StateSource& source, int param, int array, int64_t begin, int64_t count,
                        float* out);
  // Continues the optimizer's step count and, when this engine scales the loss, the scale.
  absl::Status ContinueCounters(const TrainingCounters& counters);
  // Queues the reductions of the ready buckets, in plan order.
  void SubmitReadyReductions();
  absl::Status ReduceBucket(int bucket, bool all_reduce, float* grads);
  // Whether this step's buckets are updated as their reductions complete (overlap_update), and
  // then, at stages 1 and 2 without overlap_param_gather, gathered right after their update.
  bool UpdatesDuringBackward() const;
  bool GathersAfterEachUpdate() const;
  absl::Status ClipGradients(StepTimings* timings);
  // Reads what this rank owns (see ReadOwned) and at stages 1 and 2 all-gathers the parameters,
  // after the reads or during them (EngineOptions::gather_during_reads). `timings` (may be
  // null): the reads, and the gather left after them.
  absl::Status ReadAndGather(StateSource& source, bool states, RestoreTimings* timings);
  // `params_read(b)` (may be null) is called once for every bucket b, in order, as soon as this
  // rank's part of b's parameters is read.
  absl::Status ReadOwned(StateSource& source, bool params, bool states,
                         const std::function<void(size_t)>& params_read = nullptr);
  absl::Status GatherParameters();
  // Bucket b's whole parameters into `whole` from the owned spans (all-gather, or the owner's
  // broadcast in param mode).
  absl::Status GatherBucket(size_t b, float* whole);
  // Parameters on demand (engine_units.cc).
  absl::Status StartGather(int bucket, bool prefetch);
  void Prefetch();
  int FindSlot(std::vector<Slot>& slots, bool for_prefetch);
  // CopyOwnedState once nothing queued writes the state any more; `hasher` as in
  // CopyOwnedStateInBackground (host memory only).
  absl::Status CopyOwnedStateNow(absl::Span<char> out, ShardHasher* hasher = nullptr);
  absl::Status SubmitPendingGathers();
  absl::Status WaitGathered(int bucket);
  absl::Status AllocateSlots();
  void ResetUnits();
  // Stage 3: rank 0's initial values until BroadcastParameters spreads them.
  absl::Status BroadcastStagedValues();

  const Manifest manifest_;
  Communicator* const communicator_;
  PlanProvider* const plans_;
  const EngineOptions options_;
  Device* const device_;
  const OptimizerKernel optimizer_;
  const std::vector<int> param_groups_;  // by parameter: its optimizer param group, -1 for none
  std::optional<LossScaler> scaler_;
  std::unique_ptr<SpanKernels> kernels_;  // over the owned spans of the current layout
  // The same by bucket, for the update during backward (overlap_update); empty otherwise.
  std::vector<std::unique_ptr<SpanKernels>> bucket_kernels_;
  bool updated_during_backward_ = false;  // this step's update is done (ReduceGradients)
  std::vector<float> host_scratch_;       // restores on a device without host memory

  std::shared_ptr<const Plan> plan_;
  int64_t plan_version_ = 0;
  bool rebuilt_ = false;
  std::string unshared_reason_;  // see unshared_reason()
  bool first_step_all_reduce_ = true;
  std::vector<BucketState> buckets_;
  std::vector<DeviceArray> frozen_;  // parameters without gradient, by index
  int64_t steps_done_ = 0;
  int64_t optimizer_steps_ = 0;
  std::vector<int> ready_order_;      // this step's MarkGradReady order
  std::vector<bool> marked_;          // by parameter, this step
  std::vector<bool> bucket_ready_;    // by bucket, this step
  int next_reduce_ = 0;               // the next bucket to queue for reduction
  std::unique_ptr<StateSource> pending_state_;  // optimizer state to load after the rebuild
  absl::Time backward_start_;
  absl::Time backward_end_;

  // Parameters on demand.
  std::vector<Slot> param_slots_;
  std::vector<Slot> grad_slots_;
  int64_t slot_numel_ = 0;
  int64_t use_clock_ = 0;
  std::vector<int> access_order_;  // the buckets the previous step acquired, in order
  std::vector<int> access_now_;    // this step's, so far
  size_t cursor_ = 0;              // where this step is in access_order_
  bool prefetching_ = false;       // this step follows access_order_ so far
  bool gathers_pending_ = false;   // stages 1-2: updated, the gathers not started yet
  double gather_wait_ms_ = 0;
  int gathered_peak_ = 0;
  std::vector<std::vector<float>> staged_values_;  // stage 3, rank 0: by parameter

  absl::Mutex spans_mu_;
  std::vector<std::pair<absl::Time, absl::Time>> reduce_spans_ ABSL_GUARDED_BY(spans_mu_);
  double update_ms_ ABSL_GUARDED_BY(spans_mu_) = 0;  // updates during backward, this step
  // Declared last: its thread stops (destroyed first) before anything it touches goes.
  std::unique_ptr<CommunicationQueue> queue_;
};

}  // namespace shard
