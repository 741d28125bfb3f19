#include "worker/dataplane/trainer.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/mlp.h"
#include "common/fault.h"
#include "common/mlp_data.h"
#include "common/status_macros.h"

namespace shard {

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
  SHARD_ASSIGN_OR_RETURN(std::unique_ptr<TrainingSession> session,
                         TrainingSession::Create(job, MlpManifest(job.widths), communicator,
                                                 plans, options));
  Device& device = session->device();
  Engine& engine = session->engine();
  SHARD_ASSIGN_OR_RETURN(const DataType precision, ParsePrecision(job.precision));
  const int64_t rows = job.global_batch / world;
  const int micro = job.micro_batches;
  if (rows % micro != 0) {
    return absl::InvalidArgumentError(absl::StrCat(rows, " samples per rank do not split into ",
                                                   micro, " micro-batches"));
  }
  // Accumulation adds gradients on the host (a GPU's would need a kernel of their own).
  if (micro > 1 && !device.host_memory()) {
    return absl::UnimplementedError(
        absl::StrCat("micro_batches ", micro, " needs a CPU worker for the built-in MLP"));
  }
  const int64_t micro_rows = rows / micro;
  SHARD_ASSIGN_OR_RETURN(std::unique_ptr<MlpRunner> model,
                         device.CreateMlp(job.widths, micro_rows, precision));
  if (!session->restored()) {
    SHARD_ASSIGN_OR_RETURN(const bool loaded, session->LoadInitFile());
    if (!loaded) {
      // torch.nn.Linear's default from the job's seed: the same on every rank, so nothing is
      // broadcast, and one parameter at a time (at stage 3 no rank holds the whole model).
      SHARD_RETURN_IF_ERROR(ForEachInitialMlpParameter(
          job.widths, job.seed, [&](int index, const std::vector<float>& values) {
            return engine.SetParamValues(index, values.data(), /*same_on_every_rank=*/true);
          }));
    }
  }

  const Manifest& manifest = engine.manifest();
  const int parameters = static_cast<int>(manifest.params.size());
  std::vector<float> x;
  std::vector<int64_t> y;
  std::vector<const float*> params(parameters);
  std::vector<float*> grads(parameters);
  // Micro-batches but the last: their gradients (overwritten by each backward) and their sum,
  // which the last one's backward adds as each gradient completes.
  std::vector<std::vector<float>> micro_grads, summed;
  std::vector<float*> micro_grad_pointers(parameters);
  if (micro > 1) {
    for (int i = 0; i < parameters; ++i) {
      micro_grads.emplace_back(manifest.params[i].numel());
      summed.emplace_back(manifest.params[i].numel());
      micro_grad_pointers[i] = micro_grads.back().data();
    }
  }
  const int64_t inputs = job.widths.front();
  const float scale = 1.0f / static_cast<float>(job.global_batch);
  // Parameters on demand (ZeRO-3, overlapParamGather): each layer's weight and bias are
  // acquired just before the layer runs, with the buffers backward writes into (but for the
  // micro-batches that accumulate on the host), and released when the next layer takes over.
  int held_layer = -1;
  bool into_engine_grads = false;
  const auto release_held = [&] {
    if (held_layer < 0) return;
    engine.Release(Mlp::WeightIndex(held_layer));
    engine.Release(Mlp::BiasIndex(held_layer));
    held_layer = -1;
  };
  LayerHook before_layer;
  if (engine.gathers_on_demand()) {
    before_layer = [&](int layer, bool backward) -> absl::Status {
      release_held();
      for (int index : {Mlp::WeightIndex(layer), Mlp::BiasIndex(layer)}) {
        SHARD_RETURN_IF_ERROR(engine.Acquire(index));
        params[index] = engine.param(index);
        if (backward && into_engine_grads) {
          SHARD_ASSIGN_OR_RETURN(grads[index], engine.AcquireGrad(index));
        }
      }
      held_layer = layer;
      return absl::OkStatus();
    };
  }
  while (!session->finished()) {
    const int64_t step = session->next_step();
    BeforeTrainingStep(step + 1);
    if (session->stop_requested()) {
      return absl::CancelledError(absl::StrCat("training stopped before step ", step + 1));
    }
    const absl::Time start = absl::Now();
    SHARD_RETURN_IF_ERROR(data->Read(step, job.global_batch, rank, world, &x, &y));
    for (int i = 0; i < parameters; ++i) {
      params[i] = engine.param(i);
      grads[i] = engine.grad(i);
    }
    // A bad label surfaces at Forward on the host, at LossSum on a GPU.
    auto in_data = [&](const absl::Status& status) {
      return absl::Status(status.code(), absl::StrCat("data file '", job.data_path, "', step ",
                                                      step + 1, ": ", status.message()));
    };
    engine.StartBackward();
    const float loss_factor = scale * engine.loss_scale();
    double loss_sum = 0;
    for (auto& sum : summed) std::fill(sum.begin(), sum.end(), 0.0f);
    for (int m = 0; m < micro; ++m) {
      const float* micro_x = x.data() + m * micro_rows * inputs;
      const int64_t* micro_y = y.data() + m * micro_rows;
      absl::Status forward = model->Forward(params, micro_x, micro_y, micro_rows, before_layer);
      release_held();
      if (!forward.ok()) return in_data(forward);
      into_engine_grads = m + 1 == micro;
      if (m + 1 < micro) {
        SHARD_RETURN_IF_ERROR(model->Backward(params, micro_grad_pointers, loss_factor,
                                              [](int /*index*/) {}, before_layer));
        release_held();
        for (int i = 0; i < parameters; ++i) {
          for (size_t k = 0; k < summed[i].size(); ++k) summed[i][k] += micro_grads[i][k];
        }
        absl::StatusOr<double> micro_loss = model->LossSum();
        if (!micro_loss.ok()) return in_data(micro_loss.status());
        loss_sum += *micro_loss;
      } else {
        SHARD_RETURN_IF_ERROR(model->Backward(params, grads, loss_factor, [&](int index) {
          if (micro > 1) {
            for (size_t k = 0; k < summed[index].size(); ++k) grads[index][k] += summed[index][k];
          }
          engine.MarkGradReady(index);
        }, before_layer));
        release_held();
      }
    }
    StepTimings timings;
    SHARD_RETURN_IF_ERROR(engine.Step(&timings));
    // The last micro-batch's loss after the step: on a GPU, reading it waits for the device.
    absl::StatusOr<double> last_loss = model->LossSum();
    if (!last_loss.ok()) return in_data(last_loss.status());
    loss_sum += *last_loss;
    // This rank's share of the global mean loss: its part of the sum over the global batch.
    SHARD_ASSIGN_OR_RETURN(
        const TrainingSession::Boundary boundary,
        session->EndStep(loss_sum / static_cast<double>(job.global_batch), timings, start));
    if (boundary == TrainingSession::Boundary::kPaused) return session->result();
  }
  return session->Finish();
}

}  // namespace shard
