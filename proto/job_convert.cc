#include "proto/job_convert.h"

#include <filesystem>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "common/cli.h"
#include "common/files.h"
#include "common/status_macros.h"
#include "google/protobuf/util/json_util.h"

namespace shard {
namespace {

absl::Status Missing(absl::string_view field) {
  return absl::InvalidArgumentError(absl::StrCat("job spec: ", field, " is required"));
}

std::string Resolve(const std::string& path, const std::string& base_dir) {
  if (path.empty() || base_dir.empty() || std::filesystem::path(path).is_absolute()) return path;
  return (std::filesystem::path(base_dir) / path).lexically_normal().string();
}

// -0 in a field without presence is neither sent in the binary form nor printed in JSON, so a
// job read from JSON would compare unequal to the same job written back; both mean 0.
double WithoutNegativeZero(double value) { return value == 0 ? 0.0 : value; }

// The optimizer's part of the spec (total_steps aside: the job's steps).
absl::StatusOr<OptimizerConfig> OptimizerFromProto(const v1::OptimizerSpec& o) {
  OptimizerConfig optimizer;
  if (o.name() == "torch") {
    // The script's own optimizer: its settings, groups and schedule live in the script.
    if (o.lr() != 0 || o.betas_size() != 0 || o.has_eps() || o.weight_decay() != 0 ||
        o.momentum() != 0 || o.nesterov() || o.param_groups_size() != 0 || o.has_schedule()) {
      return absl::InvalidArgumentError(
          "job spec: optimizer \"torch\" takes its settings from the training script "
          "(engine.optimizer(torch.optim.X, lr=..., ...) and its lr_scheduler): give only "
          "{\"name\": \"torch\"}");
    }
    optimizer.kind = OptimizerKind::kTorch;
    return optimizer;
  }
  if (o.name() == "adam") {
    optimizer.kind = OptimizerKind::kAdam;
  } else if (o.name() == "adamw") {
    optimizer.kind = OptimizerKind::kAdamW;
  } else if (o.name() == "sgd") {
    optimizer.kind = OptimizerKind::kSgd;
  } else if (o.name().empty()) {
    return Missing("optimizer.name (adam, adamw, sgd, or torch for the script's own)");
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("job spec: optimizer.name '", o.name(),
                     "' is unknown; use adam, adamw or sgd, or torch for the script's own"));
  }
  if (o.lr() == 0) return Missing("optimizer.lr");
  optimizer.lr = o.lr();
  if (o.betas_size() != 0 && o.betas_size() != 2) {
    return absl::InvalidArgumentError("job spec: optimizer.betas needs exactly two numbers");
  }
  if (o.betas_size() == 2) {
    optimizer.beta1 = o.betas(0);
    optimizer.beta2 = o.betas(1);
  }
  if (o.has_eps()) optimizer.eps = o.eps();
  optimizer.weight_decay = WithoutNegativeZero(o.weight_decay());
  optimizer.momentum = WithoutNegativeZero(o.momentum());
  optimizer.nesterov = o.nesterov();
  for (const v1::ParamGroupSpec& g : o.param_groups()) {
    ParamGroup group;
    group.match.assign(g.match().begin(), g.match().end());
    if (g.has_weight_decay()) group.weight_decay = WithoutNegativeZero(g.weight_decay());
    if (g.has_lr_scale()) group.lr_scale = g.lr_scale();
    optimizer.param_groups.push_back(std::move(group));
  }
  optimizer.schedule.warmup_steps = o.schedule().warmup_steps();
  if (!o.schedule().decay().empty()) {
    absl::StatusOr<LrDecay> decay = ParseLrDecay(o.schedule().decay());
    if (!decay.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("job spec: optimizer.schedule.decay ", decay.status().message()));
    }
    optimizer.schedule.decay = *decay;
  }
  optimizer.schedule.min_lr = WithoutNegativeZero(o.schedule().min_lr());
  return optimizer;
}

void OptimizerToProto(const OptimizerConfig& optimizer, v1::OptimizerSpec* o) {
  o->set_name(std::string(OptimizerKindName(optimizer.kind)));
  if (optimizer.kind == OptimizerKind::kTorch) return;  // the script holds the rest
  o->set_lr(optimizer.lr);
  o->add_betas(optimizer.beta1);
  o->add_betas(optimizer.beta2);
  o->set_eps(optimizer.eps);
  o->set_weight_decay(optimizer.weight_decay);
  o->set_momentum(optimizer.momentum);
  o->set_nesterov(optimizer.nesterov);
  for (const ParamGroup& group : optimizer.param_groups) {
    v1::ParamGroupSpec* g = o->add_param_groups();
    for (const std::string& pattern : group.match) g->add_match(pattern);
    // Explicit: a group without its own weight decay has the optimizer's.
    g->set_weight_decay(group.weight_decay.value_or(optimizer.weight_decay));
    g->set_lr_scale(group.lr_scale);
  }
  o->mutable_schedule()->set_warmup_steps(optimizer.schedule.warmup_steps);
  o->mutable_schedule()->set_decay(std::string(LrDecayName(optimizer.schedule.decay)));
  o->mutable_schedule()->set_min_lr(optimizer.schedule.min_lr);
}

}  // namespace

absl::StatusOr<v1::JobSpec> ParseJobSpecJson(absl::string_view json) {
  v1::JobSpec spec;
  google::protobuf::util::JsonParseOptions options;
  options.ignore_unknown_fields = false;
  const auto parsed = google::protobuf::util::JsonStringToMessage(
      google::protobuf::StringPiece(json.data(), json.size()), &spec, options);
  if (!parsed.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("job spec is not a valid JobSpec: ", parsed.message().as_string()));
  }
  return spec;
}

absl::StatusOr<JobConfig> JobConfigFromProto(const v1::JobSpec& spec, const std::string& base_dir) {
  JobConfig job;
  if (spec.name().empty()) return Missing("name");
  job.name = spec.name();
  if (spec.world_size() == 0) return Missing("world_size");
  job.world_size = spec.world_size();
  job.min_world_size = spec.has_min_world_size() ? spec.min_world_size() : spec.world_size();
  if (spec.model().has_external()) {
    job.external_model = true;
  } else if (!spec.model().has_mlp() || spec.model().mlp().widths().empty()) {
    return Missing("model.mlp.widths (or model.external for a model the workers bring)");
  } else {
    job.widths.assign(spec.model().mlp().widths().begin(), spec.model().mlp().widths().end());
    if (spec.data().path().empty()) return Missing("data.path");
  }
  job.data_path = Resolve(spec.data().path(), base_dir);
  job.init_path = Resolve(spec.init().path(), base_dir);
  job.seed = spec.seed();

  SHARD_ASSIGN_OR_RETURN(job.optimizer, OptimizerFromProto(spec.optimizer()));

  if (spec.global_batch() == 0) return Missing("global_batch");
  job.global_batch = spec.global_batch();
  if (spec.steps() == 0) return Missing("steps");
  job.steps = spec.steps();
  job.optimizer.total_steps = job.steps;  // the schedule spans the job
  if (spec.has_zero_stage()) job.zero_stage = spec.zero_stage();
  if (!spec.shard_mode().empty()) {
    absl::StatusOr<ShardMode> mode = ParseShardMode(spec.shard_mode());
    if (!mode.ok()) return absl::InvalidArgumentError(absl::StrCat("job spec: ", mode.status().message()));
    job.shard_mode = *mode;
  }
  // Checked before converting: a double out of int64's range has no defined conversion.
  for (auto [field, set, mebibytes, bytes] :
       {std::tuple{"bucket_cap_mb", spec.has_bucket_cap_mb(), spec.bucket_cap_mb(),
                   &job.bucket_cap_bytes},
        std::tuple{"first_bucket_cap_mb", spec.has_first_bucket_cap_mb(),
                   spec.first_bucket_cap_mb(), &job.first_bucket_cap_bytes}}) {
    if (!set) continue;
    if (!ValidMebibytes(mebibytes)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "job spec: ", field, " must be more than 0 and at most 1048576 (1 TiB), got ",
          mebibytes));
    }
    *bytes = MebibytesToBytes(mebibytes);
  }
  if (!spec.precision().empty()) job.precision = spec.precision();
  job.grad_clip_norm = WithoutNegativeZero(spec.grad_clip_norm());
  if (spec.output_dir().empty()) return Missing("output_dir");
  job.output_dir = Resolve(spec.output_dir(), base_dir);
  if (spec.has_overlap()) job.overlap = spec.overlap();
  if (spec.has_micro_batches()) job.micro_batches = spec.micro_batches();
  if (spec.has_min_buckets()) job.min_buckets = spec.min_buckets();
  if (spec.has_overlap_param_gather()) job.overlap_param_gather = spec.overlap_param_gather();
  if (spec.has_overlap_update()) job.overlap_update = spec.overlap_update();
  if (spec.has_prefetch()) job.prefetch = spec.prefetch();
  job.checkpoint_dir = spec.checkpoint().dir().empty()
                           ? (std::filesystem::path(job.output_dir) / "checkpoints").string()
                           : Resolve(spec.checkpoint().dir(), base_dir);
  job.checkpoint_every = spec.checkpoint().every_steps();
  if (spec.checkpoint().has_keep_last()) job.checkpoint_keep_last = spec.checkpoint().keep_last();
  if (spec.checkpoint().has_max_wait_ms()) {
    job.checkpoint_max_wait_ms = spec.checkpoint().max_wait_ms();
  }
  if (spec.snapshot().has_every_steps()) job.snapshot_every = spec.snapshot().every_steps();
  if (spec.snapshot().has_replicas()) job.snapshot_replicas = spec.snapshot().replicas();
  SHARD_RETURN_IF_ERROR(ValidateJobConfig(job));
  return job;
}

v1::JobSpec ToProto(const JobConfig& job) {
  v1::JobSpec spec;
  spec.set_name(job.name);
  spec.set_world_size(job.world_size);
  spec.set_min_world_size(job.min_world_size);
  if (job.external_model) {
    spec.mutable_model()->mutable_external();
  } else {
    for (int64_t w : job.widths) spec.mutable_model()->mutable_mlp()->add_widths(w);
  }
  spec.mutable_data()->set_path(job.data_path);
  spec.mutable_init()->set_path(job.init_path);
  spec.set_seed(job.seed);
  OptimizerToProto(job.optimizer, spec.mutable_optimizer());
  spec.set_global_batch(job.global_batch);
  spec.set_steps(job.steps);
  spec.set_zero_stage(job.zero_stage);
  spec.set_shard_mode(std::string(ShardModeName(job.shard_mode)));
  spec.set_bucket_cap_mb(static_cast<double>(job.bucket_cap_bytes) / (1 << 20));
  spec.set_first_bucket_cap_mb(static_cast<double>(job.first_bucket_cap_bytes) / (1 << 20));
  spec.set_precision(job.precision);
  spec.set_grad_clip_norm(job.grad_clip_norm);
  spec.set_output_dir(job.output_dir);
  spec.set_overlap(job.overlap);
  spec.set_micro_batches(job.micro_batches);
  spec.set_min_buckets(job.min_buckets);
  spec.set_overlap_param_gather(job.overlap_param_gather);
  spec.set_overlap_update(job.overlap_update);
  spec.set_prefetch(job.prefetch);
  spec.mutable_checkpoint()->set_dir(job.checkpoint_dir);
  spec.mutable_checkpoint()->set_every_steps(job.checkpoint_every);
  spec.mutable_checkpoint()->set_keep_last(job.checkpoint_keep_last);
  spec.mutable_checkpoint()->set_max_wait_ms(job.checkpoint_max_wait_ms);
  spec.mutable_snapshot()->set_every_steps(job.snapshot_every);
  spec.mutable_snapshot()->set_replicas(job.snapshot_replicas);
  return spec;
}

absl::StatusOr<JobConfig> LoadJobFile(const std::string& path) {
  SHARD_ASSIGN_OR_RETURN(std::string text, ReadFile(path));
  absl::StatusOr<v1::JobSpec> spec = ParseJobSpecJson(text);
  if (!spec.ok()) {
    return absl::Status(spec.status().code(), absl::StrCat(path, ": ", spec.status().message()));
  }
  // Paths in the job are relative to the job file, wherever the workers run.
  const std::string base_dir = std::filesystem::absolute(path).parent_path().string();
  absl::StatusOr<JobConfig> job = JobConfigFromProto(*spec, base_dir);
  if (!job.ok()) {
    return absl::Status(job.status().code(), absl::StrCat(path, ": ", job.status().message()));
  }
  // An external model reads its own data.
  if (absl::Status data = job->external_model ? absl::OkStatus() : CheckJobData(*job);
      !data.ok()) {
    return absl::Status(data.code(), absl::StrCat(path, ": ", data.message()));
  }
  return job;
}

}  // namespace shard
