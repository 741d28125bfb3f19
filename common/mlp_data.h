// The built-in MLP's data: a safetensors file with x (F32 [N, in]) and y (I64 [N]). Step s of a
// global batch B uses samples [s·B, (s+1)·B) modulo N; rank r of W reads the r-th contiguous
// B/W of them, so W workers together see exactly what one process would.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/safetensors.h"

namespace shard {

class MlpBatchReader {
 public:
  // Checks that x is F32 [N, input_width] and y is I64 [N].
  static absl::StatusOr<std::unique_ptr<MlpBatchReader>> Open(const std::string& path,
                                                              int64_t input_width);

  int64_t samples() const { return samples_; }

  // Reads rank `rank`'s slice of step `step`'s global batch into x ([B/W, in]) and y ([B/W]).
  absl::Status Read(int64_t step, int64_t global_batch, int rank, int world_size,
                    std::vector<float>* x, std::vector<int64_t>* y) const;

 private:
  MlpBatchReader() = default;
  std::unique_ptr<SafetensorsReader> file_;
  const TensorInfo* x_ = nullptr;
  const TensorInfo* y_ = nullptr;
  int64_t samples_ = 0;
  int64_t width_ = 0;
};

// Writes `samples` rows whose x is standard normal and whose y is the class a seeded random
// "teacher" MLP of these widths picks, so that a student of the same shape can learn it.
absl::Status GenerateMlpData(const std::vector<int64_t>& widths, int64_t samples, uint64_t seed,
                             const std::string& path);

}  // namespace shard
