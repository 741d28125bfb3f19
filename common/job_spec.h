// A training job as the worker and coordinator use it: the job spec (proto/shard/v1/job.proto)
// with defaults applied and every rule checked. Pure data and checks: the JSON parsing lives
// with the message (proto/job_convert.h), the data file is checked by CheckJobData.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/manifest.h"
#include "common/plan.h"

namespace shard {

enum class OptimizerKind { kAdam, kAdamW, kSgd };

struct OptimizerConfig {
  OptimizerKind kind = OptimizerKind::kAdam;
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0;
  double momentum = 0;
  bool nesterov = false;
};

absl::string_view OptimizerKindName(OptimizerKind kind);

// The optimizer's state tensors per parameter element, by PyTorch's names: exp_avg and
// exp_avg_sq for Adam/AdamW, momentum_buffer for SGD with momentum, none for plain SGD.
std::vector<std::string> OptimizerStateNames(const OptimizerConfig& optimizer);

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
  std::string precision = "fp32";
  double grad_clip_norm = 0;
  std::string output_dir;
  bool overlap = true;
  std::string checkpoint_dir;  // checkpoints go to <checkpoint_dir>/<name>/<id>/
  int64_t checkpoint_every = 0;
  int checkpoint_keep_last = 3;
};

// Every rule that needs no file: names, sizes, ranges, the optimizer's hyper-parameters, and
// that the global batch splits evenly over the world size. InvalidArgument naming the field.
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
