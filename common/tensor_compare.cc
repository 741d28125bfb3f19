#include "common/tensor_compare.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/dtype.h"
#include "common/safetensors.h"
#include "common/status_macros.h"

namespace shard {
namespace {

// Elements read per pass: bounds memory for tensors of any size.
constexpr int64_t kBlock = int64_t{1} << 20;

absl::StatusOr<double> ElementAsDouble(const char* bytes, DataType dtype) {
  switch (dtype) {
    case DataType::kFloat32: {
      float v;
      std::memcpy(&v, bytes, sizeof(v));
      return v;
    }
    case DataType::kFloat64: {
      double v;
      std::memcpy(&v, bytes, sizeof(v));
      return v;
    }
    case DataType::kFloat16: {
      uint16_t v;
      std::memcpy(&v, bytes, sizeof(v));
      return HalfToFloat(v);
    }
    case DataType::kBFloat16: {
      uint16_t v;
      std::memcpy(&v, bytes, sizeof(v));
      return BFloat16ToFloat(v);
    }
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("cannot compare ", DataTypeName(dtype), " tensors"));
  }
}

std::string Shape(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

}  // namespace

absl::StatusOr<std::vector<TensorDifference>> CompareSafetensorsFiles(const std::string& a,
                                                                      const std::string& b) {
  SHARD_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsReader> left, SafetensorsReader::Open(a));
  SHARD_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsReader> right, SafetensorsReader::Open(b));
  for (const TensorInfo& tensor : right->tensors()) {
    if (left->Find(tensor.name) == nullptr) {
      return absl::FailedPreconditionError(
          absl::StrCat("tensor '", tensor.name, "' is in ", b, " but not in ", a));
    }
  }
  std::vector<TensorDifference> differences;
  std::vector<char> left_block, right_block;
  for (const TensorInfo& tensor : left->tensors()) {
    const TensorInfo* other = right->Find(tensor.name);
    if (other == nullptr) {
      return absl::FailedPreconditionError(
          absl::StrCat("tensor '", tensor.name, "' is in ", a, " but not in ", b));
    }
    if (other->dtype != tensor.dtype || other->shape != tensor.shape) {
      return absl::FailedPreconditionError(absl::StrCat(
          "tensor '", tensor.name, "' is ", DataTypeName(tensor.dtype), " ", Shape(tensor.shape),
          " in ", a, " but ", DataTypeName(other->dtype), " ", Shape(other->shape), " in ", b));
    }
    TensorDifference difference;
    difference.name = tensor.name;
    difference.numel = tensor.numel();
    const size_t size = DataTypeSize(tensor.dtype);
    for (int64_t begin = 0; begin < difference.numel; begin += kBlock) {
      const int64_t count = std::min(kBlock, difference.numel - begin);
      left_block.resize(count * size);
      right_block.resize(count * size);
      SHARD_RETURN_IF_ERROR(left->ReadElements(tensor, begin, count, left_block.data()));
      SHARD_RETURN_IF_ERROR(right->ReadElements(*other, begin, count, right_block.data()));
      for (int64_t i = 0; i < count; ++i) {
        const char* x = left_block.data() + i * size;
        const char* y = right_block.data() + i * size;
        if (std::memcmp(x, y, size) == 0) {
          SHARD_ASSIGN_OR_RETURN(double same, ElementAsDouble(x, tensor.dtype));
          difference.max_magnitude = std::max(difference.max_magnitude, std::fabs(same));
          continue;
        }
        ++difference.differing;
        SHARD_ASSIGN_OR_RETURN(double u, ElementAsDouble(x, tensor.dtype));
        SHARD_ASSIGN_OR_RETURN(double v, ElementAsDouble(y, tensor.dtype));
        difference.max_magnitude = std::max(difference.max_magnitude, std::fabs(u));
        // NaN against NaN of another payload counts as equal; a finite value against a
        // non-finite one as an infinite difference.
        const double gap = std::isnan(u) && std::isnan(v) ? 0
                           : std::isfinite(u) && std::isfinite(v) ? std::fabs(u - v)
                                                                   : HUGE_VAL;
        if (gap > difference.max_abs_diff) {
          difference.max_abs_diff = gap;
          difference.worst_element = begin + i;
        }
      }
    }
    differences.push_back(std::move(difference));
  }
  return differences;
}

}  // namespace shard
