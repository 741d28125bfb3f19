// The engine over the Device interface (device.h), on the host: a device whose arrays the
// caller may not touch trains and restores bit for bit like the host; dynamic loss scaling by
// powers of two changes no bit of training; an inf gradient on one rank skips the update on
// every rank; a restore continues the loss scale and the optimizer's step count where a skipped
// update left them; averaging the ranks' gradients in the engine gives the bits of dividing each
// before marking it ready; the host refuses 16-bit precision. Ranks are threads over real
// loopback TCP, as in training_test.cc and resume_test.cc.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "common/checkpoint.h"
#include "common/mlp.h"
#include "common/mlp_data.h"
#include "common/safetensors.h"
#include "gtest/gtest.h"
#include "tests/support/checkpoint_commit.h"
#include "tests/support/status_assertions.h"
#include "tests/support/test_directory.h"
#include "worker/dataplane/checkpoint_saver.h"
#include "worker/dataplane/cpu_device.h"
#include "worker/dataplane/engine.h"
#include "worker/dataplane/gloo_communicator.h"
#include "worker/dataplane/trainer.h"

namespace shard {
namespace {

const std::vector<int64_t> kWidths = {12, 32, 16, 6};
constexpr int kWorld = 2;
constexpr int64_t kGlobalBatch = 32;
constexpr uint64_t kSeed = 5;

using Tensors = std::map<std::string, std::vector<float>>;

// The host's memory and arithmetic behind a device that says its arrays are not host memory,
// so the engine takes a GPU's paths (a restore reads through its host scratch and Upload).
// Counts the transfers; thread-safe, as ranks share it.
class StagingDevice final : public Device {
 public:
  std::string name() const override { return "staging"; }
  bool host_memory() const override { return false; }
  absl::Status BindThread() override { return cpu_.BindThread(); }

  absl::StatusOr<DeviceArray> Allocate(int64_t count) override { return cpu_.Allocate(count); }
  absl::Status Upload(const float* host, float* device, int64_t count) override {
    ++uploads_;
    return cpu_.Upload(host, device, count);
  }
  absl::Status Download(const float* device, float* host, int64_t count) override {
    ++downloads_;
    return cpu_.Download(device, host, count);
  }
  absl::Status Copy(const float* from, float* to, int64_t count) override {
    return cpu_.Copy(from, to, count);
  }
  absl::Status Zero(float* data, int64_t count) override { return cpu_.Zero(data, count); }
  absl::Status Divide(float* data, int64_t count, float divisor) override {
    return cpu_.Divide(data, count, divisor);
  }
  absl::StatusOr<std::unique_ptr<SpanKernels>> PrepareSpans(
      const OptimizerConfig& optimizer, std::vector<OwnedSpan> spans) override {
    return cpu_.PrepareSpans(optimizer, std::move(spans));
  }
  absl::Status AllReduceHostValues(Communicator& communicator, void* values, size_t count,
                                   DataType dtype, ReduceOp op) override {
    return cpu_.AllReduceHostValues(communicator, values, count, dtype, op);
  }
  absl::StatusOr<std::unique_ptr<MlpRunner>> CreateMlp(const std::vector<int64_t>& widths,
                                                       int64_t max_rows,
                                                       DataType precision) override {
    return cpu_.CreateMlp(widths, max_rows, precision);
  }

  int64_t uploads() const { return uploads_.load(); }
  int64_t downloads() const { return downloads_.load(); }

 private:
  CpuDevice cpu_;
  std::atomic<int64_t> uploads_{0};
  std::atomic<int64_t> downloads_{0};
};

std::string Root(const std::string& name) {
  return FreshTestDirectory("shard-engine-device-test", name);
}

const std::string& DataFile() {
  static const std::string path = [] {
    const std::string p = Root("data") + "/data.safetensors";
    EXPECT_TRUE(GenerateMlpData(kWidths, 256, 7, p).ok());
    return p;
  }();
  return path;
}

// Runs body(rank, communicator) on one thread per rank, joined by Gloo over loopback.
std::vector<absl::Status> RunRanks(int world,
                                   const std::function<absl::Status(int, Communicator&)>& body) {
  InProcessKeyValueStore store;
  std::vector<absl::Status> results(world);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < world; ++rank) {
    threads.emplace_back([&, rank] {
      GlooOptions gloo;
      gloo.rank = rank;
      gloo.size = world;
      gloo.timeout = absl::Seconds(30);
      auto communicator = CreateGlooCommunicator(&store, gloo);
      results[rank] = communicator.ok() ? body(rank, **communicator) : communicator.status();
    });
  }
  for (std::thread& t : threads) t.join();
  return results;
}

PlanOptions Planning(int world) {
  PlanOptions plan;
  plan.world_size = world;
  plan.mode = ShardMode::kRange;
  // Small caps: several buckets.
  plan.bucket_cap_bytes = 1024;
  plan.first_bucket_cap_bytes = 256;
  return plan;
}

JobConfig Job(const std::string& root) {
  JobConfig job;
  job.name = "device";
  job.world_size = kWorld;
  job.min_world_size = 1;
  job.widths = kWidths;
  job.data_path = DataFile();
  job.seed = kSeed;
  job.optimizer.kind = OptimizerKind::kAdam;
  job.optimizer.lr = 0.01;
  job.global_batch = kGlobalBatch;
  job.steps = 8;
  job.zero_stage = 2;
  job.shard_mode = ShardMode::kRange;
  job.bucket_cap_bytes = 1024;
  job.first_bucket_cap_bytes = 256;
  job.output_dir = root + "/out";
  job.checkpoint_dir = root + "/checkpoints";
  job.checkpoint_every = 4;
  std::filesystem::create_directories(job.output_dir);
  return job;
}

// TrainMlp on the job's ranks with `device` (null: the host), from `restore_dir` if set, also
// consolidating parameters and optimizer state into output_dir/consolidated.safetensors. Plays
// the coordinator's part for checkpoints: commits each once every rank's shard is on disk.
void Train(const JobConfig& job, Device* device, const std::string& restore_dir) {
  SavedShardCollector checkpoints;
  const std::vector<absl::Status> results =
      RunRanks(job.world_size, [&](int /*rank*/, Communicator& communicator) -> absl::Status {
        PlanOptions plan = PlanOptionsForJob(job);
        if (!restore_dir.empty()) {
          SHARD_ASSIGN_OR_RETURN(const CheckpointManifest manifest,
                                 ReadCheckpointManifest(restore_dir));
          plan.gradient_order = manifest.plan.gradient_order;
        }
        LocalPlanProvider plans(plan);
        TrainerOptions options;
        options.device = device;
        options.restore_dir = restore_dir;
        options.consolidate_to_rank = 0;
        options.consolidate_path = job.output_dir + "/consolidated.safetensors";
        options.observer = &checkpoints;
        return TrainMlp(job, communicator, plans, options).status();
      });
  for (const absl::Status& status : results) SHARD_ASSERT_OK(status);
  ASSERT_NO_FATAL_FAILURE(CommitSavedCheckpoints(job, checkpoints.Take()));
}

// Every tensor of a safetensors file.
Tensors ReadTensors(const std::string& path) {
  Tensors tensors;
  auto file = SafetensorsReader::Open(path);
  EXPECT_TRUE(file.ok()) << file.status();
  if (!file.ok()) return tensors;
  for (const TensorInfo& tensor : (*file)->tensors()) {
    std::vector<float> values(tensor.numel());
    SHARD_EXPECT_OK((*file)->ReadElements(tensor, 0, tensor.numel(), values.data()));
    tensors[tensor.name] = std::move(values);
  }
  return tensors;
}

// "" when `a` and `b` hold the same bits, else where they first differ.
std::string BitDifference(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return absl::StrCat("sizes ", a.size(), " and ", b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::memcmp(&a[i], &b[i], sizeof(float)) != 0) {
      return absl::StrFormat("element %d: %.9g vs %.9g", i, a[i], b[i]);
    }
  }
  return "";
}

void ExpectBitwiseEqual(const Tensors& actual, const Tensors& expected) {
  ASSERT_FALSE(expected.empty());
  ASSERT_EQ(actual.size(), expected.size());
  for (const auto& [name, values] : expected) {
    const auto found = actual.find(name);
    ASSERT_NE(found, actual.end()) << name;
    EXPECT_EQ(BitDifference(found->second, values), "") << name;
  }
}

TEST(EngineDeviceTest, ADeviceWithoutHostMemoryTrainsAndRestoresBitwiseLikeTheHost) {
  const std::string root = Root("staging");
  const JobConfig host = Job(root + "/host");
  ASSERT_NO_FATAL_FAILURE(Train(host, nullptr, ""));
  StagingDevice staging;
  const JobConfig staged = Job(root + "/staged");
  ASSERT_NO_FATAL_FAILURE(Train(staged, &staging, ""));
  // Initial values went in through Upload; final.safetensors and the consolidated state came
  // out through Download.
  EXPECT_GT(staging.uploads(), 0);
  EXPECT_GT(staging.downloads(), 0);

  const Tensors host_final = ReadTensors(host.output_dir + "/final.safetensors");
  ExpectBitwiseEqual(ReadTensors(staged.output_dir + "/final.safetensors"), host_final);
  ExpectBitwiseEqual(ReadTensors(staged.output_dir + "/consolidated.safetensors"),
                     ReadTensors(host.output_dir + "/consolidated.safetensors"));
  // Not trivially equal: training moved the parameters.
  const std::vector<std::vector<float>> initial = InitMlpParameters(kWidths, kSeed);
  EXPECT_NE(BitDifference(host_final.at("layers.0.weight"), initial[0]), "");

  // Both restore the host run's step-4 checkpoint and finish its 8 steps.
  const std::string at4 = CheckpointDirectory(host.checkpoint_dir, host.name, "step-00000004");
  JobConfig host_restored = Job(root + "/host-restored");
  host_restored.checkpoint_every = 0;
  ASSERT_NO_FATAL_FAILURE(Train(host_restored, nullptr, at4));
  StagingDevice restoring;
  JobConfig staged_restored = Job(root + "/staged-restored");
  staged_restored.checkpoint_every = 0;
  ASSERT_NO_FATAL_FAILURE(Train(staged_restored, &restoring, at4));
  // A restore sets no initial values: these uploads are the checkpoint read through the
  // engine's host scratch.
  EXPECT_GT(restoring.uploads(), 0);

  const Tensors restored_final = ReadTensors(host_restored.output_dir + "/final.safetensors");
  ExpectBitwiseEqual(ReadTensors(staged_restored.output_dir + "/final.safetensors"),
                     restored_final);
  ExpectBitwiseEqual(ReadTensors(staged_restored.output_dir + "/consolidated.safetensors"),
                     ReadTensors(host_restored.output_dir + "/consolidated.safetensors"));
  // Same world, same plan: the restored runs continue exactly as if never stopped.
  ExpectBitwiseEqual(restored_final, host_final);
}

// The engine driven directly, as TrainMlp drives it, with the host's Mlp.
struct Injection {
  int rank = 0;
  int64_t step = 0;  // 1-based
  int param = 0;
  int64_t element = 0;
};

struct AfterStep {
  StepTimings timings;
  std::vector<std::vector<float>> params;  // ParamValues after the step
  float loss_scale = 0;
  int64_t optimizer_steps = 0;
  int64_t steps_done = 0;
};

struct EngineRun {
  std::vector<std::vector<float>> initial;  // after BroadcastParameters, or after a restore
  int64_t start_step = 0;                   // the step `initial` is at
  float initial_loss_scale = 0;
  int64_t initial_optimizer_steps = 0;
  std::vector<AfterStep> steps;             // of steps start_step + 1, ...
};

absl::StatusOr<std::vector<std::vector<float>>> AllParamValues(const Engine& engine) {
  std::vector<std::vector<float>> values;
  for (size_t i = 0; i < engine.manifest().params.size(); ++i) {
    SHARD_ASSIGN_OR_RETURN(std::vector<float> v, engine.ParamValues(static_cast<int>(i)));
    values.push_back(std::move(v));
  }
  return values;
}

// Where a driven run starts and whether it saves a checkpoint on the way, as TrainMlp does.
struct Checkpointing {
  std::string restore_dir;  // start from this committed checkpoint (empty: the initial values)
  int64_t save_after = 0;   // after this step, save into job's checkpoint_dir (0: never)
  const JobConfig* job = nullptr;  // names the saved checkpoint; the engine's settings match it
  SavedShards* saved = nullptr;    // the saved shards, for CommitSavedCheckpoints
};

// Steps up to `steps` of Adam at ZeRO `zero_stage` on kWorld ranks (Job()'s settings), each rank
// running the forward and backward of its half of the global batch. With `inject`, that rank's
// gradient element is +inf at that step, written as backward completes it (before it is marked
// ready: with overlap its bucket may be reduced at once).
void DriveEngine(std::optional<LossScalerOptions> loss_scaling, int64_t steps,
                 std::optional<Injection> inject, const Checkpointing& checkpointing,
                 std::vector<EngineRun>* runs, int zero_stage = 2) {
  runs->assign(kWorld, EngineRun{});
  absl::Mutex mu;
  const std::vector<absl::Status> results =
      RunRanks(kWorld, [&](int rank, Communicator& communicator) -> absl::Status {
        PlanOptions planning = Planning(kWorld);
        std::unique_ptr<CheckpointReader> checkpoint;
        if (!checkpointing.restore_dir.empty()) {
          SHARD_ASSIGN_OR_RETURN(checkpoint, CheckpointReader::Open(checkpointing.restore_dir));
          // Restore needs the rebuilt plan: the checkpoint's gradient order gives it at once.
          planning.gradient_order = checkpoint->manifest().plan.gradient_order;
        }
        LocalPlanProvider plans(planning);
        EngineOptions options;
        options.zero_stage = zero_stage;
        options.optimizer.kind = OptimizerKind::kAdam;
        options.optimizer.lr = 0.01;
        options.loss_scaling = loss_scaling;
        SHARD_ASSIGN_OR_RETURN(
            std::unique_ptr<Engine> engine,
            Engine::Create(MlpManifest(kWidths), &communicator, &plans, options));
        const std::vector<std::vector<float>> init = InitMlpParameters(kWidths, kSeed);
        EngineRun& run = (*runs)[rank];
        if (checkpoint != nullptr) {
          SHARD_RETURN_IF_ERROR(engine->Restore(*checkpoint));
          run.start_step = checkpoint->manifest().step;
        } else {
          for (size_t i = 0; i < init.size(); ++i) {
            SHARD_RETURN_IF_ERROR(engine->SetParamValues(static_cast<int>(i), init[i].data()));
          }
          SHARD_RETURN_IF_ERROR(engine->BroadcastParameters());
        }
        SHARD_ASSIGN_OR_RETURN(run.initial, AllParamValues(*engine));
        run.initial_loss_scale = engine->loss_scale();
        run.initial_optimizer_steps = engine->optimizer_steps();
        SHARD_ASSIGN_OR_RETURN(std::unique_ptr<MlpBatchReader> data,
                               MlpBatchReader::Open(DataFile(), kWidths.front()));
        CheckpointSaver saver([&](const SavedShard& shard) {
          absl::MutexLock lock(&mu);
          (*checkpointing.saved)[shard.id].push_back(shard);
        });
        Mlp model(kWidths);
        const int n = static_cast<int>(init.size());
        std::vector<const float*> params(n);
        std::vector<float*> grads(n);
        std::vector<float> x;
        std::vector<int64_t> y;
        for (int64_t step = run.start_step + 1; step <= steps; ++step) {
          SHARD_RETURN_IF_ERROR(data->Read(step - 1, kGlobalBatch, rank, kWorld, &x, &y));
          for (int i = 0; i < n; ++i) {
            params[i] = engine->param(i);
            grads[i] = engine->grad(i);
          }
          SHARD_RETURN_IF_ERROR(
              model.Forward(params, x.data(), y.data(), kGlobalBatch / kWorld).status());
          engine->StartBackward();
          const bool poison = inject.has_value() && inject->rank == rank && inject->step == step;
          SHARD_RETURN_IF_ERROR(
              model.Backward(params, grads, 1.0f / kGlobalBatch * engine->loss_scale(),
                             [&](int i) {
                               if (poison && i == inject->param) {
                                 grads[i][inject->element] =
                                     std::numeric_limits<float>::infinity();
                               }
                               engine->MarkGradReady(i);
                             }));
          AfterStep after;
          SHARD_RETURN_IF_ERROR(engine->Step(&after.timings));
          SHARD_ASSIGN_OR_RETURN(after.params, AllParamValues(*engine));
          after.loss_scale = engine->loss_scale();
          after.optimizer_steps = engine->optimizer_steps();
          after.steps_done = engine->steps_done();
          run.steps.push_back(std::move(after));
          if (step == checkpointing.save_after) {
            StateBuffer bytes = saver.TakeBuffer();
            SHARD_RETURN_IF_ERROR(bytes.Resize(engine->OwnedStateBytes()));
            SHARD_RETURN_IF_ERROR(
                engine->CopyOwnedState(absl::MakeSpan(bytes.data(), bytes.size())));
            SavedShard saved;
            saved.id = CheckpointIdForStep(step);
            saved.dir =
                CheckpointDirectory(checkpointing.job->checkpoint_dir, checkpointing.job->name,
                                    saved.id);
            saved.step = step;
            saved.rank = rank;
            saved.plan = engine->plan_pointer();
            saved.plan_version = engine->plan_version();
            saved.counters = engine->counters();
            saver.Start(std::move(saved), kWorld, std::make_shared<StateBuffer>(std::move(bytes)));
          }
        }
        saver.WaitIdle();
        return absl::OkStatus();
      });
  for (const absl::Status& status : results) SHARD_ASSERT_OK(status);
}

void DriveEngine(std::optional<LossScalerOptions> loss_scaling, int64_t steps,
                 std::optional<Injection> inject, std::vector<EngineRun>* runs,
                 int zero_stage = 2) {
  DriveEngine(loss_scaling, steps, inject, Checkpointing{}, runs, zero_stage);
}

// "" when every parameter holds the same bits in `a` and `b`.
std::string ParamsBitDifference(const std::vector<std::vector<float>>& a,
                                const std::vector<std::vector<float>>& b) {
  if (a.size() != b.size()) return "different parameter counts";
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::string d = BitDifference(a[i], b[i]); !d.empty()) {
      return absl::StrCat("parameter ", i, " ", d);
    }
  }
  return "";
}

TEST(EngineDeviceTest, LossScalingByAPowerOfTwoIsExact) {
  constexpr int64_t kSteps = 8;
  std::vector<EngineRun> plain, scaled;
  ASSERT_NO_FATAL_FAILURE(DriveEngine(std::nullopt, kSteps, std::nullopt, &plain));
  ASSERT_NO_FATAL_FAILURE(DriveEngine(
      LossScalerOptions{.init_scale = 1024, .growth_interval = 3}, kSteps, std::nullopt, &scaled));
  for (int rank = 0; rank < kWorld; ++rank) {
    SCOPED_TRACE(absl::StrCat("rank ", rank));
    ASSERT_EQ(plain[rank].steps.size(), kSteps);
    ASSERT_EQ(scaled[rank].steps.size(), kSteps);
    for (int64_t s = 1; s <= kSteps; ++s) {
      SCOPED_TRACE(absl::StrCat("step ", s));
      const AfterStep& p = plain[rank].steps[s - 1];
      const AfterStep& q = scaled[rank].steps[s - 1];
      EXPECT_FALSE(q.timings.skipped);
      EXPECT_FALSE(p.timings.skipped);
      EXPECT_EQ(p.timings.loss_scale, 1.0f);
      EXPECT_EQ(p.loss_scale, 1.0f);
      // Doubling after every 3 clean steps: 1024 for steps 1-3, 2048 for 4-6, 4096 for 7-8.
      EXPECT_EQ(q.timings.loss_scale, std::ldexp(1024.0f, static_cast<int>((s - 1) / 3)));
      EXPECT_EQ(q.loss_scale, std::ldexp(1024.0f, static_cast<int>(s / 3)));
      EXPECT_EQ(q.optimizer_steps, s);
      EXPECT_EQ(q.steps_done, s);
      // x 2^k before the reduction and x 2^-k after it are exact in fp32: same bits every step.
      EXPECT_EQ(ParamsBitDifference(q.params, p.params), "");
    }
    EXPECT_EQ(scaled[rank].steps.back().loss_scale, 4096.0f);
    EXPECT_NE(ParamsBitDifference(plain[rank].steps.back().params, plain[rank].initial), "")
        << "training moved the parameters";
  }
  EXPECT_EQ(ParamsBitDifference(scaled[1].steps.back().params, scaled[0].steps.back().params), "");
}

TEST(EngineDeviceTest, AnInfGradientOnOneRankSkipsTheStepOnEveryRank) {
  constexpr int64_t kSteps = 6;
  constexpr int64_t kPoisoned = 4;  // after the first growth: 2048 -> 1024
  // At stage 2, layer 0's weight element 0 is owned by one rank after the reduce-scatter: the
  // other learns of the overflow only through the engine's agreement between ranks. At stage 0
  // the all-reduce carries the inf to every rank's gradients, and no agreement is needed.
  for (const int stage : {2, 0}) {
    SCOPED_TRACE(absl::StrCat("stage ", stage));
    std::vector<EngineRun> runs;
    ASSERT_NO_FATAL_FAILURE(DriveEngine(
        LossScalerOptions{.init_scale = 1024, .growth_interval = 3}, kSteps,
        Injection{.rank = 1, .step = kPoisoned, .param = Mlp::WeightIndex(0), .element = 0}, &runs,
        stage));
    for (int rank = 0; rank < kWorld; ++rank) {
      SCOPED_TRACE(absl::StrCat("rank ", rank));
      const std::vector<AfterStep>& steps = runs[rank].steps;
      ASSERT_EQ(steps.size(), kSteps);
      for (int64_t s = 1; s < kPoisoned; ++s) EXPECT_FALSE(steps[s - 1].timings.skipped) << s;
      const AfterStep& before = steps[kPoisoned - 2];
      const AfterStep& skipped = steps[kPoisoned - 1];
      const AfterStep& next = steps[kPoisoned];
      ASSERT_EQ(before.loss_scale, 2048.0f);

      EXPECT_TRUE(skipped.timings.skipped);
      EXPECT_EQ(skipped.timings.loss_scale, 2048.0f);
      EXPECT_EQ(ParamsBitDifference(skipped.params, before.params), "")
          << "a skipped step changes no parameter";
      EXPECT_EQ(skipped.steps_done, kPoisoned);
      EXPECT_EQ(skipped.optimizer_steps, kPoisoned - 1);
      EXPECT_EQ(skipped.loss_scale, 1024.0f);

      EXPECT_FALSE(next.timings.skipped);
      EXPECT_EQ(next.timings.loss_scale, 1024.0f);
      EXPECT_NE(ParamsBitDifference(next.params, skipped.params), "") << "the next step updates";
      EXPECT_EQ(next.optimizer_steps, kPoisoned);
      EXPECT_EQ(next.steps_done, kPoisoned + 1);
      for (const std::vector<float>& param : steps.back().params) {
        for (float v : param) ASSERT_TRUE(std::isfinite(v));
      }
    }
    EXPECT_EQ(ParamsBitDifference(runs[1].steps.back().params, runs[0].steps.back().params), "");
  }
}

TEST(EngineDeviceTest, ARestoreContinuesTheLossScaleAndTheOptimizerStep) {
  constexpr int64_t kSteps = 8;
  constexpr int64_t kPoisoned = 2;  // skipped: the scale drops 1024 -> 512
  constexpr int64_t kSaved = 4;     // 3 updates so far, and 2 clean steps toward the next growth
  const LossScalerOptions scaling{.init_scale = 1024, .growth_interval = 3};
  const Injection inf{.rank = 1, .step = kPoisoned, .param = Mlp::WeightIndex(0), .element = 0};
  const std::string root = Root("counters");
  const JobConfig job = Job(root);

  // The uninterrupted run, saving after step kSaved as TrainMlp does.
  SavedShards saved;
  Checkpointing saving;
  saving.save_after = kSaved;
  saving.job = &job;
  saving.saved = &saved;
  std::vector<EngineRun> uninterrupted;
  ASSERT_NO_FATAL_FAILURE(DriveEngine(scaling, kSteps, inf, saving, &uninterrupted));
  ASSERT_NO_FATAL_FAILURE(CommitSavedCheckpoints(job, saved));
  const std::string dir =
      CheckpointDirectory(job.checkpoint_dir, job.name, CheckpointIdForStep(kSaved));
  SHARD_ASSERT_OK_AND_ASSIGN(const CheckpointManifest manifest, ReadCheckpointManifest(dir));
  ASSERT_EQ(manifest.step, kSaved);
  ASSERT_TRUE(manifest.counters.has_value());
  EXPECT_EQ(manifest.counters->optimizer_step, kSaved - 1);
  EXPECT_EQ(manifest.counters->loss_scale, 512.0f);
  EXPECT_EQ(manifest.counters->loss_scale_growth_tracker, 2);
  for (int rank = 0; rank < kWorld; ++rank) {
    SCOPED_TRACE(absl::StrCat("rank ", rank));
    const std::vector<AfterStep>& steps = uninterrupted[rank].steps;
    ASSERT_EQ(steps.size(), kSteps);
    ASSERT_TRUE(steps[kPoisoned - 1].timings.skipped);
    ASSERT_EQ(steps[kSaved - 1].optimizer_steps, kSaved - 1);
    ASSERT_EQ(steps[kSaved - 1].loss_scale, 512.0f);
    // The growth tracker matters: 2 + 1 clean steps grow the scale after step 5, not step 7.
    ASSERT_EQ(steps[kSaved].loss_scale, 1024.0f);
    ASSERT_EQ(steps[kSteps - 1].loss_scale, 2048.0f);
  }

  // Fresh engines restore it and go on to step kSteps: the run continues as if never stopped.
  std::vector<EngineRun> continued;
  ASSERT_NO_FATAL_FAILURE(DriveEngine(scaling, kSteps, std::nullopt,
                                      Checkpointing{.restore_dir = dir}, &continued));
  for (int rank = 0; rank < kWorld; ++rank) {
    SCOPED_TRACE(absl::StrCat("rank ", rank));
    const EngineRun& run = continued[rank];
    const std::vector<AfterStep>& expected = uninterrupted[rank].steps;
    EXPECT_EQ(run.start_step, kSaved);
    // Not the step count, not the initial scale: where the saved run stood.
    EXPECT_EQ(run.initial_optimizer_steps, kSaved - 1);
    EXPECT_EQ(run.initial_loss_scale, 512.0f);
    EXPECT_EQ(ParamsBitDifference(run.initial, expected[kSaved - 1].params), "");
    ASSERT_EQ(run.steps.size(), kSteps - kSaved);
    for (int64_t s = kSaved + 1; s <= kSteps; ++s) {
      SCOPED_TRACE(absl::StrCat("step ", s));
      const AfterStep& actual = run.steps[s - kSaved - 1];
      EXPECT_FALSE(actual.timings.skipped);
      EXPECT_EQ(actual.steps_done, s);
      EXPECT_EQ(actual.timings.loss_scale, expected[s - 1].timings.loss_scale);
      EXPECT_EQ(actual.loss_scale, expected[s - 1].loss_scale);
      EXPECT_EQ(actual.optimizer_steps, expected[s - 1].optimizer_steps);
      EXPECT_EQ(ParamsBitDifference(actual.params, expected[s - 1].params), "");
    }
  }
  EXPECT_EQ(ParamsBitDifference(continued[1].steps.back().params,
                                continued[0].steps.back().params),
            "");

  // The same shards under a manifest without counters, as checkpoints were written before
  // them: the documented fallback (every step updated, the initial scale) restores other
  // counters, and Adam's bias correction then moves the parameters elsewhere. Proof that the
  // comparison above sees the counters.
  const std::string old_dir = CheckpointDirectory(job.checkpoint_dir, job.name, "no-counters");
  std::filesystem::create_directories(old_dir);
  for (const ShardRecord& shard : manifest.shards) {
    std::filesystem::copy_file(std::filesystem::path(dir) / shard.file,
                               std::filesystem::path(old_dir) / shard.file);
  }
  CheckpointManifest without = manifest;
  without.counters.reset();
  SHARD_ASSERT_OK(CommitCheckpoint(old_dir, without));
  std::vector<EngineRun> fallback;
  ASSERT_NO_FATAL_FAILURE(DriveEngine(scaling, kSteps, std::nullopt,
                                      Checkpointing{.restore_dir = old_dir}, &fallback));
  for (int rank = 0; rank < kWorld; ++rank) {
    SCOPED_TRACE(absl::StrCat("rank ", rank));
    const EngineRun& run = fallback[rank];
    const std::vector<AfterStep>& expected = uninterrupted[rank].steps;
    EXPECT_EQ(run.initial_optimizer_steps, kSaved);
    EXPECT_EQ(run.initial_loss_scale, scaling.init_scale);
    // The same parameters and optimizer state to start from...
    EXPECT_EQ(ParamsBitDifference(run.initial, expected[kSaved - 1].params), "");
    ASSERT_EQ(run.steps.size(), kSteps - kSaved);
    EXPECT_EQ(run.steps.front().optimizer_steps, kSaved + 1);
    EXPECT_EQ(run.steps.back().optimizer_steps, kSteps);
    // ...but another bias correction from the first update on.
    EXPECT_NE(ParamsBitDifference(run.steps.front().params, expected[kSaved].params), "");
    EXPECT_NE(ParamsBitDifference(run.steps.back().params, expected.back().params), "");
  }
}

// How the ranks' gradients are averaged: not at all, by the engine
// (EngineOptions::average_gradients), or by the caller dividing each gradient by the world size
// before marking it ready (as libshard did before the engine could).
enum class Averaging { kNone, kByEngine, kByCaller };

// Rank `rank`'s gradient of element i of parameter p at step s: different on every rank.
float Gradient(int rank, int step, int param, int64_t i) {
  return 0.001f * static_cast<float>((param * 131 + i * 7 + step * 17 + rank * 29) % 97 - 48);
}

// Rank 0's parameters after 3 steps of Adam on `world` ranks at ZeRO `stage` on `device` (null:
// the host), with Gradient()'s gradients averaged as `averaging` says.
std::vector<std::vector<float>> TrainAveraged(int world, int stage, Device* device,
                                              Averaging averaging) {
  const Manifest model = MlpManifest(kWidths);
  std::vector<std::vector<float>> trained(model.params.size());
  const std::vector<absl::Status> results =
      RunRanks(world, [&](int rank, Communicator& communicator) -> absl::Status {
        LocalPlanProvider plans(Planning(world));
        EngineOptions options;
        options.zero_stage = stage;
        options.optimizer.kind = OptimizerKind::kAdam;
        options.optimizer.lr = 0.01;
        options.device = device;
        options.average_gradients = averaging == Averaging::kByEngine;
        SHARD_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine,
                               Engine::Create(model, &communicator, &plans, options));
        const std::vector<std::vector<float>> init = InitMlpParameters(kWidths, kSeed);
        for (size_t p = 0; p < init.size(); ++p) {
          SHARD_RETURN_IF_ERROR(engine->SetParamValues(static_cast<int>(p), init[p].data()));
        }
        SHARD_RETURN_IF_ERROR(engine->BroadcastParameters());
        Device& memory = device != nullptr ? *device : HostDevice();
        for (int step = 0; step < 3; ++step) {
          SHARD_RETURN_IF_ERROR(engine->ZeroGradients());
          engine->StartBackward();
          for (int p = static_cast<int>(model.params.size()) - 1; p >= 0; --p) {
            const int64_t numel = model.params[p].numel();
            std::vector<float> grad(numel);
            for (int64_t i = 0; i < numel; ++i) grad[i] = Gradient(rank, step, p, i);
            SHARD_ASSIGN_OR_RETURN(float* into, engine->AcquireGrad(p));
            SHARD_RETURN_IF_ERROR(memory.Upload(grad.data(), into, numel));
            if (averaging == Averaging::kByCaller) {
              SHARD_RETURN_IF_ERROR(memory.Divide(into, numel, static_cast<float>(world)));
            }
            engine->MarkGradReady(p);
          }
          StepTimings timings;
          SHARD_RETURN_IF_ERROR(engine->Step(&timings));
        }
        for (size_t p = 0; p < model.params.size(); ++p) {
          if (rank == 0) trained[p].resize(model.params[p].numel());
          SHARD_RETURN_IF_ERROR(engine->GatherToRank(static_cast<int>(p), -1, 0,
                                                     rank == 0 ? trained[p].data() : nullptr));
        }
        return absl::OkStatus();
      });
  for (const absl::Status& status : results) SHARD_EXPECT_OK(status);
  return trained;
}

// Three ranks: dividing by 3 rounds, so only the same division of the same values before the
// same sum gives the same bits.
TEST(EngineDeviceTest, AveragingInTheEngineGivesTheBitsOfDividingBeforeMarkingReady) {
  StagingDevice staging;
  for (Device* device : {static_cast<Device*>(nullptr), static_cast<Device*>(&staging)}) {
    for (const int stage : {0, 1, 2, 3}) {
      SCOPED_TRACE(absl::StrCat(device != nullptr ? "staging" : "host", " stage ", stage));
      const auto by_engine = TrainAveraged(3, stage, device, Averaging::kByEngine);
      const auto by_caller = TrainAveraged(3, stage, device, Averaging::kByCaller);
      const auto summed = TrainAveraged(3, stage, device, Averaging::kNone);
      ASSERT_FALSE(by_engine.front().empty());
      EXPECT_EQ(ParamsBitDifference(by_engine, by_caller), "");
      EXPECT_NE(ParamsBitDifference(by_engine, summed), "") << "averaging changes the step";
    }
  }
}

TEST(EngineDeviceTest, TheHostDeviceRefuses16BitPrecisionNamingCuda) {
  for (DataType precision : {DataType::kBFloat16, DataType::kFloat16}) {
    SCOPED_TRACE(DataTypeName(precision));
    const absl::StatusOr<std::unique_ptr<MlpRunner>> model =
        HostDevice().CreateMlp(kWidths, 16, precision);
    EXPECT_EQ(model.status().code(), absl::StatusCode::kInvalidArgument) << model.status();
    EXPECT_TRUE(absl::StrContains(model.status().message(), "cuda")) << model.status();
  }
  SHARD_EXPECT_OK(HostDevice().CreateMlp(kWidths, 16, DataType::kFloat32).status());

  // And a bf16 job on the host stops before training, with that error.
  JobConfig job = Job(Root("bf16"));
  job.world_size = 1;
  job.precision = "bf16";
  const std::vector<absl::Status> results =
      RunRanks(1, [&](int, Communicator& communicator) -> absl::Status {
        LocalPlanProvider plans(Planning(1));
        return TrainMlp(job, communicator, plans).status();
      });
  EXPECT_EQ(results[0].code(), absl::StatusCode::kInvalidArgument) << results[0];
  EXPECT_TRUE(absl::StrContains(results[0].message(), "cuda")) << results[0];
}

}  // namespace
}  // namespace shard
