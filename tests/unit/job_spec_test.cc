#include "common/job_spec.h"

#include <filesystem>
#include <fstream>

#include "absl/strings/str_replace.h"
#include "common/mlp_data.h"
#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"
#include "proto/job_convert.h"

namespace shard {
namespace {

constexpr char kJob[] = R"({
  "name": "demo", "worldSize": 4,
  "model": {"mlp": {"widths": [8, 16, 4]}},
  "data": {"path": "data.safetensors"},
  "optimizer": {"name": "adamw", "lr": 0.001, "weightDecay": 0.1},
  "globalBatch": 32, "steps": 10, "outputDir": "out"
})";

std::string Dir() {
  const std::string dir = ::testing::TempDir() + "/shard-job-spec-test";
  std::filesystem::create_directories(dir);
  return dir;
}

std::string WriteJob(const std::string& name, const std::string& json) {
  const std::string path = Dir() + "/" + name;
  std::ofstream(path) << json;
  return path;
}

TEST(JobSpecTest, DefaultsAreAppliedAndPathsResolvedAgainstTheJobFile) {
  auto spec = ParseJobSpecJson(kJob);
  ASSERT_TRUE(spec.ok()) << spec.status();
  auto job = JobConfigFromProto(*spec, "/jobs");
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->min_world_size, 4);
  EXPECT_EQ(job->zero_stage, 1);
  EXPECT_EQ(job->shard_mode, ShardMode::kRange);
  EXPECT_EQ(job->bucket_cap_bytes, 25 << 20);
  EXPECT_DOUBLE_EQ(job->optimizer.beta2, 0.999);
  EXPECT_DOUBLE_EQ(job->optimizer.eps, 1e-8);
  EXPECT_EQ(job->optimizer.kind, OptimizerKind::kAdamW);
  EXPECT_TRUE(job->overlap);
  EXPECT_TRUE(job->overlap_param_gather);
  EXPECT_TRUE(job->overlap_update);
  EXPECT_EQ(job->data_path, "/jobs/data.safetensors");
  EXPECT_EQ(job->output_dir, "/jobs/out");
  // What workers receive is explicit and converts back to the same job.
  auto again = JobConfigFromProto(ToProto(*job), "/elsewhere");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->data_path, job->data_path);
  EXPECT_EQ(again->zero_stage, job->zero_stage);
  EXPECT_EQ(again->bucket_cap_bytes, job->bucket_cap_bytes);
  // Turned off, it stays off on the way to the workers.
  auto spec_off = ParseJobSpecJson(absl::StrReplaceAll(
      kJob, {{"\"steps\":", "\"overlapUpdate\": false, \"steps\":"}}));
  ASSERT_TRUE(spec_off.ok()) << spec_off.status();
  auto off = JobConfigFromProto(*spec_off, "/jobs");
  ASSERT_TRUE(off.ok()) << off.status();
  EXPECT_FALSE(off->overlap_update);
  auto off_again = JobConfigFromProto(ToProto(*off), "/elsewhere");
  ASSERT_TRUE(off_again.ok()) << off_again.status();
  EXPECT_FALSE(off_again->overlap_update);
}

TEST(JobSpecTest, BadSpecsAreClearErrors) {
  struct Case {
    std::string replace;
    std::string with;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {"\"steps\": 10", "\"steps\": 10, \"colour\": 1", "colour"},
      {"\"globalBatch\": 32", "\"globalBatch\": 30", "does not divide evenly over 4"},
      {"\"name\": \"demo\", ", "", "name is required"},
      {"\"outputDir\": \"out\"", "\"outputDir\": \"\"", "output_dir is required"},
      {"\"adamw\"", "\"lamb\"", "'lamb' is unknown"},
      {"\"lr\": 0.001", "\"lr\": -1", "optimizer.lr"},
      {"\"steps\": 10", "\"steps\": 10, \"zeroStage\": 4", "zero_stage"},
      {"\"steps\": 10", "\"steps\": 10, \"precision\": \"fp8\"", "use fp32, bf16 or fp16"},
      {"[8, 16, 4]", "[8]", "model.mlp.widths"},
      // Found by fuzzing (docs/fuzzing.md): each width in range, the layer 2^48 elements.
      {"[8, 16, 4]", "[16777216, 16777216, 4]", "too large"},
      {"\"steps\": 10", "\"steps\": \"many\"", "steps"},
      {"{\"mlp\": {\"widths\": [8, 16, 4]}}", "{}", "model.external"},
      {"\"steps\": 10", "\"steps\": 10, \"microBatches\": 0", "micro_batches"},
      {"\"steps\": 10", "\"steps\": 10, \"microBatches\": 3", "3 micro-batches on each of 4"},
      {"{\"mlp\": {\"widths\": [8, 16, 4]}}", "{\"external\": {}}, \"precision\": \"bf16\"",
       "external model trains in fp32"},
      // Parameter groups and the schedule.
      {"\"weightDecay\": 0.1", "\"weightDecay\": 0.1, \"paramGroups\": [{\"weightDecay\": 0}]",
       "optimizer.param_groups[0].match needs at least one parameter name pattern"},
      {"\"weightDecay\": 0.1", "\"weightDecay\": 0.1, \"paramGroups\": [{\"match\": [\"\"]}]",
       "optimizer.param_groups[0].match[0] is an empty pattern"},
      {"\"weightDecay\": 0.1",
       "\"weightDecay\": 0.1, \"paramGroups\": [{\"match\": [\"*.bias\"], \"weightDecay\": -1}]",
       "optimizer.param_groups[0].weight_decay must be a finite number >= 0"},
      {"\"weightDecay\": 0.1",
       "\"weightDecay\": 0.1, \"paramGroups\": [{\"match\": [\"*.bias\"], \"lrScale\": 0}]",
       "optimizer.param_groups[0].lr_scale must be > 0"},
      {"\"weightDecay\": 0.1",
       "\"weightDecay\": 0.1, \"paramGroups\": [{\"match\": [\"*.bias\"]}, "
       "{\"match\": [\"*norm*\", \"*.ln_*\"], \"weightDecay\": 0}]",
       "optimizer.param_groups[1] (match [\"*norm*\", \"*.ln_*\"]) matches no parameter"},
      {"\"weightDecay\": 0.1", "\"weightDecay\": 0.1, \"schedule\": {\"decay\": \"exponential\"}",
       "optimizer.schedule.decay 'exponential' is not a decay; use constant, cosine or linear"},
      {"\"weightDecay\": 0.1", "\"weightDecay\": 0.1, \"schedule\": {\"warmupSteps\": -1}",
       "optimizer.schedule.warmup_steps must be >= 0"},
      {"\"weightDecay\": 0.1", "\"weightDecay\": 0.1, \"schedule\": {\"warmupSteps\": 11}",
       "optimizer.schedule.warmup_steps is 11, more than the 10 steps"},
      {"\"weightDecay\": 0.1",
       "\"weightDecay\": 0.1, \"schedule\": {\"decay\": \"cosine\", \"minLr\": 0.01}",
       "optimizer.schedule.min_lr must be in [0, lr = 0.001]"},
      {"\"weightDecay\": 0.1", "\"weightDecay\": 0.1, \"schedule\": {\"minLr\": 0.0001}",
       "optimizer.schedule.min_lr needs decay cosine or linear"},
      {"\"weightDecay\": 0.1", "\"weightDecay\": 0.1, \"paramGroups\": {\"match\": 1}",
       "(optimizer.param_groups.match): invalid value 1"},
  };
  for (const Case& c : cases) {
    std::string json = kJob;
    const size_t at = json.find(c.replace);
    ASSERT_NE(at, std::string::npos) << c.replace;
    json.replace(at, c.replace.size(), c.with);
    absl::StatusOr<JobConfig> job = absl::UnknownError("unparsed");
    auto spec = ParseJobSpecJson(json);
    job = spec.ok() ? JobConfigFromProto(*spec, "") : absl::StatusOr<JobConfig>(spec.status());
    ASSERT_FALSE(job.ok()) << json;
    EXPECT_EQ(job.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(job.status().message().find(c.expected), absl::string_view::npos)
        << "expected '" << c.expected << "' in " << job.status();
  }
}

// kJob with `from` replaced by `to`.
std::string JobWith(const std::string& from, const std::string& to) {
  std::string json = kJob;
  json.replace(json.find(from), from.size(), to);
  return json;
}

TEST(JobSpecTest, AnExternalModelNeedsNoWidthsAndNoDataAndConvertsBack) {
  const std::string mlp = R"("mlp": {"widths": [8, 16, 4]})";
  const std::string data = R"("data": {"path": "data.safetensors"},)";
  std::string json = JobWith(mlp, R"("external": {})");
  json.replace(json.find(data), data.size(), "");
  auto spec = ParseJobSpecJson(json);
  ASSERT_TRUE(spec.ok()) << spec.status() << json;
  auto job = JobConfigFromProto(*spec, "/jobs");
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_TRUE(job->external_model);
  EXPECT_TRUE(job->widths.empty());
  EXPECT_TRUE(job->data_path.empty());
  auto again = JobConfigFromProto(ToProto(*job), "");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(again->external_model);
  // The built-in MLP still needs its data.
  spec = ParseJobSpecJson(JobWith(data, ""));
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_FALSE(JobConfigFromProto(*spec, "").ok());
}

// "torch": the training script brings its own optimizer class and its settings.
TEST(JobSpecTest, AScriptsOwnOptimizerTakesNoSettingsFromTheSpecAndNeedsAnExternalModel) {
  const std::string mlp = R"("mlp": {"widths": [8, 16, 4]})";
  const std::string adamw = R"("name": "adamw", "lr": 0.001, "weightDecay": 0.1)";
  std::string json = JobWith(mlp, R"("external": {})");
  json.replace(json.find(adamw), adamw.size(), R"("name": "torch")");
  auto spec = ParseJobSpecJson(json);
  ASSERT_TRUE(spec.ok()) << spec.status();
  auto job = JobConfigFromProto(*spec, "");
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->optimizer.kind, OptimizerKind::kTorch);
  EXPECT_TRUE(ValidateJobConfig(*job).ok()) << ValidateJobConfig(*job);
  // It converts back to the same spec: the name alone.
  auto again = JobConfigFromProto(ToProto(*job), "");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->optimizer.kind, OptimizerKind::kTorch);
  EXPECT_EQ(ToProto(*job).optimizer().ShortDebugString(), R"(name: "torch")");

  // Settings in the spec would be ignored: refused, saying where they go.
  std::string with_lr = json;
  with_lr.replace(with_lr.find(R"("name": "torch")"), 15, R"("name": "torch", "lr": 0.1)");
  auto refused = JobConfigFromProto(*ParseJobSpecJson(with_lr), "");
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("engine.optimizer"), std::string::npos)
      << refused.status();

  // The built-in MLP has no script to bring one.
  JobConfig builtin = *job;
  builtin.external_model = false;
  builtin.widths = {8, 16, 4};
  builtin.data_path = "data.safetensors";
  const absl::Status no_script = ValidateJobConfig(builtin);
  EXPECT_NE(no_script.message().find("needs an external model"), std::string::npos) << no_script;
}

TEST(JobSpecTest, ParamGroupsAndTheScheduleConvertAndRoundTrip) {
  const std::string json = JobWith(
      "\"weightDecay\": 0.1",
      R"("weightDecay": 0.1, "betas": [0.9, 0.95],
         "paramGroups": [{"match": ["*.bias", "*norm*", "*.ln_*"], "weightDecay": 0.0},
                         {"match": ["layers.1.*"], "lrScale": 0.5}],
         "schedule": {"warmupSteps": 3, "decay": "cosine", "minLr": 0.0001})");
  auto spec = ParseJobSpecJson(json);
  ASSERT_TRUE(spec.ok()) << spec.status();
  auto job = JobConfigFromProto(*spec, "/jobs");
  ASSERT_TRUE(job.ok()) << job.status();
  const OptimizerConfig& o = job->optimizer;
  ASSERT_EQ(o.param_groups.size(), 2u);
  EXPECT_EQ(o.param_groups[0].match, (std::vector<std::string>{"*.bias", "*norm*", "*.ln_*"}));
  EXPECT_EQ(o.param_groups[0].weight_decay, 0.0);
  EXPECT_EQ(o.param_groups[0].lr_scale, 1.0);
  EXPECT_EQ(o.param_groups[1].match, (std::vector<std::string>{"layers.1.*"}));
  EXPECT_FALSE(o.param_groups[1].weight_decay.has_value()) << "the optimizer's";
  EXPECT_EQ(o.param_groups[1].lr_scale, 0.5);
  EXPECT_EQ(o.schedule.warmup_steps, 3);
  EXPECT_EQ(o.schedule.decay, LrDecay::kCosine);
  EXPECT_EQ(o.schedule.min_lr, 0.0001);
  EXPECT_EQ(o.total_steps, 10) << "the schedule spans the job's steps";

  // What workers receive is explicit (the second group's decay is the optimizer's, written
  // out) and gives the same job, through the message and through its JSON.
  const v1::JobSpec explicit_spec = ToProto(*job);
  ASSERT_EQ(explicit_spec.optimizer().param_groups_size(), 2);
  EXPECT_TRUE(explicit_spec.optimizer().param_groups(1).has_weight_decay());
  EXPECT_EQ(explicit_spec.optimizer().param_groups(1).weight_decay(), 0.1);
  EXPECT_EQ(explicit_spec.optimizer().schedule().decay(), "cosine");
  std::string text;
  ASSERT_TRUE(google::protobuf::util::MessageToJsonString(explicit_spec, &text).ok());
  auto reparsed = ParseJobSpecJson(text);
  ASSERT_TRUE(reparsed.ok()) << reparsed.status() << text;
  auto again = JobConfigFromProto(*reparsed, "");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(ToProto(*again).SerializeAsString(), explicit_spec.SerializeAsString());
  EXPECT_EQ(again->optimizer.param_groups[1].weight_decay, 0.1);
  EXPECT_EQ(again->optimizer.schedule.min_lr, 0.0001);
  EXPECT_EQ(again->optimizer.total_steps, 10);

  // Without them: no groups, a constant lr, and the explicit spec says so.
  auto plain = JobConfigFromProto(*ParseJobSpecJson(kJob), "");
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_TRUE(plain->optimizer.param_groups.empty());
  EXPECT_EQ(plain->optimizer.schedule.decay, LrDecay::kConstant);
  EXPECT_EQ(plain->optimizer.schedule.warmup_steps, 0);
  EXPECT_EQ(ToProto(*plain).optimizer().schedule().decay(), "constant");
}

TEST(JobSpecTest, AnExternalModelsGroupsAreCheckedByItsEngine) {
  // Its parameter names are not known to the coordinator: any pattern passes here.
  const std::string mlp = R"("mlp": {"widths": [8, 16, 4]})";
  const std::string data = R"("data": {"path": "data.safetensors"},)";
  std::string json = JobWith(mlp, R"("external": {})");
  json.replace(json.find(data), data.size(), "");
  json.replace(json.find("\"weightDecay\": 0.1"), 18,
               R"("weightDecay": 0.1, "paramGroups": [{"match": ["*norm*"], "weightDecay": 0}])");
  auto spec = ParseJobSpecJson(json);
  ASSERT_TRUE(spec.ok()) << spec.status() << json;
  auto job = JobConfigFromProto(*spec, "");
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->optimizer.param_groups.size(), 1u);
}

TEST(JobSpecTest, TheDataFileIsCheckedAgainstTheModel) {
  const std::string data = Dir() + "/data.safetensors";
  ASSERT_TRUE(GenerateMlpData({8, 16, 4}, 100, 1, data).ok());
  const std::string job = WriteJob("job.json", kJob);
  auto loaded = LoadJobFile(job);
  ASSERT_TRUE(loaded.ok()) << loaded.status();

  // Widths that disagree with the data.
  std::string other = kJob;
  other.replace(other.find("[8, 16, 4]"), 10, "[9, 16, 4]");
  auto mismatch = LoadJobFile(WriteJob("mismatch.json", other));
  ASSERT_FALSE(mismatch.ok());
  EXPECT_NE(mismatch.status().message().find("F32[100, 8] but F32[100, 9] is needed"),
            absl::string_view::npos)
      << mismatch.status();

  // A truncated data file.
  std::filesystem::resize_file(data, std::filesystem::file_size(data) - 100);
  auto truncated = LoadJobFile(job);
  ASSERT_FALSE(truncated.ok());
  EXPECT_EQ(truncated.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(truncated.status().message().find("data.safetensors"), absl::string_view::npos);

  // No data file at all.
  std::filesystem::remove(data);
  EXPECT_EQ(LoadJobFile(job).status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace shard
