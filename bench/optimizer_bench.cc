// shard-bench-optimizer: the CPU optimizer step (one thread) against a memory copy measured in
// the same run. An fp32 Adam update reads param, grad, exp_avg, exp_avg_sq and writes param,
// exp_avg, exp_avg_sq: 7 x 4 bytes per element; SGD with momentum moves 5 x 4. The target is
// at least 0.85x the copy bandwidth (read + write bytes).
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <vector>

#include "absl/time/clock.h"
#include "common/cli.h"
#include "worker/dataplane/optimizer.h"

namespace {

template <typename Fn>
double BestSeconds(int repeats, Fn&& fn) {
  double best = 1e30;
  for (int i = 0; i < repeats; ++i) {
    const absl::Time start = absl::Now();
    fn();
    best = std::min(best, absl::ToDoubleSeconds(absl::Now() - start));
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"shard-bench-optimizer: CPU optimizer updates (one thread) in GB/s against a "
               "memory copy measured in the same run.",
               "shard-bench-optimizer"};
  int64_t elements = int64_t{1} << 25;
  int repeats = 5;
  app.add_option("--elements", elements, "elements per update")->capture_default_str();
  app.add_option("--repeats", repeats, "best of this many")->capture_default_str();
  if (std::optional<int> exit_code = shard::ParseCommandLine(app, argc, argv)) return *exit_code;

  std::vector<float> param(elements, 0.5f), grad(elements, 0.01f), m(elements, 0.0f),
      v(elements, 0.0f), copy(elements);
  // The better of memcpy and a plain copy loop: the machine's copy bandwidth.
  const double copy_s = std::min(
      BestSeconds(repeats, [&] { std::memcpy(copy.data(), param.data(), elements * sizeof(float)); }),
      BestSeconds(repeats, [&] { std::copy(param.begin(), param.end(), copy.begin()); }));
  const double copy_gbps = 2.0 * elements * sizeof(float) / copy_s / 1e9;
  std::printf("# %lld elements, best of %d; memory copy %.2f GB/s (read + write)\n",
              static_cast<long long>(elements), repeats, copy_gbps);
  std::printf("%-10s %10s %12s %10s\n", "optimizer", "time_ms", "GB/s", "vs_copy");
  struct Case {
    const char* name;
    shard::OptimizerKind kind;
    double momentum;
    double bytes_per_element;
  };
  for (const Case& c : {Case{"adam", shard::OptimizerKind::kAdam, 0, 28},
                        Case{"adamw", shard::OptimizerKind::kAdamW, 0, 28},
                        Case{"sgd", shard::OptimizerKind::kSgd, 0.9, 20}}) {
    shard::OptimizerConfig config;
    config.kind = c.kind;
    config.momentum = c.momentum;
    config.weight_decay = c.kind == shard::OptimizerKind::kAdamW ? 0.01 : 0;
    shard::OptimizerKernel kernel(config);
    float* state[2] = {m.data(), v.data()};
    int64_t step = 0;
    const double seconds = BestSeconds(repeats, [&] {
      kernel.Update(++step, param.data(), grad.data(), state, elements);
    });
    const double gbps = c.bytes_per_element * elements / seconds / 1e9;
    std::printf("%-10s %10.2f %12.2f %9.2fx\n", c.name, seconds * 1e3, gbps, gbps / copy_gbps);
  }
  return 0;
}
