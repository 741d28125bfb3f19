// libshard's C functions (capi/shard.h) over the worker library: a WorkerAgent on its own thread
// joins, heartbeats and connects each generation, then hands it over (GenerationHandoff) to the
// caller's thread, which trains it through a TrainingSession, the path shard-worker's built-in
// MLP takes too. Errors become codes plus a thread-local message here and nowhere else.
#include "capi/shard.h"

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/checkpoint.h"
#include "common/cli.h"
#include "common/logging.h"
#include "common/manifest.h"
#include "common/names.h"
#include "common/status_macros.h"
#include "dlpack/dlpack.h"
#include "google/protobuf/util/json_util.h"
#include "nlohmann/json.hpp"
#include "proto/channel_security.h"
#include "proto/job_convert.h"
#include "shard/config.h"
#include "spdlog/spdlog.h"
#include "worker/agent.h"
#include "worker/coordinator_client.h"
#include "worker/data_path.h"
#include "worker/generation_handoff.h"
#if SHARD_HAVE_CUDA
#include "worker/gpu/gpu_data_path.h"
#endif

struct shard_job {
  shard::GenerationHandoff handoff;
  std::unique_ptr<shard::WorkerAgent> agent;
  std::thread agent_thread;
  std::string worker_id;

  // The generation taken from the handoff and not yet returned, and its session.
  std::optional<shard::GenerationHandoff::Generation> generation;
  std::unique_ptr<shard::TrainingSession> session;
  std::optional<shard::Manifest> manifest;
  // The script's own optimizer (shard_job_set_optimizer): its class and per-element state.
  std::optional<shard::OptimizerStateKind> torch_optimizer;
  std::vector<shard::OwnedRange> ranges;  // shard_updated_ranges's, at layout_version
  std::string ranges_json;
  std::string layout_json;  // shard_param_layout's answer
  shard_extras_fn extras_callback = nullptr;
  void* extras_context = nullptr;
  // shard_put_extra's, while the callback runs (null otherwise).
  std::vector<std::pair<int, std::string>>* put_extras = nullptr;
  std::string sent_bytes;  // shard_gather_extra's answer
  absl::Time update_started;  // shard_step_reduce's return, for the step's optimizer time
  int64_t layout_version = 0;
  int64_t plan_version = 0;  // the engine's, when the layout was last counted
  shard::StepTimings timings;
  absl::Time step_started;
  std::string info;         // shard_job_info's answer
  std::string output_path;  // shard_generation_end's
  int gpu = -1;             // N of device cuda:N, -1 on the host
  uintptr_t stream = 0;     // the caller's CUDA stream (shard_set_stream)
  // What went wrong in shard_mark_ready or shard_mark_bucket_ready, which return nothing: the
  // step reports it.
  absl::Mutex mark_mu;
  absl::Status mark_failure ABSL_GUARDED_BY(mark_mu);
};

namespace {

thread_local std::string last_error;

int Fail(const absl::Status& status) {
  last_error = std::string(status.message());
  return status.ok() ? static_cast<int>(absl::StatusCode::kUnknown) : static_cast<int>(status.code());
}

int Done(const absl::Status& status) {
  if (status.ok()) {
    last_error.clear();
    return 0;
  }
  return Fail(status);
}

// Runs `body`, turning an exception that escapes it into an error: none crosses the C boundary.
template <typename Body>
int Guarded(Body body) {
  try {
    return Done(body());
  } catch (const std::exception& e) {
    return Fail(absl::InternalError(absl::StrCat("libshard: unexpected exception: ", e.what())));
  } catch (...) {
    return Fail(absl::InternalError("libshard: unexpected exception"));
  }
}

absl::Status NeedsJob(shard_job* job) {
  return job != nullptr ? absl::OkStatus()
                        : absl::InvalidArgumentError("no job: call shard_join first");
}

absl::Status NeedsSession(shard_job* job) {
  SHARD_RETURN_IF_ERROR(NeedsJob(job));
  if (job->session == nullptr) {
    return absl::FailedPreconditionError(
        "no generation is being trained: call shard_generation_begin first");
  }
  return absl::OkStatus();
}

// A call that reads what the caller wrote into the tensors first orders Shard's device work
// after the caller's stream; one that wrote them orders the caller's stream after it on the
// way out (events on a GPU, no host wait; nothing on the host).
absl::Status AfterCaller(shard_job* job) {
  return job->session->device().WaitForStream(job->stream);
}
absl::Status BeforeCaller(shard_job* job) {
  return job->session->device().MakeStreamWait(job->stream);
}

// What went wrong marking gradients ready, for the step to report (the first of it):
// shard_mark_ready and shard_mark_bucket_ready return nothing.
void KeepMarkFailure(shard_job* job, absl::Status failure) {
  absl::MutexLock lock(&job->mark_mu);
  if (job->mark_failure.ok()) job->mark_failure = std::move(failure);
}

// Before gradients are marked ready: Shard's device work sees what the caller wrote. (The
// engine averages them over the ranks: EngineOptions::average_gradients.)
bool GradientsWritten(shard_job* job) {
  absl::Status ordered = AfterCaller(job);
  if (ordered.ok()) return true;
  KeepMarkFailure(job, std::move(ordered));
  return false;
}

// A step's gradients are all marked (or shard_mark_ready found something wrong).
absl::Status StepReady(shard_job* job) {
  SHARD_RETURN_IF_ERROR(NeedsSession(job));
  absl::MutexLock lock(&job->mark_mu);
  return job->mark_failure;
}

// The first step of a generation that started from scratch rebuilds the buckets: the views
// move.
void CountLayout(shard_job* job) {
  const int64_t version = job->session->engine().plan_version();
  if (version != job->plan_version) {
    job->plan_version = version;
    ++job->layout_version;
  }
}

// A config field of the expected JSON type, or InvalidArgument naming it.
template <typename T>
absl::Status Read(const nlohmann::json& config, const char* key, T* out) {
  auto it = config.find(key);
  if (it == config.end() || it->is_null()) return absl::OkStatus();
  try {
    *out = it->get<T>();
  } catch (const nlohmann::json::exception&) {
    return absl::InvalidArgumentError(
        absl::StrCat("shard_join: config field \"", key, "\" has the wrong type (", it->dump(), ")"));
  }
  return absl::OkStatus();
}

absl::Status Join(const char* config_json, shard_job** out) {
  if (out == nullptr) return absl::InvalidArgumentError("shard_join: no place for the job");
  *out = nullptr;
  if (config_json == nullptr) return absl::InvalidArgumentError("shard_join: no config");
  const nlohmann::json config = nlohmann::json::parse(config_json, nullptr, false);
  if (!config.is_object()) {
    return absl::InvalidArgumentError("shard_join: the config is not a JSON object");
  }
  static const char* const kKnown[] = {
      "coordinator", "worker_id", "host", "device", "backend", "transport", "coordinator_timeout_s",
      "collective_timeout_s", "log_level", "tls_ca", "tls_cert", "tls_key", "tls_server_name",
      "job_token_file"};
  for (const auto& [key, value] : config.items()) {
    if (std::find(std::begin(kKnown), std::end(kKnown), key) == std::end(kKnown)) {
      return absl::InvalidArgumentError(absl::StrCat("shard_join: unknown config field \"", key,
                                                     "\""));
    }
  }
  std::string coordinator;
  shard::WorkerOptions options;
  double coordinator_timeout_s = 60;
  double collective_timeout_s = 60;
  std::string log_level = "info";
  std::string backend = "auto";
  std::string transport = "auto";
  shard::ClientSecurityFiles files;
  SHARD_RETURN_IF_ERROR(Read(config, "coordinator", &coordinator));
  SHARD_RETURN_IF_ERROR(Read(config, "worker_id", &options.worker_id));
  SHARD_RETURN_IF_ERROR(Read(config, "host", &options.host));
  SHARD_RETURN_IF_ERROR(Read(config, "device", &options.device));
  SHARD_RETURN_IF_ERROR(Read(config, "backend", &backend));
  SHARD_RETURN_IF_ERROR(Read(config, "transport", &transport));
  SHARD_RETURN_IF_ERROR(Read(config, "coordinator_timeout_s", &coordinator_timeout_s));
  SHARD_RETURN_IF_ERROR(Read(config, "collective_timeout_s", &collective_timeout_s));
  SHARD_RETURN_IF_ERROR(Read(config, "log_level", &log_level));
  SHARD_RETURN_IF_ERROR(Read(config, "tls_ca", &files.ca));
  SHARD_RETURN_IF_ERROR(Read(config, "tls_cert", &files.cert));
  SHARD_RETURN_IF_ERROR(Read(config, "tls_key", &files.key));
  SHARD_RETURN_IF_ERROR(Read(config, "tls_server_name", &files.server_name));
  SHARD_RETURN_IF_ERROR(Read(config, "job_token_file", &files.token));
  if (coordinator.empty()) {
    return absl::InvalidArgumentError(
        "shard_join: no coordinator address (\"coordinator\": \"host:port\", or "
        "SHARD_COORDINATOR in the shard package)");
  }
  SHARD_RETURN_IF_ERROR(shard::ValidateName("worker id", options.worker_id));
  if (!(coordinator_timeout_s > 0) || !(collective_timeout_s > 0)) {
    return absl::InvalidArgumentError("shard_join: timeouts must be positive seconds");
  }
  int gpu = -1;
  SHARD_ASSIGN_OR_RETURN([[maybe_unused]] const std::string resolved,
                         shard::ResolveBackend(options.device, backend, &gpu));
#if !SHARD_HAVE_CUDA
  if (gpu >= 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "shard_join: device ", options.device,
        " needs a libshard built with CUDA and NCCL; this one was built without "
        "(SHARD_WITH_CUDA=OFF or no CUDA toolkit found): use device cpu"));
  }
#endif
  SHARD_RETURN_IF_ERROR(
      shard::ConfigureLogging(log_level, absl::StrCat("worker=", options.worker_id)));
  SHARD_ASSIGN_OR_RETURN(const shard::ClientSecurity security, shard::LoadClientSecurity(files));
  options.coordinator_timeout = absl::Seconds(coordinator_timeout_s);
  options.collective_timeout = absl::Seconds(collective_timeout_s);

  SHARD_ASSIGN_OR_RETURN(const shard::HostTransport host_transport,
                         shard::ParseHostTransport(transport));
  options.snapshot_same_host = host_transport != shard::HostTransport::kTcp;
  const shard::HostPathOptions host_path{.host = options.host,
                                         .timeout = options.collective_timeout,
                                         .transport = host_transport};
  absl::StatusOr<std::unique_ptr<shard::DataPath>> data_path = shard::CpuDataPath(host_path);
#if SHARD_HAVE_CUDA
  if (gpu >= 0) data_path = shard::GpuDataPath(gpu, resolved, host_path);
#endif
  SHARD_RETURN_IF_ERROR(data_path.status());

  auto job = std::make_unique<shard_job>();
  job->worker_id = options.worker_id;
  job->gpu = gpu;
  shard_job* raw = job.get();
  options.trainer = [raw](const shard::JobConfig& config, shard::Communicator& communicator,
                          shard::PlanProvider& plans, const shard::TrainerOptions& trainer) {
    return raw->handoff.Train(config, communicator, plans, trainer);
  };
  job->agent = std::make_unique<shard::WorkerAgent>(
      std::move(options),
      std::make_unique<shard::CoordinatorClient>(coordinator, absl::Seconds(10), security),
      std::move(*data_path));
  job->agent_thread = std::thread([raw] {
    const absl::Status ran = raw->agent->Run();
    if (!ran.ok()) spdlog::error("{}", ran.message());
    raw->handoff.Close(ran);
  });
  // Joined once the first generation is handed over.
  absl::StatusOr<std::optional<shard::GenerationHandoff::Generation>> first = job->handoff.Next();
  absl::Status joined = first.status();
  if (joined.ok() && !first->has_value()) {
    joined = absl::FailedPreconditionError(
        "the job ended before this worker was given a rank (it had finished or was stopped)");
  }
  if (!joined.ok()) {
    shard_job_close(job.release());
    return joined;
  }
  job->generation = **first;
  *out = job.release();
  return absl::OkStatus();
}

// Hands the generation back with `result` and drops its session first: the agent replaces the
// communicator the engine's thread uses once it has it back.
void Return(shard_job* job, absl::StatusOr<shard::TrainResult> result) {
  job->session.reset();
  job->generation.reset();
  job->handoff.Return(std::move(result));
}

// The job spec's optimizer with the script's declaration: a "torch" one needs it, a built-in
// one refuses it (a script that brings an optimizer the job would not run).
absl::Status WithScriptOptimizer(const shard_job* job, shard::OptimizerConfig* optimizer) {
  const bool torch = optimizer->kind == shard::OptimizerKind::kTorch;
  if (torch && !job->torch_optimizer.has_value()) {
    return absl::FailedPreconditionError(
        "the job spec's optimizer is \"torch\", the training script's own: create it with "
        "engine.optimizer(torch.optim.X, ...) (shard_job_set_optimizer) before job.steps()");
  }
  if (!torch && job->torch_optimizer.has_value()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the script brings its own optimizer (", job->torch_optimizer->torch_class,
        ") but the job spec runs the built-in ", shard::OptimizerKindName(optimizer->kind),
        ": set \"optimizer\": {\"name\": \"torch\"} in the job spec, or drop "
        "engine.optimizer(...)"));
  }
  if (torch) {
    optimizer->torch_class = job->torch_optimizer->torch_class;
    optimizer->torch_state = job->torch_optimizer->names;
  }
  return absl::OkStatus();
}

// The session's extras provider: the script's callback hands them over through shard_put_extra.
absl::StatusOr<std::vector<std::pair<int, std::string>>> CollectExtras(shard_job* job) {
  std::vector<std::pair<int, std::string>> extras;
  if (job->extras_callback == nullptr) return extras;
  job->put_extras = &extras;
  const int failed = job->extras_callback(job->extras_context);
  job->put_extras = nullptr;
  if (failed != 0) {
    return absl::InternalError(
        "the training script could not hand over its optimizer's state for the save (its "
        "extras callback failed)");
  }
  return extras;
}

absl::Status BeginGeneration(shard_job* job, int* began, int* needs_init) {
  SHARD_RETURN_IF_ERROR(NeedsJob(job));
  if (began == nullptr || needs_init == nullptr) {
    return absl::InvalidArgumentError("shard_generation_begin: null output");
  }
  if (job->session != nullptr) {
    return absl::FailedPreconditionError(
        "a generation is being trained: end it with shard_generation_end first");
  }
  if (!job->manifest.has_value()) {
    return absl::FailedPreconditionError(
        "no model registered: call shard_job_set_model (job.wrap(model)) first");
  }
  *began = 0;
  *needs_init = 0;
  while (true) {
    if (!job->generation.has_value()) {
      SHARD_ASSIGN_OR_RETURN(std::optional<shard::GenerationHandoff::Generation> next,
                             job->handoff.Next());
      if (!next.has_value()) return absl::OkStatus();  // the job is over
      job->generation = *next;
    }
    const shard::GenerationHandoff::Generation& generation = *job->generation;
    shard::JobConfig config = *generation.job;
    SHARD_RETURN_IF_ERROR(WithScriptOptimizer(job, &config.optimizer));
    // A failure here ends this generation; the agent says whether there is a next one (the
    // world moved on) or the job fails (then Next answers with the error).
    absl::StatusOr<std::unique_ptr<shard::TrainingSession>> session =
        shard::TrainingSession::Create(config, *job->manifest, *generation.communicator,
                                       *generation.plans, *generation.options);
    if (!session.ok()) {
      Return(job, session.status());
      continue;
    }
    job->session = std::move(*session);
    job->session->SetExtrasProvider([job] { return CollectExtras(job); });
    bool loaded = job->session->restored();
    if (!loaded) {
      absl::StatusOr<bool> init = job->session->LoadInitFile();
      if (!init.ok()) {
        Return(job, init.status());
        continue;
      }
      loaded = *init;
    }
    if (absl::Status ordered = BeforeCaller(job); !ordered.ok()) {
      Return(job, ordered);
      continue;
    }
    *began = 1;
    *needs_init = loaded ? 0 : 1;
    ++job->layout_version;
    job->plan_version = job->session->engine().plan_version();
    return absl::OkStatus();
  }
}

absl::Status StepBegin(shard_job* job, int64_t* step) {
  SHARD_RETURN_IF_ERROR(NeedsSession(job));
  if (step == nullptr) return absl::InvalidArgumentError("shard_step_begin: null output");
  shard::TrainingSession& session = *job->session;
  if (session.finished()) {
    *step = -1;
    return absl::OkStatus();
  }
  if (session.stop_requested()) {
    return absl::CancelledError(
        absl::StrCat("training stopped before step ", session.next_step() + 1));
  }
  shard::Engine& engine = session.engine();
  SHARD_RETURN_IF_ERROR(AfterCaller(job));
  SHARD_RETURN_IF_ERROR(engine.ZeroGradients());
  SHARD_RETURN_IF_ERROR(BeforeCaller(job));
  {
    absl::MutexLock lock(&job->mark_mu);
    job->mark_failure = absl::OkStatus();
  }
  engine.StartBackward();
  job->timings = shard::StepTimings{};
  job->step_started = absl::Now();
  *step = session.next_step();
  return absl::OkStatus();
}

// How the generation ended, for the agent: the script's error (`code`), the pause, or the
// last step's export.
absl::StatusOr<shard::TrainResult> GenerationResult(shard_job* job, int code,
                                                    const char* message) {
  if (code != 0) {
    return absl::Status(static_cast<absl::StatusCode>(code),
                        message != nullptr ? message : "the training loop failed");
  }
  SHARD_RETURN_IF_ERROR(NeedsSession(job));
  shard::TrainingSession& session = *job->session;
  SHARD_RETURN_IF_ERROR(AfterCaller(job));  // the export reads the parameters
  if (session.result().paused_at > 0) return session.result();
  if (!session.finished()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the generation ended neither paused nor finished (step ", session.next_step(), " of ",
        session.job().steps, "): end it with the error that stopped it"));
  }
  return session.Finish();
}

absl::Status GenerationEnd(shard_job* job, int code, const char* message,
                           const char** output_path) {
  SHARD_RETURN_IF_ERROR(NeedsJob(job));
  if (!job->generation.has_value()) {
    return absl::FailedPreconditionError(
        "no generation to end: shard_generation_begin did not begin one");
  }
  job->output_path.clear();
  if (output_path != nullptr) *output_path = "";
  // The agent waits for the generation: every way out hands it back, once (an exception's
  // with this error).
  absl::StatusOr<shard::TrainResult> result =
      absl::InternalError("libshard: unexpected exception ending the generation");
  absl::Cleanup hand_back = [&] { Return(job, std::move(result)); };
  result = GenerationResult(job, code, message);
  if (result.ok()) {
    job->output_path = result->output_path;
    if (output_path != nullptr) *output_path = job->output_path.c_str();
  }
  return code != 0 ? absl::OkStatus() : result.status();
}

// A DLPack tensor over one of the engine's arrays: the descriptor and its shape are ours to
// free, the memory stays the engine's.
struct DlpackView {
  DLManagedTensor managed;
  std::vector<int64_t> shape;
};

void DeleteDlpackView(DLManagedTensor* managed) {
  delete static_cast<DlpackView*>(managed->manager_ctx);
}

// A DLPack descriptor over `data`, compact fp32 of `shape`, on the job's device.
DLManagedTensor* MakeDlpack(const shard_job* job, float* data, std::vector<int64_t> shape) {
  auto view = std::make_unique<DlpackView>();
  view->shape = std::move(shape);
  DLTensor& tensor = view->managed.dl_tensor;
  tensor.data = data;
  tensor.device = job->gpu >= 0 ? DLDevice{kDLCUDA, job->gpu} : DLDevice{kDLCPU, 0};
  tensor.ndim = static_cast<int>(view->shape.size());
  tensor.dtype = DLDataType{kDLFloat, 32, 1};
  tensor.shape = view->shape.data();
  tensor.strides = nullptr;  // compact, row-major
  tensor.byte_offset = 0;
  view->managed.manager_ctx = view.get();
  view->managed.deleter = &DeleteDlpackView;
  return &view.release()->managed;
}

absl::Status TensorDlpack(shard_job* job, int index, int grad, DLManagedTensor** out) {
  SHARD_RETURN_IF_ERROR(NeedsSession(job));
  if (out == nullptr) return absl::InvalidArgumentError("shard_tensor_dlpack: null output");
  shard::Engine& engine = job->session->engine();
  const shard::Manifest& manifest = engine.manifest();
  if (index < 0 || index >= static_cast<int>(manifest.params.size())) {
    return absl::OutOfRangeError(absl::StrCat("tensor index ", index, " is not in [0, ",
                                              manifest.params.size(), ")"));
  }
  float* data = grad ? engine.grad(index) : engine.param(index);
  if (data == nullptr && (grad == 0 || engine.gathers_on_demand())) {
    return absl::FailedPreconditionError(absl::StrCat(
        manifest.params[index].name, " is sharded (ZeRO stage 3): acquire its bucket "
        "(shard_param_layout, shard_acquire)"));
  }
  if (data == nullptr) {
    return absl::NotFoundError(
        absl::StrCat(manifest.params[index].name, " is frozen: it has no gradient"));
  }
  *out = MakeDlpack(job, data, manifest.params[index].shape);
  return absl::OkStatus();
}

absl::Status RangeDlpack(shard_job* job, int range, int array, DLManagedTensor** out) {
  SHARD_RETURN_IF_ERROR(NeedsSession(job));
  if (out == nullptr) return absl::InvalidArgumentError("shard_range_dlpack: null output");
  shard::Engine& engine = job->session->engine();
  if (range < 0 || range >= static_cast<int>(job->ranges.size())) {
    return absl::OutOfRangeError(absl::StrCat(
        "range ", range, " is not in [0, ", job->ranges.size(),
        "): ask shard_updated_ranges again after the layout version changed"));
  }
  const int states = static_cast<int>(engine.optimizer_state_names().size());
  if (array < -2 || array >= states) {
    return absl::OutOfRangeError(absl::StrCat("array ", array, " is not -2 (the gradient), -1 "
                                              "(the values) or a state tensor in [0, ", states, ")"));
  }
  const shard::OwnedRange& owned = job->ranges[range];
  float* data = array == -2 ? engine.RangeGrad(owned) : engine.RangeData(owned, array);
  *out = MakeDlpack(job, data, {owned.numel});
  return absl::OkStatus();
}

absl::Status ParamLayout(shard_job* job, const char** json) {
  SHARD_RETURN_IF_ERROR(NeedsSession(job));
  if (json == nullptr) return absl::InvalidArgumentError("shard_param_layout: null output");
  const shard::Plan& plan = job->session->engine().plan();
  nlohmann::json buckets = nlohmann::json::array();
  for (const shard::Bucket& bucket : plan.buckets) buckets.push_back(bucket.padded_numel);
  nlohmann::json params = nlohmann::json::array();
  for (const shard::ParamLocation& location : plan.locations) {
    params.push_back({location.bucket, location.offset});
  }
  job->layout_json = nlohmann::json{{"buckets", buckets},
                                    {"params", params},
                                    {"final", job->session->engine().buckets_final()}}
                         .dump();
  *json = job->layout_json.c_str();
  return absl::OkStatus();
}

absl::Status Acquire(shard_job* job, int bucket, int grad, DLManagedTensor** out) {
  SHARD_RETURN_IF_ERROR(NeedsSession(job));
  if (out == nullptr) return absl::InvalidArgumentError("shard_acquire: null output");
  shard::Engine& engine = job->session->engine();
  if (bucket < 0 || bucket >= static_cast<int>(engine.plan().buckets.size())) {
    return absl::OutOfRangeError(absl::StrCat(
        "bucket ", bucket, " is not in [0, ", engine.plan().buckets.size(),
        "): ask shard_param_layout again after the layout version changed"));
  }
  SHARD_RETURN_IF_ERROR(AfterCaller(job));  // a zeroed or refilled buffer the caller used
  SHARD_ASSIGN_OR_RETURN(float* data,
                         grad ? engine.AcquireGradBucket(bucket) : engine.AcquireBucket(bucket));
  SHARD_RETURN_IF_ERROR(BeforeCaller(job));
  *out = MakeDlpack(job, data, {engine.plan().buckets[bucket].padded_numel});
  return absl::OkStatus();
}

absl::Status SetInitial(shard_job* job, int index, const float* values) {
  SHARD_RETURN_IF_ERROR(NeedsSession(job));
  shard::Engine& engine = job->session->engine();
  if (index < 0 || index >= static_cast<int>(engine.manifest().params.size()) ||
      values == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("shard_set_initial: tensor ", index, " of ",
                                                   engine.manifest().params.size(),
                                                   ", or no values"));
  }
  SHARD_RETURN_IF_ERROR(AfterCaller(job));
  return engine.SetParamValues(index, values);
}

absl::Status UpdatedRanges(shard_job* job, const char** json) {
  SHARD_RETURN_IF_ERROR(NeedsSession(job));
  if (json == nullptr) return absl::InvalidArgumentError("shard_updated_ranges: null output");
  shard::Engine& engine = job->session->engine();
  job->ranges = engine.UpdatedRanges();
  nlohmann::json ranges = nlohmann::json::array();
  for (const shard::OwnedRange& range : job->ranges) {
    ranges.push_back({{"param", range.param},
                      {"offset", range.param_offset},
                      {"numel", range.numel},
                      {"extras", range.param_offset == 0 && engine.SavesExtrasOf(range.param)}});
  }
  job->ranges_json = ranges.dump();
  *json = job->ranges_json.c_str();
  return absl::OkStatus();
}

}  // namespace

extern "C" {

const char* shard_last_error(void) { return last_error.c_str(); }

int shard_join(const char* config_json, shard_job** job) {
  return Guarded([&] { return Join(config_json, job); });
}

int shard_job_info(shard_job* job, const char** json) {
  return Guarded([&]() -> absl::Status {
    SHARD_RETURN_IF_ERROR(NeedsJob(job));
    if (json == nullptr) return absl::InvalidArgumentError("shard_job_info: null output");
    nlohmann::json info = {{"worker_id", job->worker_id}};
    if (job->generation.has_value()) {
      const shard::GenerationHandoff::Generation& generation = *job->generation;
      info["rank"] = generation.communicator->rank();
      info["world_size"] = generation.communicator->size();
      info["generation"] = generation.options->generation;
      std::string spec;
      google::protobuf::util::JsonPrintOptions print;
      print.preserve_proto_field_names = true;
      const auto printed =
          google::protobuf::util::MessageToJsonString(shard::ToProto(*generation.job), &spec, print);
      if (!printed.ok()) return absl::InternalError(printed.message().as_string());
      info["job"] = nlohmann::json::parse(spec);
    }
    // The step a generation being trained runs next (after a restore: the one after it).
    if (job->session != nullptr) {
      info["next_step"] = job->session->next_step();
      info["optimizer_step"] = job->session->engine().optimizer_steps();
    }
    job->info = info.dump();
    *json = job->info.c_str();
    return absl::OkStatus();
  });
}

int shard_job_set_optimizer(shard_job* job, const char* optimizer_json) {
  return Guarded([&]() -> absl::Status {
    SHARD_RETURN_IF_ERROR(NeedsJob(job));
    if (job->torch_optimizer.has_value()) {
      return absl::FailedPreconditionError("the optimizer is declared already (once per job)");
    }
    if (job->session != nullptr) {
      return absl::FailedPreconditionError(
          "declare the optimizer before the first generation begins (before job.steps())");
    }
    const nlohmann::json declared =
        nlohmann::json::parse(optimizer_json != nullptr ? optimizer_json : "", nullptr, false);
    shard::OptimizerConfig optimizer;
    optimizer.kind = shard::OptimizerKind::kTorch;
    try {
      optimizer.torch_class = declared.at("class").get<std::string>();
      optimizer.torch_state = declared.at("state").get<std::vector<std::string>>();
    } catch (const nlohmann::json::exception&) {
      return absl::InvalidArgumentError(
          "shard_job_set_optimizer: expected {\"class\": \"...\", \"state\": [names]}");
    }
    if (optimizer.torch_class.empty()) {
      return absl::InvalidArgumentError("shard_job_set_optimizer: the class has no name");
    }
    SHARD_RETURN_IF_ERROR(shard::ValidateOptimizerConfig(optimizer));
    job->torch_optimizer = shard::StateKindOf(optimizer);
    return absl::OkStatus();
  });
}

int shard_job_set_model(shard_job* job, const char* manifest_json) {
  return Guarded([&]() -> absl::Status {
    SHARD_RETURN_IF_ERROR(NeedsJob(job));
    if (job->manifest.has_value()) {
      return absl::FailedPreconditionError("the model is registered already (once per job)");
    }
    if (manifest_json == nullptr) return absl::InvalidArgumentError("no manifest");
    SHARD_ASSIGN_OR_RETURN(shard::Manifest manifest, shard::ParseManifestJson(manifest_json));
    SHARD_RETURN_IF_ERROR(shard::ValidateManifest(manifest));
    for (const shard::ParamSpec& param : manifest.params) {
      if (param.dtype != shard::DataType::kFloat32) {
        return absl::InvalidArgumentError(absl::StrCat(
            "parameter ", param.name, " is ", shard::DataTypeName(param.dtype),
            "; Shard keeps fp32 parameters (convert the model with .float() before wrapping)"));
      }
    }
    job->manifest = std::move(manifest);
    return absl::OkStatus();
  });
}

int shard_generation_begin(shard_job* job, int* began, int* needs_init) {
  return Guarded([&] { return BeginGeneration(job, began, needs_init); });
}

int shard_generation_init(shard_job* job) {
  return Guarded([&]() -> absl::Status {
    SHARD_RETURN_IF_ERROR(NeedsSession(job));
    SHARD_RETURN_IF_ERROR(AfterCaller(job));
    SHARD_RETURN_IF_ERROR(job->session->BroadcastInitialValues());
    return BeforeCaller(job);
  });
}

int shard_tensor_dlpack(shard_job* job, int index, int grad, DLManagedTensor** tensor) {
  return Guarded([&] { return TensorDlpack(job, index, grad, tensor); });
}

int shard_param_layout(shard_job* job, const char** json) {
  return Guarded([&] { return ParamLayout(job, json); });
}

int shard_acquire(shard_job* job, int bucket, int grad, DLManagedTensor** tensor) {
  return Guarded([&] { return Acquire(job, bucket, grad, tensor); });
}

int shard_release(shard_job* job, int bucket) {
  return Guarded([&]() -> absl::Status {
    SHARD_RETURN_IF_ERROR(NeedsSession(job));
    job->session->engine().ReleaseBucket(bucket);
    return absl::OkStatus();
  });
}

int shard_set_initial(shard_job* job, int index, const float* values) {
  return Guarded([&] { return SetInitial(job, index, values); });
}

int shard_set_stream(shard_job* job, uintptr_t stream) {
  return Guarded([&]() -> absl::Status {
    SHARD_RETURN_IF_ERROR(NeedsJob(job));
    if (job->gpu < 0 && stream != 0) {
      return absl::InvalidArgumentError(
          "shard_set_stream: this job trains on the host, which has no streams (pass 0)");
    }
    job->stream = stream;
    return absl::OkStatus();
  });
}

int shard_layout_version(shard_job* job, int64_t* version) {
  return Guarded([&]() -> absl::Status {
    SHARD_RETURN_IF_ERROR(NeedsJob(job));
    if (version == nullptr) return absl::InvalidArgumentError("null output");
    *version = job->layout_version;
    return absl::OkStatus();
  });
}

int shard_broadcast(shard_job* job, int index) {
  return Guarded([&]() -> absl::Status {
    SHARD_RETURN_IF_ERROR(NeedsSession(job));
    shard::Engine& engine = job->session->engine();
    const shard::Manifest& manifest = engine.manifest();
    if (index < 0 || index >= static_cast<int>(manifest.params.size())) {
      return absl::OutOfRangeError(absl::StrCat("tensor index ", index, " is not in [0, ",
                                                manifest.params.size(), ")"));
    }
    const shard::ParamSpec& spec = manifest.params[index];
    if (spec.requires_grad) {
      return absl::InvalidArgumentError(absl::StrCat(
          spec.name, " is trained: its values are the engine's and the same on every rank"));
    }
    SHARD_RETURN_IF_ERROR(AfterCaller(job));
    SHARD_RETURN_IF_ERROR(engine.BroadcastFrozen(index));
    return BeforeCaller(job);
  });
}

int shard_step_begin(shard_job* job, int64_t* step) {
  return Guarded([&] { return StepBegin(job, step); });
}

void shard_mark_ready(shard_job* job, int index) {
  if (job == nullptr || job->session == nullptr) return;
  shard::Engine& engine = job->session->engine();
  const shard::Manifest& manifest = engine.manifest();
  if (index < 0 || index >= static_cast<int>(manifest.params.size())) return;
  if (GradientsWritten(job)) engine.MarkGradReady(index);
}

void shard_mark_bucket_ready(shard_job* job, int bucket) {
  if (job == nullptr || job->session == nullptr) return;
  shard::Engine& engine = job->session->engine();
  const std::vector<shard::Bucket>& buckets = engine.plan().buckets;
  if (bucket < 0 || bucket >= static_cast<int>(buckets.size()) || !engine.buckets_final() ||
      job->session->job().zero_stage >= 3) {
    KeepMarkFailure(job, absl::FailedPreconditionError(absl::StrCat(
                             "shard_mark_bucket_ready(", bucket, "): not a bucket of a final "
                             "layout at stages 0 to 2 (ask shard_param_layout again after the "
                             "layout version changed)")));
    return;
  }
  if (!GradientsWritten(job)) return;
  for (const shard::BucketEntry& entry : buckets[bucket].entries) engine.MarkGradReady(entry.param);
}

int shard_step(shard_job* job) {
  return Guarded([&]() -> absl::Status {
    SHARD_RETURN_IF_ERROR(StepReady(job));
    shard::Engine& engine = job->session->engine();
    if (engine.optimizer_config().kind == shard::OptimizerKind::kTorch) {
      return absl::FailedPreconditionError(
          "this job's optimizer is the script's own: shard_step_reduce, update, "
          "shard_step_finish");
    }
    const absl::Status stepped = engine.Step(&job->timings);
    CountLayout(job);
    SHARD_RETURN_IF_ERROR(stepped);
    return BeforeCaller(job);
  });
}

int shard_step_reduce(shard_job* job, int* update) {
  return Guarded([&]() -> absl::Status {
    SHARD_RETURN_IF_ERROR(StepReady(job));
    if (update == nullptr) return absl::InvalidArgumentError("shard_step_reduce: null output");
    absl::StatusOr<bool> reduced = job->session->engine().ReduceGradients(&job->timings);
    CountLayout(job);
    SHARD_RETURN_IF_ERROR(reduced.status());
    *update = *reduced ? 1 : 0;
    job->update_started = absl::Now();
    return BeforeCaller(job);  // the script's update reads the reduced gradients
  });
}

int shard_step_finish(shard_job* job, int update) {
  return Guarded([&]() -> absl::Status {
    SHARD_RETURN_IF_ERROR(NeedsSession(job));
    job->timings.optimizer_ms = absl::ToDoubleMilliseconds(absl::Now() - job->update_started);
    SHARD_RETURN_IF_ERROR(AfterCaller(job));  // the gather reads what the update wrote
    SHARD_RETURN_IF_ERROR(job->session->engine().EndStep(update != 0, &job->timings));
    return BeforeCaller(job);
  });
}

int shard_updated_ranges(shard_job* job, const char** json) {
  return Guarded([&] { return UpdatedRanges(job, json); });
}

int shard_range_dlpack(shard_job* job, int range, int array, DLManagedTensor** tensor) {
  return Guarded([&] { return RangeDlpack(job, range, array, tensor); });
}

int shard_set_extras_callback(shard_job* job, shard_extras_fn callback, void* context) {
  return Guarded([&]() -> absl::Status {
    SHARD_RETURN_IF_ERROR(NeedsJob(job));
    job->extras_callback = callback;
    job->extras_context = context;
    return absl::OkStatus();
  });
}

int shard_put_extra(shard_job* job, int param, const char* data, size_t size) {
  return Guarded([&]() -> absl::Status {
    SHARD_RETURN_IF_ERROR(NeedsSession(job));
    if (job->put_extras == nullptr) {
      return absl::FailedPreconditionError(
          "shard_put_extra is for the extras callback, while a save collects them");
    }
    const int params = static_cast<int>(job->session->engine().manifest().params.size());
    if (param < -1 || param >= params || (size > 0 && data == nullptr)) {
      return absl::InvalidArgumentError(
          absl::StrCat("shard_put_extra: parameter ", param, " is not -1 or in [0, ", params,
                       "), or no data"));
    }
    for (const auto& [put, bytes] : *job->put_extras) {
      if (put == param) {
        return absl::InvalidArgumentError(
            absl::StrCat("shard_put_extra: parameter ", param, "'s extras were put already"));
      }
    }
    job->put_extras->emplace_back(param, std::string(data != nullptr ? data : "", size));
    return absl::OkStatus();
  });
}

int shard_restored_extra(shard_job* job, int param, const char** data, size_t* size) {
  return Guarded([&]() -> absl::Status {
    SHARD_RETURN_IF_ERROR(NeedsSession(job));
    if (data == nullptr || size == nullptr) {
      return absl::InvalidArgumentError("shard_restored_extra: null output");
    }
    const std::map<int, std::string>& restored = job->session->restored_extras();
    auto it = restored.find(param);
    *data = it == restored.end() ? nullptr : it->second.data();
    *size = it == restored.end() ? 0 : it->second.size();
    return absl::OkStatus();
  });
}

int shard_gather_to_rank(shard_job* job, int param, int array, int to, float* out) {
  return Guarded([&]() -> absl::Status {
    SHARD_RETURN_IF_ERROR(NeedsSession(job));
    if (to < 0 || to >= job->session->communicator().size()) {
      return absl::InvalidArgumentError(absl::StrCat("shard_gather_to_rank: no rank ", to));
    }
    SHARD_RETURN_IF_ERROR(AfterCaller(job));  // the script's update may have written the state
    return job->session->engine().GatherToRank(param, array, to, out);
  });
}

int shard_gather_extra(shard_job* job, int param, int to, const char* data, size_t size,
                       const char** out, size_t* out_size) {
  return Guarded([&]() -> absl::Status {
    SHARD_RETURN_IF_ERROR(NeedsSession(job));
    shard::Engine& engine = job->session->engine();
    const int world = job->session->communicator().size();
    const int params = static_cast<int>(engine.manifest().params.size());
    if (param < 0 || param >= params || to < 0 || to >= world || out == nullptr ||
        out_size == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("shard_gather_extra: parameter ", param, " of ", params, ", rank ", to,
                       " of ", world, ", or a null output"));
    }
    const int from = engine.ExtrasHolder(param);
    if (from < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "shard_gather_extra: ", engine.manifest().params[param].name, " is frozen: no state"));
    }
    const int rank = job->session->communicator().rank();
    job->sent_bytes = rank == from && data != nullptr ? std::string(data, size) : std::string();
    SHARD_RETURN_IF_ERROR(engine.SendBytes(from, to, &job->sent_bytes));
    *out = job->sent_bytes.data();
    *out_size = job->sent_bytes.size();
    return absl::OkStatus();
  });
}

int shard_step_end(shard_job* job, double loss, int* boundary) {
  return Guarded([&]() -> absl::Status {
    SHARD_RETURN_IF_ERROR(NeedsSession(job));
    if (boundary == nullptr) return absl::InvalidArgumentError("shard_step_end: null output");
    shard::TrainingSession& session = *job->session;
    SHARD_RETURN_IF_ERROR(AfterCaller(job));  // a checkpoint may read what the caller wrote
    // The global loss is the mean of the ranks' means: every rank has an equal share.
    SHARD_ASSIGN_OR_RETURN(
        const shard::TrainingSession::Boundary reached,
        session.EndStep(loss / session.communicator().size(), job->timings, job->step_started));
    switch (reached) {
      case shard::TrainingSession::Boundary::kContinue: *boundary = SHARD_CONTINUE; break;
      case shard::TrainingSession::Boundary::kPaused: *boundary = SHARD_PAUSED; break;
      case shard::TrainingSession::Boundary::kFinished: *boundary = SHARD_FINISHED; break;
    }
    return absl::OkStatus();
  });
}

int shard_generation_end(shard_job* job, int code, const char* message, const char** output_path) {
  return Guarded([&] { return GenerationEnd(job, code, message, output_path); });
}

void shard_job_close(shard_job* job) {
  if (job == nullptr) return;
  if (job->session != nullptr || job->generation.has_value()) {
    Return(job, absl::CancelledError("the training script closed the job"));
  }
  job->agent->RequestStop("the training script closed the job");
  job->handoff.Close(absl::CancelledError("the training script closed the job"));
  if (job->agent_thread.joinable()) job->agent_thread.join();
  delete job;
}

}  // extern "C"
