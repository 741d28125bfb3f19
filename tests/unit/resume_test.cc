// Resume equivalence: a job checkpointed at step 15 on 4 ranks and restored on 2, 3 and 1 ranks
// ends at step 30 with the parameters and optimizer state of the uninterrupted 4-rank run, at
// ZeRO stages 1 and 2 and in both shard modes. Ranks are threads over real loopback TCP.
#include <filesystem>
#include <map>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/checkpoint.h"
#include "common/mlp_data.h"
#include "common/safetensors.h"
#include "gtest/gtest.h"
#include "tests/support/train_on_threads.h"
#include "worker/dataplane/gloo_communicator.h"
#include "worker/dataplane/trainer.h"

namespace shard {
namespace {

const std::vector<int64_t> kWidths = {12, 40, 24, 6};

std::string Root(const std::string& name) {
  const std::string dir = ::testing::TempDir() + "/shard-resume-test/" + name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

JobConfig Job(const std::string& root, int world, int stage, ShardMode mode) {
  JobConfig job;
  job.name = "resume";
  job.world_size = world;
  job.min_world_size = 1;
  job.widths = kWidths;
  job.data_path = ::testing::TempDir() + "/shard-resume-test-data.safetensors";
  job.seed = 9;
  job.optimizer.kind = OptimizerKind::kAdam;
  job.optimizer.lr = 0.01;
  job.global_batch = 48;  // divides over 1, 2, 3 and 4 ranks
  job.steps = 30;
  job.zero_stage = stage;
  job.shard_mode = mode;
  job.bucket_cap_bytes = 1024;
  job.first_bucket_cap_bytes = 256;
  job.output_dir = root + "/out";
  job.checkpoint_dir = root + "/checkpoints";
  job.checkpoint_every = 15;
  return job;
}

// Every parameter and optimizer state element of a checkpoint, by tensor.
std::map<std::string, std::vector<float>> Contents(const std::string& dir) {
  std::map<std::string, std::vector<float>> contents;
  auto reader = CheckpointReader::Open(dir);
  EXPECT_TRUE(reader.ok()) << reader.status();
  const CheckpointManifest& m = (*reader)->manifest();
  for (size_t p = 0; p < m.tensors.size(); ++p) {
    for (int array = -1; array < static_cast<int>(m.state_names.size()); ++array) {
      std::vector<float> values(m.tensors[p].param.numel());
      EXPECT_TRUE((*reader)
                      ->ReadElements(static_cast<int>(p), array, 0,
                                     static_cast<int64_t>(values.size()), values.data())
                      .ok());
      contents[m.tensors[p].param.name + (array < 0 ? "" : "." + m.state_names[array])] = values;
    }
  }
  return contents;
}

struct Case {
  int stage;
  ShardMode mode;
  int restore_stage;  // the stage the resumed run trains at
};

class ResumeTest : public ::testing::TestWithParam<Case> {};

TEST_P(ResumeTest, RestoringOnAnyWorldSizeContinuesExactlyAsIfNeverStopped) {
  const Case c = GetParam();
  const std::string data = ::testing::TempDir() + "/shard-resume-test-data.safetensors";
  if (!std::filesystem::exists(data)) {
    ASSERT_TRUE(GenerateMlpData(kWidths, 300, 4, data).ok());
  }
  const std::string tag =
      absl::StrCat("stage", c.stage, "to", c.restore_stage, ShardModeName(c.mode));

  const JobConfig full = Job(Root(tag + "-full"), 4, c.stage, c.mode);
  TrainMlpOnThreads(full, "");
  const std::string at15 = CheckpointDirectory(full.checkpoint_dir, full.name, "step-00000015");
  const auto expected = Contents(CheckpointDirectory(full.checkpoint_dir, full.name,
                                                     "step-00000030"));
  ASSERT_FALSE(expected.empty());

  for (int world : {2, 3, 1}) {
    SCOPED_TRACE(absl::StrCat("restored on ", world, " ranks"));
    const JobConfig resumed =
        Job(Root(absl::StrCat(tag, "-", world)), world, c.restore_stage, c.mode);
    TrainMlpOnThreads(resumed, at15);
    const auto actual = Contents(CheckpointDirectory(resumed.checkpoint_dir, resumed.name,
                                                     "step-00000030"));
    ASSERT_EQ(actual.size(), expected.size());
    double worst = 0;
    for (const auto& [name, values] : expected) {
      const std::vector<float>& other = actual.at(name);
      for (size_t i = 0; i < values.size(); ++i) {
        worst = std::max(worst, std::abs(static_cast<double>(values[i]) - other[i]));
      }
    }
    // Different world sizes sum gradients in different orders (fp32), as in the training test;
    // 15 more Adam steps keep parameters and moments within 2e-5 of the uninterrupted run's.
    EXPECT_LT(worst, 2e-5);
  }
}

// Every tensor of a safetensors file.
std::map<std::string, std::vector<float>> SafetensorsContents(const std::string& path) {
  std::map<std::string, std::vector<float>> contents;
  auto file = SafetensorsReader::Open(path);
  EXPECT_TRUE(file.ok()) << file.status();
  for (const TensorInfo& tensor : (*file)->tensors()) {
    std::vector<float> values(tensor.numel());
    EXPECT_TRUE((*file)->ReadElements(tensor, 0, tensor.numel(), values.data()).ok());
    contents[tensor.name] = values;
  }
  return contents;
}

double MaxDifference(const std::map<std::string, std::vector<float>>& a,
                     const std::map<std::string, std::vector<float>>& b) {
  EXPECT_EQ(a.size(), b.size());
  double worst = 0;
  for (const auto& [name, values] : a) {
    auto other = b.find(name);
    EXPECT_NE(other, b.end()) << name;
    if (other == b.end()) return 1e30;
    for (size_t i = 0; i < values.size(); ++i) {
      worst = std::max(worst, std::abs(static_cast<double>(values[i]) - other->second[i]));
    }
  }
  return worst;
}

TEST(ConsolidationTest, ConsolidatedStateEqualsTheExportAndImportingItContinuesTheRun) {
  const std::string data = ::testing::TempDir() + "/shard-resume-test-data.safetensors";
  if (!std::filesystem::exists(data)) {
    ASSERT_TRUE(GenerateMlpData(kWidths, 300, 4, data).ok());
  }
  const std::string root = Root("consolidation");
  JobConfig a = Job(root + "/a", 4, 2, ShardMode::kRange);
  a.steps = 20;
  a.checkpoint_every = 10;
  const std::string consolidated_a = root + "/a-consolidated.safetensors";
  TrainMlpOnThreads(a, "", consolidated_a);

  // consolidate_state_dict(to=3) and the streamed export of the step-20 checkpoint agree.
  const std::string exported_20 = root + "/a-export-20.safetensors";
  ASSERT_TRUE(ExportCheckpoint(CheckpointDirectory(a.checkpoint_dir, a.name, "step-00000020"),
                               exported_20, /*with_state=*/true, 4096, nullptr)
                  .ok());
  EXPECT_EQ(MaxDifference(SafetensorsContents(consolidated_a), SafetensorsContents(exported_20)),
            0.0);

  // A new job on 2 ranks, another stage and mode, importing the step-10 export with its state,
  // continues the run: it ends where the uninterrupted run ended.
  const std::string exported_10 = root + "/a-export-10.safetensors";
  ASSERT_TRUE(ExportCheckpoint(CheckpointDirectory(a.checkpoint_dir, a.name, "step-00000010"),
                               exported_10, /*with_state=*/true, 1 << 20, nullptr)
                  .ok());
  JobConfig b = Job(root + "/b", 2, 1, ShardMode::kParam);
  b.steps = 20;
  b.checkpoint_every = 0;
  b.init_path = exported_10;
  const std::string consolidated_b = root + "/b-consolidated.safetensors";
  TrainMlpOnThreads(b, "", consolidated_b);
  EXPECT_LT(MaxDifference(SafetensorsContents(consolidated_a), SafetensorsContents(consolidated_b)),
            2e-5);
}

INSTANTIATE_TEST_SUITE_P(Stages, ResumeTest,
                         ::testing::Values(Case{1, ShardMode::kRange, 1},
                                           Case{1, ShardMode::kParam, 1},
                                           Case{2, ShardMode::kRange, 2},
                                           Case{2, ShardMode::kParam, 2},
                                           // Across stages: a checkpoint holds plan ranges,
                                           // whatever the stage that saved them.
                                           Case{3, ShardMode::kRange, 2},
                                           Case{3, ShardMode::kParam, 1},
                                           Case{2, ShardMode::kRange, 3},
                                           Case{3, ShardMode::kParam, 3}),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return absl::StrCat("stage", info.param.stage, "_",
                                               ShardModeName(info.param.mode), "_restored_at_",
                                               info.param.restore_stage);
                         });

}  // namespace
}  // namespace shard
