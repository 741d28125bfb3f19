// shard-bench-plan: how long planning takes for the manifest of a 70-billion-parameter
// transformer (Llama-2-70B's shapes: 80 layers x 9 tensors, bf16) at world sizes 8, 64 and 1024,
// in both shard modes. The coordinator plans on every generation change and every worker
// recomputes the plan to check its hash, so this must take milliseconds.
#include <algorithm>
#include <cstdio>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/cli.h"
#include "common/plan.h"

namespace {

shard::Manifest Llama70B() {
  constexpr int64_t kHidden = 8192, kFfn = 28672, kKv = 1024, kVocab = 32000, kLayers = 80;
  shard::Manifest manifest;
  auto add = [&](std::string name, std::vector<int64_t> shape) {
    manifest.params.push_back(
        shard::ParamSpec{std::move(name), std::move(shape), shard::DataType::kBFloat16, true});
  };
  add("model.embed_tokens.weight", {kVocab, kHidden});
  for (int64_t l = 0; l < kLayers; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    add(p + "self_attn.q_proj.weight", {kHidden, kHidden});
    add(p + "self_attn.k_proj.weight", {kKv, kHidden});
    add(p + "self_attn.v_proj.weight", {kKv, kHidden});
    add(p + "self_attn.o_proj.weight", {kHidden, kHidden});
    add(p + "mlp.gate_proj.weight", {kFfn, kHidden});
    add(p + "mlp.up_proj.weight", {kFfn, kHidden});
    add(p + "mlp.down_proj.weight", {kHidden, kFfn});
    add(p + "input_layernorm.weight", {kHidden});
    add(p + "post_attention_layernorm.weight", {kHidden});
  }
  add("model.norm.weight", {kHidden});
  add("lm_head.weight", {kVocab, kHidden});
  return manifest;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"shard-bench-plan: planning time for a 70B-parameter transformer manifest "
               "(Llama-2-70B shapes, bf16) at several world sizes, both shard modes; median of "
               "--repeats runs, against the brief's 50 ms target.",
               "shard-bench-plan"};
  std::string world_sizes = "8,64,1024";
  int repeats = 11;
  double bucket_cap_mb = 25;
  app.add_option("--world-sizes", world_sizes, "comma-separated")->capture_default_str();
  app.add_option("--repeats", repeats, "runs per configuration")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000));
  app.add_option("--bucket-cap-mb", bucket_cap_mb, "bucket cap in MiB")
      ->capture_default_str()
      ->check(shard::MebibytesValidator());
  if (std::optional<int> exit_code = shard::ParseCommandLine(app, argc, argv)) return *exit_code;

  const shard::Manifest manifest = Llama70B();
  int64_t total = 0;
  for (const shard::ParamSpec& p : manifest.params) total += p.numel();
  std::printf("# manifest: %zu parameters, %.2f billion elements (bf16)\n", manifest.params.size(),
              total / 1e9);
  std::printf("# %6s %6s %8s %10s %12s %10s %10s\n", "ranks", "mode", "buckets", "ranges",
              "imbalance", "median_ms", "max_ms");
  double worst = 0;
  for (absl::string_view text : absl::StrSplit(world_sizes, ',')) {
    int world = 0;
    if (!absl::SimpleAtoi(text, &world) || world < 1) {
      std::fprintf(stderr, "shard-bench-plan: bad world size '%s'\n", std::string(text).c_str());
      return 2;
    }
    for (shard::ShardMode mode : {shard::ShardMode::kRange, shard::ShardMode::kParam}) {
      shard::PlanOptions options;
      options.world_size = world;
      options.mode = mode;
      options.bucket_cap_bytes = shard::MebibytesToBytes(bucket_cap_mb);
      std::vector<double> ms;
      absl::StatusOr<shard::Plan> plan;
      for (int i = 0; i < repeats; ++i) {
        const absl::Time start = absl::Now();
        plan = shard::MakePlan(manifest, options);
        ms.push_back(absl::ToDoubleMilliseconds(absl::Now() - start));
        if (!plan.ok()) {
          std::fprintf(stderr, "shard-bench-plan: %s\n", std::string(plan.status().message()).c_str());
          return 1;
        }
      }
      std::sort(ms.begin(), ms.end());
      size_t ranges = 0;
      for (const shard::RankOwnership& r : plan->ranks) ranges += r.ranges.size();
      std::printf("  %6d %6s %8zu %10zu %12.6f %10.2f %10.2f\n", world,
                  std::string(shard::ShardModeName(mode)).c_str(), plan->buckets.size(), ranges,
                  plan->imbalance, ms[ms.size() / 2], ms.back());
      worst = std::max(worst, ms[ms.size() / 2]);
    }
  }
  std::printf("# slowest median %.2f ms; target < 50 ms: %s\n", worst, worst < 50 ? "met" : "MISSED");
  return 0;
}
