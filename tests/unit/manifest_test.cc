#include "common/manifest.h"

#include "gtest/gtest.h"

namespace shard {
namespace {

constexpr char kMlp[] = R"({"params": [
  {"name": "layers.0.weight", "shape": [1024, 512], "dtype": "f32"},
  {"name": "layers.0.bias", "shape": [1024]},
  {"name": "embed", "shape": [10, 4], "dtype": "bf16", "requires_grad": false}]})";

TEST(ManifestTest, ParsesTheDocumentedJson) {
  auto manifest = ParseManifestJson(kMlp);
  ASSERT_TRUE(manifest.ok()) << manifest.status();
  ASSERT_EQ(manifest->params.size(), 3u);
  EXPECT_EQ(manifest->params[0].numel(), 1024 * 512);
  EXPECT_EQ(manifest->params[1].dtype, DataType::kFloat32);
  EXPECT_TRUE(manifest->params[1].requires_grad);
  EXPECT_EQ(manifest->params[2].dtype, DataType::kBFloat16);
  EXPECT_FALSE(manifest->params[2].requires_grad);
  auto again = ParseManifestJson(ManifestToJson(*manifest));
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, *manifest);
  EXPECT_EQ(ManifestHash(*again), ManifestHash(*manifest));
}

TEST(ManifestTest, ErrorsNameTheOffendingEntry) {
  struct Case {
    const char* json;
    const char* expected;
  };
  for (const Case& c : std::vector<Case>{
           {R"({"params": [{"name": "a", "shape": [2]}, {"name": "a", "shape": [3]}]})",
            "entry 1 ('a') repeats"},
           {R"({"params": [{"name": "w", "shape": []}]})", "entry 0 ('w') has an empty shape"},
           {R"({"params": [{"name": "w", "shape": [4, -1]}]})", "dimension 1 of size -1"},
           {R"({"params": [{"name": "w", "shape": [0]}]})", "dimension 0 of size 0"},
           {R"({"params": [{"name": "w", "shape": [4], "dtype": "f8"}]})", "unknown dtype 'f8'"},
           {R"({"params": [{"name": "w", "shape": [4], "dtype": "f64"}]})", "dtype f64"},
           {R"({"params": [{"name": "w", "shape": [4], "dtype": "i64"}]})", "dtype i64"},
           {R"({"params": [{"name": "w", "shape": [4], "colour": "red"}]})", "\"colour\""},
           {R"({"params": [{"shape": [4]}]})", "empty name"},
           {R"({"params": []})", "no parameters"},
           {R"({"parameters": []})", "\"params\" array"},
           {R"({"params": [)", "not valid JSON"},
       }) {
    auto manifest = ParseManifestJson(c.json);
    ASSERT_FALSE(manifest.ok()) << c.json;
    EXPECT_EQ(manifest.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(manifest.status().message().find(c.expected), absl::string_view::npos)
        << "expected '" << c.expected << "' in " << manifest.status();
  }
}

TEST(ManifestTest, ComparisonNamesTheFirstDifferingParameter) {
  auto ours = ParseManifestJson(kMlp);
  ASSERT_TRUE(ours.ok());
  Manifest theirs = *ours;
  EXPECT_TRUE(CompareManifests(*ours, theirs, "worker w1").ok());
  theirs.params[1].shape = {1000};
  absl::Status differs = CompareManifests(*ours, theirs, "worker w1");
  EXPECT_EQ(differs.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(differs.message().find("parameter 1 differs"), absl::string_view::npos) << differs;
  EXPECT_NE(differs.message().find("layers.0.bias f32[1024]"), absl::string_view::npos) << differs;
  EXPECT_NE(differs.message().find("worker w1 registered layers.0.bias f32[1000]"),
            absl::string_view::npos)
      << differs;
  theirs = *ours;
  theirs.params.pop_back();
  differs = CompareManifests(*ours, theirs, "worker w1");
  EXPECT_NE(differs.message().find("missing from worker w1"), absl::string_view::npos) << differs;
  EXPECT_NE(differs.message().find("embed"), absl::string_view::npos) << differs;
}

}  // namespace
}  // namespace shard
