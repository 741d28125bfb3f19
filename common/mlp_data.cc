#include "common/mlp_data.h"

#include <cmath>
#include <random>

#include "absl/strings/str_cat.h"
#include "common/mlp.h"
#include "common/status_macros.h"

namespace shard {

absl::StatusOr<std::unique_ptr<MlpBatchReader>> MlpBatchReader::Open(const std::string& path,
                                                                     int64_t input_width) {
  std::unique_ptr<MlpBatchReader> reader(new MlpBatchReader());
  SHARD_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsReader> file, SafetensorsReader::Open(path));
  reader->file_ = std::move(file);
  const TensorInfo* x = reader->file_->Find("x");
  if (x == nullptr || x->shape.size() != 2 || x->shape[0] < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("data file '", path, "' needs x as F32 [N, ", input_width, "] with N >= 1"));
  }
  reader->samples_ = x->shape[0];
  reader->width_ = input_width;
  SHARD_ASSIGN_OR_RETURN(
      reader->x_, reader->file_->Expect("x", DataType::kFloat32, {reader->samples_, input_width}));
  SHARD_ASSIGN_OR_RETURN(reader->y_,
                         reader->file_->Expect("y", DataType::kInt64, {reader->samples_}));
  return reader;
}

absl::Status MlpBatchReader::Read(int64_t step, int64_t global_batch, int rank, int world_size,
                                  std::vector<float>* x, std::vector<int64_t>* y) const {
  const int64_t rows = global_batch / world_size;
  x->resize(rows * width_);
  y->resize(rows);
  int64_t next = (step * global_batch + rank * rows) % samples_;
  for (int64_t done = 0; done < rows;) {
    // Contiguous runs up to the end of the file, then wrap around.
    const int64_t run = std::min(rows - done, samples_ - next);
    SHARD_RETURN_IF_ERROR(
        file_->ReadElements(*x_, next * width_, run * width_, x->data() + done * width_));
    SHARD_RETURN_IF_ERROR(file_->ReadElements(*y_, next, run, y->data() + done));
    done += run;
    next = (next + run) % samples_;
  }
  return absl::OkStatus();
}

absl::Status GenerateMlpData(const std::vector<int64_t>& widths, int64_t samples, uint64_t seed,
                             const std::string& path) {
  if (widths.size() < 2 || samples < 1) {
    return absl::InvalidArgumentError("need at least two widths and one sample");
  }
  const int64_t in = widths.front();
  std::mt19937_64 rng(seed);
  std::vector<float> x(samples * in);
  // Standard normal by Box-Muller on our own uniform draws: identical on every machine.
  for (size_t i = 0; i < x.size(); i += 2) {
    const float u1 = std::max(UniformFloat(rng), 1e-7f);
    const float u2 = UniformFloat(rng);
    const float radius = std::sqrt(-2.0f * std::log(u1));
    x[i] = radius * std::cos(6.2831853f * u2);
    if (i + 1 < x.size()) x[i + 1] = radius * std::sin(6.2831853f * u2);
  }
  // The teacher: the same architecture, its own seeded weights.
  const std::vector<std::vector<float>> teacher = InitMlpParameters(widths, seed ^ 0x5eed7eac4e5ull);
  std::vector<const float*> params;
  for (const std::vector<float>& p : teacher) params.push_back(p.data());
  std::vector<int64_t> y(samples, 0);
  Mlp model(widths);
  constexpr int64_t kChunk = 1024;
  for (int64_t start = 0; start < samples; start += kChunk) {
    const int64_t rows = std::min(kChunk, samples - start);
    SHARD_RETURN_IF_ERROR(
        model.Forward(params, x.data() + start * in, y.data() + start, rows).status());
    const std::vector<int64_t> predicted = model.Predictions();
    std::copy(predicted.begin(), predicted.end(), y.begin() + start);
  }
  return WriteSafetensors(path,
                          {TensorDecl{"x", DataType::kFloat32, {samples, in}},
                           TensorDecl{"y", DataType::kInt64, {samples}}},
                          {x.data(), y.data()},
                          {{"generator", "shard teacher MLP"},
                           {"seed", absl::StrCat(seed)}});
}

}  // namespace shard
