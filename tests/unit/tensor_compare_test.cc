// CompareSafetensorsFiles: differences found where they are, bitwise-equal files reported equal,
// 16-bit tensors compared by value, mismatched files refused with the tensor named.
#include "common/tensor_compare.h"

#include <cmath>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "common/safetensors.h"
#include "gtest/gtest.h"
#include "tests/support/status_assertions.h"

namespace shard {
namespace {

class TensorCompareTest : public ::testing::Test {
 protected:
  std::string Write(const std::string& name, const std::vector<TensorDecl>& tensors,
                    const std::vector<const void*>& data) {
    const std::string path = (std::filesystem::path(::testing::TempDir()) / name).string();
    EXPECT_TRUE(WriteSafetensors(path, tensors, data).ok());
    return path;
  }
};

TEST_F(TensorCompareTest, FindsTheLargestDifferenceAndWhereItIs) {
  std::vector<float> w(3000), b = {1.0f, -2.0f};
  for (size_t i = 0; i < w.size(); ++i) w[i] = std::sin(static_cast<float>(i));
  std::vector<float> w2 = w, b2 = b;
  w2[17] += 1e-6f;
  w2[2500] -= 3e-4f;
  const std::vector<TensorDecl> decls = {{"w", DataType::kFloat32, {30, 100}},
                                         {"b", DataType::kFloat32, {2}}};
  const std::string a = Write("a.safetensors", decls, {w.data(), b.data()});
  const std::string c = Write("c.safetensors", decls, {w2.data(), b2.data()});
  SHARD_ASSERT_OK_AND_ASSIGN(std::vector<TensorDifference> d, CompareSafetensorsFiles(a, c));
  ASSERT_EQ(d.size(), 2u);
  const TensorDifference& dw = d[0].name == "w" ? d[0] : d[1];
  const TensorDifference& db = d[0].name == "b" ? d[0] : d[1];
  EXPECT_EQ(dw.numel, 3000);
  EXPECT_EQ(dw.differing, 2);
  EXPECT_EQ(dw.worst_element, 2500);
  EXPECT_DOUBLE_EQ(dw.max_abs_diff, std::fabs(static_cast<double>(w[2500]) - w2[2500]));
  EXPECT_GT(dw.max_magnitude, 0.99);
  EXPECT_EQ(db.differing, 0);
  EXPECT_EQ(db.max_abs_diff, 0);
  EXPECT_EQ(db.max_magnitude, 2.0);
}

TEST_F(TensorCompareTest, NonFiniteAgainstFiniteIsAnInfiniteDifference) {
  std::vector<float> x = {1, 2, 3}, y = {1, std::numeric_limits<float>::infinity(), 3};
  const std::vector<TensorDecl> decls = {{"x", DataType::kFloat32, {3}}};
  SHARD_ASSERT_OK_AND_ASSIGN(
      std::vector<TensorDifference> d,
      CompareSafetensorsFiles(Write("x.safetensors", decls, {x.data()}),
                              Write("y.safetensors", decls, {y.data()})));
  EXPECT_TRUE(std::isinf(d[0].max_abs_diff));
  EXPECT_EQ(d[0].worst_element, 1);
}

TEST_F(TensorCompareTest, ComparesBFloat16ByValue) {
  std::vector<uint16_t> x = {FloatToBFloat16(1.0f), FloatToBFloat16(0.5f)};
  std::vector<uint16_t> y = {FloatToBFloat16(1.0f), FloatToBFloat16(0.75f)};
  const std::vector<TensorDecl> decls = {{"h", DataType::kBFloat16, {2}}};
  SHARD_ASSERT_OK_AND_ASSIGN(
      std::vector<TensorDifference> d,
      CompareSafetensorsFiles(Write("hx.safetensors", decls, {x.data()}),
                              Write("hy.safetensors", decls, {y.data()})));
  EXPECT_DOUBLE_EQ(d[0].max_abs_diff, 0.25);
}

TEST_F(TensorCompareTest, RefusesFilesWithOtherTensorsNamingThem) {
  std::vector<float> x = {1, 2, 3, 4};
  const std::string a = Write("p.safetensors", {{"x", DataType::kFloat32, {4}}}, {x.data()});
  const std::string other_shape =
      Write("q.safetensors", {{"x", DataType::kFloat32, {2, 2}}}, {x.data()});
  const std::string other_name =
      Write("r.safetensors", {{"z", DataType::kFloat32, {4}}}, {x.data()});
  absl::StatusOr<std::vector<TensorDifference>> shape = CompareSafetensorsFiles(a, other_shape);
  EXPECT_EQ(shape.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(shape.status().message().find("[2, 2]"), absl::string_view::npos) << shape.status();
  absl::StatusOr<std::vector<TensorDifference>> name = CompareSafetensorsFiles(a, other_name);
  EXPECT_EQ(name.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(name.status().message().find("'z'"), absl::string_view::npos) << name.status();
}

}  // namespace
}  // namespace shard
