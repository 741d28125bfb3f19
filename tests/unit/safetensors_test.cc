#include "common/safetensors.h"

#include <cstring>
#include <filesystem>
#include <fstream>

#include "gtest/gtest.h"

namespace shard {
namespace {

std::string Path(const std::string& name) {
  const std::string dir = ::testing::TempDir() + "/shard-safetensors-test";
  std::filesystem::create_directories(dir);
  return dir + "/" + name;
}

// A file with the given raw header and `data_bytes` zero bytes of data.
std::string RawFile(const std::string& name, const std::string& header, size_t data_bytes) {
  const std::string path = Path(name);
  std::ofstream out(path, std::ios::binary);
  uint64_t length = header.size();
  for (int i = 0; i < 8; ++i) out.put(static_cast<char>((length >> (8 * i)) & 0xff));
  out << header << std::string(data_bytes, '\0');
  return path;
}

TEST(SafetensorsTest, RoundTripWithPartialReads) {
  std::vector<float> weight(6 * 4);
  for (size_t i = 0; i < weight.size(); ++i) weight[i] = static_cast<float>(i) * 0.5f;
  std::vector<int64_t> labels = {3, -1, 7};
  std::vector<uint16_t> half = {FloatToHalf(1.5f), FloatToHalf(-2.0f)};
  const std::string path = Path("roundtrip.safetensors");
  ASSERT_TRUE(WriteSafetensors(path,
                               {{"w", DataType::kFloat32, {6, 4}},
                                {"y", DataType::kInt64, {3}},
                                {"h", DataType::kFloat16, {2}}},
                               {weight.data(), labels.data(), half.data()}, {{"format", "pt"}})
                  .ok());
  auto reader = SafetensorsReader::Open(path);
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_EQ((*reader)->metadata().at("format"), "pt");
  auto w = (*reader)->Expect("w", DataType::kFloat32, {6, 4});
  ASSERT_TRUE(w.ok());
  std::vector<float> row(4);
  ASSERT_TRUE((*reader)->ReadElements(**w, 8, 4, row.data()).ok());  // row 2
  EXPECT_EQ(row, (std::vector<float>{4.0f, 4.5f, 5.0f, 5.5f}));
  std::vector<int64_t> y(3);
  ASSERT_TRUE((*reader)->ReadElements(*(*reader)->Find("y"), 0, 3, y.data()).ok());
  EXPECT_EQ(y, labels);
  EXPECT_EQ((*reader)->ReadElements(**w, 20, 5, row.data()).code(), absl::StatusCode::kOutOfRange);
  auto wrong = (*reader)->Expect("w", DataType::kFloat32, {4, 6});
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(wrong.status().message().find("F32[6, 4]"), absl::string_view::npos) << wrong.status();
  EXPECT_EQ((*reader)->Expect("missing", DataType::kFloat32, {1}).status().code(),
            absl::StatusCode::kNotFound);
  // The data section starts 8-byte aligned, as the reference writer makes it.
  std::ifstream in(path, std::ios::binary);
  unsigned char length[8];
  in.read(reinterpret_cast<char*>(length), 8);
  EXPECT_EQ(length[0] % 8, 0);
}

TEST(SafetensorsTest, StreamingWriterChecksTheByteCountAndLeavesNothingBehindOnFailure) {
  const std::string path = Path("streamed.safetensors");
  std::filesystem::remove(path);
  {
    auto writer = SafetensorsWriter::Create(path, {{"a", DataType::kFloat32, {4}}});
    ASSERT_TRUE(writer.ok());
    float part[2] = {1, 2};
    ASSERT_TRUE((*writer)->Append(part, sizeof(part)).ok());
    EXPECT_EQ((*writer)->Finish().code(), absl::StatusCode::kFailedPrecondition);
  }
  EXPECT_FALSE(std::filesystem::exists(path)) << "an unfinished file never appears";
  for (const auto& entry : std::filesystem::directory_iterator(Path(""))) {
    EXPECT_EQ(entry.path().string().find(".tmp."), std::string::npos) << entry.path();
  }
  auto writer = SafetensorsWriter::Create(path, {{"a", DataType::kFloat32, {2}}});
  ASSERT_TRUE(writer.ok());
  float too_much[3] = {1, 2, 3};
  EXPECT_EQ((*writer)->Append(too_much, sizeof(too_much)).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(SafetensorsTest, HostileFilesAreRejectedWithTheReason) {
  struct Case {
    std::string header;
    size_t data;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {"not json", 0, "not a JSON object"},
      {R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})", 4, "truncated"},
      {R"({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}})", 8, "need 12"},
      {R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
           "b": {"dtype": "F32", "shape": [1], "data_offsets": [2, 6]}})", 6, "overlap"},
      {R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})", 8, "hole"},
      {R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})", 8, "cover 4 of its 8"},
      {R"({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}})", 4, "negative"},
      {R"({"a": {"dtype": "F32", "shape": [1]}})", 4, "data_offsets"},
      {R"({"a": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}})", 8, "C64"},
      {R"({"a": {"dtype": "F32", "shape": [1099511627776, 1099511627776], "data_offsets": [0, 4]}})",
       4, "larger than the file"},
      {R"({"__metadata__": {"k": 1}})", 0, "not a string"},
      // Found by fuzzing (docs/fuzzing.md): accepted, then refused by the writer.
      {R"({"": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})", 4, "empty name"},
      {R"({"a": {"dtype": "F32", "shape": [0, 18446744073709551615], "data_offsets": [0, 0]}})",
       0, "beyond 2^63"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const std::string path = RawFile("hostile" + std::to_string(i), cases[i].header, cases[i].data);
    auto reader = SafetensorsReader::Open(path);
    ASSERT_FALSE(reader.ok()) << cases[i].header;
    EXPECT_NE(reader.status().message().find(cases[i].expected), absl::string_view::npos)
        << "expected '" << cases[i].expected << "' in " << reader.status();
    EXPECT_NE(reader.status().message().find(path), absl::string_view::npos) << "names the file";
  }
  // A header length beyond the file.
  const std::string path = Path("huge-header");
  std::ofstream(path, std::ios::binary) << std::string("\xff\xff\xff\xff\x00\x00\x00\x00", 8) << "{}";
  EXPECT_EQ(SafetensorsReader::Open(path).status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(SafetensorsReader::Open(Path("absent")).status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace shard
