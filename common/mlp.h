// The built-in model: an MLP whose layer i computes x·W_iᵀ + b_i (torch.nn.Linear's
// convention, W_i of shape [out, in]) with ReLU between layers and none after the last; the
// loss is softmax cross-entropy. Forward and backward run on the CPU through OpenBLAS sgemm.
// Parameters and gradients are not owned here: the caller passes views (e.g. into the
// engine's bucket buffers), so gradients are written straight where they are reduced.
#pragma once

#include <cstdint>
#include <functional>
#include <random>
#include <vector>

#include "absl/status/statusor.h"

namespace shard {

// Called before each layer's forward (backward = false) and backward (true; last layer first).
// It may repoint that layer's entries of the params and grads vectors passed in, which are read
// only then (ZeRO-3 gathers a layer's parameters just for it: worker/dataplane/engine.h).
using LayerHook = std::function<absl::Status(int layer, bool backward)>;

class Mlp {
 public:
  explicit Mlp(std::vector<int64_t> widths);

  const std::vector<int64_t>& widths() const { return widths_; }
  int layers() const { return static_cast<int>(widths_.size()) - 1; }
  // Manifest indices (see MlpManifest): layer l's weight is 2l, its bias 2l+1.
  static int WeightIndex(int layer) { return 2 * layer; }
  static int BiasIndex(int layer) { return 2 * layer + 1; }

  // Runs `batch` rows of x ([batch, widths[0]]) through the network with the parameters at
  // params[i] (manifest order) and returns the sum over rows of the cross-entropy with labels
  // y. Keeps what Backward needs. InvalidArgument for a label outside the classes.
  absl::StatusOr<double> Forward(const std::vector<const float*>& params, const float* x,
                                 const int64_t* y, int64_t batch,
                                 const LayerHook& before_layer = nullptr);

  // Gradients of `scale` x (the summed loss of the last Forward) into grads[i], overwriting
  // them; `ready(i)` is called as soon as parameter i's gradient is complete and backward no
  // longer reads parameter i (the engine may update it then), last layer first. A hook's error
  // ends it early.
  absl::Status Backward(const std::vector<const float*>& params, const std::vector<float*>& grads,
                        float scale, const std::function<void(int)>& ready,
                        const LayerHook& before_layer = nullptr);

  // Predicted class of each row of the last Forward.
  std::vector<int64_t> Predictions() const;

 private:
  std::vector<int64_t> widths_;
  int64_t batch_ = 0;
  const float* input_ = nullptr;
  const int64_t* labels_ = nullptr;
  std::vector<std::vector<float>> outputs_;  // pre-activation output of each layer
  std::vector<std::vector<float>> hidden_;   // ReLU of each output but the last
  std::vector<float> probabilities_;         // softmax of the last output
  std::vector<float> delta_;                 // scratch: gradient of the current layer's output
  std::vector<float> delta_input_;
};

// torch.nn.Linear's default initialisation (weights and biases uniform in +-1/sqrt(in)) from a
// seeded generator, identical on every machine; one vector per parameter, manifest order.
std::vector<std::vector<float>> InitMlpParameters(const std::vector<int64_t>& widths,
                                                  uint64_t seed);
// The same values one parameter at a time (`take(index, values)`, manifest order), so that no
// more than one is in memory; the first error `take` returns stops it.
absl::Status ForEachInitialMlpParameter(
    const std::vector<int64_t>& widths, uint64_t seed,
    const std::function<absl::Status(int index, const std::vector<float>& values)>& take);

// Threads OpenBLAS may use for this process's matrix products.
void SetComputeThreads(int threads);

// A uniform float in [0, 1) with 24 random bits, the same everywhere.
float UniformFloat(std::mt19937_64& rng);

}  // namespace shard
