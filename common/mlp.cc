#include "common/mlp.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace shard {

Mlp::Mlp(std::vector<int64_t> widths) : widths_(std::move(widths)) {}

absl::StatusOr<double> Mlp::Forward(const std::vector<const float*>& params, const float* x,
                                    const int64_t* y, int64_t batch,
                                    const LayerHook& before_layer) {
  batch_ = batch;
  input_ = x;
  labels_ = y;
  const int n = layers();
  outputs_.resize(n);
  hidden_.resize(n - 1);
  const float* a = x;
  for (int l = 0; l < n; ++l) {
    const int64_t in = widths_[l];
    const int64_t out = widths_[l + 1];
    if (before_layer) {
      if (absl::Status ready = before_layer(l, /*backward=*/false); !ready.ok()) return ready;
    }
    std::vector<float>& z = outputs_[l];
    z.resize(batch * out);
    const float* bias = params[BiasIndex(l)];
    for (int64_t r = 0; r < batch; ++r) std::copy(bias, bias + out, z.data() + r * out);
    // z[batch, out] = a[batch, in] · Wᵀ + b
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, batch, out, in, 1.0f, a, in,
                params[WeightIndex(l)], in, 1.0f, z.data(), out);
    if (l + 1 < n) {
      std::vector<float>& h = hidden_[l];
      h.resize(z.size());
      for (size_t i = 0; i < z.size(); ++i) h[i] = z[i] > 0 ? z[i] : 0.0f;
      a = h.data();
    }
  }
  // Softmax cross-entropy, row by row, with the max subtracted for stability.
  const int64_t classes = widths_.back();
  const std::vector<float>& logits = outputs_.back();
  probabilities_.resize(logits.size());
  double loss = 0;
  for (int64_t r = 0; r < batch; ++r) {
    const int64_t label = y[r];
    if (label < 0 || label >= classes) {
      return absl::InvalidArgumentError(absl::StrCat("label ", label, " of batch row ", r,
                                                     " is outside the ", classes,
                                                     " classes of the model's output"));
    }
    const float* row = logits.data() + r * classes;
    const float top = *std::max_element(row, row + classes);
    double sum = 0;
    for (int64_t c = 0; c < classes; ++c) sum += std::exp(static_cast<double>(row[c] - top));
    const double log_sum = std::log(sum) + top;
    for (int64_t c = 0; c < classes; ++c) {
      probabilities_[r * classes + c] = static_cast<float>(std::exp(row[c] - log_sum));
    }
    loss += log_sum - row[label];
  }
  return loss;
}

absl::Status Mlp::Backward(const std::vector<const float*>& params,
                           const std::vector<float*>& grads, float scale,
                           const std::function<void(int)>& ready, const LayerHook& before_layer) {
  const int n = layers();
  const int64_t batch = batch_;
  const int64_t classes = widths_.back();
  // d(loss)/d(logits) = (softmax - onehot) * scale
  delta_.resize(batch * classes);
  for (int64_t r = 0; r < batch; ++r) {
    for (int64_t c = 0; c < classes; ++c) {
      const float target = c == labels_[r] ? 1.0f : 0.0f;
      delta_[r * classes + c] = (probabilities_[r * classes + c] - target) * scale;
    }
  }
  for (int l = n - 1; l >= 0; --l) {
    const int64_t in = widths_[l];
    const int64_t out = widths_[l + 1];
    if (before_layer) SHARD_RETURN_IF_ERROR(before_layer(l, /*backward=*/true));
    const float* a = l == 0 ? input_ : hidden_[l - 1].data();
    float* bias_grad = grads[BiasIndex(l)];
    std::fill(bias_grad, bias_grad + out, 0.0f);
    for (int64_t r = 0; r < batch; ++r) {
      const float* d = delta_.data() + r * out;
      for (int64_t j = 0; j < out; ++j) bias_grad[j] += d[j];
    }
    ready(BiasIndex(l));
    // dW[out, in] = deltaᵀ[out, batch] · a[batch, in]
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, out, in, batch, 1.0f, delta_.data(), out,
                a, in, 0.0f, grads[WeightIndex(l)], in);
    if (l > 0) {
      // d(a)[batch, in] = delta[batch, out] · W[out, in], then through the ReLU: before W is
      // marked ready, since the engine may update W as soon as its bucket is reduced.
      delta_input_.resize(batch * in);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, batch, in, out, 1.0f,
                  delta_.data(), out, params[WeightIndex(l)], in, 0.0f, delta_input_.data(), in);
      const std::vector<float>& z = outputs_[l - 1];
      // A select, not a conditional store, so that it vectorises (and no branch mispredicts).
      for (size_t i = 0; i < delta_input_.size(); ++i) {
        delta_input_[i] = z[i] <= 0 ? 0.0f : delta_input_[i];
      }
    }
    ready(WeightIndex(l));
    if (l == 0) break;
    delta_.swap(delta_input_);
  }
  return absl::OkStatus();
}

std::vector<int64_t> Mlp::Predictions() const {
  const int64_t classes = widths_.back();
  std::vector<int64_t> predicted(batch_);
  for (int64_t r = 0; r < batch_; ++r) {
    const float* row = outputs_.back().data() + r * classes;
    predicted[r] = std::max_element(row, row + classes) - row;
  }
  return predicted;
}

void SetComputeThreads(int threads) { openblas_set_num_threads(threads); }

float UniformFloat(std::mt19937_64& rng) {
  return static_cast<float>(rng() >> 40) * (1.0f / 16777216.0f);
}

absl::Status ForEachInitialMlpParameter(
    const std::vector<int64_t>& widths, uint64_t seed,
    const std::function<absl::Status(int index, const std::vector<float>& values)>& take) {
  std::mt19937_64 rng(seed);
  int index = 0;
  std::vector<float> values;
  for (size_t l = 0; l + 1 < widths.size(); ++l) {
    const float bound = 1.0f / std::sqrt(static_cast<float>(widths[l]));
    for (int64_t count : {widths[l + 1] * widths[l], widths[l + 1]}) {
      values.resize(count);
      for (float& v : values) v = (2.0f * UniformFloat(rng) - 1.0f) * bound;
      SHARD_RETURN_IF_ERROR(take(index++, values));
    }
  }
  return absl::OkStatus();
}

std::vector<std::vector<float>> InitMlpParameters(const std::vector<int64_t>& widths,
                                                  uint64_t seed) {
  std::vector<std::vector<float>> params;
  ForEachInitialMlpParameter(widths, seed, [&](int, const std::vector<float>& values) {
    params.push_back(values);
    return absl::OkStatus();
  }).IgnoreError();  // the callback never fails
  return params;
}

}  // namespace shard
