#include "common/checkpoint.h"
#include "common/safetensors.h"

#include <unistd.h>
#include <xxhash.h>

#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/files.h"
#include "common/shard_hasher.h"
#include "common/status_macros.h"
#include "gtest/gtest.h"
#include "tests/support/status_assertions.h"

namespace shard {
namespace {

Manifest Model() {
  return Manifest{{ParamSpec{"w", {300, 70}, DataType::kFloat32, true},
                   ParamSpec{"b", {300}, DataType::kFloat32, true}}};
}

// Over 2 ranks, shards of 21 MiB: five whole 4 MiB blocks and a short one, and each of w's
// arrays (7.4 MB per rank) starts and ends inside a block.
Manifest LargeModel() {
  return Manifest{{ParamSpec{"w", {3000, 1237}, DataType::kFloat32, true},
                   ParamSpec{"b", {1237}, DataType::kFloat32, true}}};
}

// Writes a committed checkpoint of `model` over `world` ranks whose values encode their
// position: parameter p element i holds p * 1e6 + i, state k holds that + (k + 1) * 0.25. At
// step 7, with `counters` in its manifest (none: as checkpoints before them were written).
std::string WriteCheckpoint(const std::string& name, int world,
                            std::optional<TrainingCounters> counters = std::nullopt,
                            const Manifest& model = Model()) {
  // Per process: ctest may run this binary's tests at once, and they reuse checkpoint names.
  const std::string root =
      ::testing::TempDir() + "/shard-checkpoint-test-" + std::to_string(getpid());
  const std::string dir = CheckpointDirectory(root, "job", name);
  std::filesystem::remove_all(dir);
  PlanOptions options;
  options.world_size = world;
  options.bucket_cap_bytes = 16 << 10;
  auto plan = MakePlan(model, options);
  EXPECT_TRUE(plan.ok());
  std::vector<ShardRecord> records;
  for (int rank = 0; rank < world; ++rank) {
    const ShardLayout layout = MakeShardLayout(model, *plan, rank, 2);
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
  auto manifest = MakeCheckpointManifest("job", name, 7, 2, model, *plan, adam,
                                         {"exp_avg", "exp_avg_sq"}, records);
  EXPECT_TRUE(manifest.ok()) << manifest.status();
  manifest->counters = counters;
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

// The value WriteCheckpoint stores for element `i` of parameter `param`'s array `array`.
float Expected(int param, int array, int64_t i) {
  return param * 1e6f + static_cast<float>(i) + (array + 1) * 0.25f;
}

// `record` has XXH3 of each kCheckpointBlockBytes block of `bytes`.
void ExpectBlockHashes(const ShardRecord& record, const std::vector<char>& bytes) {
  const uint64_t blocks = (bytes.size() + kCheckpointBlockBytes - 1) / kCheckpointBlockBytes;
  ASSERT_EQ(record.block_xxh3.size(), blocks);
  for (uint64_t b = 0; b < blocks; ++b) {
    const uint64_t begin = b * kCheckpointBlockBytes;
    const uint64_t length = std::min<uint64_t>(kCheckpointBlockBytes, bytes.size() - begin);
    EXPECT_EQ(record.block_xxh3[b],
              absl::StrFormat("%016x", XXH3_64bits(bytes.data() + begin, length)))
        << "block " << b;
  }
}

TEST(CheckpointTest, AShardsRecordIsTheChecksumsOfItsBytesHoweverTheyWereAppended) {
  // Two and a half blocks and a few bytes, appended at once (hashed on a second thread while
  // they are written) and in small odd pieces (hashed inline): the same file and the same
  // record, which is XXH3 of the whole file and of each 4 MiB block.
  std::vector<char> bytes(2 * kCheckpointBlockBytes + kCheckpointBlockBytes / 2 + 13);
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<char>((i * 2654435761u) >> 11);
  const std::string root =
      ::testing::TempDir() + "/shard-checkpoint-test-record-" + std::to_string(getpid());
  std::filesystem::remove_all(root);
  auto write = [&](const std::string& id, size_t piece) -> ShardRecord {
    const std::string dir = CheckpointDirectory(root, "job", id);
    absl::StatusOr<std::unique_ptr<ShardWriter>> writer = ShardWriter::Create(dir, 1, 2);
    EXPECT_TRUE(writer.ok()) << writer.status();
    for (size_t at = 0; at < bytes.size(); at += piece) {
      EXPECT_TRUE((*writer)->Append(bytes.data() + at, std::min(piece, bytes.size() - at)).ok());
    }
    absl::StatusOr<ShardRecord> record = (*writer)->Finish();
    EXPECT_TRUE(record.ok()) << record.status();
    std::ifstream in(dir + "/" + ShardFileName(1, 2), std::ios::binary);
    const std::vector<char> file((std::istreambuf_iterator<char>(in)),
                                 std::istreambuf_iterator<char>());
    EXPECT_TRUE(file == bytes) << id;
    return record.ok() ? *record : ShardRecord{};
  };
  const ShardRecord at_once = write("step-00000001", bytes.size());
  const ShardRecord in_pieces = write("step-00000002", (size_t{1} << 20) + 7);
  EXPECT_EQ(at_once, in_pieces);
  EXPECT_EQ(at_once.file, ShardFileName(1, 2));
  EXPECT_EQ(at_once.rank, 1);
  EXPECT_EQ(at_once.bytes, bytes.size());
  EXPECT_EQ(at_once.xxh3, absl::StrFormat("%016x", XXH3_64bits(bytes.data(), bytes.size())));
  ExpectBlockHashes(at_once, bytes);
}

TEST(CheckpointTest, AHasherOfTheBlocksAloneGivesTheSameBlocksAndNoWholeHash) {
  // What a replica is checked with: every block's XXH3, in pieces across block ends, and no
  // whole-shard hash (the record it is compared with carries that).
  std::vector<char> bytes(2 * kCheckpointBlockBytes + 29);
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<char>((i * 40503u) >> 7);
  ShardHasher blocks(ShardHasher::Sums::kBlocksOnly);
  const size_t piece = (size_t{3} << 20) + 5;
  for (size_t at = 0; at < bytes.size(); at += piece) {
    blocks.Append(bytes.data() + at, std::min(piece, bytes.size() - at));
  }
  const ShardRecord checked = blocks.Finish("f", 0);
  EXPECT_EQ(checked.bytes, bytes.size());
  EXPECT_EQ(checked.xxh3, "");
  ExpectBlockHashes(checked, bytes);
  EXPECT_EQ(checked.block_xxh3, HashShard(bytes.data(), bytes.size(), "f", 0).block_xxh3);
}

TEST(CheckpointTest, ReadsOfWholeAndPartialBlocksAcrossShardEndsReturnTheirBytes) {
  const std::string dir = WriteCheckpoint("step-00000020", 2, std::nullopt, LargeModel());
  auto reader = CheckpointReader::Open(dir);
  ASSERT_TRUE(reader.ok()) << reader.status();
  for (const ShardRecord& shard : (*reader)->manifest().shards) {
    ASSERT_GT(shard.block_xxh3.size(), 2u);
    ASSERT_NE(shard.bytes % kCheckpointBlockBytes, 0u);
  }
  // Windows smaller than a block, a little larger, exactly one, of several, and each array
  // whole: they start at and inside blocks, end in the shards' short last blocks, and cross
  // from one rank's shard into the other's.
  const int64_t block_floats = kCheckpointBlockBytes / sizeof(float);
  for (int param = 0; param < 2; ++param) {
    const int64_t numel = LargeModel().params[param].numel();
    for (int64_t window : {int64_t{99991}, block_floats + 3, block_floats, 3 * block_floats + 5,
                           numel}) {
      for (int array = -1; array < 2; ++array) {
        for (int64_t begin = 0; begin < numel; begin += window) {
          const int64_t count = std::min(window, numel - begin);
          std::vector<float> values(count);
          ASSERT_TRUE((*reader)->ReadElements(param, array, begin, count, values.data()).ok());
          for (int64_t i = 0; i < count; ++i) {
            ASSERT_EQ(values[i], Expected(param, array, begin + i))
                << "param " << param << " array " << array << " window " << window << " at "
                << begin + i;
          }
        }
      }
    }
  }
  for (size_t s = 0; s < 2; ++s) EXPECT_TRUE((*reader)->VerifyShard(s, nullptr).ok());
}

TEST(CheckpointTest, CorruptionInAWholeBlockReadNamesTheShardAndTheBlock) {
  const std::string dir = WriteCheckpoint("step-00000021", 2, std::nullopt, LargeModel());
  SHARD_ASSERT_OK_AND_ASSIGN(const CheckpointManifest manifest, ReadCheckpointManifest(dir));
  // w's exp_avg in shard 0 covers block 2 whole: reading it all reads that block straight into
  // the caller's buffer.
  const TensorPiece& piece = manifest.tensors[0].pieces[0];
  ASSERT_EQ(piece.shard, 0);
  const uint64_t piece_bytes = (piece.end - piece.begin) * sizeof(float);
  const uint64_t state_begin = piece.offset + piece_bytes;
  ASSERT_LE(state_begin, 2 * kCheckpointBlockBytes);
  ASSERT_GE(state_begin + piece_bytes, 3 * kCheckpointBlockBytes);
  {
    std::fstream file(dir + "/" + ShardFileName(0, 2),
                      std::ios::in | std::ios::out | std::ios::binary);
    file.seekp(2 * kCheckpointBlockBytes + 12345);
    file.put('\x5a');
  }
  auto reader = CheckpointReader::Open(dir);
  ASSERT_TRUE(reader.ok()) << reader.status();
  const std::string range = absl::StrCat("bytes [", 2 * kCheckpointBlockBytes, ", ",
                                         3 * kCheckpointBlockBytes, ")");
  std::vector<float> values(piece.end - piece.begin);
  const absl::Status whole =
      (*reader)->ReadElements(0, 0, piece.begin, values.size(), values.data());
  EXPECT_EQ(whole.code(), absl::StatusCode::kDataLoss) << whole;
  EXPECT_NE(whole.message().find(ShardFileName(0, 2)), absl::string_view::npos) << whole;
  EXPECT_NE(whole.message().find(range), absl::string_view::npos) << whole;
  // A few elements inside that block (through the one-block cache): the same error.
  const int64_t inside = (3 * kCheckpointBlockBytes - state_begin) / sizeof(float) - 10;
  const absl::Status partial =
      (*reader)->ReadElements(0, 0, piece.begin + inside, 5, values.data());
  EXPECT_EQ(partial.code(), absl::StatusCode::kDataLoss) << partial;
  EXPECT_NE(partial.message().find(range), absl::string_view::npos) << partial;
  // The blocks around it still read.
  SHARD_EXPECT_OK((*reader)->ReadElements(0, -1, piece.begin, values.size(), values.data()));
  EXPECT_EQ(values.back(), Expected(0, -1, piece.end - 1));
}

// A directory's shards read with `pread` only, as where the kernel or the file system cannot map
// them: the storage has no views.
class ShardsReadWithPread : public ShardStorage {
 public:
  explicit ShardsReadWithPread(std::unique_ptr<ShardStorage> files) : files_(std::move(files)) {}
  absl::Status Read(int shard, uint64_t offset, uint64_t bytes, char* out) override {
    return files_->Read(shard, offset, bytes, out);
  }
  std::string Describe(int shard) const override { return files_->Describe(shard); }

 private:
  std::unique_ptr<ShardStorage> files_;
};

// A reader of `dir` that maps its shards (where this kernel can: the directory's own), or one
// that reads them with `pread`.
std::unique_ptr<CheckpointReader> OpenReader(const std::string& dir, bool mapped) {
  absl::StatusOr<CheckpointManifest> manifest = ReadCheckpointManifest(dir);
  EXPECT_TRUE(manifest.ok()) << manifest.status();
  std::unique_ptr<ShardStorage> files = DirectoryShards(dir, *manifest);
  if (!mapped) files = std::make_unique<ShardsReadWithPread>(std::move(files));
  return CheckpointReader::Open(*std::move(manifest), std::move(files), dir);
}

// Whole blocks are read through a mapping of the shard and copied out; or, where the shard is
// read with `pread`, straight into the destination, or (when it sits 1 to 31 bytes past a page
// boundary, where the kernel's copy is slow) through staging and copied out. Whichever way and
// wherever the destination is, the same bytes arrive, and a corrupt block is refused.
TEST(CheckpointTest, EveryPlacementOfTheDestinationReadsTheSameCheckedBytes) {
  // On one rank each of w's arrays is 52 MB: a dozen whole blocks per read, so reads overlap
  // checks and staging areas are reused.
  const Manifest model{{ParamSpec{"w", {5000, 2600}, DataType::kFloat32, true},
                        ParamSpec{"b", {2600}, DataType::kFloat32, true}}};
  const std::string dir = WriteCheckpoint("step-00000022", 1, std::nullopt, model);
  SHARD_ASSERT_OK_AND_ASSIGN(const CheckpointManifest manifest, ReadCheckpointManifest(dir));
  const int64_t count = model.params[0].numel();
  ASSERT_EQ(manifest.tensors[0].pieces.size(), 1u);
  // w's exp_avg, after its values.
  const uint64_t state_begin = manifest.tensors[0].pieces[0].offset + count * sizeof(float);
  AlignedBuffer memory(count * sizeof(float) + 4096);
  // Where `values` go so that they sit `gap` bytes past the file's bytes modulo a page.
  auto placed = [&](uint64_t gap) {
    return reinterpret_cast<float*>(memory.data() + (gap + state_begin) % 4096);
  };
  for (bool mapped : {true, false}) {
    std::unique_ptr<CheckpointReader> reader = OpenReader(dir, mapped);
    // Mapped, the checker copies every block out; with pread, direct (0, 32, 2048) and staged
    // (4, 16, 28).
    for (int gap : {0, 4, 16, 28, 32, 2048}) {
      float* values = placed(gap);
      std::fill(values, values + count, -1.0f);
      SHARD_ASSERT_OK(reader->ReadElements(0, 0, 0, count, values));
      for (int64_t i = 0; i < count; ++i) {
        ASSERT_EQ(values[i], Expected(0, 0, i))
            << "mapped " << mapped << " gap " << gap << " at " << i;
      }
    }
  }
  // A block well inside exp_avg is corrupt: refused whichever way it is read.
  const uint64_t corrupt_block = (state_begin + kCheckpointBlockBytes - 1) / kCheckpointBlockBytes + 9;
  ASSERT_LT((corrupt_block + 1) * kCheckpointBlockBytes, state_begin + count * sizeof(float));
  {
    std::fstream file(dir + "/" + ShardFileName(0, 1),
                      std::ios::in | std::ios::out | std::ios::binary);
    file.seekp(corrupt_block * kCheckpointBlockBytes + 777);
    file.put('\x5a');
  }
  for (bool mapped : {true, false}) {
    for (int gap : {0, 16}) {
      std::unique_ptr<CheckpointReader> fresh = OpenReader(dir, mapped);  // nothing cached
      const absl::Status status = fresh->ReadElements(0, 0, 0, count, placed(gap));
      EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss)
          << "mapped " << mapped << " gap " << gap << ": " << status;
      EXPECT_NE(status.message().find(
                    absl::StrCat("bytes [", corrupt_block * kCheckpointBlockBytes, ", ")),
                absl::string_view::npos)
          << status;
    }
  }
}

// A shard cut short by someone else after the reader mapped it (its size was checked when it was
// opened): touching the missing pages would raise SIGBUS; the read fails with an error instead.
TEST(CheckpointTest, AShardCutShortAfterItWasMappedIsRefusedNotACrash) {
  const std::string dir = WriteCheckpoint("step-00000023", 1, std::nullopt, LargeModel());
  SHARD_ASSERT_OK_AND_ASSIGN(CheckpointManifest manifest, ReadCheckpointManifest(dir));
  std::unique_ptr<ShardStorage> files = DirectoryShards(dir, manifest);
  SHARD_ASSERT_OK_AND_ASSIGN(const bool mapped, files->CanView(0));
  if (!mapped) GTEST_SKIP() << "this kernel cannot populate a mapping (Linux 5.14 and later can)";
  // w's exp_avg_sq: from inside one block over whole ones. The file now ends where the first
  // whole one begins.
  ASSERT_EQ(manifest.tensors[0].pieces.size(), 1u);
  const int64_t count = LargeModel().params[0].numel();
  const uint64_t state_begin = manifest.tensors[0].pieces[0].offset + 2 * count * sizeof(float);
  const uint64_t cut = (state_begin / kCheckpointBlockBytes + 1) * kCheckpointBlockBytes;
  ASSERT_LT(cut + kCheckpointBlockBytes, state_begin + count * sizeof(float));
  std::unique_ptr<CheckpointReader> reader =
      CheckpointReader::Open(std::move(manifest), std::move(files), dir);
  std::filesystem::resize_file(dir + "/" + ShardFileName(0, 1), cut);

  std::vector<float> values(count);
  const absl::Status status = reader->ReadElements(0, 1, 0, count, values.data());
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << status;
  EXPECT_NE(status.message().find(ShardFileName(0, 1)), absl::string_view::npos) << status;
  EXPECT_NE(status.message().find("cannot be read"), absl::string_view::npos) << status;
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

std::string ReadManifestText(const std::string& dir) {
  std::ifstream in(dir + "/manifest.json");
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// The same bits (operator== would call 0.0f and -0.0f equal).
bool SameBits(float a, float b) { return std::memcmp(&a, &b, sizeof(float)) == 0; }

// A loss scale that is not a power of two and needs all nine significant digits to round-trip
// ("%.8g" prints 1000.0001, which reads back as another float).
const float kOddScale = std::nextafter(1000.0f, 2000.0f);  // 1000.00006

TEST(CheckpointTest, TheManifestKeepsTheTrainingCounters) {
  const TrainingCounters saved{
      .optimizer_step = 5, .loss_scale = kOddScale, .loss_scale_growth_tracker = 2};
  const std::string dir = WriteCheckpoint("step-00000010", 2, saved);
  SHARD_ASSERT_OK_AND_ASSIGN(const CheckpointManifest manifest, ReadCheckpointManifest(dir));
  ASSERT_TRUE(manifest.counters.has_value());
  EXPECT_EQ(*manifest.counters, saved);
  EXPECT_TRUE(SameBits(manifest.counters->loss_scale, kOddScale))
      << absl::StrFormat("%.9g", manifest.counters->loss_scale);
  // And once more through the JSON, with the edges of the optimizer step: no update yet, and
  // none skipped.
  for (int64_t optimizer_step : {int64_t{0}, int64_t{7}}) {
    CheckpointManifest edge = manifest;
    edge.counters->optimizer_step = optimizer_step;
    SHARD_ASSERT_OK_AND_ASSIGN(
        const CheckpointManifest parsed,
        CheckpointManifestFromJson(CheckpointManifestToJson(edge), dir + "/manifest.json"));
    ASSERT_TRUE(parsed.counters.has_value());
    EXPECT_EQ(*parsed.counters, *edge.counters);
  }

  // A checkpoint written before the counters were: no key, and none read.
  const std::string old = WriteCheckpoint("step-00000011", 2);
  EXPECT_EQ(ReadManifestText(old).find("\"counters\""), std::string::npos);
  SHARD_ASSERT_OK_AND_ASSIGN(const CheckpointManifest old_manifest, ReadCheckpointManifest(old));
  EXPECT_EQ(old_manifest.counters, std::nullopt);
  EXPECT_EQ(old_manifest.step, 7);
}

TEST(CheckpointTest, ImpossibleCountersInTheManifestAreRefusedNamingThem) {
  const std::string dir = WriteCheckpoint(
      "step-00000012", 1,
      TrainingCounters{.optimizer_step = 5, .loss_scale = 512, .loss_scale_growth_tracker = 2});
  const std::string path = dir + "/manifest.json";
  const std::string json = ReadManifestText(dir);
  SHARD_ASSERT_OK(CheckpointManifestFromJson(json, path).status());
  // The manifest with `key`'s value replaced by `value`.
  auto with = [&](const std::string& key, const std::string& value) {
    std::string changed = json;
    const std::string field = absl::StrCat("\"", key, "\": ");
    const size_t at = changed.find(field);
    EXPECT_NE(at, std::string::npos) << key;
    if (at == std::string::npos) return absl::OkStatus();
    const size_t begin = at + field.size();
    const size_t end = changed.find_first_of(",\n}", begin);
    changed.replace(begin, end - begin, value);
    return CheckpointManifestFromJson(changed, path).status();
  };
  struct Case {
    std::string key;
    std::string value;
    std::string named;  // in the error
  };
  for (const Case& c : std::vector<Case>{
           {"optimizer_step", "8", "\"optimizer_step\" is 8"},  // past the checkpoint's step 7
           {"optimizer_step", "-1", "\"optimizer_step\" is -1"},
           {"optimizer_step", "2.5", "optimizer_step"},
           {"loss_scale", "-512.0", "\"loss_scale\" is -512"},
           {"loss_scale", "\"512\"", ""},  // (nlohmann's type error, which names no key)
           {"loss_scale_growth_tracker", "-1", "\"loss_scale_growth_tracker\" is -1"},
       }) {
    SCOPED_TRACE(absl::StrCat(c.key, " = ", c.value));
    const absl::Status refused = with(c.key, c.value);
    EXPECT_EQ(refused.code(), absl::StatusCode::kDataLoss) << refused;
    EXPECT_NE(refused.message().find(c.named), absl::string_view::npos) << refused;
    EXPECT_NE(refused.message().find(path), absl::string_view::npos) << refused;
  }
  // The bounds themselves are fine.
  SHARD_EXPECT_OK(with("optimizer_step", "7"));
  SHARD_EXPECT_OK(with("optimizer_step", "0"));
  SHARD_EXPECT_OK(with("loss_scale", "0"));
}

TEST(CheckpointTest, TheManifestKeepsMinBucketsAndOneWithoutItReadsAsOne) {
  const std::string dir = WriteCheckpoint("step-00000012", 2);
  SHARD_ASSERT_OK_AND_ASSIGN(CheckpointManifest manifest, ReadCheckpointManifest(dir));
  manifest.plan.min_buckets = 4;
  const std::string json = CheckpointManifestToJson(manifest);
  SHARD_ASSERT_OK_AND_ASSIGN(const CheckpointManifest parsed,
                             CheckpointManifestFromJson(json, dir + "/manifest.json"));
  EXPECT_EQ(parsed.plan.min_buckets, 4);
  // Written before min_buckets: planned by the caps alone.
  const std::string key = "\"min_buckets\"";
  const size_t at = json.find(key);
  ASSERT_NE(at, std::string::npos);
  const size_t end = json.find(',', at);
  std::string old = json;
  old.erase(at, end + 1 - at);
  SHARD_ASSERT_OK_AND_ASSIGN(const CheckpointManifest before,
                             CheckpointManifestFromJson(old, dir + "/manifest.json"));
  EXPECT_EQ(before.plan.min_buckets, 1);
}

TEST(CheckpointTest, TrainingCountersRoundTripThroughSafetensorsMetadata) {
  for (const float scale : {kOddScale, 1.0f / 3, 65536.0f, std::nextafter(65536.0f, 0.0f),
                            1e-30f, std::numeric_limits<float>::max()}) {
    SCOPED_TRACE(absl::StrFormat("scale %a", scale));
    const TrainingCounters counters{
        .optimizer_step = 41, .loss_scale = scale, .loss_scale_growth_tracker = 1999};
    std::map<std::string, std::string> metadata = TrainingCountersMetadata(counters);
    EXPECT_EQ(metadata.at("optimizer_step"), "41");
    EXPECT_EQ(metadata.at("loss_scale_growth_tracker"), "1999");
    // As a file's metadata holds it, among other keys.
    metadata["step"] = "50";
    metadata["format"] = "pt";
    SHARD_ASSERT_OK_AND_ASSIGN(const TrainingCounters back,
                               TrainingCountersFromMetadata(metadata, 50));
    EXPECT_EQ(back, counters);
    EXPECT_TRUE(SameBits(back.loss_scale, scale))
        << metadata.at("loss_scale") << " read back as " << absl::StrFormat("%a", back.loss_scale);
  }

  // Without loss scaling only the optimizer step is written, and it reads back so.
  const TrainingCounters unscaled{.optimizer_step = 6};
  const std::map<std::string, std::string> plain = TrainingCountersMetadata(unscaled);
  EXPECT_EQ(plain, (std::map<std::string, std::string>{{"optimizer_step", "6"}}));
  SHARD_ASSERT_OK_AND_ASSIGN(const TrainingCounters plain_back,
                             TrainingCountersFromMetadata(plain, 9));
  EXPECT_EQ(plain_back, unscaled);

  // A file without them (older, or from elsewhere): the optimizer stepped every step, no scale.
  SHARD_ASSERT_OK_AND_ASSIGN(
      const TrainingCounters absent,
      TrainingCountersFromMetadata({{"format", "pt"}, {"step", "9"}}, 9));
  EXPECT_EQ(absent, (TrainingCounters{.optimizer_step = 9}));
  EXPECT_EQ(absent.loss_scale, 0.0f);
}

TEST(CheckpointTest, MalformedTrainingCountersInMetadataAreRefusedNamingTheKey) {
  const std::map<std::string, std::string> good = TrainingCountersMetadata(
      TrainingCounters{.optimizer_step = 4, .loss_scale = 512, .loss_scale_growth_tracker = 2});
  SHARD_ASSERT_OK(TrainingCountersFromMetadata(good, 5).status());
  struct Case {
    std::string key;
    std::string value;
  };
  for (const Case& c : std::vector<Case>{
           {"optimizer_step", "four"},
           {"optimizer_step", "3.5"},
           {"optimizer_step", ""},
           {"optimizer_step", "6"},   // past step 5
           {"optimizer_step", "-1"},
           {"loss_scale", "big"},
           {"loss_scale", "-512"},
           {"loss_scale", "inf"},
           {"loss_scale", "nan"},
           {"loss_scale_growth_tracker", "2.5"},
           {"loss_scale_growth_tracker", "-1"},
       }) {
    SCOPED_TRACE(absl::StrCat(c.key, " = '", c.value, "'"));
    std::map<std::string, std::string> metadata = good;
    metadata[c.key] = c.value;
    const absl::StatusOr<TrainingCounters> refused = TrainingCountersFromMetadata(metadata, 5);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
    EXPECT_NE(refused.status().message().find(absl::StrCat("\"", c.key, "\"")),
              absl::string_view::npos)
        << refused.status();
  }
}

TEST(CheckpointTest, ExportWritesTheTrainingCountersIntoTheMetadata) {
  const TrainingCounters saved{
      .optimizer_step = 5, .loss_scale = kOddScale, .loss_scale_growth_tracker = 2};
  const std::string dir = WriteCheckpoint("step-00000013", 2, saved);
  const std::string out = ::testing::TempDir() + "/shard-checkpoint-test-counters.safetensors";
  SHARD_ASSERT_OK(ExportCheckpoint(dir, out, true, 4096, [](uint64_t, uint64_t) {}));
  SHARD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<SafetensorsReader> file,
                             SafetensorsReader::Open(out));
  const std::map<std::string, std::string>& metadata = file->metadata();
  EXPECT_EQ(metadata.at("step"), "7");
  EXPECT_EQ(metadata.at("optimizer_step"), "5");
  EXPECT_EQ(metadata.at("optimizer"), "adam");
  EXPECT_EQ(metadata.at("format"), "pt");
  SHARD_ASSERT_OK_AND_ASSIGN(const TrainingCounters back,
                             TrainingCountersFromMetadata(metadata, 7));
  EXPECT_EQ(back, saved);
  EXPECT_TRUE(SameBits(back.loss_scale, kOddScale)) << metadata.at("loss_scale");

  // A checkpoint without counters exports the documented default: every step updated.
  const std::string old = WriteCheckpoint("step-00000014", 2);
  SHARD_ASSERT_OK(ExportCheckpoint(old, out, false, 4096, [](uint64_t, uint64_t) {}));
  SHARD_ASSERT_OK_AND_ASSIGN(const std::unique_ptr<SafetensorsReader> old_file,
                             SafetensorsReader::Open(out));
  EXPECT_EQ(old_file->metadata().at("optimizer_step"), "7");
  EXPECT_EQ(old_file->metadata().count("loss_scale"), 0u);
}

// A training script's own optimizer: its class and per-element state names in the manifest,
// and bytes of its own after each rank's pieces (a parameter's step counts, the job's scheduler
// state), which the manifest places and a reader hands back checked.
TEST(CheckpointTest, ExtrasAfterThePiecesAreCommittedAndReadBackChecked) {
  const std::string root =
      ::testing::TempDir() + "/shard-checkpoint-test-" + std::to_string(getpid());
  const std::string dir = CheckpointDirectory(root, "job", "step-00000009");
  std::filesystem::remove_all(dir);
  PlanOptions options;
  options.world_size = 2;
  options.bucket_cap_bytes = 16 << 10;
  SHARD_ASSERT_OK_AND_ASSIGN(const Plan plan, MakePlan(Model(), options));
  // Rank 0 saves the job's extras and w's, rank 1 b's.
  const std::map<int, std::vector<std::pair<int, std::string>>> extras = {
      {0, {{-1, "the scheduler's state"}, {0, std::string("w's steps\0and more", 19)}}},
      {1, {{1, "b's steps"}}}};
  std::vector<ShardRecord> records;
  for (int rank = 0; rank < 2; ++rank) {
    const ShardLayout layout = MakeShardLayout(Model(), plan, rank, 2);
    std::string bytes(layout.bytes, '\x01');
    std::vector<ShardExtra> placed;
    for (const auto& [param, data] : extras.at(rank)) {
      placed.push_back(ShardExtra{param, bytes.size(), data.size()});
      bytes += data;
    }
    SHARD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<ShardWriter> writer,
                               ShardWriter::Create(dir, rank, 2));
    SHARD_ASSERT_OK(writer->Append(bytes.data(), bytes.size()));
    SHARD_ASSERT_OK_AND_ASSIGN(ShardRecord record, writer->Finish());
    record.extras = placed;
    records.push_back(record);
  }
  OptimizerConfig lion;
  lion.kind = OptimizerKind::kTorch;
  lion.torch_class = "mine.Lion";
  lion.torch_state = {"exp_avg", "exp_avg_sq"};
  SHARD_ASSERT_OK_AND_ASSIGN(
      const CheckpointManifest manifest,
      MakeCheckpointManifest("job", "step-00000009", 9, 2, Model(), plan, lion,
                             lion.torch_state, records));
  SHARD_ASSERT_OK(CommitCheckpoint(dir, manifest));
  // The script's class holds its settings: the manifest keeps only what its state is.
  const std::string text = ReadManifestText(dir);
  EXPECT_NE(text.find("\"class\": \"mine.Lion\""), std::string::npos) << text;
  EXPECT_EQ(text.find("\"lr\""), std::string::npos) << text;

  SHARD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<CheckpointReader> reader,
                             CheckpointReader::Open(dir));
  EXPECT_EQ(reader->manifest().optimizer.kind, OptimizerKind::kTorch);
  EXPECT_EQ(reader->manifest().optimizer.torch_class, "mine.Lion");
  EXPECT_EQ(reader->manifest().optimizer.torch_state, lion.torch_state);
  EXPECT_EQ(reader->manifest().shards, records);
  for (int rank = 0; rank < 2; ++rank) {
    for (size_t e = 0; e < extras.at(rank).size(); ++e) {
      SHARD_ASSERT_OK_AND_ASSIGN(const std::string read,
                                 reader->ReadExtra(rank, records[rank].extras[e]));
      EXPECT_EQ(read, extras.at(rank)[e].second);
    }
    SHARD_EXPECT_OK(reader->VerifyShard(rank, nullptr));
  }
  std::vector<float> values(300);
  SHARD_ASSERT_OK(reader->ReadElements(1, 0, 0, 300, values.data()));

  // A flipped byte inside an extra is found, naming the shard.
  {
    std::fstream file(dir + "/" + ShardFileName(1, 2),
                      std::ios::in | std::ios::out | std::ios::binary);
    file.seekp(static_cast<std::streamoff>(records[1].extras[0].offset + 2));
    file.put('X');
  }
  SHARD_ASSERT_OK_AND_ASSIGN(reader, CheckpointReader::Open(dir));
  const absl::StatusOr<std::string> damaged = reader->ReadExtra(1, records[1].extras[0]);
  EXPECT_EQ(damaged.status().code(), absl::StatusCode::kDataLoss) << damaged.status();
  EXPECT_NE(damaged.status().message().find(ShardFileName(1, 2)), absl::string_view::npos)
      << damaged.status();
}

TEST(CheckpointTest, ExtrasOutOfPlaceAreRefused) {
  PlanOptions options;
  options.world_size = 1;
  SHARD_ASSERT_OK_AND_ASSIGN(const Plan plan, MakePlan(Model(), options));
  const uint64_t bytes = MakeShardLayout(Model(), plan, 0, 2).bytes;
  ShardRecord record{ShardFileName(0, 1), 0, bytes + 8, "00", {"00"}, {{0, bytes + 1, 7}}};
  OptimizerConfig adam;
  const std::vector<std::string> state = {"exp_avg", "exp_avg_sq"};
  // Not straight after the pieces.
  EXPECT_EQ(MakeCheckpointManifest("job", "step-1", 1, 2, Model(), plan, adam, state, {record})
                .status()
                .code(),
            absl::StatusCode::kFailedPrecondition);
  // Of a parameter the model does not have.
  record.extras = {{2, bytes, 8}};
  EXPECT_EQ(MakeCheckpointManifest("job", "step-1", 1, 2, Model(), plan, adam, state, {record})
                .status()
                .code(),
            absl::StatusCode::kFailedPrecondition);
  // Past the end of the shard, in a manifest read from disk.
  const std::string dir = WriteCheckpoint("step-00000010", 1);
  const std::string path = dir + "/manifest.json";
  std::string json = ReadManifestText(dir);
  const size_t at = json.find("\"block_bytes\"");
  ASSERT_NE(at, std::string::npos);
  json.insert(at, "\"extras\": [{\"param\": -1, \"offset\": 8, \"bytes\": 99999999}], ");
  const absl::Status past = CheckpointManifestFromJson(json, path).status();
  EXPECT_EQ(past.code(), absl::StatusCode::kDataLoss) << past;
  EXPECT_NE(past.message().find("extra bytes"), absl::string_view::npos) << past;
}

// The state a rank reports saving must be the job's built-in optimizer's; a script's own
// optimizer's comes from the report.
TEST(CheckpointTest, ASavedOptimizerIsTheJobsWithTheStateItsRanksReport) {
  OptimizerConfig adam;
  SHARD_ASSERT_OK_AND_ASSIGN(const OptimizerConfig same, SavedOptimizer(adam, StateKindOf(adam)));
  EXPECT_EQ(same.kind, OptimizerKind::kAdam);
  const absl::Status other =
      SavedOptimizer(adam, OptimizerStateKind{"", {"momentum_buffer"}}).status();
  EXPECT_EQ(other.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(other.message().find("momentum_buffer"), absl::string_view::npos) << other;
  OptimizerConfig torch;
  torch.kind = OptimizerKind::kTorch;
  SHARD_ASSERT_OK_AND_ASSIGN(
      const OptimizerConfig reported,
      SavedOptimizer(torch, OptimizerStateKind{"torch.optim.rmsprop.RMSprop", {"square_avg"}}));
  EXPECT_EQ(reported.torch_class, "torch.optim.rmsprop.RMSprop");
  EXPECT_EQ(OptimizerStateNames(reported), std::vector<std::string>{"square_avg"});
}

// --- When the disk or the memory fails (docs/checkpoints.md, "When the disk fails") -----------

TEST(CheckpointTest, FileErrorsSayWhatACallerCanDoAboutThem) {
  EXPECT_EQ(FileError("cannot write", "/x", ENOSPC).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(FileError("cannot write", "/x", EDQUOT).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(FileError("cannot write", "/x", EIO).code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(FileError("cannot open", "/x", ENOENT).code(), absl::StatusCode::kNotFound);
  const absl::Status full = FileError("cannot write", "/ck/shard.bin", ENOSPC);
  EXPECT_NE(full.message().find("'/ck/shard.bin': No space left on device"),
            absl::string_view::npos)
      << full;
}

// The names of the files in `dir` (none when it does not exist).
std::vector<std::string> FilesIn(const std::string& dir) {
  std::vector<std::string> names;
  if (!std::filesystem::exists(dir)) return names;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    names.push_back(entry.path().filename().string());
  }
  return names;
}

// A write the device fails half-way (SHARD_WRITE_ERROR, as real EIO would come from a failing
// disk) is an error naming the file and the cause, and leaves no file behind.
TEST(CheckpointTest, AShardWriteThatFailsHalfWayLeavesNoFile) {
  const std::string dir = ::testing::TempDir() + "/shard-checkpoint-test-eio-" +
                          std::to_string(getpid()) + "/step-00000009";
  std::filesystem::remove_all(dir);
  std::vector<char> bytes(3 << 20, 'x');
  {
    ::setenv("SHARD_WRITE_ERROR", "EIO", 1);
    absl::StatusOr<std::unique_ptr<ShardWriter>> writer = ShardWriter::Create(dir, 1, 2);
    ::unsetenv("SHARD_WRITE_ERROR");
    ASSERT_TRUE(writer.ok()) << writer.status();
    const absl::Status written = (*writer)->Append(bytes.data(), bytes.size());
    EXPECT_EQ(written.code(), absl::StatusCode::kDataLoss) << written;
    EXPECT_NE(written.message().find("Input/output error"), absl::string_view::npos) << written;
    EXPECT_NE(written.message().find(ShardFileName(1, 2) + ".tmp."), absl::string_view::npos)
        << written;
    EXPECT_EQ(FilesIn(dir).size(), 1u) << "half of it is in its temporary file until then";
  }
  EXPECT_TRUE(FilesIn(dir).empty()) << FilesIn(dir)[0];
  // Without the fault the same write goes through.
  SHARD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<ShardWriter> writer, ShardWriter::Create(dir, 1, 2));
  SHARD_ASSERT_OK(writer->Append(bytes.data(), bytes.size()));
  SHARD_ASSERT_OK(writer->Finish().status());
  EXPECT_EQ(FilesIn(dir), std::vector<std::string>{ShardFileName(1, 2)});
}

// A cancelled write (a save of a generation that ended, on a disk slowed to a crawl) stops and
// leaves no file behind.
TEST(CheckpointTest, ACancelledShardWriteStopsAndLeavesNoFile) {
  const std::string dir = ::testing::TempDir() + "/shard-checkpoint-test-cancel-" +
                          std::to_string(getpid()) + "/step-00000009";
  std::filesystem::remove_all(dir);
  std::vector<char> bytes(40 << 20, 'x');
  std::atomic<bool> cancel{true};
  {
    SHARD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<ShardWriter> writer,
                               ShardWriter::Create(dir, 0, 1, &cancel));
    const absl::Status written = writer->Append(bytes.data(), bytes.size());
    EXPECT_EQ(written.code(), absl::StatusCode::kCancelled) << written;
  }
  EXPECT_TRUE(FilesIn(dir).empty());
}

// Storage with two sources of every shard, as a memory snapshot with two holders: the first
// source's copy of shard 0 has one bit flipped (a memory error in a holder); Refuse moves to the
// next.
class TwoSourceShards : public ShardStorage {
 public:
  explicit TwoSourceShards(std::unique_ptr<ShardStorage> files, bool second_corrupt = false)
      : files_(std::move(files)), second_corrupt_(second_corrupt) {}
  absl::Status Read(int shard, uint64_t offset, uint64_t bytes, char* out) override {
    SHARD_RETURN_IF_ERROR(files_->Read(shard, offset, bytes, out));
    ++reads_[source_];
    const bool corrupt = shard == 0 && (source_ == 0 || second_corrupt_);
    // The flipped bit sits 100 bytes into block 1 of the shard.
    const uint64_t flipped = kCheckpointBlockBytes + 100;
    if (corrupt && offset <= flipped && flipped < offset + bytes) out[flipped - offset] ^= 1;
    return absl::OkStatus();
  }
  std::string Describe(int shard) const override {
    return absl::StrCat(files_->Describe(shard), " from source ", source_);
  }
  bool Refuse(int /*shard*/, const absl::Status& why) override {
    refusals_.push_back(std::string(why.message()));
    if (source_ == 1) return false;
    source_ = 1;
    return true;
  }
  int source() const { return source_; }
  int reads(int source) const { return reads_[source]; }
  const std::vector<std::string>& refusals() const { return refusals_; }

 private:
  std::unique_ptr<ShardStorage> files_;
  const bool second_corrupt_;
  int source_ = 0;
  int reads_[2] = {0, 0};
  std::vector<std::string> refusals_;
};

TEST(CheckpointTest, BytesThatFailTheirChecksumAreReadAgainFromTheNextSourceOrRefused) {
  const std::string dir = WriteCheckpoint("step-00000023", 2, std::nullopt, LargeModel());
  for (const bool second_corrupt : {false, true}) {
    SCOPED_TRACE(second_corrupt ? "every source corrupt" : "the first source corrupt");
    SHARD_ASSERT_OK_AND_ASSIGN(CheckpointManifest manifest, ReadCheckpointManifest(dir));
    auto storage = std::make_unique<TwoSourceShards>(
        std::make_unique<ShardsReadWithPread>(DirectoryShards(dir, manifest)), second_corrupt);
    TwoSourceShards* sources = storage.get();
    std::unique_ptr<CheckpointReader> reader =
        CheckpointReader::Open(std::move(manifest), std::move(storage), dir);
    const int64_t numel = LargeModel().params[0].numel();
    std::vector<float> values(numel);
    // w's values, then its exp_avg: whole blocks and partial ones, block 1 among them.
    const absl::Status read = reader->ReadElements(0, -1, 0, numel, values.data());
    if (second_corrupt) {
      EXPECT_EQ(read.code(), absl::StatusCode::kDataLoss) << read;
      EXPECT_NE(read.message().find("from source 1"), absl::string_view::npos) << read;
      EXPECT_EQ(sources->refusals().size(), 2u);
      continue;
    }
    SHARD_ASSERT_OK(read);
    for (int64_t i = 0; i < numel; i += 4099) ASSERT_EQ(values[i], Expected(0, -1, i)) << i;
    EXPECT_EQ(values[numel - 1], Expected(0, -1, numel - 1));
    ASSERT_EQ(sources->refusals().size(), 1u);
    EXPECT_NE(sources->refusals()[0].find("from source 0 is corrupt"), std::string::npos)
        << sources->refusals()[0];
    EXPECT_EQ(sources->source(), 1);
    EXPECT_GT(sources->reads(1), 0);
    // Later reads, and a full verification, use the good source only.
    SHARD_EXPECT_OK(reader->ReadElements(0, 0, 0, numel, values.data()));
    SHARD_EXPECT_OK(reader->VerifyShard(0, nullptr));
    EXPECT_EQ(sources->refusals().size(), 1u);
  }
}

}  // namespace
}  // namespace shard
