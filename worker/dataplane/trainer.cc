#include "worker/dataplane/trainer.h"

#include "absl/strings/str_cat.h"
#include "common/mlp.h"
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
  SHARD_ASSIGN_OR_RETURN(std::unique_ptr<MlpRunner> model,
                         device.CreateMlp(job.widths, rows, precision));
  if (!session->restored()) {
    SHARD_ASSIGN_OR_RETURN(const bool loaded, session->LoadInitFile());
    if (!loaded) {
      // torch.nn.Linear's default from the job's seed.
      const std::vector<std::vector<float>> values = InitMlpParameters(job.widths, job.seed);
      for (size_t i = 0; i < values.size(); ++i) {
        SHARD_RETURN_IF_ERROR(engine.SetParamValues(static_cast<int>(i), values[i].data()));
      }
      SHARD_RETURN_IF_ERROR(session->BroadcastInitialValues());
    }
  }

  const int parameters = static_cast<int>(engine.manifest().params.size());
  std::vector<float> x;
  std::vector<int64_t> y;
  std::vector<const float*> params(parameters);
  std::vector<float*> grads(parameters);
  const float scale = 1.0f / static_cast<float>(job.global_batch);
  while (!session->finished()) {
    const int64_t step = session->next_step();
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
    if (absl::Status forward = model->Forward(params, x.data(), y.data(), rows); !forward.ok()) {
      return in_data(forward);
    }
    engine.StartBackward();
    SHARD_RETURN_IF_ERROR(model->Backward(params, grads, scale * engine.loss_scale(),
                                          [&engine](int index) { engine.MarkGradReady(index); }));
    StepTimings timings;
    SHARD_RETURN_IF_ERROR(engine.Step(&timings));
    absl::StatusOr<double> loss_sum = model->LossSum();
    if (!loss_sum.ok()) return in_data(loss_sum.status());
    // This rank's share of the global mean loss: its part of the sum over the global batch.
    SHARD_ASSIGN_OR_RETURN(
        const TrainingSession::Boundary boundary,
        session->EndStep(*loss_sum / static_cast<double>(job.global_batch), timings, start));
    if (boundary == TrainingSession::Boundary::kPaused) return session->result();
  }
  return session->Finish();
}

}  // namespace shard
