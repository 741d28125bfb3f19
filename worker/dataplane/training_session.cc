#include "worker/dataplane/training_session.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <limits>
#include <set>

#include "absl/base/casts.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/fault.h"
#include "common/files.h"
#include "common/safetensors.h"
#include "common/status_macros.h"
#include "common/snapshot.h"
#include "common/step_boundary.h"
#include "worker/dataplane/cpu_device.h"

namespace shard {
namespace {

// A consolidated safetensors file (an export, or ConsolidateStateDict's output) as a source of
// parameters and optimizer state (<name>.<state>).
class SafetensorsStateSource : public StateSource {
 public:
  SafetensorsStateSource(std::unique_ptr<SafetensorsReader> file, const Manifest& manifest,
                         std::vector<std::string> state_names)
      : file_(std::move(file)), manifest_(manifest), state_names_(std::move(state_names)) {}

  absl::Status ReadElements(int param, int array, int64_t begin, int64_t count,
                            float* out) override {
    const ParamSpec& spec = manifest_.params[param];
    const std::string name = array < 0 ? spec.name : spec.name + "." + state_names_[array];
    SHARD_ASSIGN_OR_RETURN(const TensorInfo* tensor,
                           file_->Expect(name, DataType::kFloat32, spec.shape));
    return file_->ReadElements(*tensor, begin, count, out);
  }

 private:
  std::unique_ptr<SafetensorsReader> file_;
  const Manifest& manifest_;
  std::vector<std::string> state_names_;
};

// Whether `file` holds every optimizer state tensor of every trainable parameter.
bool HoldsOptimizerState(const SafetensorsReader& file, const Manifest& manifest,
                         const std::vector<std::string>& state_names) {
  if (state_names.empty()) return false;
  for (const ParamSpec& spec : manifest.params) {
    if (!spec.requires_grad) continue;
    for (const std::string& state : state_names) {
      if (file.Find(spec.name + "." + state) == nullptr) return false;
    }
  }
  return true;
}

// The observer of a session that nobody observes: every method's default. Stateless, so one
// serves every session.
TrainingObserver& Unobserved() {
  static TrainingObserver nobody;
  return nobody;
}

}  // namespace

TrainingSession::TrainingSession(const JobConfig& job, Communicator& communicator, Device& device,
                                 const TrainerOptions& options)
    : job_(job),
      communicator_(communicator),
      device_(device),
      options_(options),
      observer_(options.observer != nullptr ? *options.observer : Unobserved()),
      saver_([&observer = observer_](const SavedShard& saved) { observer.OnCheckpoint(saved); }) {}

absl::StatusOr<std::unique_ptr<TrainingSession>> TrainingSession::Create(
    const JobConfig& job, Manifest manifest, Communicator& communicator, PlanProvider& plans,
    const TrainerOptions& options) {
  if (job.global_batch % communicator.size() != 0) {
    return absl::InvalidArgumentError(absl::StrCat("global batch ", job.global_batch,
                                                   " does not divide over ", communicator.size(),
                                                   " workers"));
  }
  Device& device = options.device != nullptr ? *options.device : HostDevice();
  SHARD_RETURN_IF_ERROR(device.BindThread());  // the engine's memory lives on this thread's device
  SHARD_ASSIGN_OR_RETURN(const DataType precision, ParsePrecision(job.precision));
  std::unique_ptr<TrainingSession> session(
      new TrainingSession(job, communicator, device, options));
  EngineOptions engine_options;
  engine_options.zero_stage = job.zero_stage;
  engine_options.overlap = job.overlap;
  // Gathering on demand needs a model that acquires its parameters layer by layer: the
  // built-in MLP on the host (an external model's loop does not yet).
  engine_options.overlap_param_gather =
      job.overlap_param_gather && !job.external_model && device.host_memory();
  engine_options.prefetch = job.prefetch;
  // The update on the communication thread: host memory (a GPU's update runs on its compute
  // stream, ordered by events the communication thread does not have).
  engine_options.overlap_update = job.overlap_update && device.host_memory();
  engine_options.optimizer = job.optimizer;
  engine_options.grad_clip_norm = job.grad_clip_norm;
  // A training script's loss is each rank's mean over its own samples (the built-in MLP's is
  // its share of the global batch's).
  engine_options.average_gradients = job.external_model;
  engine_options.device = &device;
  engine_options.gather_during_reads = options.gather_during_reads;
  // fp16's range needs the loss scaled (bf16 has fp32's exponent and needs no scaling).
  if (precision == DataType::kFloat16) engine_options.loss_scaling = LossScalerOptions{};
  SHARD_ASSIGN_OR_RETURN(session->engine_, Engine::Create(std::move(manifest), &communicator,
                                                          &plans, engine_options));
  if (job.optimizer.kind == OptimizerKind::kTorch) {
    SHARD_RETURN_IF_ERROR(session->CheckSameOptimizer());
  }
  if (options.snapshots != nullptr && job.snapshot_every > 0) {
    TrainingObserver& observer = session->observer_;
    session->snapshotter_ = std::make_unique<Snapshotter>(
        options.snapshots, options.snapshot_replication,
        Snapshotter::Callbacks{
            [&observer](const SnapshotShard& shard, const std::vector<std::string>& dropped) {
              observer.OnSnapshot(shard, dropped);
            },
            [&observer](const SnapshotShard& shard, const std::string& buddy,
                        const absl::Status& why) {
              observer.OnSnapshotPushFailed(shard, buddy, why);
            },
            [&observer](const SnapshotShard& shard, const std::string& buddy,
                        const absl::Status& why) {
              observer.OnSnapshotPagesRefused(shard, buddy, why);
            }});
    session->snapshotter_->PrepareBuffers(session->engine_->OwnedStateBytes());
  }
  if (options.restore_from_observer || !options.restore_dir.empty()) {
    StallPoint("before-restore");
    const absl::Time start = absl::Now();
    RestoreTimings timings;
    const absl::Status restored = [&]() -> absl::Status {
      SHARD_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointReader> checkpoint,
                             options.restore_from_observer
                                 ? session->observer_.OpenRestore()
                                 : CheckpointReader::Open(options.restore_dir));
      SHARD_RETURN_IF_ERROR(session->engine_->Restore(*checkpoint, &timings));
      SHARD_RETURN_IF_ERROR(session->ReadRestoredExtras(*checkpoint));
      session->next_step_ = checkpoint->manifest().step;
      return absl::OkStatus();
    }();
    SHARD_RETURN_IF_ERROR(session->observer_.OnRestored(restored, absl::Now() - start, timings));
    session->restored_ = true;
  }
  session->result_.start_step = session->next_step_;
  return session;
}

absl::Status TrainingSession::CheckSameOptimizer() {
  const OptimizerStateKind mine = StateKindOf(engine_->optimizer_config());
  std::string identity = mine.torch_class;
  for (const std::string& name : mine.names) absl::StrAppend(&identity, "\n", name);
  // 60 bits of its hash, so that a maximum and a minimum over the ranks compare it exactly.
  const int64_t hash =
      static_cast<int64_t>(std::stoull(ContentHash(identity).substr(0, 15), nullptr, 16));
  int64_t extremes[2] = {hash, -hash};
  SHARD_RETURN_IF_ERROR(device_.AllReduceHostValues(communicator_, extremes, 2,
                                                    DataType::kInt64, ReduceOp::kMax));
  if (extremes[0] != hash || -extremes[1] != hash) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the ranks run different optimizers: this rank's is ", mine.torch_class, " with state [",
        absl::StrJoin(mine.names, ", "), "], another rank's is not; every rank must make the "
        "same engine.optimizer(cls, ...)"));
  }
  return absl::OkStatus();
}

absl::Status TrainingSession::ReadRestoredExtras(CheckpointReader& checkpoint) {
  std::set<int> wanted = {-1};
  for (const OwnedRange& range : engine_->UpdatedRanges()) wanted.insert(range.param);
  const std::vector<ShardRecord>& shards = checkpoint.manifest().shards;
  for (size_t shard = 0; shard < shards.size(); ++shard) {
    for (const ShardExtra& extra : shards[shard].extras) {
      if (!wanted.contains(extra.param)) continue;
      SHARD_ASSIGN_OR_RETURN(restored_extras_[extra.param],
                             checkpoint.ReadExtra(static_cast<int>(shard), extra));
    }
  }
  return absl::OkStatus();
}

bool TrainingSession::stop_requested() const {
  return options_.stop != nullptr && options_.stop->load();
}

bool TrainingSession::Interrupted() const { return communicator_.aborted() || stop_requested(); }

absl::StatusOr<bool> TrainingSession::LoadInitFile() {
  if (job_.init_path.empty()) return false;
  const Manifest& manifest = engine_->manifest();
  SHARD_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsReader> init,
                         SafetensorsReader::Open(job_.init_path));
  std::vector<std::string> state_names;
  int64_t steps_done = 0;
  TrainingCounters counters;
  // A script's own optimizer starts fresh: an init file holds no state of its that is not
  // per element (its step counts).
  if (engine_->optimizer_config().kind != OptimizerKind::kTorch &&
      HoldsOptimizerState(*init, manifest, engine_->optimizer_state_names())) {
    state_names = engine_->optimizer_state_names();
    auto step = init->metadata().find("step");
    if (step == init->metadata().end() || !absl::SimpleAtoi(step->second, &steps_done)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "init file '", job_.init_path,
          "' holds optimizer state but no \"step\" in its metadata (Adam's bias correction needs "
          "the step count)"));
    }
    absl::StatusOr<TrainingCounters> saved =
        TrainingCountersFromMetadata(init->metadata(), steps_done);
    if (!saved.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("init file '", job_.init_path, "': ", saved.status().message()));
    }
    counters = *saved;
  }
  // Without optimizer state in the file, the optimizer starts fresh (step 0).
  const bool with_state = !state_names.empty();
  SHARD_RETURN_IF_ERROR(engine_->LoadState(
      std::make_unique<SafetensorsStateSource>(std::move(init), manifest, state_names), with_state,
      steps_done, counters));
  next_step_ = steps_done;
  result_.start_step = steps_done;
  return true;
}

absl::Status TrainingSession::BroadcastInitialValues() { return engine_->BroadcastParameters(); }

absl::StatusOr<TrainingSession::Boundary> TrainingSession::EndStep(double loss_share,
                                                                   const StepTimings& timings,
                                                                   absl::Time started) {
  const int64_t step = next_step_;
  StepRecord record;
  record.step = step + 1;
  record.timings = timings;
  record.step_ms = absl::ToDoubleMilliseconds(absl::Now() - started);
  record.plan_version = engine_->plan_version();
  record.held_bytes = engine_->held_bytes().total();
  // Said once, at the step whose plan could not share them (the first, or a rebuild's), so that
  // a run slowed by a full /dev/shm says so when it starts, not only when it ends.
  if (!unshared_told_ && !engine_->unshared_reason().empty()) {
    record.buckets_unshared = engine_->unshared_reason();
    unshared_told_ = true;
  }
  if (step == result_.start_step) {
    steady_start_ = absl::Now();
  } else {
    hidden_ms_ += timings.hidden_ms;
    reduction_ms_ += timings.communication_ms;
    step_ms_ += record.step_ms;
    compute_ms_ += timings.backward_ms;
  }
  result_.steps = step + 1;
  next_step_ = step + 1;
  SHARD_RETURN_IF_ERROR(StartCopiedSnapshot());

  // This boundary acts on what the ranks posted at the previous one (the orders and the work in
  // flight then, and the previous step's loss): agreed one step ahead, so that no rank waits
  // here for the others. The first boundary of a run has nothing posted: no orders, and
  // nothing in flight yet.
  StepOrders orders{options_.generation, 0, 0, false};
  BoundaryWork work;
  if (posted_.has_value()) {
    SHARD_ASSIGN_OR_RETURN(const PostedAgreement agreed, SettlePosted(&record));
    orders = agreed.orders;
    work = agreed.work;
  }

  // Checkpoint or snapshot at this step boundary if one is due or requested anywhere.
  if (step == result_.start_step) boundary_state_.last_snapshot_step = step;
  const StepBoundaryRules rules{job_.steps, job_.checkpoint_every,
                                snapshotter_ != nullptr ? job_.snapshot_every : 0};
  absl::Duration waited;
  if (work.saving_step > 0 && work.saving_step != waited_for_save_ &&
      SaveDue(step + 1, rules, orders, boundary_state_)) {
    // A save is due while a rank still writes the previous one: each rank waits for its own
    // write a bounded time, once per write, and the ranks agree again (now, blocking: rare) on
    // whether one still writes. A slow disk holds training up at most checkpoint.max_wait_ms
    // per write.
    waited_for_save_ = work.saving_step;
    const absl::Time wait_start = absl::Now();
    saver_.WaitIdleFor(absl::Milliseconds(job_.checkpoint_max_wait_ms));
    waited = absl::Now() - wait_start;
    work.saving_step = saver_.writing_step();
    SHARD_RETURN_IF_ERROR(device_.AllReduceHostValues(communicator_, &work.saving_step, 1,
                                                      DataType::kInt64, ReduceOp::kMax));
  }
  const StepBoundary boundary =
      DecideStepBoundary(step + 1, rules, orders, work, &boundary_state_);
  if (boundary.snapshot && snapshotter_ == nullptr) {
    return absl::FailedPreconditionError(
        "the coordinator asked for a memory snapshot, but this worker keeps no snapshot store");
  }
  if (boundary.save_skipped) {
    ++result_.checkpoints_skipped;
    if (communicator_.rank() == 0) ReportSkippedSave(step + 1, work.saving_step, waited);
  }
  if (boundary.snapshot || boundary.save) {
    SHARD_RETURN_IF_ERROR(SaveState(step + 1, boundary, waited, &record));
  }
  // What this rank knows now, for the next boundary, with this step's loss share. Posted after
  // this boundary's saves started, so that the next one knows they are in flight. The last
  // step of a run, or the one it pauses after, waits for it: its own loss is reported.
  SHARD_RETURN_IF_ERROR(Post(step + 1, loss_share));
  if (boundary.pause || finished()) SHARD_RETURN_IF_ERROR(SettlePosted(&record).status());
  observer_.OnStep(record);
  if (boundary.pause) {
    // What the world re-forms from must be reported first: the snapshot held (and replicated),
    // or the checkpoint's shard on disk.
    if (boundary.snapshot) {
      SHARD_RETURN_IF_ERROR(snapshotter_->WaitIdle([this] { return Interrupted(); }));
    }
    // The world re-forms from a snapshot: a disk save still in flight is waited for a bounded
    // time, then given up (its generation ends with the pause, so it could not commit later).
    if (orders.pause_in_memory &&
        !saver_.WaitIdleFor(absl::Milliseconds(job_.checkpoint_max_wait_ms))) {
      saver_.Cancel();
    }
    saver_.WaitIdle();
    result_.paused_at = step + 1;
    return Boundary::kPaused;
  }
  return finished() ? Boundary::kFinished : Boundary::kContinue;
}

absl::Status TrainingSession::Post(int64_t step, double loss_share) {
  // One small all-reduce (max): the newest orders any rank knows, what any rank still has in
  // flight, and every rank's loss share in a slot of its own (the other ranks put the smallest
  // int64 there, so the max is the owner's bits), added up in rank order when it is settled,
  // the same on every rank.
  StepOrders known = observer_.Orders();
  if (known.generation != options_.generation) known = StepOrders{};
  auto values = std::make_shared<std::vector<int64_t>>(kPostedOrderValues + communicator_.size(),
                                                       std::numeric_limits<int64_t>::min());
  std::vector<int64_t>& posted = *values;
  posted[0] = known.save_request;
  posted[1] = known.pause_request;
  posted[2] = known.pause_in_memory ? 1 : 0;
  posted[3] = copying_snapshot_.has_value() || (snapshotter_ != nullptr && snapshotter_->busy())
                  ? 1
                  : 0;
  posted[4] = saver_.writing_step();
  posted[kPostedOrderValues + communicator_.rank()] = absl::bit_cast<int64_t>(loss_share);
  SHARD_ASSIGN_OR_RETURN(
      const CommunicationQueue::Ticket ticket,
      engine_->SubmitCollective([this, values] {
        return device_.AllReduceHostValues(communicator_, values->data(), values->size(),
                                           DataType::kInt64, ReduceOp::kMax);
      }));
  posted_ = Posted{std::move(values), ticket, step};
  return absl::OkStatus();
}

absl::StatusOr<TrainingSession::PostedAgreement> TrainingSession::SettlePosted(
    StepRecord* record) {
  Posted posted = std::move(*posted_);
  posted_.reset();
  SHARD_RETURN_IF_ERROR(engine_->WaitCollective(posted.ticket));
  const std::vector<int64_t>& agreed = *posted.values;
  double loss = 0;
  for (size_t r = kPostedOrderValues; r < agreed.size(); ++r) {
    loss += absl::bit_cast<double>(agreed[r]);
  }
  record->loss = loss;
  record->loss_step = posted.step;
  if (posted.step == result_.start_step + 1) result_.first_loss = loss;
  result_.last_loss = loss;
  return PostedAgreement{StepOrders{options_.generation, agreed[0], agreed[1], agreed[2] > 0},
                         BoundaryWork{agreed[3] > 0, agreed[4]}};
}

void TrainingSession::ReportSkippedSave(int64_t step, int64_t writing, absl::Duration waited) {
  SavedShard skipped;
  skipped.id = CheckpointIdForStep(step, options_.checkpoint_tag);
  skipped.dir = CheckpointDirectory(job_.checkpoint_dir, job_.name, skipped.id);
  skipped.step = step;
  skipped.rank = communicator_.rank();
  skipped.plan = engine_->plan_pointer();
  skipped.plan_version = engine_->plan_version();
  skipped.counters = engine_->counters();
  skipped.state = StateKindOf(engine_->optimizer_config());
  skipped.skipped = absl::StrCat(
      "the periodic checkpoint of step ", step, " was skipped: the checkpoint of step ", writing,
      " was still being written",
      waited >= absl::Milliseconds(1)
          ? absl::StrCat(" after training waited ",
                         absl::FormatDuration(absl::Trunc(waited, absl::Milliseconds(1))),
                         " for it")
          : "",
      " (saves fall behind the disk)");
  skipped.record = absl::UnavailableError(skipped.skipped);
  saver_.ReportSkipped(std::move(skipped));
}

TrainingSession::~TrainingSession() {
  // Training ended early (its generation is over, or it failed): nobody will commit the save in
  // flight, and a slow disk must not hold this worker back from the next generation. An
  // operator's stop lets it finish; after Finish() or a pause nothing is in flight any more.
  if (!stop_requested()) saver_.Cancel();
}

absl::Status TrainingSession::SaveState(int64_t step, const StepBoundary& boundary,
                                        absl::Duration waited, StepRecord* record) {
  const absl::Time pause_start = absl::Now() - waited;
  const int rank = communicator_.rank();
  const uint64_t pieces = engine_->OwnedStateBytes();
  using Extras = std::vector<std::pair<int, std::string>>;
  Extras provided;
  if (extras_provider_) {
    SHARD_ASSIGN_OR_RETURN(provided, extras_provider_());
  }
  uint64_t bytes = pieces;
  for (const auto& [param, extra] : provided) bytes += extra.size();
  // One copy serves both: a snapshot's buffer comes from the store (a dropped snapshot's), a
  // checkpoint's alone from the writer (its previous one). The extras go after the state.
  StateBuffer buffer;
  if (boundary.snapshot) {
    SHARD_ASSIGN_OR_RETURN(buffer, options_.snapshots->TakeBuffer(bytes));
  } else {
    buffer = saver_.TakeBuffer();
    SHARD_RETURN_IF_ERROR(buffer.Resize(bytes));
  }
  std::vector<ShardExtra> extras;
  uint64_t offset = pieces;
  for (const auto& [param, extra] : provided) {
    extras.push_back(ShardExtra{param, offset, extra.size()});
    std::memcpy(buffer.data() + offset, extra.data(), extra.size());
    offset += extra.size();
  }
  auto copy = std::make_shared<StateBuffer>(std::move(buffer));
  // A periodic snapshot alone is copied off this thread, while the next step computes: nothing
  // waits for it before the next boundary. A save, or a snapshot a pause waits for, is copied
  // now.
  const bool in_background = boundary.snapshot && !boundary.save &&
                             boundary.snapshot_request == 0 && !boundary.pause &&
                             engine_->CopiesStateInBackground();
  CommunicationQueue::Ticket copied = 0;
  std::shared_ptr<ShardHasher> hashed;
  if (in_background) {
    hashed = Snapshotter::NewHasher();
    SHARD_ASSIGN_OR_RETURN(copied, engine_->CopyOwnedStateInBackground(
                                       absl::MakeSpan(copy->data(), pieces), copy, hashed));
  } else {
    SHARD_RETURN_IF_ERROR(engine_->CopyOwnedState(absl::MakeSpan(copy->data(), pieces)));
  }
  const OptimizerStateKind state = StateKindOf(engine_->optimizer_config());
  if (boundary.snapshot) {
    SnapshotShard shard;
    shard.id = SnapshotId(step, options_.generation);
    shard.generation = options_.generation;
    shard.step = step;
    shard.rank = rank;
    shard.plan = engine_->plan().options;
    shard.plan_hash = engine_->plan().hash;
    shard.counters = engine_->counters();
    shard.request = boundary.snapshot_request;
    shard.state = state;
    shard.record.extras = extras;
    if (in_background) {
      copying_snapshot_ = CopiedSnapshot{std::move(shard), copy, copied, std::move(hashed)};
    } else {
      // Waits only for a pausing snapshot: a periodic one is never taken while one is in flight.
      SHARD_RETURN_IF_ERROR(
          snapshotter_->Start(std::move(shard), copy, [this] { return Interrupted(); }));
    }
    ++result_.snapshots_taken;
    record->snapshot = true;
  }
  const double pause_ms = absl::ToDoubleMilliseconds(absl::Now() - pause_start);
  if (boundary.save) {
    SavedShard saved;
    saved.id = CheckpointIdForStep(step, options_.checkpoint_tag);
    saved.dir = CheckpointDirectory(job_.checkpoint_dir, job_.name, saved.id);
    saved.step = step;
    saved.request = boundary.request;
    saved.rank = rank;
    saved.plan = engine_->plan_pointer();
    saved.plan_version = engine_->plan_version();
    saved.counters = engine_->counters();
    saved.state = state;
    saved.extras = std::move(extras);
    saved.pause_ms = pause_ms;
    ++result_.checkpoints_saved;
    saver_.Start(std::move(saved), communicator_.size(), std::move(copy));
  }
  result_.max_checkpoint_pause_ms = std::max(result_.max_checkpoint_pause_ms, pause_ms);
  record->checkpoint_pause_ms = pause_ms;
  return absl::OkStatus();
}

absl::Status TrainingSession::StartCopiedSnapshot() {
  if (!copying_snapshot_.has_value()) return absl::OkStatus();
  CopiedSnapshot snapshot = std::move(*copying_snapshot_);
  copying_snapshot_.reset();
  SHARD_RETURN_IF_ERROR(engine_->WaitCollective(snapshot.copied));
  return snapshotter_->Start(std::move(snapshot.shard), std::move(snapshot.bytes),
                             [this] { return Interrupted(); }, std::move(snapshot.hashed));
}

absl::StatusOr<TrainResult> TrainingSession::Finish() {
  SHARD_RETURN_IF_ERROR(StartCopiedSnapshot());
  saver_.WaitIdle();
  const int64_t trained = job_.steps - result_.start_step;
  if (trained > 1) {
    result_.steps_per_second =
        (trained - 1) / absl::ToDoubleSeconds(absl::Now() - steady_start_);
    result_.hidden_fraction = reduction_ms_ > 0 ? hidden_ms_ / reduction_ms_ : 0;
    result_.step_over_compute = compute_ms_ > 0 ? step_ms_ / compute_ms_ : 0;
  }
  result_.optimizer_state_bytes = engine_->optimizer_state_bytes();
  result_.held_bytes = engine_->held_bytes();
  result_.unshared_reason = engine_->unshared_reason();
  if (options_.consolidate_to_rank >= 0) {
    SHARD_RETURN_IF_ERROR(
        engine_->ConsolidateStateDict(options_.consolidate_to_rank, options_.consolidate_path));
  }
  // Collective: at stage 3 the parameters come from their owners.
  const std::string output_path =
      (std::filesystem::path(job_.output_dir) / "final.safetensors").string();
  if (communicator_.rank() == 0) {
    SHARD_RETURN_IF_ERROR(MakeDirectories(job_.output_dir));
    result_.output_path = output_path;
  }
  SHARD_RETURN_IF_ERROR(engine_->ConsolidateStateDict(0, output_path, /*with_state=*/false));
  return result_;
}

}  // namespace shard
