#include "common/checkpoint.h"
#include "common/safetensors.h"

#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace shard {
namespace {

Manifest Model() {
  return Manifest{{ParamSpec{"w", {300, 70}, DataType::kFloat32, true},
                   ParamSpec{"b", {300}, DataType::kFloat32, true}}};
}

// Writes a committed checkpoint of Model() over `world` ranks whose values encode their
// position: parameter p element i holds p * 1e6 + i, state k holds that + (k + 1) * 0.25.
std::string WriteCheckpoint(const std::string& name, int world) {
  const std::string root = ::testing::TempDir() + "/shard-checkpoint-test";
  const std::string dir = CheckpointDirectory(root, "job", name);
  std::filesystem::remove_all(dir);
  PlanOptions options;
  options.world_size = world;
  options.bucket_cap_bytes = 16 << 10;
  auto plan = MakePlan(Model(), options);
  EXPECT_TRUE(plan.ok());
  std::vector<ShardRecord> records;
  for (int rank = 0; rank < world; ++rank) {
    const ShardLayout layout = MakeShardLayout(Model(), *plan, rank, 2);
    auto writer = ShardWriter::Create(dir, rank, world);
    EXPECT_TRUE(writer.ok()) << writer.status();
    for (const ShardPiece& piece : layout.pieces) {
      for (int array = -1; array < 2; ++array) {
        std::vector<float> values(piece.numel);
        for (int64_t i = 0; i < piece.numel; ++i) {
          values[i] = piece.param * 1e6f + static_cast<float>(piece.param_offset + i) +
                      (array + 1) * 0.25f;
        }
        EXPECT_TRUE((*writer)->Append(values.data(), values.size() * 4).ok());
      }
    }
    auto record = (*writer)->Finish();
    EXPECT_TRUE(record.ok());
    records.push_back(*record);
  }
  OptimizerConfig adam;
  auto manifest = MakeCheckpointManifest("job", name, 7, 2, Model(), *plan, adam,
                                         {"exp_avg", "exp_avg_sq"}, records);
  EXPECT_TRUE(manifest.ok()) << manifest.status();
  EXPECT_TRUE(CommitCheckpoint(dir, *manifest).ok());
  return dir;
}

TEST(CheckpointTest, EveryElementReadsBackFromWhicheverShardHoldsIt) {
  const std::string dir = WriteCheckpoint("step-00000007", 3);
  auto reader = CheckpointReader::Open(dir);
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_EQ((*reader)->manifest().step, 7);
  EXPECT_EQ((*reader)->manifest().shards.size(), 3u);
  for (int param = 0; param < 2; ++param) {
    const int64_t numel = Model().params[param].numel();
    for (int array = -1; array < 2; ++array) {
      // Read in odd-sized windows that cross piece and shard boundaries.
      for (int64_t begin = 0; begin < numel; begin += 997) {
        const int64_t count = std::min<int64_t>(997, numel - begin);
        std::vector<float> values(count);
        ASSERT_TRUE((*reader)->ReadElements(param, array, begin, count, values.data()).ok());
        for (int64_t i = 0; i < count; ++i) {
          ASSERT_EQ(values[i], param * 1e6f + static_cast<float>(begin + i) + (array + 1) * 0.25f);
        }
      }
    }
  }
  for (size_t s = 0; s < 3; ++s) EXPECT_TRUE((*reader)->VerifyShard(s, nullptr).ok());
}

TEST(CheckpointTest, DamagedShardsAreNamedNeverReadAsWeights) {
  // A flipped byte.
  std::string dir = WriteCheckpoint("step-00000001", 2);
  const std::string shard1 = dir + "/" + ShardFileName(1, 2);
  {
    std::fstream file(shard1, std::ios::in | std::ios::out | std::ios::binary);
    file.seekp(100);
    char byte = 0;
    file.read(&byte, 1);
    file.seekp(100);
    byte ^= 0x10;
    file.write(&byte, 1);
  }
  auto reader = CheckpointReader::Open(dir);
  ASSERT_TRUE(reader.ok());
  EXPECT_TRUE((*reader)->VerifyShard(0, nullptr).ok());
  absl::Status flipped = (*reader)->VerifyShard(1, nullptr);
  EXPECT_EQ(flipped.code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(flipped.message().find(ShardFileName(1, 2)), absl::string_view::npos) << flipped;
  EXPECT_NE(flipped.message().find("bytes [0, "), absl::string_view::npos) << flipped;
  // Reading any element of that block fails too.
  std::vector<float> all(300 * 70);
  EXPECT_EQ((*reader)->ReadElements(0, -1, 0, 300 * 70, all.data()).code(),
            absl::StatusCode::kDataLoss);

  // A truncated shard.
  dir = WriteCheckpoint("step-00000002", 2);
  std::filesystem::resize_file(dir + "/" + ShardFileName(0, 2), 1000);
  reader = CheckpointReader::Open(dir);
  ASSERT_TRUE(reader.ok());
  absl::Status truncated = (*reader)->VerifyShard(0, nullptr);
  EXPECT_EQ(truncated.code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(truncated.message().find("truncated"), absl::string_view::npos) << truncated;

  // A missing shard.
  dir = WriteCheckpoint("step-00000003", 2);
  std::filesystem::remove(dir + "/" + ShardFileName(1, 2));
  reader = CheckpointReader::Open(dir);
  ASSERT_TRUE(reader.ok());
  absl::Status missing = (*reader)->VerifyShard(1, nullptr);
  EXPECT_EQ(missing.code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(missing.message().find(ShardFileName(1, 2)), absl::string_view::npos) << missing;
}

TEST(CheckpointTest, ManifestsFromTheFutureOrWithTraversalAreRefused) {
  const std::string dir = WriteCheckpoint("step-00000004", 1);
  const std::string path = dir + "/manifest.json";
  std::ifstream in(path);
  std::string json((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto rewrite = [&](const std::string& from, const std::string& to) {
    std::string changed = json;
    changed.replace(changed.find(from), from.size(), to);
    return CheckpointManifestFromJson(changed, path);
  };
  auto future = rewrite("\"format_version\": 1", "\"format_version\": 2");
  EXPECT_EQ(future.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(future.status().message().find("newer"), absl::string_view::npos);
  auto traversal = rewrite("\"file\": \"shard-", "\"file\": \"../shard-");
  EXPECT_EQ(traversal.status().code(), absl::StatusCode::kDataLoss);
  auto hole = rewrite("\"begin\": 0", "\"begin\": 1");
  EXPECT_EQ(hole.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_FALSE(ValidateCheckpointId("../step-1").ok());
  EXPECT_FALSE(ValidateCheckpointId("a/b").ok());
  EXPECT_EQ(ReadCheckpointManifest(dir + "-never-committed").status().code(),
            absl::StatusCode::kNotFound);
}

// Found by fuzzing (docs/fuzzing.md): numbers that used to be converted or wrapped around.
TEST(CheckpointTest, ForgedNumbersInTheManifestAreRefused) {
  const std::string dir = WriteCheckpoint("step-00000005", 1);
  const std::string path = dir + "/manifest.json";
  std::ifstream in(path);
  const std::string json((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto rewrite = [&](const std::string& from, const std::string& to) {
    std::string changed = json;
    const size_t at = changed.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    changed.replace(at, from.size(), to);
    return CheckpointManifestFromJson(changed, path).status();
  };
  // A float where an int goes (was undefined behaviour in the conversion).
  EXPECT_EQ(rewrite("\"world_size\": 1", "\"world_size\": 1e300").code(),
            absl::StatusCode::kDataLoss);
  EXPECT_EQ(rewrite("\"step\": 7", "\"step\": 7.5").code(), absl::StatusCode::kDataLoss);
  // An offset near 2^64 whose end wrapped around to "inside the shard".
  const absl::Status wrapped = rewrite("\"offset\": 0", "\"offset\": 18446744073709551612");
  EXPECT_EQ(wrapped.code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(wrapped.message().find("inside their shards"), absl::string_view::npos) << wrapped;
  // A shard size near 2^64 whose block count wrapped around to zero.
  std::string no_blocks = json;
  const size_t list = no_blocks.find("\"block_xxh3\": [");
  ASSERT_NE(list, std::string::npos);
  no_blocks.replace(list, no_blocks.find(']', list) + 1 - list, "\"block_xxh3\": []");
  const size_t bytes = no_blocks.find("\"bytes\": ");
  no_blocks.replace(bytes, no_blocks.find(',', bytes) - bytes, "\"bytes\": 18446744073709551615");
  EXPECT_EQ(CheckpointManifestFromJson(no_blocks, path).status().code(),
            absl::StatusCode::kDataLoss);
  // An optimizer this Shard does not know is not read as SGD.
  EXPECT_EQ(rewrite("\"name\": \"adam\"", "\"name\": \"lion\"").code(),
            absl::StatusCode::kDataLoss);
}

TEST(CheckpointTest, ACommittedCheckpointIsNeverWrittenAgain) {
  const std::string dir = WriteCheckpoint("step-00000005", 1);
  EXPECT_EQ(ShardWriter::Create(dir, 0, 1).status().code(), absl::StatusCode::kAlreadyExists);
}

TEST(CheckpointTest, ExportStreamsFullTensorsWithState) {
  const std::string dir = WriteCheckpoint("step-00000006", 3);
  const std::string out = ::testing::TempDir() + "/shard-checkpoint-test-export.safetensors";
  uint64_t last = 0;
  ASSERT_TRUE(ExportCheckpoint(dir, out, true, 4096,
                               [&](uint64_t done, uint64_t total) {
                                 EXPECT_GE(done, last);
                                 last = done;
                                 EXPECT_LE(done, total);
                               })
                  .ok());
  auto file = SafetensorsReader::Open(out);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->tensors().size(), 6u);
  EXPECT_EQ((*file)->metadata().at("step"), "7");
  auto b_sq = (*file)->Expect("b.exp_avg_sq", DataType::kFloat32, {300});
  ASSERT_TRUE(b_sq.ok());
  std::vector<float> values(300);
  ASSERT_TRUE((*file)->ReadElements(**b_sq, 0, 300, values.data()).ok());
  EXPECT_EQ(values[299], 1e6f + 299 + 0.5f);  // exp_avg_sq is state 1
}

}  // namespace
}  // namespace shard
