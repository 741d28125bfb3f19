// A model whose full fp32 training state (16 bytes a parameter: the parameter, its gradient and
// Adam's exp_avg and exp_avg_sq) does not fit in the memory a worker process may use beyond its
// own baseline trains at ZeRO stage 3 on 4 real worker processes, and the same limit stops it at
// stage 2.
//
// The limit is RLIMIT_DATA (prlimit --data), which since Linux 4.7 bounds a process's private
// writable memory: its heap and anonymous mappings (thread stacks included), not its code or the
// page cache; an allocation past it fails (the worker says "cannot allocate ..." or dies of
// std::bad_alloc). It needs no privileges and works where cgroup v2 has no memory controller
// (hosts whose memory controller is on cgroup v1). RLIMIT_AS would count every thread's malloc
// arena reservation and so says little about the memory in use. RLIMIT_DATA does not count
// shared memory, where the shared-memory transport moves stage 2's buckets (a cgroup's limit
// does count it), so the workers here talk over TCP: all their model state is private.
//
// A worker needs memory of its own before it holds any model: its libraries' data, thread stacks,
// gRPC, Gloo and OpenBLAS's buffer (about 470 MiB of private writable memory on a 2-core host
// with a CUDA-enabled build, much of it reserved rather than touched). That baseline depends on
// the build and the host, so each test measures it (4 workers training a small MLP) and sets the
// limit to the baseline plus kRoomBytesPerParam bytes per parameter of the big model: 15, less
// than the 16 of the full training state. Measured at W=4 (the least limit that passes), stage 3
// peaks at about 11 bytes a parameter above the baseline: its 4 of owned parameters, gradients
// and Adam state and the gathered slots, with the initial values every rank computes whole and
// the whole copy rank 0 stages for the broadcast on top at startup; stage 2 at about 20 (10 of
// whole parameters and gradients and a quarter of the Adam state, with its own transients on
// top). The model (widths 64, 13 x 2048, 10: 50.5 M parameters, 771 MiB of training state) is
// large enough for its memory to outweigh the baseline and small enough to train 4 steps in
// about 15 s on 2 cores.
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "common/safetensors.h"
#include "gtest/gtest.h"
#include "tests/support/cluster.h"
#include "tests/support/process.h"

namespace shard::testing {
namespace {

constexpr char kPrlimit[] = "/usr/bin/prlimit";
constexpr int kWorkers = 4;
constexpr int64_t kRoomBytesPerParam = 15;
constexpr int kSteps = 4;
constexpr int64_t kMiB = 1 << 20;

std::vector<int64_t> BigWidths() {
  std::vector<int64_t> widths = {64};
  widths.insert(widths.end(), 13, 2048);
  widths.push_back(10);
  return widths;
}

int64_t Parameters(const std::vector<int64_t>& widths) {
  int64_t total = 0;
  for (size_t i = 0; i + 1 < widths.size(); ++i) total += widths[i] * widths[i + 1] + widths[i + 1];
  return total;
}

// The private writable memory (VmData) of a running process, in bytes; 0 once it has exited.
int64_t VmDataBytes(pid_t pid) {
  std::ifstream status(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(status, line)) {
    if (!absl::StartsWith(line, "VmData:")) continue;
    std::istringstream fields(line.substr(7));  // "  425884 kB"
    int64_t kb = 0;
    fields >> kb;
    return kb * 1024;
  }
  return 0;
}

// The number after `label` in a worker's "training finished: ... model state held N bytes
// (parameters N, gradients N, optimizer state N, gathered buckets N, frozen N)" line, or -1.
int64_t Reported(const std::string& log, const std::string& label) {
  const size_t at = log.find(label);
  if (at == std::string::npos) return -1;
  const size_t begin = at + label.size();
  const size_t end = log.find_first_not_of("0123456789", begin);
  int64_t value = -1;
  if (!absl::SimpleAtoi(log.substr(begin, end - begin), &value)) return -1;
  return value;
}

class MemoryLimitTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(::access(kPrlimit, X_OK), 0)
        << kPrlimit << " (util-linux) is needed to set the limit";
    dir_ = MakeTempDir("memory");
    cluster_.emplace(dir_);
    CommandResult data = RunCommand({BinaryPath("shardctl"), "data", "generate", "--widths",
                                     "64,32,10", "--samples", "512", "--seed", "9", "--out",
                                     dir_ + "/data.safetensors"},
                                    absl::Seconds(30));
    ASSERT_EQ(data.exit_code, 0) << data.output;
  }

  // A job of 4 workers training the MLP `widths` at `zero_stage` for `steps` steps of a global
  // batch of 32, with Adam, no checkpoints and no snapshots; buckets of at most 1 MiB, so that
  // each 2048 x 2048 weight (16 MiB) is a bucket of its own, the largest unit gathered.
  std::string WriteJob(const std::string& name, const std::vector<int64_t>& widths,
                       int zero_stage, int steps) {
    const std::string path = absl::StrCat(dir_, "/", name, ".json");
    std::ofstream(path) << absl::StrCat(
        R"({"name": ")", name, R"(", "worldSize": )", kWorkers, R"(, "minWorldSize": )",
        kWorkers, R"(, "model": {"mlp": {"widths": [)", absl::StrJoin(widths, ", "),
        R"(]}}, "data": {"path": "data.safetensors"}, "seed": 11,
        "optimizer": {"name": "adam", "lr": 0.002}, "globalBatch": 32, "steps": )", steps,
        R"(, "zeroStage": )", zero_stage, R"(, "bucketCapMb": 1,
        "checkpoint": {"dir": "checkpoints", "everySteps": 0, "keepLast": 1},
        "snapshot": {"everySteps": 0, "replicas": 1}, "outputDir": ")", name, R"(-out"})");
    return path;
  }

  void StartCoordinator(const std::string& job, const std::string& name) {
    const absl::Status started = cluster_->StartCoordinator(
        {"--job", job, "--state-dir", absl::StrCat(dir_, "/", name, "-state")}, 0,
        name + "-coordinator.log");
    ASSERT_TRUE(started.ok()) << started;
  }

  // 4 workers `prefix`0..3, each under RLIMIT_DATA = `data_limit` bytes if given. OpenBLAS
  // starts one thread with its own buffer per core unless told otherwise; the workers compute
  // on one thread (--compute-threads 1), and with one OpenBLAS thread their baseline does not
  // grow with the host's cores.
  std::vector<Process> StartWorkers(const std::string& prefix,
                                    std::optional<int64_t> data_limit) {
    std::vector<Process> workers;
    for (int i = 0; i < kWorkers; ++i) {
      const std::string id = absl::StrCat(prefix, i);
      std::vector<std::string> argv;
      if (data_limit.has_value()) {
        // prlimit sets the limit on itself and execs the worker: the same pid, limited from
        // its first instruction.
        argv = {kPrlimit, absl::StrCat("--data=", *data_limit, ":", *data_limit)};
      }
      argv.insert(argv.end(), {BinaryPath("shard-worker"), "--coordinator", cluster_->address(),
                               "--id", id, "--collective-timeout", "10s", "--transport", "tcp"});
      absl::StatusOr<Process> process = Process::Start(argv, absl::StrCat(dir_, "/", id, ".log"),
                                                       {"OPENBLAS_NUM_THREADS=1"});
      EXPECT_TRUE(process.ok()) << process.status();
      if (process.ok()) workers.push_back(std::move(*process));
    }
    return workers;
  }

  // The most private writable memory a worker reaches training a small MLP (64, 2048, 10: the big
  // model's matrix shapes, so that OpenBLAS allocates its buffer as it does for the big one, but
  // 0.15 M parameters) at stage 3 on 4 workers: the workers' own baseline. Sampled from /proc
  // while they train (the memory is the libraries', the threads' and the buffers', there from
  // the first step to the end).
  int64_t MeasureBaseline() {
    StartCoordinator(WriteJob("baseline", {64, 2048, 10}, 3, 100), "baseline");
    std::vector<Process> workers = StartWorkers("baseline-w", std::nullopt);
    int64_t peak = 0;
    EXPECT_TRUE(Eventually(
        [&] {
          bool all_ended = true;
          for (Process& worker : workers) {
            peak = std::max(peak, VmDataBytes(worker.pid()));
            if (!worker.Exited()) all_ended = false;
          }
          return all_ended;
        },
        absl::Seconds(60)));
    for (Process& worker : workers) EXPECT_EQ(worker.Wait(absl::Seconds(1)), 0) << worker.Log();
    EXPECT_EQ(cluster_->coordinator().Wait(absl::Seconds(20)), 0) << cluster_->coordinator().Log();
    return peak;
  }

  struct Limit {
    int64_t params = 0;    // of the big model
    int64_t baseline = 0;  // bytes, MeasureBaseline
    int64_t bytes = 0;     // RLIMIT_DATA
  };

  Limit ChooseLimit() {
    Limit limit;
    limit.params = Parameters(BigWidths());
    limit.baseline = MeasureBaseline();
    limit.bytes = limit.baseline + kRoomBytesPerParam * limit.params;
    // What the limit leaves above the baseline does not hold the full training state.
    EXPECT_LT(limit.bytes - limit.baseline, 16 * limit.params);
    std::cout << "model: " << limit.params << " parameters, full fp32 training state "
              << 16 * limit.params / kMiB << " MiB; worker baseline "
              << limit.baseline / kMiB << " MiB; RLIMIT_DATA " << limit.bytes / kMiB
              << " MiB per worker (" << (limit.bytes - limit.baseline) / kMiB
              << " MiB above the baseline)\n";
    return limit;
  }

  std::string dir_;
  std::optional<LocalCluster> cluster_;
};

// Stage 3 at W=4 under the limit: the job finishes, every rank holds a quarter of the training
// state plus the gathered slots (2 for parameters and 2 for gradients, each the size of the
// largest bucket), and the parameters written are the whole model.
TEST_F(MemoryLimitTest, AModelWhoseTrainingStateExceedsTheLimitTrainsAtStage3OnFourWorkers) {
  const Limit limit = ChooseLimit();
  ASSERT_GT(limit.baseline, 0);
  const absl::Time start = absl::Now();
  StartCoordinator(WriteJob("big", BigWidths(), 3, kSteps), "big");
  std::vector<Process> workers = StartWorkers("w", limit.bytes);
  ASSERT_EQ(workers.size(), static_cast<size_t>(kWorkers));
  EXPECT_EQ(cluster_->coordinator().Wait(absl::Seconds(120)), 0) << cluster_->coordinator().Log();
  EXPECT_NE(cluster_->coordinator().Log().find("training finished ("), std::string::npos);
  const int64_t largest_bucket = 2048 * 2048 * sizeof(float);
  for (Process& worker : workers) {
    ASSERT_EQ(worker.Wait(absl::Seconds(20)), 0) << worker.Log();
    const std::string log = worker.Log();
    EXPECT_NE(log.find("ZeRO stage 3"), std::string::npos) << log;
    const int64_t held = Reported(log, "model state held ");
    const int64_t gathered = Reported(log, "gathered buckets ");
    ASSERT_GT(held, 0) << log;
    ASSERT_GE(gathered, 0) << log;
    // A quarter of the 16 bytes a parameter, and a little padding per bucket.
    EXPECT_LE(held - gathered, 4 * limit.params + kMiB) << log;
    EXPECT_LE(gathered, 4 * largest_bucket) << log;
    std::cout << "worker pid " << worker.pid() << ": model state held " << held / kMiB
              << " MiB (" << gathered / kMiB << " MiB of it gathered slots), peak resident "
              << worker.max_rss_kb() / 1024 << " MiB\n";
  }
  absl::StatusOr<std::unique_ptr<SafetensorsReader>> final =
      SafetensorsReader::Open(dir_ + "/big-out/final.safetensors");
  ASSERT_TRUE(final.ok()) << final.status();
  int64_t written = 0;
  for (const TensorInfo& tensor : (*final)->tensors()) written += tensor.numel();
  EXPECT_EQ(written, limit.params);
  std::cout << "stage 3 under the limit: " << kSteps << " steps in "
            << absl::FormatDuration(absl::Now() - start) << "\n";
}

// The same model, workers and limit at stage 2: a worker runs out of memory (its allocation
// fails: "cannot allocate", or std::bad_alloc) once training has begun, and the job does not
// finish.
TEST_F(MemoryLimitTest, TheSameLimitStopsTheModelAtStage2) {
  const Limit limit = ChooseLimit();
  ASSERT_GT(limit.baseline, 0);
  StartCoordinator(WriteJob("big", BigWidths(), 2, kSteps), "big");
  std::vector<Process> workers = StartWorkers("w", limit.bytes);
  ASSERT_EQ(workers.size(), static_cast<size_t>(kWorkers));
  ASSERT_TRUE(Eventually(
      [&] {
        return std::any_of(workers.begin(), workers.end(),
                           [](Process& worker) { return worker.Exited(); });
      },
      absl::Seconds(90)))
      << "no worker ran out of memory; the first one's log:\n" << workers[0].Log();
  int failed = 0;
  for (Process& worker : workers) {
    const std::string log = worker.Log();
    EXPECT_EQ(log.find("training finished"), std::string::npos) << log;
    if (!worker.Exited()) continue;  // waiting for the failed ones to come back
    ++failed;
    EXPECT_NE(worker.Wait(absl::ZeroDuration()), 0) << log;
    EXPECT_NE(log.find("ZeRO stage 2"), std::string::npos) << "failed before training: " << log;
    EXPECT_TRUE(absl::StrContains(log, "cannot allocate") ||
                absl::StrContains(log, "std::bad_alloc"))
        << "not out of memory: " << log;
  }
  std::cout << failed << " of " << kWorkers << " workers ran out of memory at stage 2\n";
  EXPECT_EQ(cluster_->coordinator().Log().find("training finished ("), std::string::npos);
  EXPECT_FALSE(std::filesystem::exists(dir_ + "/big-out/final.safetensors"));
}

}  // namespace
}  // namespace shard::testing
