#include "common/fault.h"

#include <signal.h>

#include <atomic>
#include <cstdlib>

#include <cstdio>

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

void StallTrainingAt(int64_t step) {
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

}  // namespace shard
