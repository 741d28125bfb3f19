// shard-bench-plan: how long planning takes for the manifest of a 70-billion-parameter
// transformer (Llama-2-70B's shapes: 80 layers x 9 tensors, bf16) at world sizes 8, 64 and 1024,
// in both shard modes. The coordinator plans on every generation change and every worker
// recomputes the plan to check its hash, so this must take milliseconds.
#include <algorithm>
#include <cstdio>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "bench/harness.h"
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
  shard::bench::Output output;
  app.add_option("--world-sizes", world_sizes, "comma-separated")->capture_default_str();
  app.add_option("--repeats", repeats, "runs per configuration")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000));
  app.add_option("--bucket-cap-mb", bucket_cap_mb, "bucket cap in MiB")
      ->capture_default_str()
      ->check(shard::MebibytesValidator());
  shard::bench::AddOutputOptions(app, &output);
  if (std::optional<int> exit_code = shard::ParseCommandLine(app, argc, argv)) return *exit_code;

  constexpr double kTargetMs = 50;
  const shard::Manifest manifest = Llama70B();
  int64_t total = 0;
  for (const shard::ParamSpec& p : manifest.params) total += p.numel();
  shard::bench::Report report("shard-bench-plan", output);
  report.Note(absl::StrFormat("manifest: %zu parameters, %.2f billion elements (bf16); "
                              "extras: the plan's buckets, ranges and imbalance",
                              manifest.params.size(), total / 1e9));
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
      absl::StatusOr<shard::Plan> plan;
      const std::vector<double> ms =
          shard::bench::TimeRuns(0, repeats, [&] { plan = shard::MakePlan(manifest, options); });
      if (!plan.ok()) {
        std::fprintf(stderr, "shard-bench-plan: %s\n",
                     std::string(plan.status().message()).c_str());
        return 1;
      }
      size_t ranges = 0;
      for (const shard::RankOwnership& r : plan->ranks) ranges += r.ranges.size();
      shard::bench::Record record({.op = "plan",
                                   .impl = std::string(shard::ShardModeName(mode)),
                                   .count = total,
                                   .dtype = "bf16",
                                   .ranks = world},
                                  shard::bench::Summarize(ms));
      record.Extra("buckets", static_cast<double>(plan->buckets.size()))
          .Extra("ranges", static_cast<double>(ranges))
          .Extra("imbalance", plan->imbalance)
          .Compare("time_ms", "target 50 ms", kTargetMs, shard::bench::Below(1));
      report.Add(record);
      worst = std::max(worst, record.time_ms());
    }
  }
  report.Note(absl::StrFormat("slowest median %.2f ms; target < %.0f ms: %s", worst, kTargetMs,
                              worst < kTargetMs ? "met" : "MISSED"));
  return report.Finish() ? 0 : 1;
}
