// The data-path engine on a GpuDevice, driven by TrainMlp as the worker drives it: two ranks
// sharing the GPU over the staged communicator, and a world of one over NCCL, each against the
// same job trained on the host (CpuDevice); bf16 and fp16 (with dynamic loss scaling) against
// fp32; the self-check through the GPU's collectives; and a checkpoint written from the GPU and
// restored on the CPU. Host ranks are threads over an InProcessWorld (tests/gpu/
// in_process_communicator.h): the GPU machines have no Gloo, and its rank-ordered sums are the
// same in both runs, so GPU and CPU differ only where the device computes differently.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/checkpoint.h"
#include "common/mlp.h"
#include "common/mlp_data.h"
#include "common/safetensors.h"
#include "gtest/gtest.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/gpu/in_process_communicator.h"
#include "tests/support/checkpoint_commit.h"
#include "tests/support/test_directory.h"
#include "worker/dataplane/key_value_store.h"
#include "worker/dataplane/self_check.h"
#include "worker/dataplane/trainer.h"
#include "worker/gpu/gpu_device.h"
#include "worker/gpu/nccl_communicator.h"
#include "worker/gpu/staged_communicator.h"

namespace shard {
namespace {

const std::vector<int64_t> kWidths = {16, 32, 24, 5};
constexpr int64_t kGlobalBatch = 32;
constexpr int64_t kSteps = 12;
constexpr uint64_t kSeed = 9;

// GPU against CPU in fp32. Both runs start from the same parameters and read the same batches;
// the rank-ordered in-process sums and the fused Adam (bitwise equal to the CPU's
// OptimizerKernel, docs/gpu.md) are the same on both sides, so the only difference is the
// summation order of the matrix products (cuBLAS vs OpenBLAS; TF32 is off): ~1e-6 relative in
// each gradient (docs/gpu.md bounds the MLP's at 1e-5). Adam's step m/(sqrt(v)+eps) carries
// about that relative error into each update of at most lr = 1e-3, so over 12 steps parameters
// drift apart by ~1e-8: that is what a pure summation-order change (this job on one host rank
// vs two) measures, 1.5e-8. An element whose gradient nearly cancels can see a larger relative
// error, which Adam's normalisation does not shrink, hence a bound far above 1e-8: 2e-5, the
// bound of the CPU engine's distributed-vs-serial test and of the staged communicator's 10-step
// training test. It is still 1/50 of one step's ~1e-3 move of an element, so a skipped,
// repeated or misplaced update shows.
constexpr double kParameterBound = 2e-5;
// Losses are means over 32 rows of values ~1.6, summed in double from fp32 logits. At step 1
// (same parameters) they differ by the forward pass's fp32 rounding, ~1e-6 relative (~2e-6).
// Later the parameters differ too: cross-entropy moves by at most twice the largest change of
// a logit, and a logit (a sum of <= 32 products of O(1) activations with parameters off by
// ~1e-8, randomly signed) moves by ~1e-7; the summation-order experiment above moves the loss
// by 4e-9. 1e-4 absolute (6e-5 relative) leaves a wide margin yet is 1/150 of the ~1.5e-2 by
// which one step lowers this loss on a fixed batch.
constexpr double kLossBound = 1e-4;

using Params = std::vector<std::vector<float>>;

std::string Root(const std::string& name) {
  return FreshTestDirectory("shard-engine-gpu-test", name);
}

// 256 samples: each of the 12 steps reads a different batch of 32 (a restore that read the
// wrong step's batch would show).
const std::string& DataFile() {
  static const std::string path = [] {
    const std::string p = Root("data") + "/data.safetensors";
    EXPECT_TRUE(GenerateMlpData(kWidths, 256, 7, p).ok());
    return p;
  }();
  return path;
}

// One global batch: every step trains on the same 32 samples, so the loss at step s+1 differs
// from step s's exactly when step s updated the parameters.
const std::string& OneBatchFile() {
  static const std::string path = [] {
    const std::string p = Root("one-batch") + "/data.safetensors";
    EXPECT_TRUE(GenerateMlpData(kWidths, kGlobalBatch, 11, p).ok());
    return p;
  }();
  return path;
}

// Adam at lr 1e-3, small bucket caps (1 KiB, the first 256 B) so the 1461 parameters fill
// several buckets and reductions overlap backward.
JobConfig Job(const std::string& root, int world, int stage, ShardMode mode) {
  JobConfig job;
  job.name = "engine-gpu";
  job.world_size = world;
  job.min_world_size = world;
  job.widths = kWidths;
  job.data_path = DataFile();
  job.seed = kSeed;
  job.optimizer.kind = OptimizerKind::kAdam;
  job.optimizer.lr = 1e-3;
  job.global_batch = kGlobalBatch;
  job.steps = kSteps;
  job.zero_stage = stage;
  job.shard_mode = mode;
  job.bucket_cap_bytes = 1024;
  job.first_bucket_cap_bytes = 256;
  job.output_dir = root + "/out";
  job.checkpoint_dir = root + "/checkpoints";
  std::filesystem::create_directories(job.output_dir);
  return job;
}

enum class Backend {
  kHost,       // HostDevice(), the in-process host communicator
  kStagedGpu,  // a GpuDevice of GPU 0 per rank, the staged communicator over the same world
};

struct RankRun {
  absl::Status status;
  TrainResult result;
  std::vector<StepRecord> steps;  // OnStep's records, in order
};

// Records a rank's steps into its RankRun, and hands its checkpoint shards to `checkpoints`.
class RankObserver : public TrainingObserver {
 public:
  RankObserver(RankRun& run, SavedShardCollector& checkpoints)
      : run_(run), checkpoints_(checkpoints) {}
  void OnStep(const StepRecord& record) override { run_.steps.push_back(record); }
  void OnCheckpoint(const SavedShard& shard) override { checkpoints_.OnCheckpoint(shard); }

 private:
  RankRun& run_;
  SavedShardCollector& checkpoints_;
};

struct Training {
  std::vector<RankRun> ranks;
  SavedShards saved;
};

// TrainMlp on one thread per rank of `job`, from `restore_dir` when set. A rank that fails
// aborts the world, so that its peers return instead of waiting for it.
Training Train(const JobConfig& job, Backend backend, const std::string& restore_dir = "") {
  Training run;
  run.ranks.resize(job.world_size);
  SavedShardCollector checkpoints;
  InProcessWorld world(job.world_size);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < job.world_size; ++rank) {
    threads.emplace_back([&, rank] {
      RankRun& mine = run.ranks[rank];
      // Destroyed in reverse: the staged communicator before the device whose stream it
      // orders after, both before the host communicator under it.
      std::unique_ptr<Communicator> host = world.Join(rank);
      std::unique_ptr<GpuDevice> gpu;
      std::unique_ptr<StagedCommunicator> staged;
      const auto fail = [&](const absl::Status& status) {
        mine.status = status;
        host->Abort(absl::StrCat("rank ", rank, " failed: ", status.ToString()));
      };
      Communicator* communicator = host.get();
      if (backend == Backend::kStagedGpu) {
        absl::StatusOr<std::unique_ptr<GpuDevice>> created = GpuDevice::Create(0);
        if (!created.ok()) return fail(created.status());
        gpu = std::move(*created);
        absl::StatusOr<std::unique_ptr<StagedCommunicator>> comm = StagedCommunicator::Create(
            host.get(), {.device = 0,
                         .compute_stream = gpu->stream(),
                         .wait_timeout = absl::Seconds(30)});
        if (!comm.ok()) return fail(comm.status());
        staged = std::move(*comm);
        communicator = staged.get();
      }
      PlanOptions plan = PlanOptionsForJob(job);
      if (!restore_dir.empty()) {
        absl::StatusOr<CheckpointManifest> manifest = ReadCheckpointManifest(restore_dir);
        if (!manifest.ok()) return fail(manifest.status());
        plan.gradient_order = manifest->plan.gradient_order;
      }
      LocalPlanProvider plans(plan);
      TrainerOptions options;
      options.device = gpu.get();  // null: the host
      options.restore_dir = restore_dir;
      RankObserver observer(mine, checkpoints);
      options.observer = &observer;
      absl::StatusOr<TrainResult> trained = TrainMlp(job, *communicator, plans, options);
      if (!trained.ok()) return fail(trained.status());
      mine.result = *trained;
    });
  }
  for (std::thread& t : threads) t.join();
  run.saved = checkpoints.Take();
  return run;
}

// Every rank trained every step of `job` from `first_step` (fatal otherwise).
void AssertTrained(const Training& run, const JobConfig& job, int64_t first_step = 1) {
  ASSERT_EQ(static_cast<int>(run.ranks.size()), job.world_size);
  for (size_t rank = 0; rank < run.ranks.size(); ++rank) {
    SHARD_ASSERT_OK(run.ranks[rank].status);
    ASSERT_EQ(static_cast<int64_t>(run.ranks[rank].steps.size()), job.steps - first_step + 1)
        << "rank " << rank;
  }
}

// The parameters of final.safetensors in manifest order.
Params ReadParameters(const std::string& path) {
  Params params;
  absl::StatusOr<std::unique_ptr<SafetensorsReader>> file = SafetensorsReader::Open(path);
  EXPECT_TRUE(file.ok()) << file.status();
  if (!file.ok()) return params;
  for (const ParamSpec& spec : MlpManifest(kWidths).params) {
    absl::StatusOr<const TensorInfo*> tensor =
        (*file)->Expect(spec.name, DataType::kFloat32, spec.shape);
    EXPECT_TRUE(tensor.ok()) << tensor.status();
    std::vector<float> values(spec.numel());
    if (tensor.ok()) {
      SHARD_EXPECT_OK((*file)->ReadElements(**tensor, 0, spec.numel(), values.data()));
    }
    params.push_back(std::move(values));
  }
  return params;
}

Params FinalParameters(const JobConfig& job) {
  return ReadParameters(job.output_dir + "/final.safetensors");
}

// The largest element-wise difference; infinite when the shapes differ.
double MaxDifference(const Params& a, const Params& b) {
  if (a.size() != b.size()) return INFINITY;
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].size() != b[i].size()) return INFINITY;
    for (size_t k = 0; k < a[i].size(); ++k) {
      worst = std::max(worst, std::abs(static_cast<double>(a[i][k]) - b[i][k]));
    }
  }
  return worst;
}

// Every rank's per-step losses against the reference's (rank 0's), which start at step
// `first` and cover at least one step.
void ExpectLossesMatch(const Training& gpu, const Training& cpu, int64_t first = 1) {
  const std::vector<StepRecord>& expected = cpu.ranks[0].steps;
  ASSERT_FALSE(expected.empty());
  ASSERT_EQ(expected.front().step, first);
  for (size_t rank = 0; rank < gpu.ranks.size(); ++rank) {
    const std::vector<StepRecord>& actual = gpu.ranks[rank].steps;
    ASSERT_EQ(actual.size(), expected.size()) << "rank " << rank;
    for (size_t s = 0; s < actual.size(); ++s) {
      EXPECT_EQ(actual[s].step, first + static_cast<int64_t>(s));
      EXPECT_EQ(actual[s].step, expected[s].step);
      EXPECT_NEAR(actual[s].loss, expected[s].loss, kLossBound)
          << "rank " << rank << ", step " << actual[s].step;
    }
  }
}

// Two ranks sharing GPU 0 (a GpuDevice each, gradients reduced by the staged communicator)
// train like two host ranks: ZeRO stage 2 in range mode (reduce-scatter, all-gather), stage 1
// in param mode (all-reduce, broadcast from each bucket's owner), and stage 3 in both (each
// layer's bucket gathered as the MLP reaches it, on the GPU's communication stream).
TEST(GpuEngineTest, TwoStagedRanksOnOneGpuTrainLikeTheCpu) {
  SHARD_REQUIRE_GPU();
  struct Case {
    int stage;
    ShardMode mode;
  };
  for (const Case c : {Case{2, ShardMode::kRange}, Case{1, ShardMode::kParam},
                       Case{3, ShardMode::kRange}, Case{3, ShardMode::kParam}}) {
    const std::string name = absl::StrCat("stage", c.stage, "-", ShardModeName(c.mode));
    SCOPED_TRACE(name);
    const std::string root = Root("two-staged-" + name);
    const JobConfig cpu_job = Job(root + "/cpu", 2, c.stage, c.mode);
    const Training cpu = Train(cpu_job, Backend::kHost);
    ASSERT_NO_FATAL_FAILURE(AssertTrained(cpu, cpu_job));
    const JobConfig gpu_job = Job(root + "/gpu", 2, c.stage, c.mode);
    const Training gpu = Train(gpu_job, Backend::kStagedGpu);
    ASSERT_NO_FATAL_FAILURE(AssertTrained(gpu, gpu_job));

    ExpectLossesMatch(gpu, cpu);
    // The loss is global: both GPU ranks report the same.
    for (size_t s = 0; s < gpu.ranks[0].steps.size(); ++s) {
      EXPECT_EQ(gpu.ranks[1].steps[s].loss, gpu.ranks[0].steps[s].loss) << "step " << s + 1;
    }
    // Several buckets were reduced (the small caps), on the GPU as on the host.
    EXPECT_GT(gpu.ranks[0].steps.back().timings.bucket_bytes.size(), 2u);
    EXPECT_EQ(gpu.ranks[0].steps.back().timings.bucket_bytes,
              cpu.ranks[0].steps.back().timings.bucket_bytes);
    EXPECT_EQ(gpu.ranks[0].result.optimizer_state_bytes,
              cpu.ranks[0].result.optimizer_state_bytes);

    const Params cpu_final = FinalParameters(cpu_job);
    EXPECT_LT(MaxDifference(FinalParameters(gpu_job), cpu_final), kParameterBound);
    // Not trivially equal: 12 Adam steps of 1e-3 moved parameters by up to ~1.2e-2.
    EXPECT_GT(MaxDifference(cpu_final, InitMlpParameters(kWidths, kSeed)), 5e-3);
  }
}

// Param groups and a warm-up + cosine schedule: the engine cuts owned spans where the group
// changes (in range mode a shard starts inside a bucket of several groups), the GPU steps each
// group's spans with one launch of its own settings, and training matches the host's.
TEST(GpuEngineTest, ParamGroupsAndAScheduleTrainLikeTheCpu) {
  SHARD_REQUIRE_GPU();
  const auto with_groups = [](JobConfig job) {
    job.optimizer.kind = OptimizerKind::kAdamW;
    job.optimizer.weight_decay = 0.1;
    job.optimizer.param_groups = {ParamGroup{{"*.bias"}, 0.0, 1.0},
                                  ParamGroup{{"layers.1.*"}, 0.02, 0.5}};
    job.optimizer.schedule.warmup_steps = 3;
    job.optimizer.schedule.decay = LrDecay::kCosine;
    job.optimizer.schedule.min_lr = 1e-4;
    job.optimizer.total_steps = job.steps;
    return job;
  };
  const std::string root = Root("param-groups");
  const JobConfig cpu_job = with_groups(Job(root + "/cpu", 2, 2, ShardMode::kRange));
  const Training cpu = Train(cpu_job, Backend::kHost);
  ASSERT_NO_FATAL_FAILURE(AssertTrained(cpu, cpu_job));
  const JobConfig gpu_job = with_groups(Job(root + "/gpu", 2, 2, ShardMode::kRange));
  const Training gpu = Train(gpu_job, Backend::kStagedGpu);
  ASSERT_NO_FATAL_FAILURE(AssertTrained(gpu, gpu_job));
  ExpectLossesMatch(gpu, cpu);
  // The same bound as without groups: each group's lr is at most the job's 1e-3.
  EXPECT_LT(MaxDifference(FinalParameters(gpu_job), FinalParameters(cpu_job)), kParameterBound);
}

// A world of one NCCL rank with a GpuDevice: the communicator the worker builds for one GPU.
// The self-check passes through it, then TrainMlp matches one host rank.
TEST(GpuEngineTest, NcclWorldOfOneTrainsLikeTheCpu) {
  SHARD_REQUIRE_GPU();
  const std::string root = Root("nccl-one");
  const JobConfig cpu_job = Job(root + "/cpu", 1, 2, ShardMode::kRange);
  const Training cpu = Train(cpu_job, Backend::kHost);
  ASSERT_NO_FATAL_FAILURE(AssertTrained(cpu, cpu_job));

  InProcessKeyValueStore store;
  SHARD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<GpuDevice> gpu, GpuDevice::Create(0));
  NcclOptions nccl;
  nccl.device = 0;
  nccl.compute_stream = gpu->stream();
  nccl.wait_timeout = absl::Seconds(30);
  nccl.init_timeout = absl::Seconds(60);
  SHARD_ASSERT_OK_AND_ASSIGN(
      std::unique_ptr<NcclCommunicator> comm,
      NcclCommunicator::Create(0, 1, KeyValueIdExchange(&store, absl::Seconds(5)), nccl));
  SHARD_ASSERT_OK(comm->WaitReady());

  SHARD_ASSERT_OK_AND_ASSIGN(const SelfCheckResult check, RunSelfCheck(*comm, 65536, *gpu));
  EXPECT_TRUE(absl::StrContains(check.summary, "65536")) << check.summary;

  const JobConfig gpu_job = Job(root + "/gpu", 1, 2, ShardMode::kRange);
  LocalPlanProvider plans(PlanOptionsForJob(gpu_job));
  Training gpu_run;
  gpu_run.ranks.resize(1);
  TrainerOptions options;
  options.device = gpu.get();
  SavedShardCollector checkpoints;  // the job saves none
  RankObserver observer(gpu_run.ranks[0], checkpoints);
  options.observer = &observer;
  SHARD_ASSERT_OK_AND_ASSIGN(gpu_run.ranks[0].result, TrainMlp(gpu_job, *comm, plans, options));
  SHARD_EXPECT_OK(comm->Synchronize());

  ExpectLossesMatch(gpu_run, cpu);
  EXPECT_EQ(gpu_run.ranks[0].result.steps, kSteps);
  const Params cpu_final = FinalParameters(cpu_job);
  EXPECT_LT(MaxDifference(FinalParameters(gpu_job), cpu_final), kParameterBound);
  EXPECT_GT(MaxDifference(cpu_final, InitMlpParameters(kWidths, kSeed)), 5e-3);
}

// fp32, bf16 and fp16 on one GPU (a staged world of one), all training on one repeated batch.
//
// Bounds, against the fp32 run on the GPU. docs/gpu.md measures the MLP's 16-bit error at the
// same rounded weights: loss within 2e-2 (bf16) / 3e-3 (fp16) relative (measured 3e-3 / 4e-4),
// deeper gradients off by up to 5% / 1.6%. Rounding the weights themselves (2^-9 / 2^-12
// relative each, randomly signed) adds less than the measured error again, so these bound
// step 1, where the fp32 master weights are equal. By the last step the runs have also drifted
// apart: Adam's normalised updates move each element by at most lr = 1e-3 per step, and a
// gradient a few per cent off changes that update by about as much, so the parameters differ
// by ~5% (bf16) / ~1.6% (fp16) of how far training moved them, and so does the loss decrease
// (8.5% of the loss here, measured in fp32 on the CPU): another ~4e-3 / ~1.4e-3 relative.
// Final bounds: 4e-2 (bf16) and 1e-2 (fp16), the step-1 bound plus the drift with about twice
// the margin; both are below the 8.5% by which a run that never learned (e.g. computing on
// 16-bit weight copies never refreshed) would be off.
TEST(GpuEngineTest, SixteenBitPrecisionsTrainCloseToFp32) {
  SHARD_REQUIRE_GPU();
  const std::string root = Root("sixteen-bit");
  std::map<std::string, std::vector<StepRecord>> records;
  for (const std::string precision : {"fp32", "bf16", "fp16"}) {
    SCOPED_TRACE(precision);
    JobConfig job = Job(root + "/" + precision, 1, 2, ShardMode::kRange);
    job.precision = precision;
    job.data_path = OneBatchFile();
    const Training run = Train(job, Backend::kStagedGpu);
    ASSERT_NO_FATAL_FAILURE(AssertTrained(run, job));
    const std::vector<StepRecord>& steps = run.ranks[0].steps;
    for (const StepRecord& step : steps) {
      ASSERT_TRUE(std::isfinite(step.loss)) << "step " << step.step;
    }
    for (const std::vector<float>& param : FinalParameters(job)) {
      for (float v : param) ASSERT_TRUE(std::isfinite(v));
    }
    // Fitting one batch with Adam: the loss falls. (On the CPU in fp32 this job's loss falls
    // steadily from 1.817 to 1.662, by 8.5%; 3% is well clear of the 16-bit error at step 1.)
    EXPECT_LT(steps.back().loss, 0.97 * steps.front().loss)
        << "first " << steps.front().loss << ", last " << steps.back().loss;
    records[precision] = steps;
  }

  // Loss scaling: fp16 only, GradScaler's initial 2^16 at step 1.
  for (const StepRecord& step : records["fp32"]) EXPECT_EQ(step.timings.loss_scale, 1.0f);
  for (const StepRecord& step : records["bf16"]) EXPECT_EQ(step.timings.loss_scale, 1.0f);
  const std::vector<StepRecord>& fp16 = records["fp16"];
  EXPECT_EQ(fp16.front().timings.loss_scale, 65536.0f);
  // One batch, so the next step's loss (computed before its update) changed exactly when this
  // step updated; a skipped step halves the scale and leaves the weights, hence the loss, as
  // they were. Scaled output gradients are at most 2^16/32 = 2048 (f16 reaches 65504), so no
  // step is expected to overflow; the skip path is checked as well in case one does.
  int updated = 0;
  for (size_t s = 0; s + 1 < fp16.size(); ++s) {
    const StepRecord& step = fp16[s];
    const StepRecord& next = fp16[s + 1];
    if (step.timings.skipped) {
      EXPECT_EQ(next.loss, step.loss) << "step " << step.step << " was skipped";
      EXPECT_EQ(next.timings.loss_scale, step.timings.loss_scale / 2);
    } else {
      ++updated;
      EXPECT_NE(next.loss, step.loss) << "step " << step.step << " updated nothing";
      EXPECT_EQ(next.timings.loss_scale, step.timings.loss_scale);  // growth only after 2000
    }
  }
  EXPECT_GT(updated, 0);

  const double fp32_first = records["fp32"].front().loss;
  const double fp32_last = records["fp32"].back().loss;
  struct Bound {
    std::string precision;
    double first;  // step 1: the MLP's 16-bit error at equal weights (docs/gpu.md)
    double last;   // plus the drift of 12 steps
  };
  for (const Bound& bound : {Bound{"bf16", 2e-2, 4e-2}, Bound{"fp16", 3e-3, 1e-2}}) {
    SCOPED_TRACE(bound.precision);
    const std::vector<StepRecord>& steps = records[bound.precision];
    EXPECT_NEAR(steps.front().loss, fp32_first, bound.first * fp32_first);
    EXPECT_NEAR(steps.back().loss, fp32_last, bound.last * fp32_last);
  }
}

// The self-check (closed-form all-reduce and all-gather) over three ranks sharing GPU 0, its
// buffers in each rank's GpuDevice memory, through the staged communicator's streams.
TEST(GpuEngineTest, StagedSelfCheckPassesOnTheGpu) {
  SHARD_REQUIRE_GPU();
  constexpr int kRanks = 3;
  // Not a multiple of 3: the all-gather covers 3 x 21845 elements, the all-reduce all 65536.
  constexpr size_t kElements = 65536;
  InProcessWorld world(kRanks);
  std::vector<absl::StatusOr<SelfCheckResult>> results(kRanks, absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (int rank = 0; rank < kRanks; ++rank) {
    threads.emplace_back([&, rank] {
      std::unique_ptr<Communicator> host = world.Join(rank);
      absl::StatusOr<std::unique_ptr<GpuDevice>> gpu = GpuDevice::Create(0);
      if (!gpu.ok()) {
        results[rank] = gpu.status();
        host->Abort("no device");
        return;
      }
      absl::StatusOr<std::unique_ptr<StagedCommunicator>> comm = StagedCommunicator::Create(
          host.get(), {.device = 0,
                       .compute_stream = (*gpu)->stream(),
                       .wait_timeout = absl::Seconds(30)});
      if (!comm.ok()) {
        results[rank] = comm.status();
        host->Abort("no communicator");
        return;
      }
      results[rank] = RunSelfCheck(**comm, kElements, **gpu);
      if (!results[rank].ok()) host->Abort("self-check failed");
    });
  }
  for (std::thread& t : threads) t.join();
  for (int rank = 0; rank < kRanks; ++rank) {
    ASSERT_TRUE(results[rank].ok()) << "rank " << rank << ": " << results[rank].status();
    EXPECT_TRUE(absl::StrContains(results[rank]->summary, "3 ranks")) << results[rank]->summary;
  }
}

// Two staged GPU ranks train 6 of the 12 steps and checkpoint; two host ranks restore that
// checkpoint (the GPU's buffers read back through Download into the same shard layout) and
// finish. The result matches 12 uninterrupted host steps within the bound of the fp32
// comparison: the first 6 steps differ by the GPU's summation order, the last 6 not at all.
TEST(GpuEngineTest, CheckpointFromTheGpuRestoresOnTheCpu) {
  SHARD_REQUIRE_GPU();
  constexpr int64_t kAt = 6;
  const std::string root = Root("gpu-checkpoint");
  const JobConfig cpu_job = Job(root + "/cpu", 2, 2, ShardMode::kRange);
  const Training cpu = Train(cpu_job, Backend::kHost);
  ASSERT_NO_FATAL_FAILURE(AssertTrained(cpu, cpu_job));

  JobConfig gpu_job = Job(root + "/gpu", 2, 2, ShardMode::kRange);
  gpu_job.steps = kAt;
  gpu_job.checkpoint_every = kAt;
  Training gpu = Train(gpu_job, Backend::kStagedGpu);
  ASSERT_NO_FATAL_FAILURE(AssertTrained(gpu, gpu_job));
  ASSERT_NO_FATAL_FAILURE(CommitSavedCheckpoints(gpu_job, gpu.saved));
  const std::string checkpoint = CheckpointDirectory(gpu_job.checkpoint_dir, gpu_job.name,
                                                     CheckpointIdForStep(kAt));
  SHARD_ASSERT_OK_AND_ASSIGN(const CheckpointManifest manifest,
                             ReadCheckpointManifest(checkpoint));
  EXPECT_EQ(manifest.step, kAt);

  JobConfig restored_job = Job(root + "/restored", 2, 2, ShardMode::kRange);
  const Training restored = Train(restored_job, Backend::kHost, checkpoint);
  ASSERT_NO_FATAL_FAILURE(AssertTrained(restored, restored_job, kAt + 1));
  EXPECT_EQ(restored.ranks[0].result.start_step, kAt);

  // Steps 1-6 on the GPU, 7-12 on the CPU, each against the uninterrupted run.
  Training cpu_first = cpu;
  Training cpu_last = cpu;
  for (RankRun& rank : cpu_first.ranks) rank.steps.resize(kAt);
  for (RankRun& rank : cpu_last.ranks) {
    rank.steps.erase(rank.steps.begin(), rank.steps.begin() + kAt);
  }
  ExpectLossesMatch(gpu, cpu_first, 1);
  ExpectLossesMatch(restored, cpu_last, kAt + 1);

  const Params cpu_final = FinalParameters(cpu_job);
  EXPECT_LT(MaxDifference(FinalParameters(restored_job), cpu_final), kParameterBound);
  // Not trivially equal: the 6 steps on the CPU moved the parameters far beyond the bound.
  EXPECT_GT(MaxDifference(FinalParameters(gpu_job), cpu_final), 1e-3);
}

}  // namespace
}  // namespace shard
