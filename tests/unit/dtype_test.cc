#include "common/dtype.h"

#include <bit>
#include <cmath>
#include <cstdint>

#include "gtest/gtest.h"

namespace shard {
namespace {

TEST(DataTypeTest, SizesAndNamesRoundTrip) {
  EXPECT_EQ(DataTypeSize(DataType::kFloat32), 4u);
  EXPECT_EQ(DataTypeSize(DataType::kFloat16), 2u);
  EXPECT_EQ(DataTypeSize(DataType::kBFloat16), 2u);
  EXPECT_EQ(DataTypeSize(DataType::kInt64), 8u);
  for (DataType dtype : {DataType::kFloat32, DataType::kFloat16, DataType::kBFloat16,
                         DataType::kInt64}) {
    absl::StatusOr<DataType> parsed = ParseDataType(DataTypeName(dtype));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, dtype);
  }
}

TEST(DataTypeTest, UnknownNameIsAnErrorThatListsTheChoices) {
  absl::StatusOr<DataType> parsed = ParseDataType("float32");
  ASSERT_FALSE(parsed.ok());
  EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(parsed.status().message().find("float32"), absl::string_view::npos);
  EXPECT_NE(parsed.status().message().find("bf16"), absl::string_view::npos);
}

TEST(HalfTest, EveryHalfSurvivesARoundTripThroughFloat) {
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {
    const uint16_t h = static_cast<uint16_t>(bits);
    const float f = HalfToFloat(h);
    if (std::isnan(f)) {
      EXPECT_TRUE(((h >> 10) & 0x1f) == 0x1f && (h & 0x3ff) != 0) << bits;
      EXPECT_TRUE(std::isnan(HalfToFloat(FloatToHalf(f))));
      continue;
    }
    EXPECT_EQ(FloatToHalf(f), h) << "half bits " << bits << " -> " << f;
  }
}

TEST(HalfTest, KnownValuesAndRounding) {
  EXPECT_EQ(FloatToHalf(1.0f), 0x3c00);
  EXPECT_EQ(FloatToHalf(-2.0f), 0xc000);
  EXPECT_EQ(FloatToHalf(65504.0f), 0x7bff);                // largest finite half
  EXPECT_EQ(FloatToHalf(65520.0f), 0x7c00);                // halfway to 65536 rounds to inf
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -24)), 0x0001);   // smallest subnormal
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -25)), 0x0000);   // halfway rounds to even (zero)
  EXPECT_EQ(FloatToHalf(std::ldexp(1.5f, -24)), 0x0002);   // 1.5 ulp rounds to even (2)
  // 1 + 2^-11 is halfway between 1 and the next half: ties to even keeps 1.
  EXPECT_EQ(FloatToHalf(1.0f + std::ldexp(1.0f, -11)), 0x3c00);
  EXPECT_EQ(FloatToHalf(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);
  EXPECT_FLOAT_EQ(HalfToFloat(0x3555), 0.333251953125f);
}

TEST(BFloat16Test, RoundsToNearestEvenAndKeepsNaN) {
  EXPECT_EQ(FloatToBFloat16(1.0f), 0x3f80);
  // 1 + 2^-8 is halfway between bf16 neighbours 1 and 1 + 2^-7: ties to even keeps 1.
  EXPECT_EQ(FloatToBFloat16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);
  EXPECT_EQ(FloatToBFloat16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);
  EXPECT_TRUE(std::isnan(BFloat16ToFloat(FloatToBFloat16(std::nanf("")))));
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {
    const float f = BFloat16ToFloat(static_cast<uint16_t>(bits));
    if (!std::isnan(f)) {
      EXPECT_EQ(FloatToBFloat16(f), bits);
    }
  }
}

}  // namespace
}  // namespace shard
