// shard-bench-checkpoint: checkpoint save and restore throughput through the real engine (W
// ranks as threads, Adam state, a model of --gib GiB of checkpoint), next to the raw write
// (with fsync) and read bandwidth of the same disk with the same number of parallel streams,
// measured in the same run, and the training pause per save next to every rank copying the same
// bytes at once. GB/s count checkpoint bytes (1e9). Page-cache effects are
// removed with posix_fadvise(DONTNEED) after every write, so reads come from the disk.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/checkpoint.h"
#include "common/cli.h"
#include "worker/dataplane/engine.h"
#include "worker/dataplane/gloo_communicator.h"

namespace shard {
namespace {

void DropFromPageCache(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) return;
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
}

void DropDirectory(const std::string& dir) {
  for (const auto& entry : std::filesystem::directory_iterator(dir)) DropFromPageCache(entry.path());
}

// The disk's own figures for `streams` files written (then fsynced) and read in parallel, in
// 8 MiB pieces, `bytes` in all: the same concurrency as W ranks saving or restoring.
std::pair<double, double> RawDisk(const std::string& dir, uint64_t bytes, int streams) {
  const uint64_t per_stream = bytes / streams;
  auto run = [&](bool write) {
    const absl::Time start = absl::Now();
    std::vector<std::thread> threads;
    for (int s = 0; s < streams; ++s) {
      threads.emplace_back([&, s] {
        const std::string path = absl::StrCat(dir, "/raw-", s, ".bin");
        std::vector<char> buffer(8 << 20, 'x');
        if (write) {
          const int out = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
          for (uint64_t done = 0; done < per_stream; done += buffer.size()) {
            if (::write(out, buffer.data(), buffer.size()) < 0) std::perror("write");
          }
          ::fsync(out);
          ::close(out);
        } else {
          const int in = ::open(path.c_str(), O_RDONLY);
          while (::read(in, buffer.data(), buffer.size()) > 0) {
          }
          ::close(in);
        }
      });
    }
    for (std::thread& t : threads) t.join();
    const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
    for (int s = 0; s < streams; ++s) DropFromPageCache(absl::StrCat(dir, "/raw-", s, ".bin"));
    return bytes / seconds / 1e9;
  };
  const double write_gbps = run(true);
  const double read_gbps = run(false);
  for (int s = 0; s < streams; ++s) std::filesystem::remove(absl::StrCat(dir, "/raw-", s, ".bin"));
  return {write_gbps, read_gbps};
}

struct Ranks {
  InProcessKeyValueStore store;
  std::vector<std::unique_ptr<GlooCommunicator>> communicators;
  std::vector<std::unique_ptr<LocalPlanProvider>> plans;
  std::vector<std::unique_ptr<Engine>> engines;
};

// Creates `world` engines (threads connect their communicators concurrently).
std::unique_ptr<Ranks> MakeRanks(const Manifest& model, int world, const std::vector<int>& order) {
  auto ranks = std::make_unique<Ranks>();
  ranks->communicators.resize(world);
  ranks->plans.resize(world);
  ranks->engines.resize(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      GlooOptions gloo;
      gloo.rank = r;
      gloo.size = world;
      ranks->communicators[r] = std::move(*CreateGlooCommunicator(&ranks->store, gloo));
      PlanOptions options;
      options.world_size = world;
      options.gradient_order = order;  // already rebuilt: restores need no rebuild
      ranks->plans[r] = std::make_unique<LocalPlanProvider>(options);
      EngineOptions engine;
      engine.zero_stage = 2;
      engine.overlap = false;
      ranks->engines[r] = std::move(
          *Engine::Create(model, ranks->communicators[r].get(), ranks->plans[r].get(), engine));
    });
  }
  for (std::thread& t : threads) t.join();
  return ranks;
}

}  // namespace
}  // namespace shard

int main(int argc, char** argv) {
  CLI::App app{"shard-bench-checkpoint: checkpoint save/restore GB/s through the engine against "
               "the same disk's raw write (fsync) and read bandwidth, and the training pause per "
               "save against a memory copy.",
               "shard-bench-checkpoint"};
  double gib = 1.0;
  std::string dir = "/tmp/shard-bench-checkpoint";
  std::string worlds = "1,2,4";
  int repeats = 3;
  app.add_option("--gib", gib, "checkpoint size in GiB (parameters and Adam state)")
      ->capture_default_str();
  app.add_option("--dir", dir, "scratch directory on the disk to measure")->capture_default_str();
  app.add_option("--world-sizes", worlds, "comma-separated")->capture_default_str();
  app.add_option("--repeats", repeats,
                 "best of this many saves, restores and raw measurements (this disk's speed "
                 "varies from one second to the next)")
      ->capture_default_str()
      ->check(CLI::Range(1, 20));
  if (std::optional<int> exit_code = shard::ParseCommandLine(app, argc, argv)) return *exit_code;

  // Four parameters; parameters plus exp_avg and exp_avg_sq make `gib` GiB.
  const int64_t total_elements = static_cast<int64_t>(gib * (1 << 30) / 12);
  const int64_t rows = total_elements / 4 / 4096;
  shard::Manifest model;
  for (int p = 0; p < 4; ++p) {
    model.params.push_back(
        shard::ParamSpec{absl::StrCat("layers.", p, ".weight"), {rows, 4096}, shard::DataType::kFloat32, true});
  }
  std::vector<int> order = {3, 2, 1, 0};
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const uint64_t bytes = static_cast<uint64_t>(rows) * 4096 * 4 * 4 * 3;
  std::printf("# checkpoint of %.2f GiB (4 x [%lld, 4096] f32 with Adam state); the raw disk is "
              "measured with as many parallel files (write + fsync, read) as there are ranks\n",
              bytes / 1073741824.0, static_cast<long long>(rows));
  std::printf("%6s %9s %9s %8s %9s %9s %8s %9s %10s %8s\n", "ranks", "save", "raw_write",
              "ratio", "restore", "raw_read", "ratio", "pause_ms", "memcpy_ms", "ratio");
  for (absl::string_view text : absl::StrSplit(worlds, ',')) {
    int world = 0;
    if (!absl::SimpleAtoi(text, &world) || world < 1) return 2;
    double raw_write = 0, raw_read = 0, pause = 1e30, copy = 1e30;
    double best_save_s = 1e30, best_restore_s = 1e30;
    for (int repeat = 0; repeat < repeats; ++repeat) {
      auto ranks = shard::MakeRanks(model, world, order);
      // The raw figures are taken with the engines' memory allocated, as it is during the save
      // (free memory sets the kernel's dirty-page limits and so how writes are throttled).
      const auto [raw_write_now, raw_read_now] = shard::RawDisk(dir, bytes, world);
      raw_write = std::max(raw_write, raw_write_now);
      raw_read = std::max(raw_read, raw_read_now);
      const std::string id = absl::StrCat("step-", world);
      const std::string path = shard::CheckpointDirectory(dir, "bench", id);
      // Save: each rank copies its owned state (the pause) into its snapshot buffer (kept from an
      // earlier save, as the trainer keeps it), then writes its shard; the commit follows the
      // last shard.
      std::vector<shard::ShardRecord> records(world);
      std::vector<double> pause_ms(world);
      std::vector<double> copy_ms(world);
      std::vector<std::vector<char>> snapshots(world);
      std::vector<std::vector<char>> copies(world);
      for (int r = 0; r < world; ++r) {
        (void)ranks->engines[r]->CopyOwnedState(&snapshots[r]);  // an earlier save: warm buffer
        copies[r].assign(snapshots[r].size(), 1);                 // the reference's warm buffer
      }
      const absl::Time start = absl::Now();
      std::vector<std::thread> threads;
      for (int r = 0; r < world; ++r) {
        threads.emplace_back([&, r] {
          const absl::Time pause_start = absl::Now();
          (void)ranks->engines[r]->CopyOwnedState(&snapshots[r]);
          pause_ms[r] = absl::ToDoubleMilliseconds(absl::Now() - pause_start);
          auto writer = shard::ShardWriter::Create(path, r, world);
          (void)(*writer)->Append(snapshots[r].data(), snapshots[r].size());
          records[r] = *(*writer)->Finish();
        });
      }
      for (std::thread& t : threads) t.join();
      auto manifest = shard::MakeCheckpointManifest("bench", id, 1, 2, model,
                                                    ranks->engines[0]->plan(), {},
                                                    {"exp_avg", "exp_avg_sq"}, records);
      (void)shard::CommitCheckpoint(path, *manifest);
      const double save_s = absl::ToDoubleSeconds(absl::Now() - start);
      // The reference: every rank copying the same bytes between warm buffers at once.
      threads.clear();
      for (int r = 0; r < world; ++r) {
        threads.emplace_back([&, r] {
          const absl::Time copy_start = absl::Now();
          std::memcpy(copies[r].data(), snapshots[r].data(), snapshots[r].size());
          copy_ms[r] = absl::ToDoubleMilliseconds(absl::Now() - copy_start);
        });
      }
      for (std::thread& t : threads) t.join();
      shard::DropDirectory(path);
      ranks.reset();
      // Restore on the same number of ranks from the disk.
      auto restored = shard::MakeRanks(model, world, order);
      const absl::Time restore_start = absl::Now();
      threads.clear();
      for (int r = 0; r < world; ++r) {
        threads.emplace_back([&, r] {
          auto reader = shard::CheckpointReader::Open(path);
          if (absl::Status s = restored->engines[r]->Restore(**reader); !s.ok()) {
            std::fprintf(stderr, "restore: %s\n", std::string(s.message()).c_str());
          }
        });
      }
      for (std::thread& t : threads) t.join();
      const double restore_s = absl::ToDoubleSeconds(absl::Now() - restore_start);
      pause = std::min(pause, *std::max_element(pause_ms.begin(), pause_ms.end()));
      copy = std::min(copy, *std::max_element(copy_ms.begin(), copy_ms.end()));
      best_save_s = std::min(best_save_s, save_s);
      best_restore_s = std::min(best_restore_s, restore_s);
      std::filesystem::remove_all(path);
    }
    const double save_s = best_save_s;
    const double restore_s = best_restore_s;
    const double save_gbps = bytes / save_s / 1e9;
    const double restore_gbps = bytes / restore_s / 1e9;
    std::printf("%6d %9.2f %9.2f %7.2fx %9.2f %9.2f %7.2fx %9.1f %10.1f %7.2fx\n", world,
                save_gbps, raw_write, save_gbps / raw_write, restore_gbps, raw_read,
                restore_gbps / raw_read, pause, copy, pause / copy);
  }
  std::filesystem::remove_all(dir);
  return 0;
}
