// shard-bench-optimizer: the CPU optimizer step (one thread) against a memory copy measured in
// the same run. An fp32 Adam update reads param, grad, exp_avg, exp_avg_sq and writes param,
// exp_avg, exp_avg_sq: 7 x 4 bytes per element; SGD with momentum moves 5 x 4. The target is
// at least 0.85x the copy bandwidth (read + write bytes).
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <vector>

#include "absl/strings/str_format.h"
#include "bench/harness.h"
#include "common/cli.h"
#include "worker/dataplane/optimizer.h"

int main(int argc, char** argv) {
  CLI::App app{"shard-bench-optimizer: CPU optimizer updates (one thread) in GB/s against a "
               "memory copy measured in the same run.",
               "shard-bench-optimizer"};
  int64_t elements = int64_t{1} << 25;
  int repeats = 5;
  shard::bench::Output output;
  app.add_option("--elements", elements, "elements per update")->capture_default_str();
  app.add_option("--repeats", repeats, "best of this many")->capture_default_str();
  shard::bench::AddOutputOptions(app, &output);
  if (std::optional<int> exit_code = shard::ParseCommandLine(app, argc, argv)) return *exit_code;

  std::vector<float> param(elements, 0.5f), grad(elements, 0.01f), m(elements, 0.0f),
      v(elements, 0.0f), copy(elements);
  shard::bench::Report report("shard-bench-optimizer", output);
  report.Note(absl::StrFormat("%lld f32 elements, best of %d; size(B): the bytes read and "
                              "written; the memory copy is the better of memcpy and a copy loop",
                              static_cast<long long>(elements), repeats));
  // A copy reads and writes every byte it copies.
  const shard::bench::Descriptor copy_what = {.op = "memcpy",
                                              .impl = "1 thread",
                                              .bytes = 2 * elements * 4,
                                              .count = elements,
                                              .dtype = "f32",
                                              .stat = shard::bench::Statistic::kBest};
  shard::bench::Descriptor loop_what = copy_what;
  loop_what.op = "copy_loop";
  const shard::bench::Record memcpy_record(
      copy_what, shard::bench::Summarize(shard::bench::TimeRuns(0, repeats, [&] {
        std::memcpy(copy.data(), param.data(), elements * sizeof(float));
      })));
  const shard::bench::Record loop_record(
      loop_what, shard::bench::Summarize(shard::bench::TimeRuns(0, repeats, [&] {
        std::copy(param.begin(), param.end(), copy.begin());
      })));
  report.Add(memcpy_record);
  report.Add(loop_record);
  // The better of the two: the machine's copy bandwidth.
  const double copy_gbps = std::max(*memcpy_record.algbw_gbps(), *loop_record.algbw_gbps());
  struct Case {
    const char* name;
    shard::OptimizerKind kind;
    double momentum;
    int64_t bytes_per_element;
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
    shard::bench::Record record(
        {.op = c.name,
         .impl = "1 thread",
         .bytes = c.bytes_per_element * elements,
         .count = elements,
         .dtype = "f32",
         .stat = shard::bench::Statistic::kBest},
        shard::bench::Summarize(shard::bench::TimeRuns(0, repeats, [&] {
          kernel.Update(++step, param.data(), grad.data(), state, elements);
        })));
    record.Compare("algbw_gbps", "memory copy", copy_gbps);
    report.Add(record);
  }
  return report.Finish() ? 0 : 1;
}
