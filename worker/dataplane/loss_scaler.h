// Dynamic loss scaling for fp16 training, with torch.cuda.amp.GradScaler's rules and defaults.
// Per step: backward of loss x scale(); ScaleGradients(grads, inv_scale(), found_inf) (kernels.h);
// all-reduce found_inf with kMax across ranks; then Update(found_inf): on overflow the caller
// skips the optimizer step and the scale is multiplied by backoff_factor; after growth_interval
// clean steps in a row it is multiplied by growth_factor. The scale is an fp32 value updated in
// fp32, as torch's _amp_update_scale_ does, so runs agree with torch's step for step.
// Host-side and thread-compatible.
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"

namespace shard {

struct LossScalerOptions {
  float init_scale = 65536.0f;  // 2^16
  float growth_factor = 2.0f;
  float backoff_factor = 0.5f;
  int64_t growth_interval = 2000;
};

class LossScaler {
 public:
  // InvalidArgument unless init_scale > 0 and finite, growth_factor > 1, 0 < backoff_factor < 1
  // and growth_interval >= 1.
  static absl::StatusOr<LossScaler> Create(LossScalerOptions options = {});

  float scale() const { return scale_; }
  // 1 / scale rounded to fp32 from double, as GradScaler's unscale_ computes it.
  float inv_scale() const { return static_cast<float>(1.0 / static_cast<double>(scale_)); }
  // Clean steps since the last overflow or growth.
  int64_t growth_tracker() const { return growth_tracker_; }

  // Records the step's outcome and returns whether its optimizer step should be applied
  // (false on overflow). A growth that would overflow fp32 is not applied (torch's rule).
  bool Update(bool found_inf);

  // Continues from a checkpoint's scale and growth tracker. InvalidArgument unless the scale is
  // positive and finite and the tracker is in [0, growth_interval).
  absl::Status Restore(float scale, int64_t growth_tracker);

 private:
  explicit LossScaler(LossScalerOptions options)
      : options_(options), scale_(options.init_scale) {}

  LossScalerOptions options_;
  float scale_;
  int64_t growth_tracker_ = 0;
};

}  // namespace shard
