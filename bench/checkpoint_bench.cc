// shard-bench-checkpoint: checkpoint save and restore throughput through the real engine (W
// ranks as threads, Adam state, a model of --gib GiB of checkpoint), next to the raw write
// (with fsync) and read bandwidth of the same disk with the same number of parallel streams,
// measured in the same run, and the training pause per save next to every rank copying the same
// bytes at once. GB/s count checkpoint bytes (1e9). Every file is dropped from the page cache
// (posix_fadvise(DONTNEED)) before it is read, the checkpoint's as the raw reference's, so
// reads come from the disk.
//
// The raw read is of the checkpoint's own shard files, as `dd iflag=nocache` reads (8 MiB
// read()s into one aligned buffer, each piece dropped from the page cache once read, as the
// checkpoint reader drops it), in the same repeat as the checkpoint's reads. A second raw read
// goes around the page cache (O_DIRECT, 8 reads in flight): the disk with no copy out of the
// page cache, which the raw read makes into a buffer that stays in the processor's caches and
// a restore into the engine's gigabytes. The four reads of a repeat (raw, raw O_DIRECT,
// checked, restore) take turns going first (see the loop). On this project's virtual machines
// a read that keeps what it read in the page cache ran at half speed when the memory it needed
// had not been freed just before (the guest hands freed memory back to the host, and touching
// it again faults on the host): a plain read of other files right after writing (and so
// freeing) them, the reference before, measured that rather than the disk.
//
// The restore is reported twice. "read" is every rank reading and verifying what it owns (the
// reads Engine::Restore makes); "restore" is Engine::Restore itself, which at ZeRO stage 1/2
// then all-gathers the parameters over the communicator: with W ranks on one machine that is a
// loopback copy of (W - 1)/W of the parameters into every rank, which the raw read does not do.
// Both are checked: what was read and restored must be the bytes that were saved. The gather
// runs after the reads, or bucket by bucket during them (--gather-during-reads; by default as a
// worker chooses); "gather_ms" is what is left of it once the reads are done, as
// Engine::Restore times it on the rank that finished reading last (the others' gathers also wait
// for that rank's reads), and the last ratio is the restore against the raw read followed by
// that remainder.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <optional>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "bench/harness.h"
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

// Runs `body(rank)` on every rank at once.
void OnRanks(int world, const std::function<void(int)>& body) {
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) threads.emplace_back(body, r);
  for (std::thread& t : threads) t.join();
}

// Milliseconds for the disk to write `streams` files (then fsync them) in parallel, in 8 MiB
// pieces, `bytes` in all: the same concurrency as W ranks saving.
double RawWrite(const std::string& dir, uint64_t bytes, int streams) {
  const uint64_t per_stream = bytes / streams;
  constexpr size_t kPiece = 8 << 20;
  const absl::Time start = absl::Now();
  OnRanks(streams, [&](int s) {
    AlignedBuffer buffer(kPiece);  // page-aligned, as dd's
    std::memset(buffer.data(), 'x', kPiece);
    const int out = ::open(absl::StrCat(dir, "/raw-", s, ".bin").c_str(),
                           O_WRONLY | O_CREAT | O_TRUNC, 0644);
    for (uint64_t done = 0; done < per_stream; done += kPiece) {
      if (::write(out, buffer.data(), kPiece) < 0) std::perror("write");
    }
    ::fsync(out);
    ::close(out);
  });
  const double ms = absl::ToDoubleMilliseconds(absl::Now() - start);
  for (int s = 0; s < streams; ++s) std::filesystem::remove(absl::StrCat(dir, "/raw-", s, ".bin"));
  return ms;
}

// Milliseconds for the disk to read `files` in parallel as `dd iflag=nocache` would: 8 MiB
// read()s into one page-aligned buffer each, each piece dropped from the page cache once read
// (as the checkpoint reader drops it), the files dropped from it first.
double RawRead(const std::vector<std::string>& files) {
  for (const std::string& file : files) DropFromPageCache(file);
  const absl::Time start = absl::Now();
  OnRanks(static_cast<int>(files.size()), [&](int s) {
    constexpr size_t kPiece = 8 << 20;
    AlignedBuffer buffer(kPiece);
    const int in = ::open(files[s].c_str(), O_RDONLY);
    off_t offset = 0;
    for (ssize_t n = 0; (n = ::read(in, buffer.data(), kPiece)) > 0; offset += n) {
      ::posix_fadvise(in, offset, n, POSIX_FADV_DONTNEED);
    }
    ::close(in);
  });
  return absl::ToDoubleMilliseconds(absl::Now() - start);
}

// The same files read around the page cache (O_DIRECT), 8 reads of 8 MiB in flight per file
// (there is no readahead), in milliseconds: the disk's figure when no processor copies what it
// reads. Absent where the file system refuses O_DIRECT, at the open or at a read.
std::optional<double> RawDirectRead(const std::vector<std::string>& files) {
  constexpr size_t kPiece = 8 << 20;
  constexpr int kInFlight = 8;
  std::vector<int> fds;
  for (const std::string& file : files) {
    const int fd = ::open(file.c_str(), O_RDONLY | O_DIRECT);
    if (fd < 0) {
      for (int open_fd : fds) ::close(open_fd);
      return std::nullopt;
    }
    fds.push_back(fd);
  }
  std::atomic<bool> refused = false;
  const absl::Time start = absl::Now();
  OnRanks(static_cast<int>(files.size()), [&](int s) {
    const off_t size = ::lseek(fds[s], 0, SEEK_END);
    OnRanks(kInFlight, [&](int t) {
      AlignedBuffer buffer(kPiece);
      for (off_t offset = t * kPiece; offset < size && !refused; offset += kInFlight * kPiece) {
        if (::pread(fds[s], buffer.data(), kPiece, offset) < 0) refused = true;
      }
    });
  });
  const double ms = absl::ToDoubleMilliseconds(absl::Now() - start);
  for (int fd : fds) ::close(fd);
  if (refused) return std::nullopt;
  return ms;
}

// Values for every element, as training leaves them: the engine's buffers are written (its
// pages are mapped and warm, as in a training job) and the saved bytes are worth checking.
class PatternSource : public StateSource {
 public:
  absl::Status ReadElements(int param, int array, int64_t begin, int64_t count,
                            float* out) override {
    for (int64_t i = 0; i < count; ++i) {
      out[i] = static_cast<float>((begin + i) % 65521) * 1e-3f + param + 0.25f * (array + 1);
    }
    return absl::OkStatus();
  }
};

struct Ranks {
  InProcessKeyValueStore store;
  std::vector<std::unique_ptr<GlooCommunicator>> communicators;
  std::vector<std::unique_ptr<LocalPlanProvider>> plans;
  std::vector<std::unique_ptr<Engine>> engines;
};

// Creates `world` engines (threads connect their communicators concurrently), gathering the
// parameters during a restore's reads or after them.
std::unique_ptr<Ranks> MakeRanks(const Manifest& model, int world, const std::vector<int>& order,
                                 bool gather_during_reads) {
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
      engine.gather_during_reads = gather_during_reads;
      ranks->engines[r] = std::move(
          *Engine::Create(model, ranks->communicators[r].get(), ranks->plans[r].get(), engine));
    });
  }
  for (std::thread& t : threads) t.join();
  return ranks;
}

// Exits with a message unless `status` is OK: a benchmark of a failing save or restore is void.
void Check(const absl::Status& status, const std::string& what) {
  if (status.ok()) return;
  std::fprintf(stderr, "%s: %s\n", what.c_str(), std::string(status.message()).c_str());
  std::exit(1);
}

// Milliseconds for every rank at once to run `read` on its own reader of the checkpoint in
// `path`, dropped from the page cache first.
double TimeCheckpointReads(const std::string& path, int world,
                           const std::function<void(int, CheckpointReader&)>& read) {
  DropDirectory(path);
  const absl::Time start = absl::Now();
  OnRanks(world, [&](int r) {
    auto reader = CheckpointReader::Open(path);
    Check(reader.status(), "opening the checkpoint");
    read(r, **reader);
  });
  return absl::ToDoubleMilliseconds(absl::Now() - start);
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
  shard::bench::Output output;
  app.add_option("--gib", gib, "checkpoint size in GiB (parameters and Adam state)")
      ->capture_default_str();
  app.add_option("--dir", dir, "scratch directory on the disk to measure")->capture_default_str();
  app.add_option("--world-sizes", worlds, "comma-separated")->capture_default_str();
  app.add_option("--repeats", repeats,
                 "best of this many saves, restores and raw measurements (this disk's speed "
                 "varies from one second to the next)")
      ->capture_default_str()
      ->check(CLI::Range(1, 20));
  std::string gather = "auto";
  app.add_option("--gather-during-reads", gather,
                 "restores all-gather the parameters during their reads (on), after them (off), "
                 "or as a worker chooses (auto: during, where this process has 2 cores per rank)")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "on", "off"}));
  shard::bench::AddOutputOptions(app, &output);
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
  shard::bench::Report report("shard-bench-checkpoint", output);
  report.Note(absl::StrFormat(
      "checkpoint of %.2f GiB (4 x [%lld, 4096] f32 with Adam state), best of %d repeats; GB/s "
      "count checkpoint bytes", bytes / 1073741824.0, static_cast<long long>(rows), repeats));
  report.Note("raw_write: as many files written in parallel (+ fsync) as there are ranks; save: "
              "every rank copies its state (the pause) and writes its shard, then the commit");
  report.Note("raw_read: the checkpoint's shard files read in parallel as dd would (dd), and "
              "with O_DIRECT, 8 reads of 8 MiB in flight each (O_DIRECT; none where the file "
              "system refuses it); read: every rank reads and verifies what it owns");
  report.Note("restore: Engine::Restore, with the parameters' all-gather during the reads or "
              "after them (--gather-during-reads); gather_ms: the all-gather left after its "
              "reads; raw_read dd + gather: the raw read followed by that remainder");
  report.Note("pause: the slowest rank's copy of its state; memcpy: every rank copying the same "
              "bytes between warm buffers at once");
  for (absl::string_view text : absl::StrSplit(worlds, ',')) {
    int world = 0;
    if (!absl::SimpleAtoi(text, &world) || world < 1) return 2;
    const bool gather_during_reads =
        gather == "auto" ? shard::GatherDuringReadsPays(world) : gather == "on";
    // Milliseconds per repeat: the best of each is the figure.
    std::vector<double> raw_write_ms, raw_read_ms, raw_direct_ms, save_ms, read_ms, restore_ms,
        pause_ms, copy_ms;
    double best_restore_ms = 1e30, gather_ms = 0;
    for (int repeat = 0; repeat < repeats; ++repeat) {
      auto ranks = shard::MakeRanks(model, world, order, gather_during_reads);
      // The state as training leaves it (see PatternSource).
      shard::OnRanks(world, [&](int r) {
        shard::Check(ranks->engines[r]->LoadState(std::make_unique<shard::PatternSource>(),
                                                  /*with_state=*/true, 1,
                                                  shard::TrainingCounters{.optimizer_step = 1}),
                     "filling the engine");
      });
      // The raw write is taken with the engines' memory allocated, as it is during the save
      // (free memory sets the kernel's dirty-page limits and so how writes are throttled).
      raw_write_ms.push_back(shard::RawWrite(dir, bytes, world));
      const std::string id = absl::StrCat("step-", world);
      const std::string path = shard::CheckpointDirectory(dir, "bench", id);
      std::vector<std::string> shard_files;
      for (int r = 0; r < world; ++r) {
        shard_files.push_back(absl::StrCat(path, "/", shard::ShardFileName(r, world)));
      }
      auto read_raw = [&] { raw_read_ms.push_back(shard::RawRead(shard_files)); };
      auto read_raw_direct = [&] {
        if (std::optional<double> ms = shard::RawDirectRead(shard_files)) {
          raw_direct_ms.push_back(*ms);
        }
      };
      // Save: each rank copies its owned state (the pause) into its snapshot buffer (kept from an
      // earlier save, as the trainer keeps it), then writes its shard; the commit follows the
      // last shard. The writes start once every rank has copied, so that a rank's pause is not
      // measured while a rank that copied sooner writes and hashes on the same 2 cores: ranks
      // with cores of their own do not slow each other's copies (here, at 4 ranks of 1 GiB,
      // overlapping phases made the pause 1.07-1.68x the copy, 1.09-1.34x apart). The save's
      // time still includes that wait.
      std::vector<shard::ShardRecord> records(world);
      std::vector<double> rank_pause_ms(world);
      std::vector<double> rank_copy_ms(world);
      std::vector<std::vector<char>> snapshots(world);
      // Page-aligned, as the engine's arrays are (CpuDevice::Allocate).
      std::vector<shard::AlignedBuffer> copies;
      for (int r = 0; r < world; ++r) {
        // An earlier save: warm buffer.
        shard::Check(ranks->engines[r]->CopyOwnedState(&snapshots[r]), "copying the state");
        copies.emplace_back(snapshots[r].size());  // the reference's warm buffer
        std::memset(copies[r].data(), 1, copies[r].size());
      }
      const absl::Time start = absl::Now();
      std::barrier copied(world);  // every rank's pause is over
      shard::OnRanks(world, [&](int r) {
        const absl::Time pause_start = absl::Now();
        shard::Check(ranks->engines[r]->CopyOwnedState(&snapshots[r]), "copying the state");
        rank_pause_ms[r] = absl::ToDoubleMilliseconds(absl::Now() - pause_start);
        copied.arrive_and_wait();
        auto writer = shard::ShardWriter::Create(path, r, world);
        shard::Check(writer.status(), "creating the shard");
        shard::Check((*writer)->Append(snapshots[r].data(), snapshots[r].size()),
                     "writing the shard");
        auto record = (*writer)->Finish();
        shard::Check(record.status(), "finishing the shard");
        records[r] = *record;
      });
      auto manifest = shard::MakeCheckpointManifest("bench", id, 1, 2, model,
                                                    ranks->engines[0]->plan(), {},
                                                    {"exp_avg", "exp_avg_sq"}, records);
      shard::Check(manifest.status(), "making the manifest");
      shard::Check(shard::CommitCheckpoint(path, *manifest), "committing");
      save_ms.push_back(absl::ToDoubleMilliseconds(absl::Now() - start));
      // The reference: every rank copying the same bytes between warm buffers at once.
      shard::OnRanks(world, [&](int r) {
        const absl::Time copy_start = absl::Now();
        std::memcpy(copies[r].data(), snapshots[r].data(), snapshots[r].size());
        rank_copy_ms[r] = absl::ToDoubleMilliseconds(absl::Now() - copy_start);
      });
      ranks.reset();
      auto restored = shard::MakeRanks(model, world, order, gather_during_reads);
      for (shard::AlignedBuffer& buffer : copies) std::memset(buffer.data(), 0xff, buffer.size());
      // Read: every rank reads and verifies what it owns (on the same world size, its own
      // shard: parameters, then each state, piece by piece, as Engine::Restore reads them)
      // into a warm buffer laid out as the shard.
      auto read_checked = [&] {
        read_ms.push_back(shard::TimeCheckpointReads(
            path, world, [&](int r, shard::CheckpointReader& reader) {
              const shard::ShardLayout layout =
                  shard::MakeShardLayout(model, restored->engines[r]->plan(), r, 2);
              for (const shard::ShardPiece& piece : layout.pieces) {
                for (int array = -1; array < 2; ++array) {
                  char* out =
                      copies[r].data() + piece.byte_offset + (array + 1) * piece.numel * 4;
                  shard::Check(reader.ReadElements(piece.param, array, piece.param_offset,
                                                   piece.numel, reinterpret_cast<float*>(out)),
                               "reading the checkpoint");
                }
              }
            }));
      };
      // Restore on the same number of ranks from the disk.
      std::vector<shard::RestoreTimings> timings(world);
      auto restore = [&] {
        restore_ms.push_back(shard::TimeCheckpointReads(
            path, world, [&](int r, shard::CheckpointReader& reader) {
              shard::Check(restored->engines[r]->Restore(reader, &timings[r]), "restoring");
            }));
      };
      // The four reads take turns going first, so that none is always the one right after
      // the save's writes: with the raw read first in even repeats and the checked read first
      // in odd ones, the checked read (which does less than the restore) ran at 0.86-0.98x the
      // restore at 1 rank in five runs on the 16-core machine; taking turns, 0.92-1.04x in four.
      const std::function<void()> reads[] = {read_raw, read_raw_direct, read_checked, restore};
      for (int k = 0; k < 4; ++k) reads[(k + repeat) % 4]();
      for (int r = 0; r < world; ++r) {
        std::vector<char> state;
        shard::Check(restored->engines[r]->CopyOwnedState(&state), "copying the restored state");
        if (state != snapshots[r] ||
            std::memcmp(copies[r].data(), snapshots[r].data(), snapshots[r].size()) != 0) {
          std::fprintf(stderr, "rank %d: the restored state differs from the saved one\n", r);
          return 1;
        }
      }
      pause_ms.push_back(*std::max_element(rank_pause_ms.begin(), rank_pause_ms.end()));
      copy_ms.push_back(*std::max_element(rank_copy_ms.begin(), rank_copy_ms.end()));
      if (restore_ms.back() < best_restore_ms) {
        best_restore_ms = restore_ms.back();
        gather_ms = std::min_element(timings.begin(), timings.end(),
                                     [](const shard::RestoreTimings& a,
                                        const shard::RestoreTimings& b) {
                                       return a.gather_ms < b.gather_ms;
                                     })->gather_ms;
      }
      std::filesystem::remove_all(path);
    }
    auto record = [&](std::string op, std::string impl, uint64_t counted_bytes,
                      std::vector<double> samples) {
      return shard::bench::Record({.op = std::move(op),
                                   .impl = std::move(impl),
                                   .bytes = static_cast<int64_t>(counted_bytes),
                                   .ranks = world,
                                   .stat = shard::bench::Statistic::kBest},
                                  shard::bench::Summarize(std::move(samples)));
    };
    const shard::bench::Record raw_write = record("raw_write", "fsync", bytes, raw_write_ms);
    const shard::bench::Record raw_read = record("raw_read", "dd", bytes, raw_read_ms);
    const shard::bench::Record raw_direct = record("raw_read", "O_DIRECT", bytes, raw_direct_ms);
    const double raw_read_gbps = *raw_read.algbw_gbps();
    const double raw_direct_gbps = raw_direct.algbw_gbps().value_or(0);
    report.Add(raw_write);
    report.Add(record("save", "engine", bytes, save_ms)
                   .Compare("algbw_gbps", "raw_write", *raw_write.algbw_gbps()));
    report.Add(raw_read);
    if (raw_direct.stats().samples > 0) report.Add(raw_direct);
    report.Add(record("read", "checked", bytes, read_ms)
                   .Compare("algbw_gbps", "raw_read dd", raw_read_gbps));
    // The floor of a restore: the raw read, then what is left of the gather.
    const double floor_gbps = bytes / (bytes / raw_read_gbps * 1e-6 + gather_ms) / 1e6;
    report.Add(record("restore", gather_during_reads ? "gather during" : "gather after", bytes,
                      restore_ms)
                   .Extra("gather_ms", gather_ms)
                   .Compare("algbw_gbps", "raw_read dd", raw_read_gbps)
                   .Compare("algbw_gbps", "raw_read O_DIRECT", raw_direct_gbps)
                   .Compare("algbw_gbps", "raw_read dd + gather", floor_gbps));
    const shard::bench::Record memcpy_record = record("memcpy", "every rank", 0, copy_ms);
    report.Add(memcpy_record);
    report.Add(record("pause", "copy state", 0, pause_ms)
                   .Compare("time_ms", "memcpy", memcpy_record.time_ms()));
  }
  std::filesystem::remove_all(dir);
  return report.Finish() ? 0 : 1;
}
