// Element types the data path moves and reduces.
#pragma once

#include <cstddef>
#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace shard {

enum class DataType : uint8_t { kFloat32, kFloat16, kBFloat16, kInt64, kFloat64 };

// Bytes per element.
size_t DataTypeSize(DataType dtype);

// Lower-case short name as used in manifests: f32, f16, bf16, i64, f64.
absl::string_view DataTypeName(DataType dtype);

// Inverse of DataTypeName; InvalidArgument naming the accepted values otherwise.
absl::StatusOr<DataType> ParseDataType(absl::string_view name);

// IEEE half and bfloat16 conversions (round to nearest even), used where a backend has no native
// arithmetic for the 16-bit types.
float HalfToFloat(uint16_t bits);
uint16_t FloatToHalf(float value);
float BFloat16ToFloat(uint16_t bits);
uint16_t FloatToBFloat16(float value);

}  // namespace shard
