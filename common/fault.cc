#include "common/fault.h"

#include <errno.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>

#include <cstdio>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/time/clock.h"

namespace shard {

void FaultPoint(absl::string_view name) {
  const char* fault = std::getenv("SHARD_FAULT");
  if (fault == nullptr || name != fault) return;
  static std::atomic<int> passed{0};
  const char* skip = std::getenv("SHARD_FAULT_SKIP");
  if (skip != nullptr && passed.fetch_add(1) < std::atoi(skip)) return;
  ::raise(SIGKILL);
}

void BeforeTrainingStep(int64_t step) {
  static const int64_t slow_ms = [] {
    const char* slow = std::getenv("SHARD_SLOW_STEP_MS");
    return slow == nullptr ? int64_t{0} : std::max<int64_t>(0, std::atoll(slow));
  }();
  if (slow_ms > 0) absl::SleepFor(absl::Milliseconds(slow_ms));
  const char* stall = std::getenv("SHARD_STALL_TRAINING");
  if (stall == nullptr || std::atoll(stall) != step) return;
  // stderr, not the log: this file builds into the portable GPU tests, which have no spdlog.
  std::fprintf(stderr,
               "SHARD_STALL_TRAINING: the training thread stops for good before step %lld "
               "(heartbeats go on)\n",
               static_cast<long long>(step));
  while (true) absl::SleepFor(absl::Seconds(1));
}

void StallPoint(absl::string_view name) {
  static std::atomic<bool> stalled{false};
  const char* stall = std::getenv("SHARD_STALL");
  if (stall != nullptr && name == stall && !stalled.exchange(true)) ::raise(SIGSTOP);
}

int64_t SlowWriteMillisPerMiB() {
  const char* slow = std::getenv("SHARD_SLOW_WRITE_MS");
  return slow == nullptr ? int64_t{0} : std::max<int64_t>(0, std::atoll(slow));
}

int InjectedWriteError() {
  const char* error = std::getenv("SHARD_WRITE_ERROR");
  if (error == nullptr) return 0;
  const std::string name = absl::AsciiStrToUpper(error);
  const int err = name == "ENOSPC" ? ENOSPC : name == "EIO" ? EIO : 0;
  if (err == 0) return 0;
  static std::atomic<int> writes{0};
  const char* times = std::getenv("SHARD_WRITE_ERROR_TIMES");
  if (times != nullptr && writes.fetch_add(1) >= std::atoi(times)) return 0;
  std::fprintf(stderr, "SHARD_WRITE_ERROR: this checkpoint shard write fails half-way with %s\n",
               name.c_str());
  return err;
}

bool ReplicasCorrupted() {
  const char* corrupt = std::getenv("SHARD_CORRUPT_REPLICAS");
  return corrupt != nullptr && !std::string(corrupt).empty() && std::string(corrupt) != "0";
}

void CorruptReplicaIfAsked(char* bytes, uint64_t size, absl::string_view what) {
  if (!ReplicasCorrupted() || size == 0) return;
  bytes[size / 2] ^= 1;
  std::fprintf(stderr, "SHARD_CORRUPT_REPLICAS: flipped the low bit of byte %llu of %.*s\n",
               static_cast<unsigned long long>(size / 2), static_cast<int>(what.size()),
               what.data());
}

}  // namespace shard
