// A training job as the worker and coordinator use it: the job spec (proto/shard/v1/job.proto)
// with defaults applied and every rule checked. Pure data and checks: the JSON parsing lives
// with the message (proto/job_convert.h), the data file is checked by CheckJobData.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/manifest.h"
#include "common/plan.h"

namespace shard {

// kTorch: the training script brings a torch.optim class of its own (shard.torch's
// engine.optimizer); the engine keeps its state but runs no update rule of its own.
enum class OptimizerKind { kAdam, kAdamW, kSgd, kTorch };

// Settings for the parameters whose names match, as one of torch.optim's param groups. The
// first group with a matching pattern takes a parameter; unmatched parameters use the
// optimizer's own settings. common/param_groups.h assigns and resolves them.
struct ParamGroup {
  // fnmatch(3) patterns (no flags: `*` also matches '.', `?` one character, `[...]` a class)
  // over the manifest's parameter names, e.g. "*.bias".
  std::vector<std::string> match;
  std::optional<double> weight_decay;  // unset: the optimizer's weight_decay
  double lr_scale = 1;                 // this group's lr is lr_scale x the scheduled lr
};

enum class LrDecay { kConstant, kCosine, kLinear };

// The learning rate over the run (common/param_groups.h LearningRateAt has the formula): a
// linear warm-up over the first warmup_steps updates, then constant, or a cosine or linear
// decay to min_lr at the job's last step.
struct LrSchedule {
  int64_t warmup_steps = 0;
  LrDecay decay = LrDecay::kConstant;
  double min_lr = 0;
};

struct OptimizerConfig {
  OptimizerKind kind = OptimizerKind::kAdam;
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0;
  double momentum = 0;
  bool nesterov = false;
  std::vector<ParamGroup> param_groups;
  LrSchedule schedule;
  // The updates the schedule spans: the job's `steps` (JobConfigFromProto fills it in), where a
  // decay reaches min_lr. 0 = unknown, allowed only without a decay.
  int64_t total_steps = 0;
  // kTorch only, declared by the training script, not the job spec: the optimizer's class
  // ("torch.optim.adamw.AdamW") and its state tensors that have one value per parameter element
  // (exp_avg, ...), which the engine keeps in its sharded state arrays. The script keeps the
  // rest (step counts, factored moments) and hands it over with every save (checkpoint extras).
  std::string torch_class;
  std::vector<std::string> torch_state;
};

absl::string_view OptimizerKindName(OptimizerKind kind);
absl::string_view LrDecayName(LrDecay decay);
// "constant", "cosine" or "linear"; InvalidArgument naming the accepted values otherwise.
absl::StatusOr<LrDecay> ParseLrDecay(absl::string_view name);

// The optimizer's state tensors per parameter element, by PyTorch's names: exp_avg and
// exp_avg_sq for Adam/AdamW, momentum_buffer for SGD with momentum, none for plain SGD, and
// torch_state for a script's own optimizer.
std::vector<std::string> OptimizerStateNames(const OptimizerConfig& optimizer);

// Snapshot defaults (docs/recovery.md has the measured overhead behind them).
constexpr int64_t kDefaultSnapshotEvery = 10;
// How long a step boundary at which a disk checkpoint is due waits for the previous one's write
// before that save is skipped (docs/checkpoints.md, "When the disk fails").
constexpr int64_t kDefaultCheckpointMaxWaitMs = 10000;
constexpr int kDefaultSnapshotReplicas = 1;

struct JobConfig {
  std::string name;
  int world_size = 1;
  int min_world_size = 1;
  // The model the workers bring registers its own manifest; the built-in MLP is `widths`.
  bool external_model = false;
  std::vector<int64_t> widths;  // the built-in MLP, input to output (empty for an external model)
  std::string data_path;        // the MLP's data; an external model reads its own
  std::string init_path;  // empty: seeded init
  uint64_t seed = 0;
  OptimizerConfig optimizer;
  int64_t global_batch = 0;
  int64_t steps = 0;
  int zero_stage = 1;
  ShardMode shard_mode = ShardMode::kRange;
  int64_t bucket_cap_bytes = int64_t{25} << 20;
  int64_t first_bucket_cap_bytes = int64_t{1} << 20;
  int min_buckets = 4;  // PlanOptions::min_buckets
  std::string precision = "fp32";
  double grad_clip_norm = 0;
  std::string output_dir;
  bool overlap = true;
  int micro_batches = 1;  // gradient accumulation over this many micro-batches per step
  // Stages 1 and 2: the parameter all-gather overlaps the next forward (the built-in MLP on CPU).
  bool overlap_param_gather = true;
  int prefetch = 1;  // stage 3: buckets gathered ahead of the one in use
  // Each bucket's update as soon as its reduction completes (no clipping, no loss scaling, the
  // built-in optimizer, CPU workers).
  bool overlap_update = true;
  std::string checkpoint_dir;  // checkpoints go to <checkpoint_dir>/<name>/<id>/
  int64_t checkpoint_every = 0;
  int checkpoint_keep_last = 3;
  // A save due while a rank still writes the previous checkpoint waits at most this long for it
  // (once per write), then a periodic one is skipped and a requested one waits for a later
  // boundary: a slow disk never holds training longer (0: never wait).
  int64_t checkpoint_max_wait_ms = kDefaultCheckpointMaxWaitMs;
  // In-memory snapshots (common/snapshot.h): every `snapshot_every` steps (0: off), each rank's
  // shard kept by `snapshot_replicas` buddies besides itself.
  int64_t snapshot_every = kDefaultSnapshotEvery;
  int snapshot_replicas = kDefaultSnapshotReplicas;
};

// The optimizer's hyper-parameters, groups and schedule on their own (what the engine checks):
// InvalidArgument naming the field, e.g. "optimizer.param_groups[1].lr_scale must be > 0".
// Whether each group takes a parameter depends on the model: param_groups.h AssignParamGroups.
absl::Status ValidateOptimizerConfig(const OptimizerConfig& optimizer);

// Every rule that needs no file: names, sizes, ranges, the optimizer's hyper-parameters, groups
// and schedule (for the built-in MLP, also that every group takes a parameter of its model),
// and that the global batch splits evenly over the world size. InvalidArgument naming the field.
absl::Status ValidateJobConfig(const JobConfig& job);

// How the job's parameters are planned at its full world size: shard mode and bucket caps.
PlanOptions PlanOptionsForJob(const JobConfig& job);

// The element type the model computes in for a job's `precision`: fp32, bf16 or fp16
// (InvalidArgument naming the accepted values otherwise).
absl::StatusOr<DataType> ParsePrecision(const std::string& precision);

// The built-in MLP's parameters: layers.{i}.weight [out, in] and layers.{i}.bias [out].
Manifest MlpManifest(const std::vector<int64_t>& widths);

// Opens the data file and checks it against the job: x is F32 [N, widths[0]], y is I64 [N],
// N >= 1. (Labels are checked against the output width as batches are read.)
absl::Status CheckJobData(const JobConfig& job);

}  // namespace shard
