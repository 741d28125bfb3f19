#include "worker/dataplane/trainer.h"

#include <cstring>
#include <filesystem>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/fault.h"
#include "common/files.h"
#include "common/mlp.h"
#include "common/mlp_data.h"
#include "common/safetensors.h"
#include "common/status_macros.h"
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

// Initial values: the job's init file, or torch.nn.Linear's default from the job's seed. An init
// file with optimizer state (an export with state, or ConsolidateStateDict's output) continues
// that run: its state and step count are loaded and training starts after its step. Returns the
// steps already done.
absl::StatusOr<int64_t> InitializeParameters(const JobConfig& job, Engine& engine) {
  const Manifest& manifest = engine.manifest();
  if (job.init_path.empty()) {
    const std::vector<std::vector<float>> values = InitMlpParameters(job.widths, job.seed);
    for (size_t i = 0; i < values.size(); ++i) {
      SHARD_RETURN_IF_ERROR(engine.SetParamValues(static_cast<int>(i), values[i].data()));
    }
    SHARD_RETURN_IF_ERROR(engine.BroadcastParameters());
    return 0;
  }
  SHARD_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsReader> init,
                         SafetensorsReader::Open(job.init_path));
  std::vector<std::string> state_names;
  int64_t steps_done = 0;
  TrainingCounters counters;
  if (HoldsOptimizerState(*init, manifest, engine.optimizer_state_names())) {
    state_names = engine.optimizer_state_names();
    auto step = init->metadata().find("step");
    if (step == init->metadata().end() || !absl::SimpleAtoi(step->second, &steps_done)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "init file '", job.init_path,
          "' holds optimizer state but no \"step\" in its metadata (Adam's bias correction needs "
          "the step count)"));
    }
    absl::StatusOr<TrainingCounters> saved =
        TrainingCountersFromMetadata(init->metadata(), steps_done);
    if (!saved.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("init file '", job.init_path, "': ", saved.status().message()));
    }
    counters = *saved;
  }
  // Without optimizer state in the file, the optimizer starts fresh (step 0).
  const bool with_state = !state_names.empty();
  SHARD_RETURN_IF_ERROR(engine.LoadState(
      std::make_unique<SafetensorsStateSource>(std::move(init), manifest, state_names), with_state,
      steps_done, counters));
  return steps_done;
}

}  // namespace

absl::Status WriteParameters(Engine& engine, const std::string& path) {
  const Manifest& manifest = engine.manifest();
  std::vector<TensorDecl> tensors;
  std::vector<const void*> data;
  std::vector<std::vector<float>> values(manifest.params.size());
  for (size_t i = 0; i < manifest.params.size(); ++i) {
    const ParamSpec& param = manifest.params[i];
    tensors.push_back(TensorDecl{param.name, param.dtype, param.shape});
    SHARD_ASSIGN_OR_RETURN(values[i], engine.ParamValues(static_cast<int>(i)));
    data.push_back(values[i].data());
  }
  return WriteSafetensors(path, tensors, data, {{"format", "pt"}, {"producer", "shard"}});
}

absl::StatusOr<TrainResult> TrainMlp(const JobConfig& job, Communicator& communicator,
                                     PlanProvider& plans, const TrainerOptions& options) {
  const int rank = communicator.rank();
  const int world = communicator.size();
  if (job.global_batch % world != 0) {
    return absl::InvalidArgumentError(absl::StrCat("global batch ", job.global_batch,
                                                   " does not divide over ", world, " workers"));
  }
  SHARD_ASSIGN_OR_RETURN(std::unique_ptr<MlpBatchReader> data,
                         MlpBatchReader::Open(job.data_path, job.widths.front()));
  Device& device = options.device != nullptr ? *options.device : HostDevice();
  SHARD_RETURN_IF_ERROR(device.BindThread());  // the model's memory lives on this thread's device
  SHARD_ASSIGN_OR_RETURN(const DataType precision, ParsePrecision(job.precision));
  const int64_t rows = job.global_batch / world;
  SHARD_ASSIGN_OR_RETURN(std::unique_ptr<MlpRunner> model,
                         device.CreateMlp(job.widths, rows, precision));

  EngineOptions engine_options;
  engine_options.zero_stage = job.zero_stage;
  engine_options.overlap = job.overlap;
  engine_options.optimizer = job.optimizer;
  engine_options.grad_clip_norm = job.grad_clip_norm;
  engine_options.device = &device;
  // fp16's range needs the loss scaled (bf16 has fp32's exponent and needs no scaling).
  if (precision == DataType::kFloat16) engine_options.loss_scaling = LossScalerOptions{};
  SHARD_ASSIGN_OR_RETURN(
      std::unique_ptr<Engine> engine,
      Engine::Create(MlpManifest(job.widths), &communicator, &plans, engine_options));
  int64_t start_step = 0;
  if (!options.restore_dir.empty()) {
    StallPoint("before-restore");
    SHARD_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointReader> checkpoint,
                           CheckpointReader::Open(options.restore_dir));
    SHARD_RETURN_IF_ERROR(engine->Restore(*checkpoint));
    start_step = checkpoint->manifest().step;
  } else {
    SHARD_ASSIGN_OR_RETURN(int64_t initialized, InitializeParameters(job, *engine));
    start_step = initialized;
  }
  CheckpointSaver saver([&options](const SavedShard& saved) {
    if (options.on_checkpoint) options.on_checkpoint(saved);
  });
  int64_t satisfied_request = 0;

  const int parameters = static_cast<int>(engine->manifest().params.size());
  std::vector<float> x;
  std::vector<int64_t> y;
  std::vector<const float*> params(parameters);
  std::vector<float*> grads(parameters);
  const float scale = 1.0f / static_cast<float>(job.global_batch);
  TrainResult result;
  result.start_step = start_step;
  absl::Time steady_start;  // end of the first step
  double hidden_ms = 0;
  double reduction_ms = 0;
  for (int64_t step = start_step; step < job.steps; ++step) {
    if (options.stop != nullptr && options.stop->load()) {
      return absl::CancelledError(absl::StrCat("training stopped before step ", step + 1));
    }
    const absl::Time start = absl::Now();
    SHARD_RETURN_IF_ERROR(data->Read(step, job.global_batch, rank, world, &x, &y));
    for (int i = 0; i < parameters; ++i) {
      params[i] = engine->param(i);
      grads[i] = engine->grad(i);
    }
    // A bad label surfaces at Forward on the host, at LossSum on a GPU.
    auto in_data = [&](const absl::Status& status) {
      return absl::Status(status.code(), absl::StrCat("data file '", job.data_path, "', step ",
                                                      step + 1, ": ", status.message()));
    };
    if (absl::Status forward = model->Forward(params, x.data(), y.data(), rows); !forward.ok()) {
      return in_data(forward);
    }
    engine->StartBackward();
    Engine* e = engine.get();
    SHARD_RETURN_IF_ERROR(model->Backward(params, grads, scale * engine->loss_scale(),
                                          [e](int index) { e->MarkGradReady(index); }));
    StepRecord record;
    SHARD_RETURN_IF_ERROR(engine->Step(&record.timings));
    absl::StatusOr<double> loss_sum = model->LossSum();
    if (!loss_sum.ok()) return in_data(loss_sum.status());
    // The global mean loss: every rank's share of the sum over the global batch.
    double loss = *loss_sum / static_cast<double>(job.global_batch);
    SHARD_RETURN_IF_ERROR(
        device.AllReduceHostValues(communicator, &loss, 1, DataType::kFloat64, ReduceOp::kSum));
    record.step = step + 1;
    record.loss = loss;
    record.step_ms = absl::ToDoubleMilliseconds(absl::Now() - start);
    record.plan_version = engine->plan_version();
    if (step == start_step) {
      result.first_loss = loss;
      steady_start = absl::Now();
    } else {
      hidden_ms += record.timings.hidden_ms;
      reduction_ms += record.timings.communication_ms;
    }
    result.last_loss = loss;
    result.steps = step + 1;

    // Checkpoint at this step boundary if it is due or requested anywhere; the ranks agree on
    // the newest save and pause requests any of them knows.
    StepOrders known = options.orders ? options.orders() : StepOrders{};
    if (known.generation != options.generation) known = StepOrders{};
    int64_t requests[2] = {known.save_request, known.pause_request};
    if (options.orders) {
      SHARD_RETURN_IF_ERROR(device.AllReduceHostValues(communicator, requests, 2,
                                                       DataType::kInt64, ReduceOp::kMax));
    }
    const StepBoundary boundary = DecideStepBoundary(
        step + 1, job.steps, job.checkpoint_every,
        StepOrders{options.generation, requests[0], requests[1]}, &satisfied_request);
    if (boundary.save) {
      const absl::Time pause_start = absl::Now();
      std::vector<char> bytes = saver.TakeBuffer();
      SHARD_RETURN_IF_ERROR(engine->CopyOwnedState(&bytes));
      SavedShard saved;
      saved.id = CheckpointIdForStep(step + 1, options.checkpoint_tag);
      saved.dir = CheckpointDirectory(job.checkpoint_dir, job.name, saved.id);
      saved.step = step + 1;
      saved.request = boundary.request;
      saved.rank = rank;
      saved.plan = engine->plan_pointer();
      saved.plan_version = engine->plan_version();
      saved.counters = engine->counters();
      saved.pause_ms = absl::ToDoubleMilliseconds(absl::Now() - pause_start);
      result.max_checkpoint_pause_ms = std::max(result.max_checkpoint_pause_ms, saved.pause_ms);
      ++result.checkpoints_saved;
      record.checkpoint_pause_ms = saved.pause_ms;
      saver.Start(std::move(saved), world, std::move(bytes));
    }
    if (options.on_step) options.on_step(record);
    if (boundary.pause) {
      saver.WaitIdle();  // the shard must be reported before the world re-forms from it
      result.paused_at = step + 1;
      return result;
    }
  }
  saver.WaitIdle();
  if (job.steps - start_step > 1) {
    result.steps_per_second =
        (job.steps - start_step - 1) / absl::ToDoubleSeconds(absl::Now() - steady_start);
    result.hidden_fraction = reduction_ms > 0 ? hidden_ms / reduction_ms : 0;
  }
  result.optimizer_state_bytes = engine->optimizer_state_bytes();
  if (options.consolidate_to_rank >= 0) {
    if (absl::Status consolidated =
            engine->ConsolidateStateDict(options.consolidate_to_rank, options.consolidate_path);
        !consolidated.ok()) {
      return consolidated;
    }
  }
  if (rank == 0) {
    SHARD_RETURN_IF_ERROR(MakeDirectories(job.output_dir));
    result.output_path = (std::filesystem::path(job.output_dir) / "final.safetensors").string();
    SHARD_RETURN_IF_ERROR(WriteParameters(*engine, result.output_path));
  }
  return result;
}

}  // namespace shard
