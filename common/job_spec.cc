#include "common/job_spec.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/names.h"
#include "common/param_groups.h"
#include "common/safetensors.h"
#include "common/status_macros.h"

namespace shard {
namespace {

absl::Status Invalid(absl::string_view field, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat("job spec: ", field, " ", why));
}

}  // namespace

absl::string_view OptimizerKindName(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::kAdam: return "adam";
    case OptimizerKind::kAdamW: return "adamw";
    case OptimizerKind::kSgd: return "sgd";
    case OptimizerKind::kTorch: return "torch";
  }
  return "unknown";
}

std::vector<std::string> OptimizerStateNames(const OptimizerConfig& optimizer) {
  if (optimizer.kind == OptimizerKind::kTorch) return optimizer.torch_state;
  if (optimizer.kind == OptimizerKind::kSgd) {
    return optimizer.momentum > 0 ? std::vector<std::string>{"momentum_buffer"}
                                  : std::vector<std::string>{};
  }
  return {"exp_avg", "exp_avg_sq"};
}

absl::string_view LrDecayName(LrDecay decay) {
  switch (decay) {
    case LrDecay::kConstant: return "constant";
    case LrDecay::kCosine: return "cosine";
    case LrDecay::kLinear: return "linear";
  }
  return "unknown";
}

absl::StatusOr<LrDecay> ParseLrDecay(absl::string_view name) {
  for (LrDecay decay : {LrDecay::kConstant, LrDecay::kCosine, LrDecay::kLinear}) {
    if (name == LrDecayName(decay)) return decay;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("'", name, "' is not a decay; use constant, cosine or linear"));
}

absl::StatusOr<DataType> ParsePrecision(const std::string& precision) {
  if (precision == "fp32") return DataType::kFloat32;
  if (precision == "bf16") return DataType::kBFloat16;
  if (precision == "fp16") return DataType::kFloat16;
  return absl::InvalidArgumentError(absl::StrCat(
      "'", precision, "' is not a precision; use fp32, bf16 or fp16 (16-bit needs GPU workers)"));
}

PlanOptions PlanOptionsForJob(const JobConfig& job) {
  PlanOptions plan;
  plan.world_size = job.world_size;
  plan.mode = job.shard_mode;
  plan.bucket_cap_bytes = job.bucket_cap_bytes;
  plan.first_bucket_cap_bytes = job.first_bucket_cap_bytes;
  plan.min_buckets = job.min_buckets;
  return plan;
}

// The built-in MLP's widths and data file.
absl::Status ValidateMlp(const JobConfig& job) {
  if (job.widths.size() < 2) {
    return Invalid("model.mlp.widths", "needs at least an input and an output width");
  }
  for (size_t i = 0; i < job.widths.size(); ++i) {
    if (job.widths[i] < 1 || job.widths[i] > (int64_t{1} << 24)) {
      return Invalid("model.mlp.widths", absl::StrCat("entry ", i, " is ", job.widths[i],
                                                      "; widths must be in [1, 2^24]"));
    }
  }
  if (job.widths.back() < 2) {
    return Invalid("model.mlp.widths", "needs at least 2 output classes");
  }
  // Each width is bounded, but a layer's weight is the product of two: the model must be a
  // manifest the data path accepts (at most 2^40 elements a parameter).
  if (absl::Status model = ValidateManifest(MlpManifest(job.widths)); !model.ok()) {
    return Invalid("model.mlp.widths", absl::StrCat("describe a model too large to train: ",
                                                    model.message()));
  }
  if (job.data_path.empty()) return Invalid("data.path", "is required");
  return absl::OkStatus();
}

absl::Status ValidateOptimizerConfig(const OptimizerConfig& o) {
  auto invalid = [](absl::string_view field, absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat("optimizer.", field, " ", why));
  };
  if (o.kind == OptimizerKind::kTorch) {
    // The script's optimizer and scheduler hold the hyper-parameters, groups and schedule.
    if (!o.param_groups.empty()) {
      return invalid("param_groups", "are the torch optimizer's own: pass them to "
                                     "engine.optimizer(cls, groups) instead of the job spec");
    }
    if (o.schedule.warmup_steps != 0 || o.schedule.decay != LrDecay::kConstant) {
      return invalid("schedule", "is the script's own with a torch optimizer: use a "
                                 "torch.optim.lr_scheduler on it");
    }
    for (size_t k = 0; k < o.torch_state.size(); ++k) {
      if (o.torch_state[k].empty() ||
          std::count(o.torch_state.begin(), o.torch_state.end(), o.torch_state[k]) != 1) {
        return invalid("torch_state", absl::StrCat("entry ", k, " ('", o.torch_state[k],
                                                   "') is empty or repeated"));
      }
    }
    return absl::OkStatus();
  }
  if (!(o.lr > 0) || !std::isfinite(o.lr)) return invalid("lr", "must be positive");
  if (!(o.beta1 >= 0 && o.beta1 < 1) || !(o.beta2 >= 0 && o.beta2 < 1)) {
    return invalid("betas", "must be two numbers in [0, 1)");
  }
  if (!(o.eps > 0)) return invalid("eps", "must be positive");
  if (!(o.weight_decay >= 0)) return invalid("weight_decay", "must be >= 0");
  if (!(o.momentum >= 0 && o.momentum < 1)) return invalid("momentum", "must be in [0, 1)");
  if (o.nesterov && (o.kind != OptimizerKind::kSgd || o.momentum <= 0)) {
    return invalid("nesterov", "needs sgd with momentum > 0");
  }
  for (size_t g = 0; g < o.param_groups.size(); ++g) {
    const ParamGroup& group = o.param_groups[g];
    const std::string field = absl::StrCat("param_groups[", g, "]");
    if (group.match.empty()) {
      return invalid(absl::StrCat(field, ".match"),
                     "needs at least one parameter name pattern, e.g. \"*.bias\"");
    }
    for (size_t k = 0; k < group.match.size(); ++k) {
      if (group.match[k].empty()) {
        return invalid(absl::StrCat(field, ".match[", k, "]"), "is an empty pattern");
      }
      if (group.match[k].find('\0') != std::string::npos) {
        return invalid(absl::StrCat(field, ".match[", k, "]"), "contains a NUL character");
      }
    }
    if (group.weight_decay.has_value() &&
        !(*group.weight_decay >= 0 && std::isfinite(*group.weight_decay))) {
      return invalid(absl::StrCat(field, ".weight_decay"), "must be a finite number >= 0");
    }
    if (!(group.lr_scale > 0) || !std::isfinite(o.lr * group.lr_scale)) {
      return invalid(absl::StrCat(field, ".lr_scale"),
                     "must be > 0 (and lr x lr_scale finite); default 1");
    }
  }
  const LrSchedule& schedule = o.schedule;
  if (schedule.warmup_steps < 0) return invalid("schedule.warmup_steps", "must be >= 0");
  if (!(schedule.min_lr >= 0 && schedule.min_lr <= o.lr)) {
    return invalid("schedule.min_lr", absl::StrCat("must be in [0, lr = ", o.lr, "]"));
  }
  if (schedule.min_lr != 0 && schedule.decay == LrDecay::kConstant) {
    return invalid("schedule.min_lr", "needs decay cosine or linear (the lr decays to it)");
  }
  if (o.total_steps < 0) return invalid("total_steps", "must be >= 0");
  if (schedule.decay != LrDecay::kConstant && o.total_steps < 1) {
    return invalid("total_steps",
                   absl::StrCat("must be set for decay ", LrDecayName(schedule.decay),
                                " (the job's steps: the decay ends there)"));
  }
  if (o.total_steps > 0 && schedule.warmup_steps > o.total_steps) {
    return invalid("schedule.warmup_steps", absl::StrCat("is ", schedule.warmup_steps,
                                                         ", more than the ", o.total_steps,
                                                         " steps the schedule spans"));
  }
  return absl::OkStatus();
}

absl::Status ValidateJobConfig(const JobConfig& job) {
  SHARD_RETURN_IF_ERROR(ValidateName("job spec: name", job.name));
  if (job.world_size < 1) return Invalid("world_size", "must be at least 1");
  if (job.min_world_size < 1 || job.min_world_size > job.world_size) {
    return Invalid("min_world_size", absl::StrCat("must be in [1, world_size = ", job.world_size,
                                                  "], got ", job.min_world_size));
  }
  if (job.optimizer.kind == OptimizerKind::kTorch && !job.external_model) {
    return Invalid("optimizer.name", "\"torch\" (the training script's own torch.optim class) "
                                     "needs an external model: a shard.torch script brings both");
  }
  if (job.external_model) {
    if (!job.widths.empty()) return Invalid("model", "is either mlp or external, not both");
    if (job.precision != "fp32") {
      return Invalid("precision", "an external model trains in fp32 (its parameters are fp32)");
    }
  } else {
    SHARD_RETURN_IF_ERROR(ValidateMlp(job));
  }
  if (job.output_dir.empty()) return Invalid("output_dir", "is required");
  if (absl::Status optimizer = ValidateOptimizerConfig(job.optimizer); !optimizer.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("job spec: ", optimizer.message()));
  }
  if (job.global_batch < 1) return Invalid("global_batch", "must be at least 1");
  if (job.global_batch % job.world_size != 0) {
    return Invalid("global_batch", absl::StrCat(job.global_batch, " does not divide evenly over ",
                                                job.world_size,
                                                " workers; use a multiple of the world size"));
  }
  if (job.global_batch % job.min_world_size != 0) {
    return Invalid("global_batch", absl::StrCat(job.global_batch,
                                                " does not divide evenly over min_world_size ",
                                                job.min_world_size));
  }
  if (job.micro_batches < 1) {
    return Invalid("micro_batches", absl::StrCat("must be at least 1, got ", job.micro_batches));
  }
  for (const int world : {job.world_size, job.min_world_size}) {
    if (job.global_batch % (int64_t{world} * job.micro_batches) != 0) {
      return Invalid("global_batch", absl::StrCat(job.global_batch, " does not split into ",
                                                  job.micro_batches, " micro-batches on each of ",
                                                  world, " workers"));
    }
  }
  if (job.steps < 1) return Invalid("steps", "must be at least 1");
  const LrSchedule& schedule = job.optimizer.schedule;
  if (job.optimizer.total_steps != 0 && job.optimizer.total_steps != job.steps) {
    return Invalid("optimizer.total_steps",
                   absl::StrCat("is ", job.optimizer.total_steps, " but the job has ", job.steps,
                                " steps; the schedule spans the job's steps"));
  }
  if (schedule.warmup_steps > job.steps) {
    return Invalid("optimizer.schedule.warmup_steps",
                   absl::StrCat("is ", schedule.warmup_steps, ", more than the job's ", job.steps,
                                " steps"));
  }
  if (!job.external_model) {
    // The built-in MLP's parameters are known now: a group that takes none of them is an
    // error before any worker starts. (An external model's are checked when its engine is
    // created.)
    if (absl::Status groups =
            AssignParamGroups(job.optimizer, MlpManifest(job.widths)).status();
        !groups.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("job spec: ", groups.message()));
    }
  }
  if (job.zero_stage < 0 || job.zero_stage > 3) {
    return Invalid("zero_stage", absl::StrCat("must be 0, 1, 2 or 3, got ", job.zero_stage));
  }
  if (job.prefetch < 0 || job.prefetch > 16) {
    return Invalid("prefetch", absl::StrCat("must be 0 to 16 buckets, got ", job.prefetch));
  }
  if (job.bucket_cap_bytes < 1 || job.first_bucket_cap_bytes < 1) {
    return Invalid("bucket_cap_mb", "must be positive");
  }
  if (job.min_buckets < 1 || job.min_buckets > 1024) {
    return Invalid("min_buckets",
                   absl::StrCat("must be 1 (the caps alone) to 1024, got ", job.min_buckets));
  }
  if (absl::Status precision = ParsePrecision(job.precision).status(); !precision.ok()) {
    return Invalid("precision", precision.message());
  }
  if (!(job.grad_clip_norm >= 0)) return Invalid("grad_clip_norm", "must be >= 0 (0 = off)");
  if (job.checkpoint_dir.empty()) return Invalid("checkpoint.dir", "is required");
  if (job.checkpoint_every < 0) return Invalid("checkpoint.every_steps", "must be >= 0");
  if (job.checkpoint_keep_last < 1) return Invalid("checkpoint.keep_last", "must be at least 1");
  if (job.checkpoint_max_wait_ms < 0) return Invalid("checkpoint.max_wait_ms", "must be >= 0");
  if (job.snapshot_every < 0) return Invalid("snapshot.every_steps", "must be >= 0 (0: off)");
  if (job.snapshot_replicas < 0) return Invalid("snapshot.replicas", "must be >= 0");
  return absl::OkStatus();
}

Manifest MlpManifest(const std::vector<int64_t>& widths) {
  Manifest manifest;
  for (size_t i = 0; i + 1 < widths.size(); ++i) {
    manifest.params.push_back(ParamSpec{absl::StrCat("layers.", i, ".weight"),
                                        {widths[i + 1], widths[i]}, DataType::kFloat32, true});
    manifest.params.push_back(
        ParamSpec{absl::StrCat("layers.", i, ".bias"), {widths[i + 1]}, DataType::kFloat32, true});
  }
  return manifest;
}

absl::Status CheckJobData(const JobConfig& job) {
  SHARD_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsReader> data,
                         SafetensorsReader::Open(job.data_path));
  const TensorInfo* x = data->Find("x");
  const TensorInfo* y = data->Find("y");
  if (x == nullptr || y == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "data file '", job.data_path, "' needs tensors x (F32 [N, ", job.widths.front(),
        "]) and y (I64 [N])"));
  }
  if (x->shape.size() != 2 || x->shape[0] < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("data file '", job.data_path, "': x must be F32 [N, in] with N >= 1"));
  }
  const int64_t samples = x->shape[0];
  if (absl::StatusOr<const TensorInfo*> checked =
          data->Expect("x", DataType::kFloat32, {samples, job.widths.front()});
      !checked.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(checked.status().message(),
                                                   " (model.mlp.widths[0] is ", job.widths.front(),
                                                   ")"));
  }
  return data->Expect("y", DataType::kInt64, {samples}).status();
}

}  // namespace shard
